"""OmegaConf's ``${...}`` interpolation, the subset verl's YAML files use.

- ``${a.b}``: the value at ``a.b``; ``${.x}`` / ``${..x}``: relative to the key's own section;
- ``${oc.select:a.b,fallback}``: the value at ``a.b``, or ``fallback`` (parsed as YAML, may
  itself interpolate) when ``a.b`` is not set;
- other resolvers (``${oc.env:HOME}``) are refused: the value should be written out.

A string that is exactly one ``${...}`` takes the target's value and type; otherwise each
``${...}`` is replaced by the target's text. A target is looked up in the user's tree, then in
klppo's defaults, then in verl's defaults.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Mapping, Sequence

import yaml

from klppo.config.files import yaml_value
from klppo.config.problems import Problem

_DOTTED = re.compile(r"\.*[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z_][A-Za-z0-9_-]*)*")
_MISSING = "???"  # OmegaConf's "mandatory, not set"


class Invalid:
    """Marks a value whose interpolation failed (the problem has been recorded)."""


INVALID = Invalid()


class Interpolator:
    """Resolves the ``${...}`` in a tree; ``failed`` lists the keys whose resolution failed."""

    def __init__(self, trees: Sequence[dict], flat: Mapping[str, Any], problems: list[Problem]):
        self.trees, self.flat, self.problems = trees, flat, problems
        self.failed: list[str] = []

    def walk(self, value: Any, key: str) -> Any:
        if isinstance(value, dict):
            out = {k: self.walk(v, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
            return {k: v for k, v in out.items() if v is not INVALID}
        if isinstance(value, list):
            items = [self.walk(v, key) for v in value]
            return INVALID if any(v is INVALID for v in items) else items
        if isinstance(value, str) and "${" in value:
            result = self.expand(value, key, (key,))
            if result is INVALID:
                self.failed.append(key)
            return result
        return value

    def expand(self, text: str, key: str, stack: tuple[str, ...]) -> Any:
        spans = _spans(text)
        if spans is None:
            self.problems.append(Problem((key,), f"{key}: cannot resolve {text!r}: its ${{ and }} do not pair up; "
                                         "close each ${...}"))
            return INVALID
        if len(spans) == 1 and spans[0][0] == 0 and spans[0][1] == len(text):
            return self.lookup(spans[0][2], key, stack)
        out, at = [], 0
        for start, end, inner in spans:
            value = self.lookup(inner, key, stack)
            if value is INVALID:
                return INVALID
            out += [text[at:start], str(value)]
            at = end
        return "".join(out + [text[at:]])

    def lookup(self, expr: str, key: str, stack: tuple[str, ...]) -> Any:
        select = expr.startswith("oc.select:")
        target, comma, fallback = expr[len("oc.select:"):].partition(",") if select else (expr, "", "")
        target = target.strip()
        if not _DOTTED.fullmatch(target):
            why = "klppo resolves only ${dotted.key} and ${oc.select:key,default}, not resolvers such as oc.env; write the value itself"
            return self._fail(key, expr, why)
        target = absolute_key(target, key)
        if target in stack:
            return self._fail(key, expr, f"interpolation cycle {' -> '.join(stack + (target,))}; write a value in one of them")
        found, value = self.find(target)
        if not found and select and comma:
            return self._fallback(fallback.strip(), key, stack)
        if not found:
            return self._fail(key, expr, f"it refers to the unknown key '{target}'; write the value itself or fix the key")
        if isinstance(value, str) and "${" in value:
            return self.expand(value, target, stack + (target,))
        return copy.deepcopy(value)

    def find(self, target: str) -> tuple[bool, Any]:
        for tree in self.trees:
            found, value = get_dotted(tree, target)
            if found and value != _MISSING:
                return True, value
        if target in self.flat and self.flat[target] != _MISSING:
            return True, self.flat[target]
        return False, None

    def _fallback(self, text: str, key: str, stack: tuple[str, ...]) -> Any:
        if "${" in text:
            return self.expand(text, key, stack)
        try:
            return yaml_value(text) if text else None
        except yaml.YAMLError:
            return text

    def _fail(self, key: str, expr: str, why: str) -> Invalid:
        self.problems.append(Problem((key,), f"{key}: cannot resolve '${{{expr}}}': {why}"))
        return INVALID


def _spans(text: str) -> list[tuple[int, int, str]] | None:
    """(start, end, inside) of each outermost ``${...}`` in ``text``; None when braces do not pair."""
    spans, i = [], text.find("${")
    while i != -1:
        depth, j = 0, i + 1
        while j < len(text):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                break
            j += 1
        if depth:
            return None
        spans.append((i, j + 1, text[i + 2:j]))
        i = text.find("${", j + 1)
    return spans


class DefaultTest:
    """Whether a value equals verl's default for a key, the default resolved when it interpolates."""

    def __init__(self, trees: Sequence[dict], flat: Mapping[str, Any]):
        self.interpolator = Interpolator(trees, flat, problems=[])  # failures mean "not equal"

    def same(self, key: str, value: Any, default: Any) -> bool:
        if same_value(value, default):
            return True
        value, default = self._resolved(key, value), self._resolved(key, default)
        return value is not INVALID and default is not INVALID and same_value(value, default)

    def _resolved(self, key: str, value: Any) -> Any:
        if isinstance(value, str) and "${" in value:
            return self.interpolator.expand(value, key, (key,))
        return value


def same_value(a: Any, b: Any) -> bool:
    """Equal as config values: 1 == 1.0 == '1e0', True is not 1, lists and mappings item by item."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    x, y = _number(a), _number(b)
    if x is not None and y is not None:
        return x == y
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_value(p, q) for p, q in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value) if value.strip() and value.strip()[0] in "+-.0123456789" else None
        except ValueError:
            return None
    return None


def absolute_key(target: str, key: str) -> str:
    """An OmegaConf key relative to ``key``'s section (``.x``, ``..x``) as a full dotted key."""
    dots = len(target) - len(target.lstrip("."))
    if not dots:
        return target
    base = key.split(".")[:-dots]
    return ".".join(base + [target[dots:]])


def get_dotted(tree: Any, key: str) -> tuple[bool, Any]:
    """(found, value) of a dotted key in nested dicts."""
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False, None
        tree = tree[part]
    return True, tree


def set_dotted(tree: dict, key: str, value: Any) -> None:
    """Set a dotted key in nested dicts, making (or replacing with) a dict at each level above it."""
    *parents, last = key.split(".")
    for part in parents:
        if not isinstance(tree.get(part), dict):
            tree[part] = {}
        tree = tree[part]
    tree[last] = value
