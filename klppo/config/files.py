"""Read a config file: every way a file can be unusable becomes one ``UserError`` line that
names the file, the place in it and the fix (never a traceback).

Beyond what PyYAML refuses, a key written twice in one mapping is an error here: PyYAML keeps
the last one silently, so a user editing the first copy would see no effect. Numbers are read as
verl reads them (OmegaConf's loader, Hydra's overrides): ``1e-6`` is a float, where YAML 1.1
reads a string for want of a decimal point. ``yaml_value`` reads an override's value the same way.
"""

from __future__ import annotations

import os
import re
from typing import Any

import yaml

from klppo.errors import UserError

_MAX_BYTES = 16 * 1024 * 1024  # a config is a few KB; anything this big is the wrong file


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in the same mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key (a list or mapping used as a key)
                continue  # SafeLoader's own error names it
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' is given twice (first at line {first.start_mark.line + 1}); "
                    "keep one of them", key_node.start_mark)
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _UniqueKeyLoader.construct_mapping)
# A mantissa without a decimal point and an exponent (1e-6, -2E+3): a float for OmegaConf and Hydra.
_EXPONENT_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$")
_UniqueKeyLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))


def yaml_value(text: str) -> Any:
    """One value written in YAML (an override's, an interpolation's default), read as a config file's."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def read_yaml(path: str) -> dict:
    """The mapping in the YAML file ``path`` ({} for an empty file); ``UserError`` for anything else."""
    text = _read_text(path)
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.MarkedYAMLError as e:
        raise UserError(_yaml_message(path, e, text)) from None
    except yaml.YAMLError as e:
        raise UserError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        kind = {list: "a list", str: "a single string"}.get(type(data), f"a single {type(data).__name__} value")
        raise UserError(f"config file {path} holds {kind}; it must hold a mapping of sections at the top level "
                        "(data:, actor_rollout_ref:, trainer:, ...)")
    return data


def _read_text(path: str) -> str:
    """The file's text (UTF-8, with or without a byte-order mark)."""
    try:
        if os.path.isdir(path):
            raise UserError(f"config file {path} is a folder; give the path of a YAML file in it")
        with open(path, "rb") as f:
            data = f.read(_MAX_BYTES + 1)
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist; check the path given as the config") from None
    except PermissionError:
        raise UserError(f"config file {path} cannot be read (permission denied); make it readable") from None
    except OSError as e:
        raise UserError(f"cannot read config file {path}: {e.strerror or e}; give a readable YAML file") from None
    if len(data) > _MAX_BYTES:
        raise UserError(f"config file {path} is over {_MAX_BYTES // 2**20} MB, not a config; give the YAML file")
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise UserError(f"config file {path} is UTF-16 text; save it as UTF-8, e.g. iconv -f utf-16 -t utf-8 {path} -o {path}.utf8")
    if b"\0" in data:
        raise UserError(f"config file {path} is a binary file (it holds NUL bytes), not YAML text; give the YAML file")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise UserError(
            f"config file {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at line {line}, column {column}); "
            f"save it as UTF-8, e.g. iconv -f latin1 -t utf-8 {path} -o {path}.utf8"
        ) from None


def _yaml_message(path: str, e: yaml.MarkedYAMLError, text: str) -> str:
    """One line: where in the file, what PyYAML found, and the usual fix for it."""
    mark = e.problem_mark or e.context_mark
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    what = " ".join(str(e.problem or e.context or "").split())
    if "\t" in what or "'\\t'" in what or (mark is not None and _line(text, mark.line).startswith("\t")):
        fix = "indent with spaces, not tabs"
    elif "given twice" in what:
        fix = ""
    elif "expected ',' or ']'" in what or "expected ',' or '}'" in what:
        fix = "close the [list] or {mapping} opened before it"
    elif "could not determine a constructor" in what:
        fix = "klppo reads plain YAML only; remove the !tag"
    else:
        fix = "check the indentation and quote values that contain ': ' or start with a special character"
    return f"config file {path} is not valid YAML{where}: {what}" + (f"; {fix}" if fix else "")


def _line(text: str, index: int) -> str:
    lines = text.splitlines()
    return lines[index] if 0 <= index < len(lines) else ""
