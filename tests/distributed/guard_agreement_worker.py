"""One rank of a PPO run whose guard and controller inputs differ on rank 1; run by ``torchrun``
from test_guard_agreement.py as ``guard_agreement_worker.py <out_dir> <schedule> key=value ...``.

Rank 1 changes, at the steps ``<schedule>`` names (a JSON object: step -> what), the numbers a
rank measures for itself: its KL estimate (``kl+X``), the reward KL the adaptive controller
reads online (``reward_kl+X``), its scores (``nan_scores``), its update's loss (``nan_loss``) and
entropy (``entropy=X``). Every rank records what its guard decided and the KL coefficient after
each step in ``<out_dir>/decisions_rank<R>.json``; the run itself is ``main_ppo``'s.
"""

import json
import math
import os
import sys
from pathlib import Path

from klppo.safety import guards
from klppo.trainer import dynamic_sampling, evaluate, ppo_trainer
from klppo.commands.main_ppo import main

RANK = int(os.environ["RANK"])
DECISIONS: list = []


def _perturbed() -> list[str]:
    """The schedule's changes for this rank at the current step ([] on rank 0)."""
    step = str(STATE["step"])
    return [] if RANK != 1 or step not in SCHEDULE else SCHEDULE[step]


def _recorded(method):
    def record(self, step, *args, **kwargs):
        result = method(self, step, *args, **kwargs)
        values = [a for a in args if isinstance(a, (int, float, dict)) and not isinstance(a, bool)]
        DECISIONS.append([method.__name__, step, getattr(result, "value", result), repr(values),
                          [event.kind for event in self.events]])
        return result
    return record


def _patch() -> None:
    for name in ("check_kl", "check_finite", "check_health"):
        setattr(guards.RunGuard, name, _recorded(getattr(guards.RunGuard, name)))

    train_step = ppo_trainer.PPOTrainer.train_step

    def step_and_record(self):
        STATE["step"] = self.step
        out = train_step(self)
        DECISIONS.append(["kl_coef", self.step, repr(float(self.p.kl_ctrl.value))])
        return out

    ppo_trainer.PPOTrainer.train_step = step_and_record

    offline_policy_kl = evaluate.offline_policy_kl

    def kl_of_this_rank(parts, batch, records, step):
        kl, metrics = offline_policy_kl(parts, batch, records, step)
        return kl + sum(float(c[3:]) for c in _perturbed() if c.startswith("kl+")), metrics

    # the trainer weights recorded log-probs itself; the sampled probe runs from evaluate.sampled_offline_kl
    ppo_trainer.offline_policy_kl = evaluate.offline_policy_kl = kl_of_this_rank

    apply_kl_penalty = ppo_trainer.apply_kl_penalty

    def penalty_of_this_rank(*args, **kwargs):
        rewards, stats = apply_kl_penalty(*args, **kwargs)
        extra = sum(float(c[10:]) for c in _perturbed() if c.startswith("reward_kl+"))
        return rewards, {**stats, "actor/reward_kl_penalty": stats["actor/reward_kl_penalty"] + extra}

    ppo_trainer.apply_kl_penalty = penalty_of_this_rank

    score_batch = dynamic_sampling.score_batch

    def scores_of_this_rank(parts, batch, shards, timer, *args, **kwargs):
        score_batch(parts, batch, shards, timer, *args, **kwargs)
        if "nan_scores" in _perturbed():
            batch.token_level_scores[0, 0] = math.nan

    dynamic_sampling.score_batch = scores_of_this_rank

    update_actor = ppo_trainer.update_actor

    def update_of_this_rank(*args, **kwargs):
        metrics = update_actor(*args, **kwargs)
        for change in _perturbed():
            if change == "nan_loss":
                metrics["actor/pg_loss"] = math.nan
            elif change.startswith("entropy="):
                metrics["actor/entropy"] = float(change[8:])
        return metrics

    ppo_trainer.update_actor = update_of_this_rank


if __name__ == "__main__":
    out, SCHEDULE, STATE = Path(sys.argv[1]), json.loads(sys.argv[2]), {"step": 0}
    _patch()
    code = main(sys.argv[3:])
    (out / f"decisions_rank{RANK}.json").write_text(json.dumps(DECISIONS, indent=1))
    sys.exit(code)
