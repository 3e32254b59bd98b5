"""``klppo ppo`` / ``python -m klppo.trainer.main_ppo --config x.yaml [key.path=value ...]``: one PPO run.

The same command runs under ``torchrun --nproc_per_node N -m klppo.trainer.main_ppo ...``:
every process joins the process group, trains its share, and leaves it cleanly; a process
that fails leaves at once, and torchrun stops the others.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from klppo.cli_support import loaded_with_notes, parse_config_args, quiet_libraries, run_cli
from klppo.config import command_line_config, format_config, load_ppo_config


def run_ppo(config_path: str | None, overrides: list[str], print_fn=print) -> list[dict]:
    """Validate the config, build everything, train; returns the logged metrics records."""
    from klppo.distributed import launched_world_size, run_on_ranks
    from klppo.run.build import start_processes
    from klppo.run.setup import check_run_dir, return_freed_memory

    # a launch unlike the config is its first problem; its warnings are shown before anything loads
    cfg = loaded_with_notes(lambda notes: load_ppo_config(config_path, overrides, notes=notes,
                                                          launched=launched_world_size()), print_fn)
    check_run_dir(cfg.trainer.default_local_dir)
    return_freed_memory()
    quiet_libraries()
    env = start_processes(cfg)
    return run_on_ranks(env, lambda log: _train(cfg, env, log), print_fn)


def _train(cfg, env, print_fn) -> list[dict]:
    from klppo.monitoring.memory import PeakMemory
    from klppo.run.build import build_ppo, resolve_packing
    from klppo.trainer.ppo_trainer import PPOTrainer
    from klppo.run.state import resume_target
    from klppo.distributed import same_on_every_rank

    resolve_packing(cfg, print_fn)  # so that the memory plan counts the rows the run will have
    check_memory_plan(cfg, env, print_fn)  # before any model loads; a run that cannot fit stops here
    setup_memory = PeakMemory(env.device)
    setup_memory.reset()
    parts = build_ppo(cfg, log=print_fn, env=env)  # the config's, data's and models' user errors surface here
    with engine_stopped_at_the_end(parts):
        resume_from = same_on_every_rank(lambda: resume_target(parts))  # so does a checkpoint that cannot be resumed
        # The run folder is first written once the first step is logged (klppo.run.folder).
        trainer = PPOTrainer(parts, print_fn=print_fn, setup_peak_gb=setup_memory.peak_gb(),
                             config_text=format_config(cfg))
        return trainer.fit(resume_from)


def check_memory_plan(cfg, env, print_fn) -> None:
    """The memory plan's short block (``trainer.plan_check``), agreed over the ranks, rank 0 prints;
    under ``error`` a run whose estimate exceeds the device's memory by a clear margin stops with
    the plan's knobs (a ``UserError`` on every rank) instead of running out of memory later.

    Each rank sees its own free memory (another process on its GPU, the host's memory at that
    moment), so each would reach its own verdict: one rank stopping alone leaves the others
    waiting in the next collective. The plan is made against the least memory any rank has,
    and a refusal on any rank is raised on all (``same_on_every_rank``, as the resume check).
    """
    from klppo.distributed import all_gather_objects, same_on_every_rank
    from klppo.monitoring.memory import available_bytes
    from klppo.plan.check import check_at_start, plan_check_mode

    if plan_check_mode(cfg) == "off":
        return
    least = min(all_gather_objects(available_bytes(env.device)))  # host sync: one gather before any model
    same_on_every_rank(lambda: check_at_start(cfg, world_size=env.world_size, device=env.device.type,
                                              free_bytes=lambda: least, print_fn=print_fn))


@contextmanager
def engine_stopped_at_the_end(parts):
    """The vLLM engine is stopped after the run: after every rank's last collective when the run
    succeeds; at once after a failure (stopping it leaves the process group, as ``abandon`` would)."""
    from klppo.distributed import barrier

    if parts.engine is None:
        yield
        return
    try:
        yield
        barrier()
    finally:
        parts.engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_config_args(argv, "klppo ppo", "Train with KL-regularised PPO.")
    return run_cli(lambda: run_ppo(*command_line_config(args)))


if __name__ == "__main__":
    sys.exit(main())
