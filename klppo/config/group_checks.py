"""The checks of group estimators (GRPO, RLOO, ...: the other responses to the same prompt are the
baseline) and of DAPO's dynamic sampling (``algorithm.filter_groups``), which needs them."""

from __future__ import annotations

from klppo.config.problems import Problem, check_at_least, check_positive
from klppo.config.schema import SCORE_METRICS, PPOConfig

ROLLOUT = "actor_rollout_ref.rollout"
FILTER = "algorithm.filter_groups"
# Estimators that use the other responses to the same prompt as the baseline.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_vectorized", "rloo_vectorized", "opo",
                    "grpo_passk", "gpg", "optimal_token_baseline", "tir_optimal_token_baseline")
# Group estimators that cannot run on groups of one (the others give a lone response its raw
# score, as verl does, with a warning: ``group_of_one_notes``).
NEEDS_TWO = {"grpo_passk": "it rewards each group's best response by its margin over the second best",
             "rloo_vectorized": "it gives a group of one an advantage of 0, so nothing would train"}


def group_problems(cfg: PPOConfig, out: list[Problem]) -> None:
    """A group estimator that cannot train on one response per prompt, and dynamic sampling's checks."""
    estimator, n = cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout.n
    if estimator in NEEDS_TWO and n == 1:
        out.append(Problem(("algorithm.adv_estimator", f"{ROLLOUT}.n"),
                           f"algorithm.adv_estimator = '{estimator}' needs {ROLLOUT}.n >= 2 (got {n}): "
                           f"{NEEDS_TWO[estimator]}; set {ROLLOUT}.n=4 or more, or use algorithm.adv_estimator=gae"))
    _check_filter_groups(cfg, out)


def _check_filter_groups(cfg: PPOConfig, out: list[Problem]) -> None:
    """Dynamic sampling needs groups, a metric klppo computes, and a generation batch of prompts."""
    fg, data, algo = cfg.algorithm.filter_groups, cfg.data, cfg.algorithm
    check_positive(out, "data.gen_batch_size", data.gen_batch_size, "number of prompts")
    check_at_least(out, f"{FILTER}.max_inflight_gen_batches", fg.max_inflight_gen_batches, 1)
    if not fg.enable:
        if data.gen_batch_size != data.train_batch_size:
            out.append(Problem(("data.gen_batch_size", f"{FILTER}.enable"), (
                f"data.gen_batch_size = {data.gen_batch_size} differs from data.train_batch_size = "
                f"{data.train_batch_size} but {FILTER}.enable is false: a step draws exactly its "
                f"train_batch_size prompts then; set {FILTER}.enable=true or remove data.gen_batch_size")))
        return
    if algo.adv_estimator not in GROUP_ESTIMATORS:
        out.append(Problem((f"{FILTER}.enable", "algorithm.adv_estimator"), (
            f"{FILTER}.enable needs a group estimator ({', '.join(GROUP_ESTIMATORS)}), not "
            f"algorithm.adv_estimator = '{algo.adv_estimator}': only there does a prompt whose responses' "
            f"rewards tie get advantages of 0; set algorithm.adv_estimator=grpo or {FILTER}.enable=false")))
    elif cfg.actor_rollout_ref.rollout.n == 1:
        out.append(Problem((f"{FILTER}.enable", f"{ROLLOUT}.n"), f"{FILTER}.enable with {ROLLOUT}.n = 1: a group of one "
                           f"response never has spread, so every prompt would be dropped; set {ROLLOUT}.n=4 or more"))
    if fg.metric is None:
        out.append(Problem((f"{FILTER}.metric",), (
            f"{FILTER}.metric = null: name what must differ within a group: the response's score (reward, score, "
            "seq_reward), its reward after the KL penalty (seq_final_reward) or an entry of the dict the reward "
            f"function returns (e.g. acc); set {FILTER}.metric=score")))
    elif fg.metric not in SCORE_METRICS and cfg.reward_model.enable:
        out.append(Problem((f"{FILTER}.metric", "reward_model.enable"), (
            f"{FILTER}.metric = '{fg.metric}' names an entry of the dict a reward function returns, but "
            "reward_model.enable scores responses with a reward model, which returns one score each; set "
            f"{FILTER}.metric=score")))
    if fg.metric == "seq_final_reward" and algo.use_kl_in_reward:
        out.append(Problem((f"{FILTER}.metric", "algorithm.use_kl_in_reward"), (
            f"{FILTER}.metric = 'seq_final_reward' with algorithm.use_kl_in_reward: the KL penalty needs the "
            "old and reference log-probs, which klppo (as verl) computes only for the kept responses; filter by "
            f"{FILTER}.metric=score, or use the KL loss (actor_rollout_ref.actor.use_kl_loss) instead")))


def group_of_one_notes(cfg: PPOConfig) -> list[str]:
    """A group estimator on one response per prompt runs as in verl (verl's rollout-correction and
    LoRA examples do): each group's baseline is 0, so the advantage is the raw score; said once."""
    estimator, n = cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout.n
    if estimator not in GROUP_ESTIMATORS or estimator in NEEDS_TWO or n != 1:
        return []
    return [f"warning: algorithm.adv_estimator = '{estimator}' with {ROLLOUT}.n = 1: every group is one response, "
            "so it has no baseline and its advantage is its own score (as verl computes it); set "
            f"{ROLLOUT}.n=4 or more for the group baseline, or use algorithm.adv_estimator=gae"]


def filter_groups_notes(cfg: PPOConfig) -> list[str]:
    """verl's keys of dynamic sampling that have no effect in klppo's synchronous loop, said once."""
    inflight = cfg.algorithm.filter_groups.max_inflight_gen_batches
    if inflight == 1:
        return []
    return [f"warning: {FILTER}.max_inflight_gen_batches = {inflight} has no effect: klppo draws, generates and "
            "scores one generation batch at a time, as verl's DAPO recipe does; remove the key"]
