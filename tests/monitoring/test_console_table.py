"""The console backend: a compact table per step, rank 0 only; metrics.jsonl always."""

from klppo.monitoring.logger import METRICS_FILE, PPO_CONSOLE_KEYS, MetricsLogger, console_table, read_metrics

STEP = {
    "actor/pg_loss": -0.00488, "actor/pg_clipfrac": 0.0171, "actor/entropy": 0.093, "actor/kl_to_ref": 0.0123,
    "actor/reward_kl_penalty_coeff": 0.02, "critic/score/mean": 0.461, "critic/vf_loss": 0.2176,
    "critic/vf_explained_var": -0.197, "perf/throughput": 7229.0, "val-core/openai/gsm8k/reward/mean@1": 0.29,
    "timing_s/gen": 0.2,
}


def test_console_table_groups_metrics_by_prefix_and_fits_a_100_column_terminal():
    lines = console_table(12, STEP, PPO_CONSOLE_KEYS, total=60).splitlines()
    assert lines[0].startswith("step 12/60 ---")
    assert [line.split()[0] for line in lines[1:] if not line.startswith(" ")] == ["actor", "critic", "perf", "val-core"]
    assert all(len(line) <= 100 for line in lines)
    assert any("pg_clipfrac" in line and "0.0171" in line for line in lines)
    assert any("openai/gsm8k/reward/mean@1" in line and "0.29" in line for line in lines)
    assert not any("gen" in line for line in lines[1:])  # only the chosen keys (and validation) show


def test_only_rank_0_prints_and_writes(tmp_path):
    printed = []
    rank0 = MetricsLogger(tmp_path / "r0", ["console"], print_fn=printed.append)
    rank1 = MetricsLogger(tmp_path / "r1", ["console"], print_fn=printed.append, rank=1)
    assert rank1.log(1, STEP)["step"] == 1
    assert printed == [] and not (tmp_path / "r1").exists()
    rank0.log(1, STEP, total=2)
    assert len(printed) == 1 and printed[0].startswith("step 1/2")
    assert read_metrics(tmp_path / "r0")[0]["critic/score/mean"] == 0.461


def test_console_can_be_switched_off_between_steps_while_metrics_jsonl_gets_every_step(tmp_path):
    printed = []
    logger = MetricsLogger(tmp_path, ["console", "jsonl"], print_fn=printed.append, console_keys=("train/loss",))
    logger.log(1, {"train/loss": 2.0})
    logger.console = False
    logger.log(2, {"train/loss": 1.0})
    assert len(printed) == 1 and "loss" in printed[0] and "2" in printed[0]
    assert len((tmp_path / METRICS_FILE).read_text().splitlines()) == 2
    logger.close()
    logger.close()
