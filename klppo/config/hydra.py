"""verl's Hydra forms: ``--config-path DIR --config-name NAME`` on the command line, and a config
file's ``hydra:`` and ``defaults:`` sections.

verl's scripts pick a config with ``--config-path`` / ``--config-name`` (verl's own
``ppo_trainer``, ``ppo_megatron_trainer`` or ``sft_trainer``, or a YAML file of their own), and
such a file starts from verl's tree with ``defaults: [ppo_trainer, _self_]``. klppo's PPO
defaults are ``ppo_trainer``'s, so both forms load as they are: the name becomes the file, a
built-in name needs none, and ``ppo_megatron_trainer`` adds what it sets that klppo reads, its
three ``strategy: megatron`` keys, which klppo trains with FSDP2 and says so (``config.checks``).
``sft_trainer`` adds where verl's SFT defaults differ from ``klppo sft``'s (betas, warm-up,
cosine schedule, epochs, ...): verl's SFT module path (``klppo.trainer.fsdp_sft_trainer``) starts
from it, as verl's does.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from klppo.config.optimizers import untaken_arguments
from klppo.config.problems import Problem
from klppo.errors import UserError

MEGATRON_STRATEGIES = ("actor_rollout_ref.actor.strategy", "actor_rollout_ref.ref.strategy", "critic.strategy")
# verl's sft_trainer.yaml, where it differs from klppo sft's defaults in what klppo reads (its
# placeholder paths and its wandb logger aside): verl's SFT module path starts from these.
VERL_SFT_TRAINER = {
    "data.prompt_key": "question", "data.response_key": "answer", "data.micro_batch_size_per_gpu": 4,
    "model.enable_gradient_checkpointing": True, "optim.betas": [0.9, 0.95], "optim.lr_warmup_steps_ratio": 0.1,
    "optim.warmup_style": "cosine", "trainer.total_epochs": 4, "trainer.project_name": "gsm8k-sft",
    "trainer.experiment_name": "test",
}
# verl's built-in configs -> what each sets beyond klppo's defaults (ppo_trainer's, for PPO) that klppo reads
VERL_CONFIGS: dict[str, dict[str, object]] = {
    "ppo_trainer": {}, "ppo_megatron_trainer": {key: "megatron" for key in MEGATRON_STRATEGIES},
    "sft_trainer": VERL_SFT_TRAINER,
}
# Config groups verl's own files name in their defaults, whose settings the file itself sets again
# (sft_trainer.yaml's optim section; klppo's optim defaults are the rest).
VERL_GROUPS = ({"optim": "fsdp"},)


def command_line_config(args) -> tuple[Optional[str], list[str]]:
    """(config file or None, overrides) of a parsed command line (``args``: its ``config``,
    ``overrides``, ``config_path`` and ``config_name``) that may name its config as Hydra does.

    ``config_name`` (``.yaml`` optional) is a file in ``config_path`` (default: the current
    folder); where there is none, a name of verl's own configs loads klppo's defaults (plus
    what ``ppo_megatron_trainer`` sets, ahead of the overrides so that they still win)."""
    config, overrides, config_path, config_name = args.config, args.overrides, args.config_path, args.config_name
    if config_name is None:
        if config_path is not None:
            raise UserError(f"--config-path {config_path} names a folder but no --config-name names the file in it")
        return config, overrides
    if config is not None:
        raise UserError(f"both a config file ({config}) and --config-name {config_name}: give one of the two")
    stem = config_name[:-5] if config_name.endswith(".yaml") else config_name
    folder = config_path if config_path is not None else "."
    file = os.path.join(folder, f"{stem}.yaml")
    if os.path.isfile(file):
        return file, overrides
    if stem in VERL_CONFIGS:  # verl's own, from its package: what it sets beyond klppo's defaults comes first
        return None, [f"{key}={json.dumps(value)}" for key, value in VERL_CONFIGS[stem].items()] + overrides
    raise UserError(f"--config-name {config_name}: no file {file} (--config-path {folder}); name a YAML file there, "
                    f"or one of verl's own configs ({', '.join(VERL_CONFIGS)})")


def hydra_sections(tree: dict, source: str, problems: list[Problem], notes: list[str]) -> dict:
    """``tree`` without Hydra's ``hydra:`` (its own settings: search paths, run folders) and
    ``defaults:`` sections, with what a ``ppo_megatron_trainer`` default sets added under the
    file's own values. A default other than verl's two configs and ``_self_``, or ``_self_``
    ahead of them (verl's defaults would then override the file), is a problem."""
    if "defaults" not in tree and "hydra" not in tree:
        return tree
    tree = dict(tree)
    if "hydra" in tree:
        tree.pop("hydra")
        notes.append(f"warning: the hydra section of {source} has no effect in klppo (Hydra's own settings: search "
                     "paths, output folders)")
    defaults = tree.pop("defaults", [])
    entries = defaults if isinstance(defaults, list) else [defaults]
    names = [entry for entry in entries if isinstance(entry, str)]
    unknown = [entry for entry in entries
               if entry not in VERL_GROUPS and (not isinstance(entry, str) or entry not in (*VERL_CONFIGS, "_self_"))]
    if unknown:
        problems.append(Problem(("defaults",), f"defaults entr{'y' if len(unknown) == 1 else 'ies'} "
                                f"{', '.join(repr(e) for e in unknown)} of {source}: klppo starts every config from "
                                f"verl's ppo_trainer tree and knows {', '.join(VERL_CONFIGS)} and _self_; put the "
                                "settings of other config files in this one"))
    bases = [name for name in names if name in VERL_CONFIGS]
    if "_self_" in names and bases and names.index("_self_") < names.index(bases[-1]):
        problems.append(Problem(("defaults",), f"defaults of {source} put _self_ ahead of {bases[-1]}, so verl's "
                                "defaults would override this file's values; put _self_ last"))
    for base in bases:
        for key, value in VERL_CONFIGS[base].items():
            _set_default(tree, key.split("."), value)
    return tree


def _set_default(tree: dict, path: list[str], value: object) -> None:
    """``value`` at ``path`` in ``tree`` unless the file sets it (sections created as needed)."""
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            if child is not None:
                return  # the file's own (wrong) value there: its own error follows
            child = node[part] = {}
        node = child
    node.setdefault(path[-1], value)


def resolve_megatron(cfg, notes: list[str]) -> None:
    """Engines set to verl's ``megatron`` (``ppo_megatron_trainer`` sets all three) train with
    FSDP2, which the resolved config shows; one warning says so. ``cfg``: a ``PPOConfig``."""
    sections = {"actor_rollout_ref.actor": cfg.actor_rollout_ref.actor, "actor_rollout_ref.ref": cfg.actor_rollout_ref.ref,
                "critic": cfg.critic}
    megatron = [key for key, section in sections.items() if section.strategy == "megatron"]
    if not megatron:
        return
    dropped = []
    for key in megatron:
        sections[key].strategy = "fsdp2"
        dropped += _without_megatron_optimizer_settings(sections[key], key)
    notes.append(f"warning: {', '.join(f'{key}.strategy' for key in megatron)} = 'megatron': training with FSDP2 "
                 "instead, since klppo has no Megatron-LM engine (each decoder block sharded over all ranks); "
                 "Megatron's parallelism settings (tensor, pipeline, expert) have no effect"
                 + (f", nor do its optimizer's settings {', '.join(dropped)}" if dropped else ""))


def _without_megatron_optimizer_settings(section, key: str) -> list[str]:
    """verl's Megatron engine hands ``optim.override_optimizer_config`` to Megatron's optimizer
    (``optimizer_offload_fraction``, ``use_precision_aware_optimizer``, ...): the keys the torch
    optimiser klppo builds does not take are dropped (-> their dotted names); the rest act."""
    optim = getattr(section, "optim", None)
    if optim is None:
        return []
    untaken, _ = untaken_arguments(optim.optimizer_impl, optim.optimizer, optim.override_optimizer_config)
    for name in untaken:
        del optim.override_optimizer_config[name]
    return [f"{key}.optim.override_optimizer_config.{name}" for name in untaken]
