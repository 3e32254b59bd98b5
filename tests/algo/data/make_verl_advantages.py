"""Writes verl_advantages.json: verl's grpo_vectorized, rloo_vectorized, opo, grpo_passk, gpg and
remax advantage estimators run once on a seeded batch.

Run by hand with verl's core_algos.py and utils/groupwise.py at hand (the paths below; the values
in the JSON came from volcengine/verl at commit b178a3cd5), torch and numpy:
    python tests/algo/data/make_verl_advantages.py tests/algo/data/verl_advantages.json
Only verl's own function definitions run (the five estimators, and groupwise's
``as_torch_index``, ``group_mean_std`` and what they call, cut from the files with ``ast``);
what they need of the rest of verl (the registry decorator, the device) is stood in for.
"""
import ast
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

VERL_CORE_ALGOS = Path(os.environ.get("VERL_CORE_ALGOS", "/tmp/verl/verl/trainer/ppo/core_algos.py"))
VERL_GROUPWISE = Path(os.environ.get("VERL_GROUPWISE", "/tmp/verl/verl/utils_groupwise.py"))
ESTIMATORS = ("grpo_vectorized", "rloo_vectorized", "opo", "grpo_passk", "gpg", "remax")


class _Names:
    """verl's AdvantageEstimator as the decorators read it: AdvantageEstimator.GPG -> "gpg"."""

    def __getattr__(self, name: str) -> str:
        return name.lower()


def _cut(path: Path, names: set[str]) -> list[ast.stmt]:
    tree = ast.parse(path.read_text())
    keep = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert {node.name for node in keep} == names, (path, sorted(names - {node.name for node in keep}))
    return keep


def verl_functions() -> dict:
    functions = {f"compute_{name}_outcome_advantage" for name in ESTIMATORS}
    body = _cut(VERL_GROUPWISE, {"_resolve_device", "_to_1d_numpy_object_array", "as_torch_index", "group_mean_std"})
    body += _cut(VERL_CORE_ALGOS, functions)
    ns = {"torch": torch, "np": np, "os": os, "Optional": Optional, "Any": Any, "defaultdict": defaultdict,
          "AlgoConfig": dict, "AdvantageEstimator": _Names(), "register_adv_est": lambda name: (lambda fn: fn),
          "get_device_name": lambda: "cpu"}
    exec(compile(ast.Module(body=body, type_ignores=[]), "verl", "exec"), ns)
    return ns


def inputs(seed: int = 20251206, t: int = 6) -> dict:
    """Groups of 1 to 5 answers, interleaved; scores on a response's last real token, some 0 (GPG's
    alpha counts the others), a tie for a group's best (pass@k); a second index without groups of one."""
    g = torch.Generator().manual_seed(seed)
    sizes = [3, 1, 4, 2, 5, 1, 3]
    index = [f"p{group}" for group, n in enumerate(sizes) for _ in range(n)]
    order = torch.randperm(len(index), generator=g).tolist()
    index = [index[i] for i in order]
    b = len(index)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    scores = torch.randint(-2, 4, (b,), generator=g).float() * 0.5  # ties and zeros
    scores[0] = 0.0
    rewards = torch.zeros(b, t)
    rewards[torch.arange(b), lengths - 1] = scores
    paired = [f"q{min(i // 2, b // 2 - 1)}" for i in range(b)]  # groups of two, the last of three where b is odd
    rewards[3, 0] -= 0.25  # a reward before the last token (a KL penalty's): ReMax's returns-to-go differ by token
    greedy = {group: torch.randint(-2, 4, (), generator=g).item() * 0.5 for group in sorted(set(index))}
    baselines = torch.tensor([greedy[group] for group in index])  # ReMax's: each prompt's greedy score
    return {"token_level_rewards": rewards, "response_mask": mask, "index": index, "paired_index": paired,
            "reward_baselines": baselines}


def main(out: str) -> None:
    ns, x = verl_functions(), inputs()
    rewards, mask = x["token_level_rewards"], x["response_mask"].float()
    result = {"inputs": {"token_level_rewards": rewards.tolist(), "response_mask": x["response_mask"].tolist(),
                         "index": x["index"], "paired_index": x["paired_index"],
                         "reward_baselines": x["reward_baselines"].tolist()}, "cases": {}}
    for name in ESTIMATORS:
        for norm in ((True, False) if name.startswith("grpo") else (True,)):
            index = x["paired_index"] if name == "grpo_passk" else x["index"]
            fn = ns[f"compute_{name}_outcome_advantage"]
            kwargs = {"norm_adv_by_std_in_grpo": norm} if name == "grpo_vectorized" else {}
            config = {"norm_adv_by_std_in_grpo": norm}
            if name == "remax":
                advantages, returns = fn(rewards.clone(), x["reward_baselines"], mask, config=config)
            else:
                advantages, returns = fn(rewards.clone(), mask, np.array(index, dtype=object), config=config, **kwargs)
            result["cases"][f"{name}{'' if norm else '_not_normed'}"] = {
                "estimator": name, "norm_adv_by_std_in_grpo": norm, "paired": name == "grpo_passk",
                "advantages": advantages.tolist(), "returns": returns.tolist()}
    Path(out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
