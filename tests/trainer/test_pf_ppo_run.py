"""PF-PPO in a run (algorithm.use_pf_ppo with GAE): each step trains on a draw of its responses
weighted by their scores, the same draw every time the step runs."""

from klppo.commands.main_ppo import run_ppo


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


def test_pow_draws_only_rewarded_responses_and_a_rerun_draws_the_same(ppo_overrides, tmp_path):
    changes = {"algorithm.use_pf_ppo": "true", "algorithm.pf_ppo.reweight_method": "pow",
               "trainer.total_training_steps": 3}
    first = run_ppo(None, ppo_overrides(tmp_path / "a", **changes), print_fn=quiet)
    plain = run_ppo(None, ppo_overrides(tmp_path / "plain", **{"trainer.total_training_steps": 3}), print_fn=quiet)
    for drawn, whole in zip(first, plain):
        assert whole["critic/score/min"] == 0.0 < whole["critic/score/max"]  # each step has wrong and right answers
        assert drawn["critic/score/min"] == 1.0  # a score of 0 weighs 1e-8: never drawn
        assert 0.0 < drawn["training/pf_ppo/unique_frac"] < 1.0
    again = run_ppo(None, ppo_overrides(tmp_path / "b", **changes), print_fn=quiet)
    keys = [k for k in first[-1] if not k.startswith(("timing_s/", "perf/"))]
    assert [[r[k] for k in keys] for r in first] == [[r[k] for k in keys] for r in again]


def test_pf_ppo_with_a_critic_free_estimator_is_a_warning_as_in_verl(ppo_overrides, tmp_path):
    printed = []
    (record,) = run_ppo(None, ppo_overrides(tmp_path / "grpo", **{
        "algorithm.use_pf_ppo": "true", "algorithm.adv_estimator": "grpo", "trainer.total_training_steps": 1}),
        print_fn=lambda *a, **k: printed.append(" ".join(map(str, a))))
    assert "warning: algorithm.use_pf_ppo has no effect with algorithm.adv_estimator = 'grpo'" in printed[0]
    assert "training/pf_ppo/unique_frac" not in record
