"""The offline KL probe's cost and noise by its size: what ``algorithm.kl_ctrl.probe_every`` and
``probe_prompts`` trade (README, "Offline RLHF"; benchmarks/README.md, "kl_probe.py").

    python benchmarks/kl_probe.py                      # issue #33's model, one thread, ~3 min
    python benchmarks/kl_probe.py --drift 0.18 --seeds 16 --prompts 4 8 16 32

Issue #33's workload (``step_overhead.py``'s model and offline data, 32-token responses, one
response per prompt) with the actor's weights drifted from the reference's by Gaussian noise of
``--drift`` times each tensor's standard deviation (0.18 gives a KL near 0.1, between the guards'
defaults of target and rollback). For each probe size, ``evaluate.offline_policy_kl`` on the same
step's first prompts with ``--seeds`` seeds (the probe's stream is seeded by the step): the
median process CPU time of a probe and the estimate's mean and standard deviation.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from step_overhead import build_workload, overrides  # noqa: E402


def probe_figures(root: Path, work: Path, drift: float, sizes: list[int], seeds: int) -> dict[int, dict]:
    from klppo.config import load_ppo_config
    from klppo.monitoring.timer import PhaseTimer
    from klppo.run.build import build_ppo, start_processes
    from klppo.trainer.dynamic_sampling import scored_step_batch
    from klppo.trainer.evaluate import offline_policy_kl

    shutil.rmtree(work, ignore_errors=True)
    batch_size = [f"data.train_batch_size={max(sizes)}", f"actor_rollout_ref.actor.ppo_mini_batch_size={max(sizes)}"]
    cfg = load_ppo_config(None, overrides("offline", root, work, 2, "issue33") + batch_size)
    parts = build_ppo(cfg, log=lambda *a, **k: None, env=start_processes(cfg))
    drawn = scored_step_batch(parts, PhaseTimer(), 1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a policy drifted from the reference
        for p in parts.actor.parameters():
            p.add_(torch.randn(p.shape, generator=g) * drift * p.std().clamp_min(1e-3))
    base, out = parts.settings, {}
    for prompts in sizes:
        parts.settings = dataclasses.replace(base, kl=dataclasses.replace(base.kl, probe_prompts=prompts))
        kls, seconds = [], []
        for step in range(1, seeds + 1):
            start = time.process_time()
            kls.append(offline_policy_kl(parts, drawn.batch, drawn.records, step)[0])
            seconds.append(time.process_time() - start)
        out[prompts] = {"ms": 1000 * statistics.median(seconds[1:]), "kl_mean": statistics.mean(kls),
                        "kl_std": statistics.stdev(kls)}
        print(f"{prompts:>3} prompts: {out[prompts]['ms']:6.0f} ms a probe, KL {out[prompts]['kl_mean']:.4f} "
              f"+- {out[prompts]['kl_std']:.4f} (std over {seeds} seeds)", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drift", type=float, default=0.18, help="noise added to the actor, in each tensor's std")
    p.add_argument("--prompts", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--seeds", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workload", type=Path, default=None, help="folder for the model and data (kept)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = build_workload(args.workload or Path(tmp), "issue33")
        probe_figures(root, Path(tmp) / "run", args.drift, args.prompts, args.seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
