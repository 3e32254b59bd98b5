"""``klppo report``: plots, the guard events and a diagnosis from a run directory."""

import json

import yaml

from klppo.cli import main as klppo_main
from klppo.monitoring.report import load_run, step_ranges, threshold_lines, write_report

CONFIG = {
    "algorithm": {"use_kl_in_reward": True, "kl_ctrl": {"type": "adaptive", "kl_coef": 0.02, "target_kl": 0.1}},
    "trainer": {"project_name": "p", "experiment_name": "e", "total_training_steps": 20,
                "guard": {"rollback_kl": 0.15, "early_stop_kl": 0.2, "entropy_floor": 0.3, "clipfrac_max": 0.3}},
}


def step_record(step: int, critic: bool) -> dict:
    """A step of a run whose reward climbs from 0.2 to 0.8; KL is above its 0.1 target at steps 10-12."""
    kl = {10: 0.12, 11: 0.14, 12: 0.16}.get(step, 0.02)
    record = {
        "step": step, "critic/score/mean": 0.2 + 0.6 * (step - 1) / 19, "actor/kl_to_ref": kl,
        "actor/reward_kl_penalty": kl, "actor/reward_kl_penalty_coeff": 0.02 + 0.001 * step,
        "actor/pg_clipfrac": 0.05, "actor/entropy": 1.0 - 0.04 * step, "perf/throughput": 1000.0,
        "timing_s/gen": 0.6, "timing_s/update_actor": 0.3, "timing_s/step": 1.0,
    }
    if critic:
        record.update({"critic/vf_loss": 1.0 / step, "critic/vf_explained_var": 0.5})
    if step == 20:
        record["val-core/arith/reward/mean@1"] = 0.7
    return record


def write_run(run_dir, critic: bool = True, events: bool = True):
    """A synthetic run directory: 20 steps, a rollback at step 12 and an entropy warning at step 19."""
    run_dir.mkdir(parents=True)
    records = [{"step": 0, "val-core/arith/reward/mean@1": 0.3}] + [step_record(s, critic) for s in range(1, 21)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    if events:
        (run_dir / "events.jsonl").write_text(
            json.dumps({"step": 12, "kind": "rollback", "message": "KL 0.16 > rollback_kl 0.15: rolled back to step 8",
                        "kl": 0.16, "target_step": 8}) + "\n"
            + json.dumps({"step": 19, "kind": "warn_entropy", "message": "entropy 0.24 below 0.3", "entropy": 0.24}) + "\n")
    return run_dir


def test_report_holds_the_plots_the_guard_events_and_the_diagnosis(tmp_path):
    report = write_report(write_run(tmp_path / "run"))
    assert report == tmp_path / "run" / "report" / "report.md"
    text = report.read_text()
    for name in ("reward", "kl", "kl_coef", "clipfrac", "entropy", "value", "throughput", "timing"):
        png = report.parent / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name}.png)" in text
    assert "| 12 | rollback | KL 0.16 > rollback_kl 0.15: rolled back to step 8 | kl=0.16, target_step=8 |" in text
    assert "| 19 | warn_entropy |" in text
    assert "KL exceeded target_kl = 0.1 at steps 10-12; rolled back at 12" in text
    assert "KL exceeded rollback_kl = 0.15 at step 12; rolled back at 12" in text
    assert "reward (critic/score/mean) rose from 0.216 to 0.784" in text  # steps 1-2 vs 19-20
    assert "entropy (actor/entropy) fell below entropy_floor = 0.3 at step 18 (3 of 20 steps below" in text
    assert "validation val-core/arith/reward/mean@1 went from 0.3 (step 0) to 0.7 (step 20)" in text
    assert "guard events: rollback at step 12; warn_entropy at step 19." in text


def test_report_command_writes_html_without_a_value_plot_for_a_run_without_critic_or_events(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", critic=False, events=False)
    assert klppo_main(["report", str(run_dir), "--out", str(tmp_path / "r.html")]) == 0
    assert capsys.readouterr().out == f"report written to {tmp_path / 'r.html'}\n"
    text = (tmp_path / "r.html").read_text()
    assert text.startswith("<!DOCTYPE html>")
    assert not (tmp_path / "value.png").exists() and (tmp_path / "kl.png").exists()
    assert "<img src='kl.png'" in text and "No guard events." in text and "no guard events." in text


def test_kl_lines_come_from_the_adaptive_target_and_the_guard_thresholds():
    assert threshold_lines(CONFIG)["kl"] == [("target_kl", 0.1), ("rollback_kl", 0.15), ("early_stop_kl", 0.2)]
    fixed = {"algorithm": {"kl_ctrl": {"type": "fixed", "target_kl": 0.1}}}  # an older run: no guard section
    assert threshold_lines(fixed) == {"kl": [], "entropy": [], "clipfrac": []}
    assert step_ranges([3, 10, 11, 12, 30]) == "3, 10-12, 30"
    assert step_ranges(list(range(0, 40, 2)), most=3) == "0, 2, 4 and 17 more"


def test_report_command_on_a_missing_dir_prints_one_line_and_exits_2(tmp_path, capsys):
    assert klppo_main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: run directory") and err.count("\n") == 1
    (tmp_path / "empty").mkdir()
    assert klppo_main(["report", str(tmp_path / "empty")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err


def test_a_truncated_metrics_line_is_a_user_error_naming_file_and_line(tmp_path):
    run_dir = write_run(tmp_path / "run")
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 21, "actor/')
    try:
        load_run(run_dir)
    except ValueError as exc:
        assert "metrics.jsonl, line 22" in str(exc)
    else:
        raise AssertionError("expected a UserError")


def test_a_distributed_run_adds_overlap_and_rank_balance_to_the_throughput_panel():
    from klppo.monitoring.plots import build_panels

    single = [step_record(s, critic=True) for s in range(1, 4)]
    ranks = [dict(r, **{"global_seqlen/minmax_diff": 20.0, "global_seqlen/balanced_max": 350.0,
                        "global_seqlen/balanced_min": 348.0}) for r in single]
    ranks[0]["perf/overlap_ratio"] = 0.2  # profiled at step 1 only

    def throughput_axes(records):
        panel = next(p for p in build_panels(records, {}) if p.name == "throughput")
        return [[s.label for s in axis.series] for axis in panel.axes]

    assert throughput_axes(single) == [["perf/throughput"]]
    assert throughput_axes(ranks) == [["perf/throughput"], ["overlap ratio"],
                                      ["max - min, unbalanced", "max, balanced", "min, balanced"]]
