"""Groups that teach nothing: logged, and with algorithm.filter_groups (DAPO's dynamic sampling) left out."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from klppo.data.arithmetic import write_arithmetic_offline_parquet
from klppo.errors import UserError
from klppo.monitoring.logger import read_metrics
from klppo.trainer import ppo_trainer
from klppo.commands.main_ppo import run_ppo

FG = "algorithm.filter_groups"


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


def _mostly_tied(path, n_prompts: int = 16):
    """Offline GRPO data whose groups mostly tie: prompt i's two recorded responses score (1, 0) when
    i % 4 == 0, (1, 1) when i % 4 == 1 and (0, 0) otherwise."""
    write_arithmetic_offline_parquet(path, n_prompts, seed=2, n_responses=2)
    table = pq.read_table(path)
    scores = [[1.0, 0.0] if i % 4 == 0 else [1.0, 1.0] if i % 4 == 1 else [0.0, 0.0] for i in range(n_prompts)]
    pq.write_table(table.append_column("scores", pa.array(scores)), path)
    return path


@pytest.fixture
def grpo(ppo_overrides, tmp_path):
    data = _mostly_tied(tmp_path / "tied.parquet")

    def overrides(run_dir=None, **changes):
        base = {"data.train_files": data, "data.shuffle": "false", "algorithm.adv_estimator": "grpo",
                "algorithm.use_kl_in_reward": "false", "data.train_batch_size": 4,
                "actor_rollout_ref.actor.ppo_mini_batch_size": 2}
        return ppo_overrides(run_dir, **{**base, **changes})

    return overrides


def _trained_prompts(monkeypatch) -> list[list[int]]:
    """Record, step by step, the prompts (extra_info.index) of the rows each actor update trains on."""
    seen, real = [], ppo_trainer.update_actor

    def update_actor(actor, optimizer, batch, *args, **kwargs):
        seen.append(sorted({info["index"] for info in batch.extra_infos}))
        return real(actor, optimizer, batch, *args, **kwargs)

    monkeypatch.setattr(ppo_trainer, "update_actor", update_actor)
    return seen


def test_tied_groups_are_logged_and_trained_on_without_filtering(grpo, monkeypatch):
    trained = _trained_prompts(monkeypatch)
    records = run_ppo(None, grpo(), print_fn=quiet)
    # step 1: prompts 0-3, of which only prompt 0 has spread -> 3 of 4 groups tie; their tokens' advantages are 0
    assert records[0]["critic/score/zero_std_frac"] == 0.75
    assert 0.5 < records[0]["critic/advantages/zero_frac"] < 1.0
    assert trained == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert not any(k.startswith("training/filter_groups/") for k in records[0])


def test_filter_groups_trains_only_on_groups_with_spread_and_counts_the_draws(grpo, monkeypatch):
    trained = _trained_prompts(monkeypatch)
    records = run_ppo(None, grpo(**{f"{FG}.enable": "true", "data.train_batch_size": 2, "data.gen_batch_size": 4,
                                    "actor_rollout_ref.actor.ppo_mini_batch_size": 1}), print_fn=quiet)
    # each generation batch of 4 prompts holds one with spread (i % 4 == 0): two draws per step of 2 prompts
    assert trained == [[0, 4], [8, 12]]
    for r in records:
        assert (r["training/filter_groups/gen_batches"], r["training/filter_groups/kept_groups"],
                r["training/filter_groups/dropped_groups"]) == (2.0, 2.0, 6.0)
        assert r["critic/score/zero_std_frac"] == 0.0 and r["critic/advantages/zero_frac"] == 0.0
        assert (r["critic/score/mean"], r["critic/score/min"], r["critic/score/max"]) == (0.5, 0.0, 1.0)
    # the sampler advanced by every draw: 2 steps x 2 draws of 4 = the 16 prompts, one epoch
    assert records[-1]["training/epoch"] == 0


def test_a_step_that_exceeds_max_num_gen_batches_is_an_error_naming_the_keys(grpo):
    with pytest.raises(UserError, match=r"step 1 drew 1 generation batches of data.gen_batch_size=4 prompts and kept "
                                        r"1 prompts .* raise algorithm.filter_groups.max_num_gen_batches"):
        run_ppo(None, grpo(**{f"{FG}.enable": "true", "data.gen_batch_size": 4,
                              f"{FG}.max_num_gen_batches": 1}), print_fn=quiet)


def test_offline_data_with_too_few_groups_with_spread_stops_after_one_epoch(grpo):
    # 16 prompts hold 4 with spread; 8 per step cannot be found in the 4 generation batches of an epoch
    with pytest.raises(UserError, match="drew 4 generation batches .* one epoch of the recorded data"):
        run_ppo(None, grpo(**{f"{FG}.enable": "true", "data.train_batch_size": 8, "data.gen_batch_size": 4,
                              "actor_rollout_ref.actor.ppo_mini_batch_size": 4}), print_fn=quiet)


# verl's DAPO reward: a dict whose "acc" (a bool, as verl's math_dapo returns it) is what the groups are
# filtered by. Here the score ties in every group, and "acc" differs only in the groups of prompts 0, 4,
# 8, ...: each recorded group holds the right answer and one off by 1.
ACC_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    right = solution_str.endswith("#### " + ground_truth)
    return {"score": 1.0, "acc": right and extra_info["index"] % 4 == 0, "pred": solution_str[-3:]}
'''


@pytest.fixture
def acc_grpo(ppo_overrides, tmp_path):
    data = write_arithmetic_offline_parquet(tmp_path / "offline.parquet", 16, seed=2, n_responses=2)
    reward = tmp_path / "acc_reward.py"
    reward.write_text(ACC_REWARD)

    def overrides(run_dir=None, **changes):
        base = {"data.train_files": data, "data.shuffle": "false", "algorithm.adv_estimator": "grpo",
                "algorithm.use_kl_in_reward": "false", "custom_reward_function.path": reward,
                f"{FG}.enable": "true", "data.train_batch_size": 2, "data.gen_batch_size": 4,
                "actor_rollout_ref.actor.ppo_mini_batch_size": 1}
        return ppo_overrides(run_dir, **{**base, **changes})

    return overrides


def test_filter_groups_by_a_reward_component_as_verls_dapo_acc(acc_grpo, monkeypatch, tmp_path):
    trained = _trained_prompts(monkeypatch)
    records = run_ppo(None, acc_grpo(**{f"{FG}.metric": "acc"}), print_fn=quiet)
    # each generation batch of 4 prompts holds one whose responses' acc differ: two draws per step
    assert trained == [[0, 4], [8, 12]]
    assert all(r["training/filter_groups/gen_batches"] == 2.0 and r["reward/acc/mean"] == 0.5 for r in records)
    # by the score, which ties everywhere, no group is kept
    with pytest.raises(UserError, match="kept 0 prompts whose responses' rewards differ"):
        run_ppo(None, acc_grpo(tmp_path / "by_score", **{f"{FG}.metric": "score"}), print_fn=quiet)


def test_a_filter_component_the_reward_function_does_not_return_is_an_error_naming_the_row(acc_grpo):
    with pytest.raises(UserError, match=r"offline.parquet row 0: algorithm.filter_groups.metric = 'accuracy', but "
                                        r"the reward function returned no numeric 'accuracy' for this response \(its "
                                        r"numeric entries besides 'score': 'acc'\)"):
        run_ppo(None, acc_grpo(**{f"{FG}.metric": "accuracy"}), print_fn=quiet)


REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # About half the groups of two tie: the parity of the response's length.
    return float(len(solution_str) % 2)
'''


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/"))}


def test_online_filter_groups_resumes_exactly_as_the_uninterrupted_run(ppo_overrides, task_dir, tmp_path,
                                                                       crash_after_logging):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    changes = {"data.train_files": task_dir / "train.parquet", "actor_rollout_ref.rollout.name": "hf",
               "custom_reward_function.path": reward, "algorithm.adv_estimator": "grpo",
               "algorithm.use_kl_in_reward": "false", "actor_rollout_ref.actor.use_kl_loss": "true",
               f"{FG}.enable": "true", f"{FG}.metric": "seq_reward", f"{FG}.max_num_gen_batches": 30,
               "data.train_batch_size": 2, "data.gen_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 1,
               "data.max_response_length": 4, "trainer.total_training_steps": 3, "trainer.save_freq": 1}
    full = run_ppo(None, ppo_overrides(tmp_path / "full", **changes), print_fn=quiet)
    for r in full:  # every trained group has spread; draws are counted
        assert r["critic/score/zero_std_frac"] == 0.0 and r["training/filter_groups/kept_groups"] >= 2
        assert r["training/filter_groups/kept_groups"] + r["training/filter_groups/dropped_groups"] == \
            2 * r["training/filter_groups/gen_batches"]
    assert max(r["training/filter_groups/gen_batches"] for r in full[1:]) > 1  # a resumed step draws again

    with crash_after_logging(2):  # logged, not yet saved: the checkpoint is step 1's
        run_ppo(None, ppo_overrides(tmp_path / "crashed", **changes), print_fn=quiet)
    resumed = run_ppo(None, ppo_overrides(tmp_path / "crashed", **changes), print_fn=quiet)
    assert [r["step"] for r in resumed] == [2, 3]
    assert [_comparable(r) for r in resumed] == [_comparable(r) for r in full[1:]]
    assert [r["step"] for r in read_metrics(tmp_path / "crashed")] == [1, 2, 3]
