"""Load a config: YAML file -> key=value overrides -> verl's keys klppo does not act on set
aside -> ${...} interpolation -> typed tree -> derived defaults -> validation.

Every problem found on the way is collected and raised together as one ``UserError`` whose
first line is a summary and whose other lines each name one dotted key, what is wrong and the
fix. The typed tree is built from the dataclass annotations in ``schema.py``; nothing here
knows a particular key except through those annotations (the value checks live in
``checks.py``, verl's other keys in ``verl.py``). Warnings (verl keys without effect, a
fallback) go to the caller's ``notes`` list, one printable line each.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
from functools import lru_cache
from typing import Any, Callable, Literal, Sequence, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from klppo.config.checks import check_ppo, check_rm, check_sft, resolve_ppo, resolve_sft
from klppo.config.files import read_yaml, yaml_value
from klppo.config.hydra import hydra_sections
from klppo.config.interpolate import INVALID, DefaultTest, Interpolator, Invalid
from klppo.config.problems import Problem
from klppo.config.schema import PPOConfig
from klppo.config.supervised import RMConfig, SFTConfig
from klppo.config.verl import split_verl_keys, summary, verl_defaults, verl_sections
from klppo.config.verl_reasons import REFUSED_VALUES
from klppo.config.verl_sft import split_verl_sft_keys
from klppo.errors import UserError

C = TypeVar("C")

_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z_][A-Za-z0-9_-]*)*")  # verl has keys such as capture-range
# PyYAML follows YAML 1.1, where `1e-6` (no dot) is a string; float fields accept these.
_FLOAT_RE = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")
_HINTS = {
    bool: "write true or false",
    int: "write a whole number without quotes, e.g. 8",
    float: "write a number, e.g. 0.2 or 1e-6",
    str: "write a string",
}


# ---- public API ----


def load_ppo_config(path: str | None, overrides: Sequence[str] = (), notes: list[str] | None = None,
                    launched: int | None = None) -> PPOConfig:
    """Load, resolve and validate a PPO config from a YAML file (None = defaults) and overrides.

    ``overrides`` are ``key.path=value`` strings (also hydra's ``+key=value``), the value parsed
    as YAML (``trainer.logger=[console,jsonl]``, ``data.val_files=null``). ``~key.path`` drops a
    key so its default applies. Any key of verl's config tree is accepted; the ones klppo does
    not act on, when set, are listed in one warning. Raises ``UserError`` listing every problem
    found; on success appends the warnings to ``notes`` (lines to print, first ones start with
    ``warning:``). ``launched``: the processes a run was started as (``klppo ppo``), checked first
    against ``trainer.n_gpus_per_node x trainer.nnodes``; None where nothing is launched.
    """
    return _load(PPOConfig, path, overrides, resolve_ppo, lambda cfg: check_ppo(cfg, launched), notes, verl=True)


def load_sft_config(path: str | None, overrides: Sequence[str] = (), notes: list[str] | None = None) -> SFTConfig:
    """Load, resolve and validate an SFT config; same rules as ``load_ppo_config``, with verl's SFT
    trainer's keys (``verl_sft.py``) where ``load_ppo_config`` has verl's PPO keys."""
    return _load(SFTConfig, path, overrides, resolve_sft, check_sft, notes)


def load_rm_config(path: str | None, overrides: Sequence[str] = (), notes: list[str] | None = None) -> RMConfig:
    """Load, resolve and validate a reward-model training config; same rules as ``load_sft_config``."""
    return _load(RMConfig, path, overrides, resolve_sft, check_rm, notes)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """The config tree as plain nested dicts and lists (e.g. to save next to a checkpoint)."""
    return dataclasses.asdict(cfg)


def format_config(cfg: Any) -> str:
    """The resolved config as YAML text that loads back to an equal config."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


# ---- the pipeline ----


def _load(
    schema: type[C],
    path: str | os.PathLike | None,
    overrides: Sequence[str],
    resolve: Callable[[C, list[str]], None],
    check: Callable[[C], list[Problem]],
    notes: list[str] | None,
    verl: bool = False,
) -> C:
    """YAML -> overrides -> verl keys -> interpolation -> typed tree -> derived defaults -> checks; all problems at once."""
    if isinstance(overrides, str):
        overrides = [overrides]
    source = "(defaults)" if path is None else os.fspath(path)
    full = {} if path is None else read_yaml(source)
    _check_command(schema, source, full)
    problems: list[Problem] = []
    found: list[str] = []
    full = hydra_sections(full, source, problems, found)
    full = _apply_overrides(full, overrides, problems)
    defaults = config_to_dict(schema())
    kept, ignored = full, []
    builder = _Builder(schema, problems, bad=set(), verl=verl)
    if verl:  # verl's keys that klppo does not act on leave the tree here
        same = DefaultTest([full, defaults], verl_defaults()).same
        kept, ignored = split_verl_keys(full, _field_kinds(schema), same, builder.unknown, problems)
    elif schema is SFTConfig:  # and verl's SFT trainer's
        kept, ignored = split_verl_sft_keys(full, _field_kinds(schema), problems)
    interpolator = Interpolator([kept, full, defaults], verl_defaults() if verl else {}, problems)
    kept = interpolator.walk(kept, "")
    builder.bad.update(interpolator.failed)
    cfg = builder.build(schema, kept, "")
    resolve(cfg, found)
    problems += [p for p in check(cfg) if not builder.touches_bad(p)]
    if problems:
        raise UserError(_summary(source, overrides, problems))
    if notes is not None:
        notes += found + summary(ignored)
    return cfg


# The top-level section that marks a config file as one command's: PPO's, or SFT's and RM's.
_OWN_SECTION = {PPOConfig: "actor_rollout_ref", SFTConfig: "model", RMConfig: "model"}
_WHOSE = {"actor_rollout_ref": ("a PPO config", "run it with klppo ppo, or validate it without --sft"),
          "model": ("an SFT or reward-model config",
                    "run it with klppo sft or klppo rm, or validate it with validate-config --sft")}


def _check_command(schema: type, source: str, raw: dict) -> None:
    """A file written for the other commands is one error saying so (not an unknown key per section)."""
    own = _OWN_SECTION.get(schema)
    other = next((name for name in _WHOSE if name != own and name in raw), None)
    if own is not None and other is not None and own not in raw:
        what, fix = _WHOSE[other]
        raise UserError(f"config {source} is {what} (it has a top-level '{other}' section, which this command's "
                        f"config has not); {fix}")


def _summary(source: str, overrides: Sequence[str], problems: list[Problem]) -> str:
    n = len(problems)
    where = f"config {source}" + (f" + {len(overrides)} override{'s' if len(overrides) > 1 else ''}" if overrides else "")
    if n == 1:  # one problem, one line
        return f"{problems[0].message} (in {where})"
    lines = [f"{where} has {n} errors:"]
    return "\n".join(lines + [f"  - {p.message}" for p in problems])


# ---- overrides ----


def _apply_overrides(raw: dict, overrides: Sequence[str], problems: list[Problem]) -> dict:
    """A copy of ``raw`` with each ``key.path=value`` override applied in order."""
    raw = copy.deepcopy(raw)
    for text in overrides:
        parsed = _parse_override(text, problems)
        if parsed is not None:
            _set_dotted(raw, *parsed, text, problems)
    return raw


def _parse_override(text: str, problems: list[Problem]) -> tuple[str, Any, bool] | None:
    """(key, value, delete) of one override, or None after recording why it is malformed."""
    body = text.lstrip("+")  # hydra's +key=value (add) and ++key=value (force add): same here
    delete = body.startswith("~")  # hydra's ~key: drop the key, so its default applies
    key, eq, value_text = body.lstrip("~").partition("=")
    key = key.strip()
    if not _KEY_RE.fullmatch(key) or (not eq and not delete):
        problems.append(Problem((), f"override {text!r} is not of the form key.path=value, e.g. actor_rollout_ref.actor.optim.lr=1e-6"))
        return None
    if delete:
        return key, None, True
    try:
        value = yaml_value(value_text) if value_text.strip() else ""  # hydra: `key=` is ''
    except yaml.YAMLError:
        problems.append(Problem((key,), f"override {text!r}: the value is not valid YAML; quote it or write a list as [a,b]"))
        return None
    return key, value, False


def _set_dotted(raw: dict, key: str, value: Any, delete: bool, text: str, problems: list[Problem]) -> None:
    parts = key.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        if node.get(part) is None:
            if delete:
                return
            node[part] = {}
        if not isinstance(node[part], dict):
            section = ".".join(parts[: i + 1])
            problems.append(Problem((section,), f"override {text!r}: '{section}' holds the value {node[part]!r}, not a section of keys, so '{key}' cannot be set"))
            return
        node = node[part]
    if delete:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = value


# ---- building the typed tree ----


class _Builder:
    """Builds dataclass instances from nested dicts against their annotations.

    Unknown keys and values of the wrong type become ``Problem``s (an invalid value is
    INVALID); a wrong value leaves its field at the default and its key in ``bad``, so later
    value checks that read it are dropped. With ``verl``, verl's keys count for suggestions.
    """

    def __init__(self, schema: type, problems: list[Problem], bad: set[str], verl: bool = False):
        self.problems, self.bad, self.verl = problems, bad, verl
        self.all_paths = _all_paths(schema)

    def build(self, cls: type[C], data: dict, path: str) -> C:
        hints = _field_types(cls)
        kwargs = {}
        for key, value in data.items():
            key_path = _join(path, str(key))
            if key not in hints:
                self.unknown(path, str(key), value)
                continue
            result = self._field(hints[key], value, key_path)
            if result is not INVALID:
                kwargs[key] = result
        return cls(**kwargs)

    def touches_bad(self, problem: Problem) -> bool:
        return any(k == b or k.startswith(b + ".") for k in problem.keys for b in self.bad)

    def _field(self, tp: Any, value: Any, path: str) -> Any:
        if dataclasses.is_dataclass(tp):
            if value is None:  # an empty section in YAML (`actor:` with nothing under it)
                value = {}
            if not isinstance(value, dict):
                return self._bad(path, f"{path}: is a section, not a value; write its keys under it (e.g. {path}.{next(iter(_field_types(tp)))}=...), got {_show(value)}")
            return self.build(tp, value, path)
        try:
            return _coerce(value, tp, path)
        except _Mismatch as e:
            return self._bad(path, str(e))

    def _bad(self, path: str, message: str) -> Invalid:
        self.bad.add(path)
        self.problems.append(Problem((path,), message))
        return INVALID

    def unknown(self, prefix: str, key: str, value: Any = None) -> None:
        """Record the unknown key ``prefix.key`` (holding ``value``) with the most helpful fix."""
        full = _join(prefix, key)
        self.problems.append(Problem((full,), _unknown_message(prefix, key, value, self.all_paths, self.verl)))


def _unknown_message(prefix: str, key: str, value: Any, all_paths: tuple[str, ...], verl: bool) -> str:
    """The fix for an unknown key: a top-level section nested by mistake; the same name where it
    lives (a misplaced key or section: the one holding most of its keys); a close name in the same
    section (a typo, or verl's longer name such as ``..._per_gpu``); else the section's keys."""
    full = _join(prefix, key)
    parent = {p: p.rpartition(".")[0] for p in all_paths}
    names = [p.rpartition(".")[2] for p in all_paths if parent[p] == prefix]
    if prefix and key in [p for p in all_paths if not parent[p]]:
        return (f"unknown key '{full}': '{key}' is a top-level section, not part of '{prefix}'; move it to the "
                f"top level (no indentation in the YAML file, or {key}.<key>=... on the command line)")
    paths = all_paths + (tuple(verl_defaults()) if verl else ())
    elsewhere = [p for p in paths if p.rpartition(".")[2] == key and p != full and not full.startswith(p + ".")]
    if elsewhere:
        children = [str(k) for k in value] if isinstance(value, dict) else []
        best = max(elsewhere, key=lambda p: (sum(f"{p}.{c}" in paths for c in children), _similarity(full, p)))
        return f"unknown key '{full}'; did you mean '{best}'? '{key}' lives there, not {_where(prefix)}"
    candidates = names + [n for n in (verl_sections().get(prefix, ()) if verl else ()) if n not in names]
    close = difflib.get_close_matches(key, candidates, n=1) or [n for n in candidates if n.startswith(key + "_")]
    if close:
        return f"unknown key '{full}'; did you mean '{_join(prefix, close[0])}'?"
    return f"unknown key '{full}'; valid keys {_where(prefix)} are: {', '.join(names or candidates)}"


def _where(prefix: str) -> str:
    return f"under '{prefix}'" if prefix else "at the top level"


def _similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


@lru_cache(maxsize=None)
def _field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation (schema.py uses postponed annotations)."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


@lru_cache(maxsize=None)
def _all_paths(cls: type, prefix: str = "") -> tuple[str, ...]:
    """Every dotted key of the tree, sections included, in declaration order."""
    paths: list[str] = []
    for name, tp in _field_types(cls).items():
        path = _join(prefix, name)
        paths.append(path)
        if dataclasses.is_dataclass(tp):
            paths += _all_paths(tp, path)
    return tuple(paths)


@lru_cache(maxsize=None)
def _field_kinds(cls: type, prefix: str = "") -> dict[str, str]:
    """Every dotted key of the tree -> "section", "optional" (None allowed) or "value"."""
    kinds: dict[str, str] = {}
    for name, tp in _field_types(cls).items():
        path = _join(prefix, name)
        if dataclasses.is_dataclass(tp):
            kinds[path] = "section"
            kinds.update(_field_kinds(tp, path))
        else:
            kinds[path] = "optional" if type(None) in get_args(tp) else "value"
    return kinds


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


# ---- scalar and container types ----


class _Mismatch(Exception):
    """A value does not fit its annotation; the message is the user-facing problem."""


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """``value`` converted to annotation ``tp``, or ``_Mismatch`` naming the key and the fix."""
    origin = get_origin(tp)
    if origin is Union:
        return _coerce_union(value, tp, path)
    if origin is Literal:
        return _coerce_literal(value, tp, path)
    if origin is list:
        if not isinstance(value, list):
            raise _Mismatch(_expected(path, tp, value))
        (item,) = get_args(tp)
        return [_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:  # an open mapping handed on as it is (e.g. keyword arguments of a call)
        if value is None:  # `kwargs:` with nothing under it in YAML
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _Mismatch(f"{path}: expected a mapping of names to values, got {_show(value)}; write a YAML "
                            f"mapping, e.g. {{name: value}}, or set one entry with {path}.<name>=value")
        return copy.deepcopy(value)
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is float:
        number = _as_float(value)
        if number is not None:
            return number
    if tp is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)  # OmegaConf also turns `experiment_name: 2024` into a string
    assert tp in _HINTS, f"annotation {tp!r} of {path} is not supported by the config loader"
    raise _Mismatch(_expected(path, tp, value))


def _coerce_union(value: Any, tp: Any, path: str) -> Any:
    arms = [a for a in get_args(tp) if a is not type(None)]
    if value is None and len(arms) < len(get_args(tp)):
        return None
    if len(arms) == 1:  # Optional[X]: X's own message is the most precise
        return _coerce(value, arms[0], path)
    for arm in arms:
        try:
            return _coerce(value, arm, path)
        except _Mismatch:
            pass
    raise _Mismatch(_expected(path, tp, value))


def _coerce_literal(value: Any, tp: Any, path: str) -> Any:
    allowed = get_args(tp)
    if any(value == a and type(value) is type(a) for a in allowed):
        return value
    near = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1, cutoff=0.0)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    if (path, str(value)) in REFUSED_VALUES:  # one of verl's that klppo lacks: why, not a near miss
        hint = f": klppo does not have it ({REFUSED_VALUES[path, str(value)]})"
    raise _Mismatch(f"{path} = {value!r} is not one of {', '.join(repr(a) for a in allowed)}{hint}")


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
        return float(value)
    return None


def _expected(path: str, tp: Any, value: Any) -> str:
    return f"{path}: expected {_describe(tp)}, got {_show(value)}; {_hint(tp)}"


def _describe(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Union:
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"a list of {_describe(args[0]).split(' ', 1)[1]}s"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}[tp]


def _hint(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Union:  # the last arm is the most general one (a list, in Union[str, list[str]])
        return _hint([a for a in args if a is not type(None)][-1])
    if origin is list:
        return "write a YAML list, e.g. [a, b]"
    if origin is Literal:
        return "write one of the values listed"
    return _HINTS[tp]


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return f"a mapping (keys: {', '.join(map(str, value))})"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if value is None:
        return "null"
    kind = {int: "an integer", float: "a number", str: "a string", list: "a list"}.get(type(value), type(value).__name__)
    return f"{value!r} ({kind})"
