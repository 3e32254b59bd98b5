"""``klppo export``: a checkpoint's model as a Hugging Face folder (what verl's model_merger makes).

A run exports its actor (an SFT or reward-model run: its model) when it ends; ``klppo export
RUN_DIR OUT`` does the same for any checkpoint the run saved: its newest (the one
``latest_checkpointed_iteration.txt`` names), or a ``global_step_N`` folder named directly. The
model is built as the run built it, from the run's own ``config.yaml`` (model folder, LoRA
settings, chat template; ``key=value`` overrides apply, e.g. where the model folder has moved), in
one process, whatever number of ranks saved the checkpoint. The checkpoint is checked whole first
and its weights are read without running code. The folder is the run's own export:
``from_pretrained`` loads it, a LoRA model's adapters are merged (and written alone beside it),
the tokenizer goes with it, and it is written beside its final place and renamed, so a failure
leaves no half folder.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from klppo.checkpoint.state import WEIGHTS_DIR, pointed_step, step_dir
from klppo.checkpoint.verify import check_resume_target, saved_kind
from klppo.cli_support import quiet_libraries, run_cli
from klppo.config import load_ppo_config, load_rm_config, load_sft_config
from klppo.config.schema import FSDPConfig
from klppo.distributed import (
    DistEnv, load_model_training_state, load_sharded, model_training_state, resolve_device,
)
from klppo.errors import UserError
from klppo.models.load import load_tokenizer
from klppo.run.adapters import export_model
from klppo.run.setup import Sharder, load_model, lora_spec

CONFIG_FILE = "config.yaml"  # what a run writes beside its checkpoints (klppo.run.folder)


@dataclass(frozen=True)
class SavedModel:
    """Which model of a checkpoint to export, and how the run built it."""

    name: str  # its name in the checkpoint's weights: actor, critic or model
    role: str  # load_model's: causal_lm, critic or reward_model
    path: str  # the model folder it started from
    key: str  # the config key of that folder
    lora_prefix: str  # the config section of its LoRA keys
    chat_template: str | None = None  # actor_rollout_ref.model.custom_chat_template
    tokenizer_path: str | None = None  # actor_rollout_ref.model.tokenizer_path: the run's tokenizer, where not in path


def find_checkpoint(path: Path) -> Path:
    """``path`` itself when it is a checkpoint folder, else the newest checkpoint of the run folder ``path``."""
    if not path.is_dir():
        raise UserError(f"'{path}' is not a folder; give a run's folder (its trainer.default_local_dir) or one of its "
                        "global_step_N checkpoints")
    if (path / WEIGHTS_DIR).is_dir():
        return path
    step = pointed_step(path)
    if step is None:
        raise UserError(f"'{path}' holds no checkpoint (no latest_checkpointed_iteration.txt); give a run's folder "
                        "after it saved one (trainer.save_freq), or a global_step_N folder")
    return step_dir(path, step)


def saved_model(folder: Path, config_path: Path, overrides: list[str], which: str):
    """(the run's config, the model to export) for the checkpoint in ``folder``."""
    kind = saved_kind(folder)
    if kind is None:
        raise UserError(f"'{folder}' is not a checkpoint of a klppo run; give a global_step_N folder of one")
    if not config_path.is_file():
        raise UserError(f"'{config_path}' does not exist: the run writes its config there; give it with --config")
    if kind == "ppo":
        cfg = load_ppo_config(str(config_path), overrides)
        arf = cfg.actor_rollout_ref
        if which == "critic":
            if cfg.algorithm.adv_estimator != "gae":
                raise UserError(f"--model critic: the run trained no critic (algorithm.adv_estimator = "
                                f"'{cfg.algorithm.adv_estimator}'); export its actor")
            return cfg, SavedModel("critic", "critic", cfg.critic.model.path, "critic.model.path", "critic.model",
                                   tokenizer_path=arf.model.tokenizer_path)
        return cfg, SavedModel("actor", "causal_lm", arf.model.path, "actor_rollout_ref.model.path",
                               "actor_rollout_ref.model", arf.model.custom_chat_template, arf.model.tokenizer_path)
    if which == "critic":
        raise UserError(f"--model critic: '{folder}' is a checkpoint of {kind} training, which has one model; "
                        "leave --model out")
    if kind == "supervised":  # saved before checkpoints recorded their kind: the run's config tells
        kind = "rm" if "loss" in _top_level_keys(config_path) else "sft"
    cfg = (load_rm_config if kind == "rm" else load_sft_config)(str(config_path), overrides)
    role = "reward_model" if kind == "rm" else "causal_lm"
    return cfg, SavedModel("model", role, cfg.model.partial_pretrain, "model.partial_pretrain", "model")


def _top_level_keys(path: Path) -> set[str]:
    from klppo.config.files import read_yaml

    tree = read_yaml(str(path))
    return set(tree) if isinstance(tree, dict) else set()


def export_checkpoint(source: str, out: str, *, which: str = "actor", config: str | None = None,
                      overrides: list[str] | None = None, adapter_out: str | None = None, device: str = "cpu",
                      force: bool = False, print_fn=print) -> list[Path]:
    """Write the checkpoint's model to ``out`` (and a LoRA model's adapter to ``adapter_out``); returns the folders."""
    folder = find_checkpoint(Path(source))
    out_dir = Path(out)
    adapter_dir = Path(adapter_out) if adapter_out else out_dir.with_name(out_dir.name + "_adapter")
    for target in (out_dir, adapter_dir):
        if target.exists() and not force:
            raise UserError(f"'{target}' exists; choose another path, or pass --force to replace it")
        place, checkpoint = target.resolve(), folder.resolve()
        if place == checkpoint or checkpoint in place.parents or place in checkpoint.parents:
            raise UserError(f"'{target}' is in or holds the checkpoint '{folder}'; write the export somewhere else")
    config_path = Path(config) if config else folder.parent / CONFIG_FILE
    cfg, model_info = saved_model(folder, config_path, list(overrides or []), which)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=resolve_device(device, key="--device"),
                  is_distributed=False)
    print_fn(f"building {model_info.name} from {model_info.path} ({model_info.key}) on {env.device}")
    lora = lora_spec(_section(cfg, model_info.lora_prefix), model_info.lora_prefix)
    model = load_model(model_info.role, model_info.path, key=model_info.key, env=env, sharder=Sharder(env),
                       fsdp=FSDPConfig(), seed=cfg.data.seed, lora=lora)
    state = {model_info.name: model_training_state(model)}
    step = check_resume_target(folder, kind=_kind_of(model_info), world_size=None, sharded=state,
                               key=f"checkpoint {folder}")
    print_fn(f"reading its weights at step {step} from {folder}")
    load_sharded(state, folder / WEIGHTS_DIR)
    load_model_training_state(model, state[model_info.name])
    tokenizer = load_tokenizer(model_info.path, model_info.key, model_info.chat_template,
                               tokenizer_path=model_info.tokenizer_path)
    written = export_model(model, tokenizer, out_dir, adapter_dir, env)
    print_fn(f"exported {model_info.name} of step {step} to {' and '.join(str(p) for p in written)}")
    return written


def _kind_of(model_info: SavedModel) -> str:
    return "ppo" if model_info.name in ("actor", "critic") else "rm" if model_info.role == "reward_model" else "sft"


def _section(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="klppo export", description="Write a checkpoint's model as a Hugging Face "
                                     "folder, as the run's own export at its end is written.")
    parser.add_argument("checkpoint", help="a run's folder (its newest checkpoint) or a global_step_N folder")
    parser.add_argument("out", help="the Hugging Face folder to write")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides of the run's config (e.g. a model "
                        "folder that has moved: actor_rollout_ref.model.path=...)")
    parser.add_argument("--model", choices=("actor", "critic"), default="actor",
                        help="a PPO checkpoint's actor (default) or critic")
    parser.add_argument("--config", help=f"the run's config (default: {CONFIG_FILE} in the run's folder)")
    parser.add_argument("--adapter-out", help="where a LoRA model's adapter goes (default: OUT_adapter)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu")
    parser.add_argument("--force", action="store_true", help="replace existing output folders")
    args = parser.parse_intermixed_args(argv)
    quiet_libraries()
    return run_cli(lambda: export_checkpoint(args.checkpoint, args.out, which=args.model, config=args.config,
                                             overrides=args.overrides, adapter_out=args.adapter_out,
                                             device=args.device, force=args.force))


if __name__ == "__main__":
    sys.exit(main())
