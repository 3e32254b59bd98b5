"""The checks of how responses are rewarded: ``reward_model.*`` (its models, the ranking of
responses, DAPO's overlong punishment in ``reward_kwargs``) and ``trainer.gold_reward``."""

from __future__ import annotations

import math
from klppo.config.problems import Problem, check_positive
from klppo.config.schema import PPOConfig


def reward_problems(cfg: PPOConfig) -> list[Problem]:
    out: list[Problem] = []
    check_positive(out, "reward_model.ranking.scale", cfg.reward_model.ranking.scale)
    _check_reward_model(cfg, out)
    _check_overlong_buffer(cfg, out)
    _check_gold_reward(cfg, out)
    _check_remax(cfg, out)
    return out


def _check_remax(cfg: PPOConfig, out: list[Problem]) -> None:
    """ReMax's baseline is a greedy response generated each step and scored as the samples are."""
    if cfg.algorithm.adv_estimator != "remax":
        return
    rollout = "actor_rollout_ref.rollout"
    if cfg.actor_rollout_ref.rollout.name == "offline":
        out.append(Problem(("algorithm.adv_estimator", f"{rollout}.name"), "algorithm.adv_estimator = 'remax' takes "
                           "the score of a greedy response to each prompt as its baseline, generated each step, and "
                           f"{rollout}.name = 'offline' generates nothing; set {rollout}.name=hf or vllm, or use grpo "
                           "or rloo on the recorded responses"))
    if cfg.reward_model.rank_responses:
        out.append(Problem(("algorithm.adv_estimator", "reward_model.rank_responses"), "algorithm.adv_estimator = "
                           "'remax' scores one greedy response per prompt, which reward_model.rank_responses cannot "
                           "rank against the others; use the reward models' scores (rank_responses=false) or grpo"))


def _check_reward_model(cfg: PPOConfig, out: list[Problem]) -> None:
    rm = cfg.reward_model
    if rm.enable and not rm.model.path:
        out.append(Problem(("reward_model.model.path",), "reward_model.enable = true needs reward_model.model.path: "
                           "a local folder written by `klppo rm` (or any one-label sequence-classification model)"))
    if rm.model.extra_paths and not rm.enable:
        out.append(Problem(("reward_model.model.extra_paths",), "reward_model.model.extra_paths are further reward "
                           "models: set reward_model.enable = true and reward_model.model.path"))
    if rm.rank_responses and not rm.enable:
        out.append(Problem(("reward_model.rank_responses",), "reward_model.rank_responses = true ranks responses by a "
                           "reward model: set reward_model.enable = true and reward_model.model.path"))
    sources = {"prompt_length": cfg.data.max_prompt_length, "response_length": cfg.actor_rollout_ref.rollout.response_length}
    for name, source in sources.items():
        if getattr(rm.rollout, name) != source:  # a copy of its source has been checked there
            check_positive(out, f"reward_model.rollout.{name}", getattr(rm.rollout, name), "number of tokens")
    if rm.rank_responses and cfg.actor_rollout_ref.rollout.n < 2:
        out.append(Problem(("reward_model.rank_responses", "actor_rollout_ref.rollout.n"), "reward_model.rank_responses "
                           "ranks each prompt's responses against each other: set actor_rollout_ref.rollout.n >= 2"))


def _check_overlong_buffer(cfg: PPOConfig, out: list[Problem]) -> None:
    """DAPO's overlong punishment: a buffer inside the length it ends at, on a reward function's scores."""
    kwargs, key = cfg.reward_model.reward_kwargs, "reward_model.reward_kwargs"
    buffer = kwargs.overlong_buffer_cfg
    if not buffer.enable:
        return
    max_len = kwargs.max_resp_len if kwargs.max_resp_len is not None else cfg.data.max_response_length
    source = f"{key}.max_resp_len" if kwargs.max_resp_len is not None else "data.max_response_length"
    check_positive(out, f"{key}.overlong_buffer_cfg.len", buffer.len, "number of tokens")
    if 0 < max_len < buffer.len:
        out.append(Problem((f"{key}.overlong_buffer_cfg.len", source),
                           f"{key}.overlong_buffer_cfg.len = {buffer.len} is longer than {source} = {max_len}, where "
                           "the buffer ends (verl's dapo reward manager refuses it too): set a shorter buffer"))
    if buffer.penalty_factor < 0 or math.isnan(buffer.penalty_factor):
        out.append(Problem((f"{key}.overlong_buffer_cfg.penalty_factor",),
                           f"{key}.overlong_buffer_cfg.penalty_factor = {buffer.penalty_factor!r} must be >= 0"))


def reward_notes(cfg: PPOConfig) -> list[str]:
    """DAPO's overlong buffer beside a reward model acts as in verl: not at all (verl's dapo reward
    manager hands the reward model's scores on as they are; verl's FAPO recipe sets both); said once.
    So do a reward function's arguments without the function they are for."""
    notes = []
    if cfg.reward_model.reward_kwargs.overlong_buffer_cfg.enable and cfg.reward_model.enable:
        notes.append("warning: reward_model.reward_kwargs.overlong_buffer_cfg has no effect with reward_model.enable: "
                     "it punishes a reward function's scores (verl's dapo reward manager), and the scores are the "
                     "reward model's, which verl's manager and klppo leave as they are")
    for key, section in (("custom_reward_function", cfg.custom_reward_function),
                         ("trainer.gold_reward", cfg.trainer.gold_reward)):
        if section.reward_kwargs and not section.path:
            notes.append(f"warning: {key}.reward_kwargs has no effect: they are passed to the function in "
                         f"{key}.path, which is not set" + (" (the built-in rules take none)"
                                                             if key == "custom_reward_function" else ""))
    return notes


def _check_gold_reward(cfg: PPOConfig, out: list[Problem]) -> None:
    gold, key = cfg.trainer.gold_reward, "trainer.gold_reward"
    if gold.path and gold.model_path:
        out.append(Problem((f"{key}.path", f"{key}.model_path"), f"{key} takes a reward function ({key}.path) or a "
                           f"reward model ({key}.model_path), not both; set one of them to null"))
    if (gold.path or gold.model_path) and not cfg.data.val_files:
        out.append(Problem((f"{key}", "data.val_files"), f"{key} is scored at validation on held-out prompts only, "
                           "but data.val_files is not set; set data.val_files (and trainer.test_freq) or "
                           f"{key}=null"))
