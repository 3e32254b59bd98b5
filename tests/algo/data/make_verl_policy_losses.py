"""Writes verl_policy_losses.json: verl's GSPO, CISPO, SAPO, GPG and GMPO (geo_mean) policy losses
run once on seeded tensors.

Run by hand with verl's core_algos.py at hand (VERL_CORE_ALGOS below; the values in the JSON
came from volcengine/verl at commit b178a3cd5; GSPO's and CISPO's are verl 0.9.1's) and torch:
    python tests/algo/data/make_verl_policy_losses.py tests/algo/data/verl_policy_losses.json
Only verl's own function definitions run (``agg_loss`` and the ``compute_policy_loss_<mode>``
functions, cut from the file with ``ast``); what they need of the rest of verl (masked_mean, the
actor config's clip ranges, SAPO's temperatures and the global batch counts) is stood in for.
"""
import ast
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch

VERL_CORE_ALGOS = Path(os.environ.get("VERL_CORE_ALGOS", "/tmp/verl/verl/trainer/ppo/core_algos.py"))
MODES = ("gspo", "cispo", "sapo", "gpg", "geo_mean")
FUNCTIONS = ("agg_loss", *(f"compute_policy_loss_{mode}" for mode in MODES))


class ActorConfig(SimpleNamespace):
    """verl's ActorConfig as the two losses read it."""


def masked_mean(values, mask, axis=None):  # verl.utils.torch_functional.masked_mean
    s = (values * mask).sum() if axis is None else (values * mask).sum(axis=axis)
    return s / (mask.sum(axis=axis) + 1e-8) if axis is not None else s / (mask.sum() + 1e-8)


def verl_functions() -> dict:
    tree = ast.parse(VERL_CORE_ALGOS.read_text())
    keep = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS]
    assert sorted(node.name for node in keep) == sorted(FUNCTIONS), [node.name for node in keep]
    ns = {"torch": torch, "Optional": Optional, "Any": Any, "ActorConfig": ActorConfig, "DictConfig": dict,
          "AlgoConfig": dict, "register_policy_loss": lambda name: (lambda fn: fn),
          "verl_F": SimpleNamespace(masked_mean=masked_mean, masked_sum=lambda v, m, axis=None: (v * m).sum(axis))}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(VERL_CORE_ALGOS), "exec"), ns)
    return ns


def inputs(seed: int = 20251205, b: int = 6, t: int = 7) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 5, 1, 6, 3, 7])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    old = -3.0 * torch.rand(b, t, generator=g)
    new = old + 0.05 * torch.randn(b, t, generator=g)
    new[1] += 0.3  # a sequence whose ratio leaves any clip range
    new[4, 0] -= 2.0  # a token far below pi_old
    advantages = torch.randn(b, 1, generator=g).expand(b, t).clone()
    advantages[5] = torch.randn(t, generator=g)  # token-level advantages too (GAE)
    weights = 0.5 + torch.rand(b, t, generator=g)
    return {"old_log_prob": old * mask, "log_prob": new * mask, "advantages": advantages * mask,
            "response_mask": mask, "rollout_is_weights": weights}


CASES = {  # name -> loss, clip ranges, loss_agg_mode, global sequences, rollout-correction weights
    "gspo_paper": ("gspo", 3e-4, 4e-4, "seq-mean-token-mean", None, False),
    "gspo_wide_global_weighted": ("gspo", 0.2, 0.28, "token-mean", 10, True),
    "cispo_token_mean": ("cispo", 0.2, 0.28, "token-mean", None, False),
    "cispo_seq_mean_token_sum_global_weighted": ("cispo", 1.0, 0.28, "seq-mean-token-sum", 10, True),
    "sapo_default_temperatures": ("sapo", 0.2, 0.2, "token-mean", None, False),
    "sapo_sharp_global_weighted": ("sapo", 0.2, 0.2, "token-mean", 10, True),
    "gpg_token_mean": ("gpg", 0.2, 0.2, "token-mean", None, False),
    "gpg_seq_mean_token_mean_global_weighted": ("gpg", 0.2, 0.2, "seq-mean-token-mean", 10, True),
    "geo_mean_gmpo_range": ("geo_mean", 0.4, 0.4, "token-mean", None, False),
    "geo_mean_narrow_weighted": ("geo_mean", 0.05, 0.1, "token-mean", None, True),
}
TAUS = {"sapo_sharp_global_weighted": (3.0, 5.0)}  # SAPO's tau_pos, tau_neg; verl's defaults elsewhere


def main(out: str) -> None:
    ns, x = verl_functions(), inputs()
    result = {"inputs": {k: v.tolist() for k, v in x.items()}, "cases": {}}
    for name, (mode, low, high, agg, sequences, weighted) in CASES.items():
        log_prob = x["log_prob"].clone().requires_grad_(True)
        mask = x["response_mask"].float()
        info = {"dp_size": 1, "batch_num_tokens": None, "global_batch_size": sequences}
        tau_pos, tau_neg = TAUS.get(name, (1.0, 1.05))
        config = ActorConfig(clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high, global_batch_info=info,
                             tau_pos=tau_pos, tau_neg=tau_neg)
        fn = ns[f"compute_policy_loss_{mode}"]
        loss, metrics = fn(x["old_log_prob"], log_prob, x["advantages"], mask, loss_agg_mode=agg, config=config,
                           rollout_is_weights=x["rollout_is_weights"] if weighted else None)
        loss.backward()
        result["cases"][name] = {"mode": mode, "clip_ratio_low": low, "clip_ratio_high": high, "loss_agg_mode": agg,
                                 "global_seq_count": sequences, "weighted": weighted, "tau_pos": tau_pos, "tau_neg": tau_neg,
                                 "loss": loss.item(),
                                 "grad": log_prob.grad.tolist(), "metrics": metrics}
    Path(out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
