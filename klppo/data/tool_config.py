"""verl's tool and interaction config YAMLs (``rollout.multi_turn.tool_config_path`` and
``interaction_config_path``), read and checked without building anything: the trainer builds the
tools from these entries (``rollout.tools``), and ``klppo plan`` renders prompts with their schemas,
importing no tool's code. And verl's function tools (``function_tool_path``): a Python file whose
``@function_tool`` functions are tools, read by running it.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
import types
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import yaml

from klppo.errors import UserError

TOOL_CONFIG_KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
INTERACTION_CONFIG_KEY = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"


@dataclass(frozen=True)
class ToolEntry:
    """One tool of a tool config: the class that implements it, its config, and its schema (OpenAI's
    function format, which the chat template shows the model)."""

    class_name: str
    config: dict
    schema: dict
    where: str  # "<file> tools[i]", for errors

    @property
    def name(self) -> str:
        """The name the model calls the tool by."""
        return self.schema["function"]["name"]


def read_tool_config(path: str | Path) -> list[ToolEntry]:
    """The tools a verl tool config lists, in order (a ``UserError`` naming the entry whose class or
    name is missing, or whose name another tool has)."""
    entries = read_config_list(path, TOOL_CONFIG_KEY, "tools",
                               "tool config YAML (tools: [{class_name, config, tool_schema}])")
    tools: list[ToolEntry] = []
    for i, entry in enumerate(entries):
        where = f"{path} tools[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise UserError(f"{where}: each tool needs a class_name (e.g. verl.tools.gsm8k_tool.Gsm8kTool)")
        schema = entry.get("tool_schema") or {}
        function = schema.get("function") if isinstance(schema, dict) else None
        if not isinstance(function, dict) or not function.get("name"):
            raise UserError(f"{where}: tool_schema.function.name is missing; it is the name the model calls the "
                            "tool by")
        tool = ToolEntry(entry["class_name"], entry.get("config") or {}, schema, where)
        if any(t.name == tool.name for t in tools):
            raise UserError(f"{where}: a second tool named {tool.name!r}; give each tool its own function name")
        tools.append(tool)
    return tools


def read_config_list(path: str | Path, key: str, section: str, example: str) -> list:
    """The ``section`` list of the YAML file at ``path`` (the config key ``key``)."""
    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise UserError(f"{key} = {str(path)!r}: cannot read it ({error}); point it at verl's {example}") from None
    entries = config.get(section) if isinstance(config, dict) else None
    if not isinstance(entries, list):
        raise UserError(f"{key} = {str(path)!r} has no '{section}' list; write {section}: [...] as verl's {example} does")
    return entries


# ---- verl's function tools (multi_turn.function_tool_path) ----

FUNCTION_TOOL_KEY = "actor_rollout_ref.rollout.multi_turn.function_tool_path"


@dataclass(frozen=True)
class FunctionTool:
    """A plain Python function registered as a tool with ``@function_tool`` (verl 0.8+): its schema comes
    from its type hints and Google-style docstring (``transformers.utils.get_json_schema``)."""

    name: str
    fn: Callable
    schema: dict


class ToolResponse:
    """verl's ``ToolResponse``, for function tools that return one: its ``text`` is the reply."""

    def __init__(self, text: Optional[str] = None, image=None, video=None, **kwargs):
        self.text, self.image, self.video = text, image, video


_registered: Optional[list[FunctionTool]] = None  # the functions the file being read registers


def function_tool(name: Optional[str | Callable] = None, *, schema: Optional[dict] = None):
    """verl's ``@function_tool`` decorator: ``@function_tool``, ``@function_tool("name")`` or
    ``@function_tool(schema={...})``. Only ``read_function_tools`` collects what it registers."""

    def register(fn: Callable, tool_name: Optional[str]) -> Callable:
        tool_name = tool_name or fn.__name__
        if _registered is None:
            return fn  # imported outside read_function_tools: a plain function
        built = dict(schema) if schema is not None else _schema_of(fn, tool_name)
        _registered.append(FunctionTool(tool_name, fn, built))
        return fn

    if callable(name) and schema is None:
        return register(name, None)
    return lambda fn: register(fn, name)


def read_function_tools(path: str | Path) -> list[FunctionTool]:
    """The functions a verl function-tool file registers, in order. The file is run as verl runs it
    (the user's own code, as custom_reward_function.path is). Where verl is not installed,
    ``verl.tools.function_tool`` and ``verl.tools.schemas`` are klppo's stand-ins while it runs
    (``function_tool``, ``ToolResponse``); where it is, the file imports verl's own, and its tools are
    read from verl's registry. A file that cannot run, registers nothing, or whose schema cannot be
    built is a ``UserError`` naming it."""
    global _registered
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{FUNCTION_TOOL_KEY} = {str(path)!r} is not a file; point it at a Python file of "
                        "@function_tool functions (verl's function tools)")
    module_name = "_klppo_function_tools_" + str(path.resolve()).replace(os.sep, "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    _registered = []
    try:
        registry = _verls_registry()
        before = set(registry or ())
        with _verl_stand_ins() if registry is None else nullcontext():
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        tools = _registered + [_from_verl(registry[name]) for name in registry or () if name not in before]
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 (the user's file: any error, named with its place)
        raise UserError(f"{FUNCTION_TOOL_KEY} = {str(path)!r} fails when run: {type(error).__name__}: {error}") from None
    finally:
        _registered = None
    if not tools:
        raise UserError(f"{FUNCTION_TOOL_KEY} = {str(path)!r} registers no tool; decorate each tool function with "
                        "@function_tool (from verl.tools.function_tool import function_tool)")
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"{FUNCTION_TOOL_KEY} = {str(path)!r} registers {', '.join(twice)} twice; give each tool its "
                        "own name")
    return tools


def _verls_registry() -> Optional[dict]:
    """verl's function-tool registry (name -> its FunctionTool), where verl is installed; else None."""
    if importlib.util.find_spec("verl") is None:
        return None
    try:
        from verl.tools.function_tool import FUNCTION_TOOL_REGISTRY
    except ImportError:  # a verl older than its function tools (0.8)
        return None
    return FUNCTION_TOOL_REGISTRY


def _from_verl(tool) -> FunctionTool:
    """verl's own FunctionTool, its schema dumped as verl hands it to the chat template."""
    return FunctionTool(tool.name, tool.fn, tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True))


def _schema_of(fn: Callable, name: str) -> dict:
    """The OpenAI function schema of ``fn`` as verl builds it (and dumps it for the chat template)."""
    from transformers.utils import get_json_schema

    variadic = [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if variadic:
        raise UserError(f"@function_tool {name!r}: its parameters {', '.join(variadic)} are variadic, which a tool "
                        "schema cannot describe; give it named parameters")
    try:
        raw = get_json_schema(fn)
    except Exception as error:  # noqa: BLE001 (transformers' parsing exceptions)
        raise UserError(f"@function_tool {name!r}: no schema can be built from it ({error}); give every parameter "
                        "a type hint and the docstring an Args: block describing each") from None
    function = {key: raw["function"][key] for key in ("description", "parameters") if key in raw["function"]}
    return {"type": "function", "function": {"name": name, **function}}


@contextmanager
def _verl_stand_ins() -> Iterator[None]:
    """``verl.tools.function_tool`` and ``verl.tools.schemas`` as klppo's, for one file's import."""
    names = ("verl", "verl.tools", "verl.tools.function_tool", "verl.tools.schemas")
    kept = {name: sys.modules.get(name) for name in names}
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    sys.modules["verl"].tools = sys.modules["verl.tools"]
    sys.modules["verl.tools"].function_tool = sys.modules["verl.tools.function_tool"]
    sys.modules["verl.tools"].schemas = sys.modules["verl.tools.schemas"]
    sys.modules["verl.tools.function_tool"].function_tool = function_tool
    sys.modules["verl.tools.function_tool"].ToolResponse = ToolResponse
    sys.modules["verl.tools.schemas"].ToolResponse = ToolResponse
    try:
        yield
    finally:
        for name, module in kept.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
