"""Writes verl_rollout_corr_0.9.1.json: verl 0.9.1's rollout_corr_helper run once on seeded tensors.

Run by hand where verl's wheel is unpacked (VERL below) and torch is installed:
    python tests/algo/data/make_verl_rollout_corr.py tests/algo/data/verl_rollout_corr_0.9.1.json
verl's own modules run unchanged; only the imports it needs and this environment lacks (Ray,
tensordict, its config classes) are stood in for, since the functions called never use them.
"""
import ast
import json
import sys
import types
from pathlib import Path

import torch

VERL = Path("/tmp/verldl/x/verl")

def fake(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod

# verl.utils.torch_functional: only masked_sum / masked_mean are used; take them from verl's source.
src = (VERL / "utils/torch_functional.py").read_text()
tree = ast.parse(src)
keep = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("masked_sum", "masked_mean")]
ns = {"torch": torch}
exec(compile(ast.Module(body=keep, type_ignores=[]), "torch_functional", "exec"), ns)
for name in ("verl", "verl.utils", "verl.trainer", "verl.trainer.config", "verl.workers", "verl.workers.config"):
    fake(name)
fake("verl.utils.torch_functional", masked_sum=ns["masked_sum"], masked_mean=ns["masked_mean"])

class DataProto:
    def __init__(self, tensors): self.batch = tensors
    @classmethod
    def from_dict(cls, tensors): return cls(tensors)

fake("verl.protocol", DataProto=DataProto)
fake("verl.trainer.config.algorithm", RolloutCorrectionConfig=dict)
fake("verl.workers.config.actor", PolicyLossConfig=dict)
helper = types.ModuleType("rollout_corr_helper")
source = (VERL / "trainer/ppo/rollout_corr_helper.py").read_text()
exec(compile(source, "rollout_corr_helper.py", "exec"), helper.__dict__)

SEED, B, T = 20250901, 6, 7
g = torch.Generator().manual_seed(SEED)
lengths = torch.tensor([7, 5, 1, 6, 3, 7])
mask = torch.arange(T)[None, :] < lengths[:, None]
rollout = -3.0 * torch.rand(B, T, generator=g)
old = rollout + 0.4 * torch.randn(B, T, generator=g)
old[1, 2] += 3.0  # one token far above mu, one far below: both bounds bite
old[3, 0] -= 3.0
rollout, old = rollout * mask, old * mask

CASES = {
    "token_tis": dict(rollout_is="token", rollout_is_threshold=2.0),
    "sequence_tis_normalised": dict(rollout_is="sequence", rollout_is_threshold=5.0, rollout_is_batch_normalize=True),
    "token_icepop_normalised": dict(rollout_is="token", rollout_is_threshold="0.5_2.0",
                                    rollout_is_batch_normalize=True),
    "sequence_icepop": dict(rollout_is="sequence", rollout_is_threshold="0.2_3.0"),
    "rs_all_options_one_threshold": dict(
        rollout_rs=",".join(sorted(helper.SUPPORTED_ROLLOUT_RS_OPTIONS)), rollout_rs_threshold=2.0),
    "rs_mixed_with_token_is": dict(rollout_is="token", rollout_is_threshold=1.5,
                                    rollout_rs="token_k1,seq_mean_k3,seq_max_k2,seq_sum_k1,token_k2",
                                    rollout_rs_threshold="0.4_2.5,0.25,2.0,0.2_5.0,0.5"),
    "metrics_only": dict(),
}
out = {"verl_version": "0.9.1", "seed": SEED, "lengths": lengths.tolist(),
       "old_log_prob": old.tolist(), "rollout_log_prob": rollout.tolist(), "cases": {}}
for name, kwargs in CASES.items():
    proto, keep, metrics = helper.compute_rollout_correction_and_rejection_mask(old, rollout, mask.float(), **kwargs)
    case = {"kwargs": kwargs, "keep": (keep > 0.5).tolist(), "metrics": metrics}
    if proto is not None:
        case["weights"] = proto.batch["rollout_is_weights"].tolist()
    out["cases"][name] = case
Path(sys.argv[1]).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
print({k: len(v["metrics"]) for k, v in out["cases"].items()})
