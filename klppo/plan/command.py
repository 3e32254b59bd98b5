"""``klppo plan CONFIG [key=value ...]``: a run's batches, memory per rank and phase, and time, before it runs.

Nothing loads weights: the models' shapes come from config.json and the safetensors headers,
the lengths from the Parquet files' metadata and a sample of rows. The machine defaults to
this one's (the config's ranks; CUDA's free memory, else the host's available memory).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from klppo.cli_support import run_cli
from klppo.config import PPOConfig, load_ppo_config
from klppo.config.kl_probe import probe_every
from klppo.errors import UserError
from klppo.monitoring.flops import peak_flops_by_name
from klppo.plan.batches import format_batches, plan_batches
from klppo.plan.check import length_sample, lengths_of, plan_run
from klppo.plan.estimate import GiB, device_bytes_from, parse_size
from klppo.plan.memory import converted_load_bytes
from klppo.plan.inputs import Lengths
from klppo.plan.tables import format_memory, format_time, format_verdict
from klppo.plan.time import step_flops

DTYPE_KEYS = ("actor_rollout_ref.actor.fsdp_config.dtype", "actor_rollout_ref.ref.fsdp_config.dtype",
              "critic.model.fsdp_config.dtype", "reward_model.model.fsdp_config.dtype")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="klppo plan", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="YAML config (verl key names); may be left out with overrides only")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides, as klppo ppo takes them")
    p.add_argument("--gpus-per-node", type=int, help="ranks per node (default: trainer.n_gpus_per_node)")
    p.add_argument("--nodes", type=int, help="nodes (default: trainer.nnodes)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: trainer.device (auto: cuda if this machine has one)")
    p.add_argument("--device-memory", help="memory per device, e.g. 80GiB (default: trainer.plan_device_memory, "
                                           "else this machine's free memory)")
    p.add_argument("--host-memory", help="host memory per node, e.g. 1TiB (default: this machine's)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="compute dtype of every model (fsdp_config.dtype)")
    p.add_argument("--device-name", help="the device, for its peak FLOP/s (default: this machine's GPU), e.g. H100")
    p.add_argument("--peak-tflops", type=float, help="the device's dense peak, TFLOP/s (default: by --device-name)")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation the step time assumes (0.4)")
    args = p.parse_args(argv)
    if args.config is not None and "=" in args.config:  # overrides only, verl's command-line form
        args.overrides, args.config = [args.config, *args.overrides], None
    return args


def _cuda():
    import torch

    return torch.cuda if torch.cuda.is_available() else None


def machine_device(cfg: PPOConfig, flag: str | None) -> str:
    if flag is not None:
        return flag
    if cfg.trainer.device != "auto":
        return cfg.trainer.device
    return "cuda" if _cuda() is not None else "cpu"


def free_device_bytes(device: str) -> int:
    """What this machine offers one rank: the first GPU's free memory, or the host's available memory."""
    import torch

    from klppo.monitoring.memory import available_bytes

    if device == "cuda" and _cuda() is None:
        raise UserError("--device cuda on a machine without a GPU: give --device-memory (e.g. 80GiB) to plan for one")
    return available_bytes(torch.device("cuda:0" if device == "cuda" else "cpu"))


def host_bytes(flag: str | None) -> int:
    if flag is not None:
        return parse_size(flag, "--host-memory")
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def host_lines(e, per_node: int, host: int) -> str:
    """Host RAM per node at load (each rank's baseline, offloaded state) and at export (rank 0)."""
    actor = e.settings.model("actor")
    offloaded = sum(m.parameters * 4 // m.shards for m in e.settings.models
                    if e.settings.device == "cuda" and (m.param_offload or m.offload_policy))
    converted = 0 if e.settings.whole_loads else converted_load_bytes(e.settings)  # rank 0's, while shards fill
    load = per_node * (int(0.5 * GiB) + offloaded) + actor.shape.embedding_parameters * 4 + converted
    export = load + actor.parameters * 4 // actor.shards + 2 * actor.shape.embedding_parameters * 4
    return (f"host RAM per node: load {load / GiB:.1f} GiB, export {export / GiB:.1f} GiB "
            f"of {host / GiB:.1f} GiB ({per_node} rank(s) a node)")


def plan_text(args: argparse.Namespace) -> str:
    overrides = list(args.overrides) + ([f"{k}={args.dtype}" for k in DTYPE_KEYS] if args.dtype else [])
    cfg = load_ppo_config(args.config, overrides)
    per_node = args.gpus_per_node or cfg.trainer.n_gpus_per_node
    world = per_node * (args.nodes or cfg.trainer.nnodes)
    device = machine_device(cfg, args.device)
    device_bytes = device_bytes_from(cfg, args.device_memory, lambda: free_device_bytes(device))
    sample = length_sample(cfg)
    lengths = lengths_of(sample)
    e, knobs = plan_run(cfg, world_size=world, device=device, device_bytes=device_bytes, lengths=lengths)
    parts = [format_batches(plan_batches(cfg, world, sample)), format_memory(e), format_verdict(e, knobs),
             host_lines(e, per_node, host_bytes(args.host_memory)), _time_table(cfg, e, lengths, args, world)]
    return "\n\n".join(parts)


def _time_table(cfg: PPOConfig, e, lengths: Lengths, args, world: int) -> str:
    rows = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    prompts = [round(lengths.mean_prompt)] * rows
    responses = [round(lengths.mean_response)] * rows
    epochs = {"actor": cfg.actor_rollout_ref.actor.ppo_epochs, "critic": cfg.critic.ppo_epochs}
    probe_rows = e.settings.passes.probe_rows / probe_every(cfg)  # a probe every probe_every steps
    flops = step_flops(e.settings, prompts, responses, epochs=epochs, probe_rows=probe_rows)
    name = args.device_name or (_cuda().get_device_name(0) if _cuda() is not None else e.settings.device)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops_by_name(name, _compute_dtype(cfg))
    return format_time(flops, mfu=args.mfu, peak_flops=peak, devices=world, device_name=name)


def _compute_dtype(cfg: PPOConfig):
    import torch

    return torch.bfloat16 if cfg.actor_rollout_ref.actor.fsdp_config.dtype == "bfloat16" else torch.float32


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_cli(lambda: print(plan_text(args)))


if __name__ == "__main__":
    sys.exit(main())
