"""verl's SFT keys (``verl.trainer.fsdp_sft_trainer``'s ``sft_trainer.yaml``) in ``klppo sft``.

As ``verl.py`` does for PPO, before the typed tree is built every key of verl's SFT tree that
is not a field of ``supervised.py`` leaves the raw config: a key klppo spells another way moves
there and acts (``optim.lr_scheduler`` is ``optim.warmup_style``, ``trainer.seed`` is
``data.seed``, ``model.fsdp_config.cpu_offload`` is ``offload_policy``); any other key is
dropped, listed in the one warning when set to anything but verl's default, or refused where
ignoring it would train something else. A key neither has stays, for the builder to report.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Mapping

from klppo.config.interpolate import get_dotted, set_dotted
from klppo.config.problems import Problem
from klppo.config.verl import show, whole_sequence_micro_batches

# Every leaf of verl's SFT tree (sft_trainer.yaml with its optim/fsdp group, verl b178a3cd5) -> its default.
VERL_SFT_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 256, "data.micro_batch_size": None, "data.micro_batch_size_per_gpu": 4,
    "data.train_files": "~/data/gsm8k/train.parquet", "data.val_files": "~/data/gsm8k/test.parquet",
    "data.train_max_samples": -1, "data.val_max_samples": -1, "data.prompt_key": "question",
    "data.response_key": "answer", "data.prompt_dict_keys": None, "data.response_dict_keys": None,
    "data.multiturn.enable": False, "data.multiturn.messages_key": "messages", "data.multiturn.tools_key": "tools",
    "data.multiturn.enable_thinking_key": "enable_thinking", "data.max_length": 1024, "data.truncation": "error",
    "data.balance_dp_token": False, "data.chat_template": None, "data.custom_cls.path": None,
    "data.custom_cls.name": None, "data.use_shm": False, "data.apply_chat_template_kwargs": {},
    "model.partial_pretrain": "~/models/gemma-1.1-7b-it", "model.use_shm": False,
    "model.fsdp_config.model_dtype": "fp32", "model.fsdp_config.wrap_policy.min_num_params": 0,
    "model.fsdp_config.cpu_offload": False, "model.fsdp_config.offload_params": False, "model.external_lib": None,
    "model.enable_gradient_checkpointing": True, "model.trust_remote_code": False, "model.lora_rank": 0,
    "model.lora_alpha": 16, "model.target_modules": "all-linear", "model.use_liger": False, "model.strategy": "fsdp2",
    "optim._target_": "verl.workers.config.FSDPOptimizerConfig", "optim.optimizer": "AdamW",
    "optim.optimizer_impl": "torch.optim", "optim.lr": 1e-5, "optim.lr_warmup_steps_ratio": 0.1,
    "optim.total_training_steps": -1, "optim.weight_decay": 0.01, "optim.lr_warmup_steps": -1,
    "optim.betas": [0.9, 0.95], "optim.clip_grad": 1.0, "optim.min_lr_ratio": 0.0, "optim.num_cycles": 0.5,
    "optim.lr_scheduler_type": "constant", "optim.warmup_style": None, "optim.override_optimizer_config": None,
    "optim.lr_scheduler": "cosine", "ulysses_sequence_parallel_size": 1, "use_remove_padding": False,
    "trainer.default_local_dir": "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
    "trainer.default_hdfs_dir": None, "trainer.project_name": "gsm8k-sft", "trainer.experiment_name": "test",
    "trainer.total_epochs": 4, "trainer.total_training_steps": None, "trainer.logger": ["console", "wandb"],
    "trainer.seed": 1, "trainer.save_freq": -1, "trainer.test_freq": -1, "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 8, "trainer.max_ckpt_to_keep": None, "trainer.resume_mode": "auto",
    "trainer.resume_from_path": None, "trainer.checkpoint.save_contents": ["model", "optimizer", "extra"],
    "trainer.checkpoint.load_contents": "${trainer.checkpoint.save_contents}", "trainer.device": "cuda",
}
# verl SFT keys that are klppo fields under another name.
SFT_ALIASES: dict[str, str] = {
    "optim.lr_scheduler": "optim.warmup_style", "optim.lr_scheduler_type": "optim.warmup_style",
    "trainer.seed": "data.seed", "model.fsdp_config.cpu_offload": "model.fsdp_config.offload_policy",
    "model.fsdp_config.offload_params": "model.fsdp_config.param_offload",
}
REFUSE = "refuse"
# (patterns, why it has no effect[, REFUSE when a non-default value would train something else]); first match wins.
SFT_RULES: tuple[tuple, ...] = (
    (("data.custom_cls.*",), "klppo reads its own SFT columns only (no custom dataset class)", REFUSE),
    (("data.chat_template",), "verl's SFT refuses it too; klppo renders prompts with the template saved with the "
     "tokenizer", REFUSE),
    (("model.external_lib",), "klppo never imports code for a model; use an architecture transformers ships", REFUSE),
    (("model.trust_remote_code",), "klppo never runs code from a model folder", REFUSE),
    (("data.micro_batch_size",), "verl's SFT trainer reads data.micro_batch_size_per_gpu only, and so does klppo"),
    (("data.use_shm", "model.use_shm"), "klppo reads files where they are (no shared-memory copy)"),
    (("data.balance_dp_token",), "klppo splits a step's examples over the ranks by count"),
    (("model.fsdp_config.model_dtype",), "klppo keeps master weights in fp32 and sets the compute dtype with "
     "model.fsdp_config.dtype"),
    (("model.fsdp_config.wrap_policy.*", "model.strategy", "model.use_liger"),
     "FSDP engine tuning; klppo wraps each decoder block, then the root, with FSDP2"),
    (("ulysses_sequence_parallel_size",), "Ulysses sequence parallelism; klppo keeps whole sequences on each "
     "device (same numbers)"),
    (("use_remove_padding",), "klppo's SFT forwards pad each micro-batch to its longest example (same numbers)"),
    (("trainer.default_hdfs_dir", "trainer.checkpoint.*"), "klppo saves the complete state in one format "
     "(trainer.save_freq, max_ckpt_to_keep)"),
    (("trainer.test_freq",), "klppo measures validation loss ten times a run, with the console table"),
    (("optim._target_",), "verl's dataclass name for the section (verl's own bookkeeping)"),
    (("optim.total_training_steps", "optim.num_cycles"), "klppo's schedule follows trainer.total_training_steps "
     "(or total_epochs) with one cosine half-period"),
)


def split_verl_sft_keys(raw: dict, fields: Mapping[str, str], problems: list[Problem]
                        ) -> tuple[dict, list[tuple[str, Any, str]]]:
    """(the tree the typed builder gets, [(key, value, reason)] of set keys without effect)."""
    moves: list[tuple[str, Any]] = []
    ignored: list[tuple[str, Any, str]] = []
    kept = _walk(raw, "", raw, fields, problems, moves, ignored)
    for key, value in moves:
        set_dotted(kept, key, value)
    return kept, _whole_sequence_micro_batch(kept, raw, ignored)


def _whole_sequence_micro_batch(kept: dict, raw: dict, ignored: list[tuple[str, Any, str]]
                                ) -> list[tuple[str, Any, str]]:
    """verl's micro-batch under Ulysses groups, as a whole-sequence one (as for PPO's)."""
    _, sp = get_dotted(raw, "ulysses_sequence_parallel_size")
    return whole_sequence_micro_batches(kept, [("data.micro_batch_size_per_gpu", "ulysses_sequence_parallel_size", sp)],
                                        ignored)


def _walk(node: dict, prefix: str, full: dict, fields: Mapping[str, str], problems: list[Problem],
          moves: list, ignored: list) -> dict:
    kept: dict = {}
    for name, value in node.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        kind = fields.get(key)
        if kind == "section" and isinstance(value, dict):
            kept[name] = _walk(value, key, full, fields, problems, moves, ignored)
        elif kind is not None:
            if not (value is None and kind == "value" and key in VERL_SFT_DEFAULTS and VERL_SFT_DEFAULTS[key] is None):
                kept[name] = value  # (verl's null there means "not set": klppo's default applies)
        elif key in SFT_ALIASES:
            _alias(key, value, full, problems, moves)
        elif key in VERL_SFT_DEFAULTS:
            _no_effect(key, value, problems, ignored)
        elif isinstance(value, dict) and any(k.startswith(key + ".") for k in VERL_SFT_DEFAULTS):
            rest = _walk(value, key, full, fields, problems, moves, ignored)  # a section of verl's only
            if rest:
                kept[name] = rest  # keys neither has: the builder reports them
        else:
            kept[name] = value
    return kept


def _same(value: Any, default: Any) -> bool:
    return value == default or (value is not None and default is not None and str(value) == str(default))


def _alias(key: str, value: Any, full: dict, problems: list[Problem], moves: list) -> None:
    if key in ("optim.lr_scheduler_type", "model.fsdp_config.cpu_offload", "model.fsdp_config.offload_params") \
            and _same(value, VERL_SFT_DEFAULTS[key]):
        return  # verl's default there: klppo's own default for the target applies
    target = SFT_ALIASES[key]
    found, theirs = get_dotted(full, target)
    if found and theirs is not None and not _same(theirs, value):
        problems.append(Problem((key, target), f"{key} = {show(value)} and {target} = {show(theirs)} set the same knob "
                                "(verl's spelling and klppo's); keep one of them"))
        return
    moves.append((target, value))


def _no_effect(key: str, value: Any, problems: list[Problem], ignored: list) -> None:
    default = VERL_SFT_DEFAULTS[key]
    if _same(value, default):
        return
    rule = next((r for r in SFT_RULES if any(fnmatch.fnmatchcase(key, p) for p in r[0])), None)
    reason, refuse = (rule[1], rule[2:] == (REFUSE,)) if rule else ("a verl setting klppo does not use", False)
    if refuse:
        problems.append(Problem((key,), f"{key} = {show(value)}: {reason}; remove the key (verl's default is "
                                f"{show(default)})"))
    else:
        ignored.append((key, value, reason))
