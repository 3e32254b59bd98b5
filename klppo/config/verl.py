"""verl's config keys: the ones klppo acts on under another spelling, and the ones it accepts
but does not act on.

klppo promises that a verl config runs with at most a path changed. verl's tree has about a
thousand keys (``verl_keys_<version>.yaml``, written by ``scripts/verl_config_keys.py`` from
verl's generated PPO config; ``verl_keys_older.yaml`` holds keys of earlier releases that
verl's own scripts still set). Before the typed tree is built, ``split_verl_keys`` takes every
such key that is not a field of ``schema.py`` out of the raw config:

- a key verl spells two ways (``optim.clip_grad`` / ``grad_clip``; 0.9.1's ``reward.*`` /
  the older ``reward_model.*``) moves to klppo's spelling, and acts;
- verl's global micro-batch sizes become the per-device ones, as verl computes them;
- with Ulysses sequence parallelism, verl's per-device micro-batch is a group's (each device
  holds 1/sp of every sequence); klppo keeps whole sequences on each device, so it takes 1/sp
  as many sequences per micro-batch: the same tokens per device, the same numbers;
- any other key is dropped; when its value differs from verl's default it is listed, with the
  reason from ``verl_reasons.RULES``, in one summary warning, or refused as an error when
  ignoring it would change what is trained.

A key neither klppo nor verl has stays in the tree, where the builder reports it as unknown.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import yaml

from klppo.config.problems import Problem
from klppo.config.interpolate import absolute_key, get_dotted, set_dotted
from klppo.config.verl_reasons import FOLLOWS, REFUSE, RULES

VERL_VERSION = "0.9.1"
_HERE = Path(__file__).parent
VERL_KEYS_FILE = _HERE / f"verl_keys_{VERL_VERSION}.yaml"
OLDER_KEYS_FILE = _HERE / "verl_keys_older.yaml"

# Mappings whose content verl passes on unchecked (engine kwargs, config overrides): any key
# below one of these is verl's.
_OPEN_NAME = re.compile(r"(_kwargs|override_\w+|_options|runtime_env)$")
_FOLLOWS = re.compile(r"\$\{(?:oc\.select:)?\s*([.\w-]+)\s*(?:,.*)?\}")
NO_DEFAULT = object()  # the default of a key below an open mapping: none, so any value is set

_FSDP_KNOBS = ("param_offload", "optimizer_offload", "offload_policy", "reshard_after_forward", "fsdp_size", "dtype")

# verl keys that are klppo fields under another name (verl keeps both spellings itself).
ALIASES: dict[str, str] = {
    # verl 0.9.1's engine clips with optim.clip_grad; its actor/critic grad_clip is the older name.
    "actor_rollout_ref.actor.optim.clip_grad": "actor_rollout_ref.actor.grad_clip",
    "critic.optim.clip_grad": "critic.grad_clip",
    # lr_scheduler_type is verl's newer name of warmup_style (which klppo keeps).
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "actor_rollout_ref.actor.optim.warmup_style",
    "critic.optim.lr_scheduler_type": "critic.optim.warmup_style",
    # verl 0.9.1 moved critic.model.fsdp_config to critic.fsdp.
    **{f"critic.fsdp.{k}": f"critic.model.fsdp_config.{k}" for k in _FSDP_KNOBS},
    # verl 0.9.1 moved reward_model.* and custom_reward_function.* under reward.*.
    "reward.reward_model.enable": "reward_model.enable",
    "reward.reward_model.model_path": "reward_model.model.path",
    "reward.custom_reward_function.path": "custom_reward_function.path",
    "reward.custom_reward_function.name": "custom_reward_function.name",
    "reward.custom_reward_function.reward_kwargs": "custom_reward_function.reward_kwargs",
    "reward.reward_model.rollout.prompt_length": "reward_model.rollout.prompt_length",
    "reward.reward_model.rollout.response_length": "reward_model.rollout.response_length",
    # verl 0.3's name of log_val_generations.
    "trainer.val_generations_to_log_to_wandb": "trainer.log_val_generations",
}

# Keys that verl's older trees set to another key's value, which is what klppo does anyway.
_SAME_AS = {
    "critic.model.tokenizer_path": ("actor_rollout_ref.model.tokenizer_path", "actor_rollout_ref.model.path"),
}

# verl's global micro-batch sizes (deprecated there too): verl divides them by the world size.
GLOBAL_MICRO: dict[str, str] = {
    "actor_rollout_ref.actor.ppo_micro_batch_size": "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size": "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "critic.ppo_micro_batch_size": "critic.ppo_micro_batch_size_per_gpu",
    "reward_model.micro_batch_size": "reward_model.micro_batch_size_per_gpu",
}

# verl's Ulysses sequence-parallel sizes (its older and newer spellings), each with the per-device
# micro-batches it shares over a group of devices. verl's reference defaults to the actor's size.
_ACTOR_SP = ("actor_rollout_ref.actor.ulysses_sequence_parallel_size",
             "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size")
_REF_SP = ("actor_rollout_ref.ref.ulysses_sequence_parallel_size",
           "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size")
_CRITIC_SP = ("critic.ulysses_sequence_parallel_size", "critic.fsdp.ulysses_sequence_parallel_size",
              "critic.model.fsdp_config.ulysses_sequence_parallel_size")
ULYSSES_MICRO: dict[str, tuple[tuple[str, ...], ...]] = {  # micro-batch key -> SP keys, first found first
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": (_ACTOR_SP,),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": (_ACTOR_SP,),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": (_REF_SP, _ACTOR_SP),
    "critic.ppo_micro_batch_size_per_gpu": (_CRITIC_SP,),
}


# ---- the key lists ----


def _read(path: Path) -> dict:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C loader reads the ~1,300 keys 10x faster
    with open(path, encoding="utf-8") as f:
        return yaml.load(f, Loader=loader)


@lru_cache(maxsize=None)
def _older() -> dict:
    return _read(OLDER_KEYS_FILE)


@lru_cache(maxsize=None)
def verl_defaults() -> dict[str, Any]:
    """Every verl leaf key klppo knows -> verl's default: the current tree, then older releases'."""
    current = _read(VERL_KEYS_FILE)
    assert str(current["verl_version"]) == VERL_VERSION, f"{VERL_KEYS_FILE} is not verl {VERL_VERSION}"
    older = _older()
    keys = {**current["keys"], **current["megatron_keys"]}
    for section in ("keys", "from_scripts"):
        for key, entry in older[section].items():
            keys.setdefault(key, entry["default"])
    return keys


@lru_cache(maxsize=None)
def verl_sections() -> dict[str, tuple[str, ...]]:
    """Every section of verl's tree -> the names directly under it ('' is the top level)."""
    children: dict[str, dict[str, None]] = {}
    for key in verl_defaults():
        parts = key.split(".")
        for i in range(len(parts)):
            children.setdefault(".".join(parts[:i]), {})[parts[i]] = None
    return {section: tuple(names) for section, names in children.items()}


def open_mapping(key: str) -> Optional[str]:
    """The verl key above ``key`` whose content verl passes on unchecked (engine kwargs, ...), if any."""
    parts = key.split(".")
    known, sections = verl_defaults(), verl_sections()
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        is_open = known.get(prefix, None) == {} or bool(_OPEN_NAME.search(parts[i - 1]))
        if is_open and (prefix in known or prefix in sections):
            return prefix
    return None


def reason_for(key: str, schema_leaves: Mapping[str, Any] = {}) -> tuple[str, bool] | None:
    """(why ``key`` has no effect in klppo, whether a non-default value is refused), or None.

    The first matching rule of ``verl_reasons.RULES`` decides; at its ``FOLLOWS`` entry a key
    whose verl default copies a klppo field (``${oc.select:data.max_prompt_length,512}``) is
    that field's. A key below an open mapping without a rule of its own takes the mapping's.
    """
    for rule in RULES:
        if rule is FOLLOWS:
            target = _follows(key)
            if target in schema_leaves:
                return f"klppo reads {target}, which verl copies here by default", False
        elif _matches(key, rule[0]):
            return rule[1], rule[2:] == (REFUSE,)
    parent = open_mapping(key)
    return reason_for(parent, schema_leaves) if parent else None


def _follows(key: str) -> Optional[str]:
    """The key that verl's default of ``key`` copies (``${X}`` or ``${oc.select:X,...}``), if any."""
    default = verl_defaults().get(key)
    match = _FOLLOWS.fullmatch(default.strip()) if isinstance(default, str) else None
    return absolute_key(match.group(1), key) if match else None


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


# ---- splitting a raw config ----


@dataclass
class _Split:
    """The state of one ``split_verl_keys`` walk."""

    full: dict  # the user's raw tree, to read aliased targets and the world size
    fields: Mapping[str, str]  # schema key -> "section", "optional" or "value"
    is_default: Callable[[str, Any, Any], bool]
    unknown: Callable[[str, str, Any], None]
    problems: list[Problem]
    ignored: list[tuple[str, Any, str]] = field(default_factory=list)
    moves: list[tuple[str, Any]] = field(default_factory=list)


def split_verl_keys(
    raw: dict,
    fields: Mapping[str, str],
    is_default: Callable[[str, Any, Any], bool],
    unknown: Callable[[str, str, Any], None],
    problems: list[Problem],
) -> tuple[dict, list[tuple[str, Any, str]]]:
    """(the tree the typed builder gets, [(key, value, reason)] of set keys that have no effect).

    ``fields`` describes the schema; ``is_default(key, value, verl_default)`` compares a value
    with verl's default (which may be an interpolation); ``unknown(section, name, value)`` reports a
    key of a verl-only section that verl does not have either. Refusals go to ``problems``.
    """
    split = _Split(raw, fields, is_default, unknown, problems)
    kept = _walk(split, raw, "")
    _whole_sequence_micro_batches(split, kept)  # before the moves: a global size is already per device
    for key, value in split.moves:
        set_dotted(kept, key, value)
    return kept, split.ignored


def _walk(split: _Split, node: dict, prefix: str) -> dict:
    kept: dict = {}
    for name, value in node.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        kind = split.fields.get(key)
        if kind == "section" and isinstance(value, dict):
            kept[name] = _walk(split, value, key)
        elif kind is not None:
            if not (value is None and kind == "value" and _null_is_unset(key)):
                kept[name] = value
        elif key in ALIASES:
            _alias(split, key, value)
        elif key in GLOBAL_MICRO:
            _global_micro(split, key, value)
        elif key in verl_sections() and isinstance(value, dict):  # a section in some release: look inside
            _walk_verl_only(split, value, key)
        elif key in verl_defaults() or open_mapping(key):
            _no_effect(split, key, value)
        elif key in verl_sections():
            _section_value(split, key, value)
        else:
            kept[name] = value  # neither klppo's nor verl's: the builder reports it
    return kept


def _walk_verl_only(split: _Split, node: dict, prefix: str) -> None:
    """A section klppo's schema lacks: every key in it must be verl's."""
    for name, value in node.items():
        key = f"{prefix}.{name}"
        if key in ALIASES:
            _alias(split, key, value)
        elif key in verl_sections() and isinstance(value, dict):
            _walk_verl_only(split, value, key)
        elif key in verl_defaults() or open_mapping(key):
            _no_effect(split, key, value)
        elif key in verl_sections():
            _section_value(split, key, value)
        else:
            split.unknown(prefix, str(name), value)


def _section_value(split: _Split, key: str, value: Any) -> None:
    """A value where verl has a section: nothing when empty (``multi_turn:`` in YAML), else a problem."""
    if value is not None:
        example = f"{key}.{next(n for n in verl_sections()[key] + ('<key>',) if not n.startswith('_'))}"
        split.problems.append(Problem((key,), f"{key}: is a section of verl's config, not a value; write its keys "
                                      f"under it (e.g. {example}=...), got {show(value)}"))


def _null_is_unset(key: str) -> bool:
    """Whether verl writes null for "not set" at this klppo field, so klppo's default applies."""
    return verl_defaults().get(key, NO_DEFAULT) is None or key.endswith(".optim.min_lr_ratio")  # null until verl 0.5


def _no_effect(split: _Split, key: str, value: Any) -> None:
    default = verl_defaults().get(key, NO_DEFAULT)
    defaults = [] if default is NO_DEFAULT else [default] + _older()["other_defaults"].get(key, [])
    if any(split.is_default(key, value, d) for d in defaults):  # a value copied from any release's tree
        return
    if key in _SAME_AS and any(split.is_default(key, value, "${" + same + "}") for same in _SAME_AS[key]):
        return  # what klppo does anyway
    found = reason_for(key, {k: v for k, v in split.fields.items() if v != "section"})
    reason, refuse = found or ("a verl setting klppo does not use", False)
    if refuse:
        shown = "" if default is NO_DEFAULT else f" (verl's default is {show(default)})"
        split.problems.append(Problem((key,), f"{key} = {show(value)}: {reason}; remove the key{shown}"))
    else:
        split.ignored.append((key, value, reason))


def _alias(split: _Split, key: str, value: Any) -> None:
    target = ALIASES[key]
    if split.is_default(key, value, verl_defaults().get(key)):
        return  # left at verl's default: klppo's own default for the target applies
    found, theirs = get_dotted(split.full, target)
    if found and theirs is not None and theirs != value:
        split.problems.append(Problem((key, target), f"{key} = {show(value)} and {target} = {show(theirs)} set the "
                                      f"same knob (verl's two spellings of it); keep one of them"))
        return
    split.moves.append((target, value))


def _global_micro(split: _Split, key: str, value: Any) -> None:
    """verl's global micro-batch, divided by the world size as verl does (``ppo_micro_batch_size //= world``)."""
    if value is None:
        return
    target = GLOBAL_MICRO[key]
    world = 1
    for name in ("trainer.n_gpus_per_node", "trainer.nnodes"):
        found, count = get_dotted(split.full, name)
        world *= count if found and isinstance(count, int) and not isinstance(count, bool) and count > 0 else 1
    found, per_gpu = get_dotted(split.full, target)
    if found and per_gpu is not None:
        why = f"{key} (verl's global size, deprecated there too) and {target} are both set; keep {target} only"
    elif not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % world:
        why = (f"{key} = {show(value)} is verl's global micro-batch, split over trainer.nnodes x n_gpus_per_node = "
               f"{world} devices: set {target} (samples per device) instead, e.g. {target}=4")
    else:
        split.moves.append((target, value // world))
        return
    split.problems.append(Problem((key, target), why))


def _whole_sequence_micro_batches(split: _Split, kept: dict) -> None:
    """verl's per-device micro-batches under Ulysses groups, as klppo's whole-sequence ones."""
    sizes = [(micro_key, *_sequence_parallel_size(split.full, sp_key_lists))
             for micro_key, sp_key_lists in ULYSSES_MICRO.items()]
    split.ignored = whole_sequence_micro_batches(kept, sizes, split.ignored)


def whole_sequence_micro_batches(kept: dict, sizes: list[tuple[str, str, Any]], ignored: list[tuple[str, Any, str]]
                                 ) -> list[tuple[str, Any, str]]:
    """Each (micro-batch key, its SP key, the SP size) of ``sizes`` where the size is over 1: verl's
    micro-batch of a group of sp devices, each holding 1/sp of every sequence, becomes ``micro // sp``
    whole sequences in ``kept`` (at least one), the tokens per device of verl's groups. -> ``ignored``,
    where each SP key's line names the sizes it took."""
    resized: dict[str, list[str]] = {}
    for micro_key, sp_key, sp in sizes:
        found, micro = get_dotted(kept, micro_key)
        if found and positive_int(micro) and positive_int(sp) and sp > 1:
            whole = max(1, micro // sp)
            set_dotted(kept, micro_key, whole)
            resized.setdefault(sp_key, []).append(f"{micro_key} {micro} -> {whole}")
    return [(key, value, reason if key not in resized else
             f"Ulysses sequence parallelism: klppo keeps whole sequences on each device, so its micro-batches hold "
             f"1/{value} as many, the tokens per device of verl's groups of {value}: {', '.join(resized[key])}; "
             f"the numbers are the same")
            for key, value, reason in ignored]


def _sequence_parallel_size(raw: dict, sp_key_lists: tuple[tuple[str, ...], ...]) -> tuple[str, int]:
    """(key, size): the largest SP size set as a whole number in the first list that sets one ("", 1: none)."""
    for keys in sp_key_lists:
        sizes = [(value, key) for key in keys for found, value in [get_dotted(raw, key)] if found and positive_int(value)]
        if sizes:
            size, key = max(sizes)
            return key, size
    return "", 1


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# ---- helpers ----


def show(value: Any, limit: int = 80) -> str:
    """A value as a user would write it on the command line (cut after ``limit`` characters)."""
    if isinstance(value, str):
        text = value if value and value.strip() == value else repr(value)
    else:
        text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def summary(ignored: list[tuple[str, Any, str]]) -> list[str]:
    """The one warning listing every verl key set to a value that has no effect, grouped by why."""
    if not ignored:
        return []
    groups: dict[str, list[str]] = {}
    for key, value, reason in ignored:
        groups.setdefault(reason, []).append(f"{key}={show(value)}")
    n = len(ignored)
    lines = [f"warning: {n} verl setting{'s' if n > 1 else ''} in this config {'have' if n > 1 else 'has'} no effect in "
             "klppo (accepted, so verl configs run as they are):"]
    lines += [f"  - {', '.join(keys)}: no effect in klppo ({reason})" for reason, keys in groups.items()]
    return lines
