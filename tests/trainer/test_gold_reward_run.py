"""A held-out gold reward at validation: logged beside the training reward, never trained on, its
divergence from the training reward an event; the detectors' windows resume exactly."""

import json

import pytest

from klppo.checkpoint.state import load_checkpoint

from klppo.errors import UserError
from klppo.commands.main_ppo import run_ppo

REWARDS = '''
CALLS = [0]


def rising(data_source, solution_str, ground_truth, extra_info=None):
    """A training reward that grows with every call, whatever the response: it rises at every validation."""
    CALLS[0] += 1
    return 0.01 * CALLS[0]


def flat(data_source, solution_str, ground_truth, extra_info=None):
    return 0.5


def shorter_is_better(data_source, solution_str, ground_truth, extra_info=None):
    return -0.01 * len(solution_str)
'''


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "rewards.py"
    path.write_text(REWARDS)
    return path


def _events(run_dir) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_gold_reward_that_disagrees_with_the_training_reward_raises_the_divergence_event(
        ppo_overrides, task_dir, rewards_file, tmp_path):
    overrides = ppo_overrides(**{
        "data.val_files": task_dir / "val.parquet", "trainer.test_freq": 1, "trainer.total_training_steps": 3,
        "actor_rollout_ref.rollout.name": "offline",
        "custom_reward_function.path": rewards_file, "custom_reward_function.name": "rising",
        "trainer.gold_reward.path": rewards_file, "trainer.gold_reward.name": "flat",
        "trainer.guard.divergence_validations": 3, "trainer.guard.divergence_action": "stop",
    })
    records = run_ppo(None, overrides, print_fn=quiet)
    # validations at steps 0, 1, 2: the third sees training reward up and gold flat, and stops the run
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["val-gold/reward/mean"] == 0.5 == r["val-gold/openai/gsm8k/reward/mean@1"] for r in records)
    train = [r["val-core/reward/mean"] for r in records]
    assert train[0] < train[1] < train[2]
    (event,) = _events(tmp_path / "run")
    assert (event["kind"], event["step"], event["validations"], event["action"]) == ("reward_divergence", 2, 3, "stop")
    assert event["train_change"] == pytest.approx(train[2] - train[0]) and event["gold_change"] == 0.0
    # each reward's spread over the held-out responses: the flat gold has none, so it moved by 0 spreads
    assert all(r["val-gold/reward/std"] == 0.0 < r["val-core/reward/std"] for r in records)
    spread = sum(r["val-core/reward/std"] for r in records) / 3
    assert (event["gold_spread"], event["gold_shift"]) == (0.0, 0.0)
    assert event["train_spread"] == pytest.approx(spread) and event["train_shift"] == pytest.approx(
        event["train_change"] / spread)


def _training_numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("val-", "timing_s/", "perf/"))}


@pytest.fixture(scope="module")
def gold_runs(tiny_model_dir, task_dir, rewards_file, tmp_path_factory):
    """make(run_dir, **changes) -> records: 3 offline steps validated every step, with a gold reward
    (shorter is better), a 6-step window (the shortest allowed) and a checkpoint after steps 2 and 3."""

    def make(run_dir, gold: bool = True, **changes):
        settings = {
            "data.train_files": task_dir / "offline.parquet", "data.val_files": task_dir / "val.parquet",
            "data.max_prompt_length": 64, "data.max_response_length": 8, "data.train_batch_size": 8,
            "actor_rollout_ref.model.path": tiny_model_dir, "actor_rollout_ref.rollout.name": "offline",
            "actor_rollout_ref.rollout.n": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
            "actor_rollout_ref.actor.optim.lr": 1e-3, "critic.optim.lr": 1e-3, "algorithm.use_kl_in_reward": "true",
            "trainer.total_training_steps": 3, "trainer.save_freq": 2, "trainer.test_freq": 1,
            "trainer.guard.window": 6, "trainer.logger": "[]", "trainer.device": "cpu",
            "trainer.default_local_dir": run_dir,
        }
        if gold:
            settings.update({"trainer.gold_reward.path": rewards_file, "trainer.gold_reward.name": "shorter_is_better"})
        settings.update(changes)
        return run_ppo(None, [f"{k}={v}" for k, v in settings.items()], print_fn=quiet)

    root = tmp_path_factory.mktemp("gold_runs")
    return make, root, make(root / "full")


def test_the_gold_reward_is_logged_but_never_trained_on(gold_runs):
    make, root, with_gold = gold_runs
    without = make(root / "no_gold", gold=False)
    assert "val-gold/reward/mean" in with_gold[1] and "val-gold/reward/mean" not in without[1]
    assert [_training_numbers(r) for r in with_gold] == [_training_numbers(r) for r in without]
    # the training reward's validation numbers do not move either
    # (val-core/reward/mean and /std, over all responses, are logged with a gold reward only)
    val_core = lambda r: {k: v for k, v in r.items() if k.startswith("val-core/") and not k.startswith("val-core/reward/")}  # noqa: E731
    assert [val_core(r) for r in with_gold] == [val_core(r) for r in without]


def test_the_length_trend_is_the_slope_of_the_last_window_steps_mean_lengths(gold_runs):
    from klppo.safety.reward_hacking import least_squares_slope

    steps = [r for r in gold_runs[2] if r["step"] >= 1]
    means = [r["response_length/mean"] for r in steps]
    assert [r["response_length/mean_trend"] for r in steps] == [least_squares_slope(means[max(0, i - 5): i + 1])
                                                                for i in range(len(means))]


def test_a_resumed_run_keeps_the_detectors_windows_as_the_uninterrupted_run(gold_runs, crash_after_logging):
    make, root, full = gold_runs
    with crash_after_logging(3):
        make(root / "crashed")
    resumed = make(root / "crashed")  # from the checkpoint of step 2
    assert [r["step"] for r in resumed] == [3]
    assert [_training_numbers(r) for r in resumed] == [_training_numbers(r) for r in full[3:]]
    assert resumed[0]["val-gold/reward/mean"] == full[3]["val-gold/reward/mean"]
    # The whole guard record: the detectors' windows (validations 1-3, steps 1-3), counters, good checkpoints.
    guard = lambda run: load_checkpoint(root / run / "global_step_3")["guard"]  # noqa: E731
    assert guard("crashed") == guard("full")
    assert len(guard("full")["health"]["divergence"]["history"]) == 3
    assert len(guard("full")["health"]["length_trend"]["values"]) == 3
    assert _events(root / "crashed") == _events(root / "full")


def test_a_gold_reward_file_that_does_not_exist_is_refused_before_any_model_loads(ppo_overrides, task_dir,
                                                                                  tmp_path, monkeypatch):
    from klppo.run import build

    monkeypatch.setattr(build, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    overrides = ppo_overrides(**{"data.val_files": task_dir / "val.parquet",
                                 "trainer.gold_reward.path": tmp_path / "missing.py"})
    with pytest.raises(UserError, match=r"trainer.gold_reward.path '.*missing.py' not found"):
        run_ppo(None, overrides, print_fn=quiet)


@pytest.mark.parametrize("changes, message", [
    ({"trainer.gold_reward.path": "g.py"}, "trainer.gold_reward is scored at validation on held-out prompts only"),
    ({"trainer.gold_reward.path": "g.py", "trainer.gold_reward.model_path": "rm", "data.val_files": "v.parquet"},
     "not both"),
    ({"trainer.guard.divergence_validations": 1}, "divergence_validations = 1 must be >= 2"),
])
def test_gold_reward_config_mistakes_name_the_key_and_the_fix(changes, message):
    from klppo.config import load_ppo_config

    with pytest.raises(UserError, match=message):
        load_ppo_config(None, ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m",
                               *[f"{k}={v}" for k, v in changes.items()]])
