"""Load a config: YAML file -> key=value overrides -> ${...} interpolation -> typed tree ->
derived defaults -> validation.

Every problem found on the way is collected and raised together as one ``UserError`` whose
first line is a summary and whose other lines each name one dotted key, what is wrong and the
fix. The typed tree is built from the dataclass annotations in ``schema.py``; nothing here
knows a particular key except through those annotations (the value checks live in
``validate.py``).
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

from klppo.config.schema import PPOConfig, RMConfig, SFTConfig
from klppo.config.checks import Problem, check_ppo, check_rm, check_sft, resolve_ppo, resolve_sft
from klppo.errors import UserError

C = TypeVar("C")

_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
# PyYAML follows YAML 1.1, where `1e-6` (no dot) is a string; float fields accept these.
_FLOAT_RE = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")
_INTERP_RE = re.compile(r"\$\{([^{}]*)\}")
_HINTS = {
    bool: "write true or false",
    int: "write a whole number without quotes, e.g. 8",
    float: "write a number, e.g. 0.2 or 1e-6",
    str: "write a string",
}


class _Invalid:
    """Marks a value that failed its type check (the field keeps its default)."""


_INVALID = _Invalid()


# ---- public API ----


def load_ppo_config(path: str | None, overrides: Sequence[str] = ()) -> PPOConfig:
    """Load, resolve and validate a PPO config from a YAML file (None = defaults) and overrides.

    ``overrides`` are ``key.path=value`` strings (also hydra's ``+key=value``), the value parsed
    as YAML (``trainer.logger=[console,jsonl]``, ``data.val_files=null``). ``~key.path`` drops a
    key so its default applies. Raises ``UserError`` listing every problem found.
    """
    return _load(PPOConfig, path, overrides, resolve_ppo, check_ppo)


def load_sft_config(path: str | None, overrides: Sequence[str] = ()) -> SFTConfig:
    """Load, resolve and validate an SFT config; same rules as ``load_ppo_config``."""
    return _load(SFTConfig, path, overrides, resolve_sft, check_sft)


def load_rm_config(path: str | None, overrides: Sequence[str] = ()) -> RMConfig:
    """Load, resolve and validate a reward-model training config; same rules as ``load_ppo_config``."""
    return _load(RMConfig, path, overrides, resolve_sft, check_rm)


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
    resolve: Callable[[C], None],
    check: Callable[[C], list[Problem]],
) -> C:
    """YAML -> overrides -> interpolation -> typed tree -> derived defaults -> checks; all problems at once."""
    if isinstance(overrides, str):
        overrides = [overrides]
    source = "(defaults)" if path is None else os.fspath(path)
    raw = {} if path is None else _read_yaml(source)
    problems: list[Problem] = []
    raw = _apply_overrides(raw, overrides, problems)
    interpolator = _Interpolator(raw, config_to_dict(schema()), problems)
    raw = interpolator.walk(raw, "")
    builder = _Builder(schema, problems, bad=set(interpolator.failed))
    cfg = builder.build(schema, raw, "")
    resolve(cfg)
    problems += [p for p in check(cfg) if not builder.touches_bad(p)]
    if problems:
        raise UserError(_summary(source, overrides, problems))
    return cfg


def _summary(source: str, overrides: Sequence[str], problems: list[Problem]) -> str:
    n = len(problems)
    where = f"config {source}" + (f" + {len(overrides)} override{'s' if len(overrides) > 1 else ''}" if overrides else "")
    if n == 1:  # one problem, one line
        return f"{problems[0].message} (in {where})"
    lines = [f"{where} has {n} errors:"]
    return "\n".join(lines + [f"  - {p.message}" for p in problems])


def _read_yaml(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist; check the path given as the config") from None
    except OSError as e:
        raise UserError(f"cannot read config file {path}: {e}") from None
    except yaml.YAMLError as e:
        raise UserError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config file {path} must hold a mapping of sections (data:, trainer:, ...) at the top level, got {_show(data)}")
    return data


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
        value = yaml.safe_load(value_text) if value_text.strip() else ""  # hydra: `key=` is ''
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


def _get_dotted(tree: Any, key: str) -> tuple[bool, Any]:
    """(found, value) of a dotted key in nested dicts."""
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False, None
        tree = tree[part]
    return True, tree


# ---- ${dotted.key} interpolation (the subset of OmegaConf's that verl's YAML files use) ----


class _Interpolator:
    """Replaces ``${a.b}`` in string values by the value at ``a.b`` (the user's, else the default).

    A string that is exactly one ``${...}`` takes the target's value and type; otherwise each
    ``${...}`` is replaced by the target's text. Resolvers (``${oc.env:X}``) are refused.
    """

    def __init__(self, raw: dict, defaults: dict, problems: list[Problem]):
        self.raw, self.defaults, self.problems = raw, defaults, problems
        self.failed: list[str] = []  # keys whose interpolation failed; their checks are skipped

    def walk(self, value: Any, key: str) -> Any:
        if isinstance(value, dict):
            out = {k: self.walk(v, _join(key, str(k))) for k, v in value.items()}
            return {k: v for k, v in out.items() if v is not _INVALID}
        if isinstance(value, list):
            items = [self.walk(v, key) for v in value]
            return _INVALID if any(v is _INVALID for v in items) else items
        if isinstance(value, str) and "${" in value:
            result = self.expand(value, key, (key,))
            if result is _INVALID:
                self.failed.append(key)
            return result
        return value

    def expand(self, text: str, key: str, stack: tuple[str, ...]) -> Any:
        whole = _INTERP_RE.fullmatch(text)
        if whole:
            return self.lookup(whole.group(1), key, stack)
        parts = []
        for m in _INTERP_RE.finditer(text):
            parts.append(self.lookup(m.group(1), key, stack))
        if any(p is _INVALID for p in parts):
            return _INVALID
        values = iter(parts)
        return _INTERP_RE.sub(lambda _: str(next(values)), text)

    def lookup(self, target: str, key: str, stack: tuple[str, ...]) -> Any:
        found, value = False, None
        if not _KEY_RE.fullmatch(target):
            why = "klppo resolves only ${dotted.key} interpolations, not resolvers such as oc.env; write the value itself"
        elif target in stack:
            why = f"interpolation cycle {' -> '.join(stack + (target,))}; write a value in one of them"
        else:
            found, value = _get_dotted(self.raw, target)
            if not found:
                found, value = _get_dotted(self.defaults, target)
            why = f"it refers to the unknown key '{target}'; write the value itself or fix the key"
        if not found:
            self.problems.append(Problem((key,), f"{key}: cannot resolve '${{{target}}}': {why}"))
            return _INVALID
        if isinstance(value, str) and "${" in value:
            return self.expand(value, key, stack + (target,))
        return copy.deepcopy(value)


# ---- building the typed tree ----


class _Builder:
    """Builds dataclass instances from nested dicts against their annotations.

    Unknown keys and values of the wrong type become ``Problem``s; a wrong value leaves its
    field at the default and its key in ``bad``, so later value checks that read it are dropped.
    """

    def __init__(self, schema: type, problems: list[Problem], bad: set[str]):
        self.problems, self.bad = problems, bad
        self.all_paths = _all_paths(schema)

    def build(self, cls: type[C], data: dict, path: str) -> C:
        hints = _field_types(cls)
        kwargs = {}
        for key, value in data.items():
            key_path = _join(path, str(key))
            if key not in hints:
                self._unknown(path, str(key), list(hints))
                continue
            result = self._field(hints[key], value, key_path)
            if result is not _INVALID:
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

    def _bad(self, path: str, message: str) -> _Invalid:
        self.bad.add(path)
        self.problems.append(Problem((path,), message))
        return _INVALID

    def _unknown(self, prefix: str, key: str, names: list[str]) -> None:
        full = _join(prefix, key)
        near = _suggest(prefix, key, names, self.all_paths)
        if near:
            fix = f"did you mean '{near}'?"
        else:
            fix = f"valid keys {f'under {prefix!r}' if prefix else 'at the top level'} are: {', '.join(names)}"
        self.problems.append(Problem((full,), f"unknown key '{full}'; {fix}"))


def _suggest(prefix: str, key: str, names: list[str], all_paths: tuple[str, ...]) -> str | None:
    """The most likely intended full key: the same name elsewhere in the tree (a misplaced key),
    a longer name that starts with it (verl's old `ppo_micro_batch_size` -> `..._per_gpu`),
    a close name at this level (a typo), a close name elsewhere, or a close full path."""
    full = _join(prefix, key)
    leaf = {p: p.rsplit(".", 1)[-1] for p in all_paths}
    for matches in (lambda name: name == key, lambda name: name.startswith(key + "_")):
        candidates = [p for p in all_paths if matches(leaf[p])]
        if candidates:
            return _closest(full, candidates)
    close = difflib.get_close_matches(key, names, n=1)
    if close:
        return _join(prefix, close[0])
    similar = [p for p in all_paths if difflib.SequenceMatcher(None, key, leaf[p]).ratio() >= 0.8]
    if similar:
        return _closest(full, similar)
    not_ancestors = [p for p in all_paths if not full.startswith(p + ".")]
    close = difflib.get_close_matches(full, not_ancestors, n=1, cutoff=0.85)  # shared prefixes inflate the ratio
    return close[0] if close else None


def _closest(target: str, candidates: list[str]) -> str:
    return max(candidates, key=lambda c: difflib.SequenceMatcher(None, target, c).ratio())


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
