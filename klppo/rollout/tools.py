"""Tools a multi-turn rollout calls (``rollout.multi_turn.tool_config_path``), and how it reads their calls.

The tool config is verl's YAML: a list under ``tools``, each with the ``class_name`` that
implements it, its ``config`` and its ``tool_schema`` (OpenAI's function format, which the chat
template shows the model). ``verl.tools.gsm8k_tool.Gsm8kTool`` is klppo's own ``Gsm8kTool``, the
same tool without verl installed; any other ``class_name`` is imported as a Python path (the
user's own code, as ``custom_reward_function.path`` is) and used as verl uses it::

    tool = cls(config, tool_schema)
    instance_id, _ = tool.create(create_kwargs=...)          # per call, with the row's tools_kwargs
    response, reward, metrics = tool.execute(instance_id, arguments)
    tool.release(instance_id)

Each method may be a coroutine (verl's tools are ``async``): a turn runs every row's calls
concurrently. ``response`` is text, or anything with a ``text`` attribute (verl's ToolResponse).

The model asks for a tool in Hermes' format (``multi_turn.format: hermes``, Qwen's)::

    <tool_call>
    {"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}
    </tool_call>
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from klppo.errors import UserError
from klppo.rewards import gsm8k

TOOL_CONFIG_KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON, as the model wrote it (re-serialised)


def parse_hermes_tool_calls(text: str) -> list[ToolCall]:
    """The calls of a turn's text, in order: every ``<tool_call>{"name", "arguments"}</tool_call>``
    whose body is JSON with both keys (others are skipped, as verl skips them)."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            calls.append(ToolCall(str(call["name"]), json.dumps(call["arguments"], ensure_ascii=False)))
        except (ValueError, KeyError, TypeError):
            continue
    return calls


def truncate_tool_text(text: str, max_length: int, side: str) -> str:
    """A tool's reply cut to ``max_length`` characters as verl cuts it: ``left`` keeps the start,
    ``right`` the end, ``middle`` both halves, with a marker where text went."""
    if len(text) <= max_length:
        return text
    if side == "left":
        return text[:max_length] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-max_length:]
    half = max_length // 2
    return text[:half] + "...(truncated)..." + text[-half:]


class Gsm8kTool:
    """verl's ``Gsm8kTool``: scores the answer it is given against the row's ground truth (gsm8k's
    flexible extraction: the last number) and says so; its reward is -0.05 when the answer is no
    better than the last one this instance scored, else 0."""

    def __init__(self, config: dict, tool_schema: dict):
        self.config, self.tool_schema = config, tool_schema
        self._instances: dict[str, dict] = {}

    def create(self, instance_id: Optional[str] = None, ground_truth: Any = None, **kwargs) -> tuple[str, str]:
        instance_id = instance_id or uuid.uuid4().hex
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth")
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ""

    def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple[str, float, dict]:
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state = self._instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return f"Current parsed answer={answer!r} reward={reward!r}", tool_reward, {}

    def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instances[instance_id]
        return gsm8k.compute_score(state["response"], state["ground_truth"], method="flexible", format_score=0.0,
                                   score=1.0)

    def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)


BUILT_IN = {"verl.tools.gsm8k_tool.Gsm8kTool": Gsm8kTool, "klppo.rollout.tools.Gsm8kTool": Gsm8kTool}


@dataclass(frozen=True)
class Tools:
    """The tools of a run: by the name the model calls them, and their schemas for the chat template."""

    by_name: dict[str, Any]
    schemas: list[dict]

    def __bool__(self) -> bool:
        return bool(self.by_name)


NO_TOOLS = Tools({}, [])


def load_tools(path: str | Path) -> Tools:
    """The tools a verl tool config lists, each built once for the run (a ``UserError`` naming the
    entry for a file, class or schema that is not right)."""
    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise UserError(f"{TOOL_CONFIG_KEY} = {str(path)!r}: cannot read it ({error}); point it at verl's tool "
                        "config YAML (a 'tools' list of class_name, config, tool_schema)") from None
    entries = config.get("tools") if isinstance(config, dict) else None
    if not isinstance(entries, list):
        raise UserError(f"{TOOL_CONFIG_KEY} = {str(path)!r} has no 'tools' list; write tools: [{{class_name: ..., "
                        "config: ..., tool_schema: ...}}] as verl's tool configs do")
    by_name, schemas = {}, []
    for i, entry in enumerate(entries):
        where = f"{path} tools[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise UserError(f"{where}: each tool needs a class_name (e.g. verl.tools.gsm8k_tool.Gsm8kTool)")
        schema = entry.get("tool_schema") or {}
        name = (schema.get("function") or {}).get("name") if isinstance(schema, dict) else None
        if not name:
            raise UserError(f"{where}: tool_schema.function.name is missing; it is the name the model calls the "
                            "tool by")
        if name in by_name:
            raise UserError(f"{where}: a second tool named {name!r}; give each tool its own function name")
        by_name[name] = tool_class(entry["class_name"], where)(entry.get("config") or {}, schema)
        schemas.append(schema)
    return Tools(by_name, schemas)


def tool_class(class_name: str, where: str) -> type:
    """klppo's own class for a verl tool it has, else the class at the Python path ``class_name``."""
    if class_name in BUILT_IN:
        return BUILT_IN[class_name]
    module_name, _, attribute = class_name.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as error:
        built_in = ", ".join(sorted(BUILT_IN))
        raise UserError(f"{where}: class_name {class_name!r} cannot be imported ({error}); klppo has {built_in} "
                        "built in, and imports any other from the Python path (make its module importable)") from None


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


async def call_tool(tools: Tools, call: ToolCall, tools_kwargs: dict, max_length: int, truncate_side: str
                    ) -> tuple[str, float]:
    """One call's reply text (cut to ``max_length`` characters) and its reward. A call the tool
    cannot take (unknown name, arguments that are not JSON, an error inside the tool) gets the
    error as its reply and reward 0, as verl replies, so the model sees what went wrong."""
    tool, instance_id = None, None
    try:
        tool = tools.by_name[call.name]
        arguments = json.loads(call.arguments)
        kwargs = (tools_kwargs or {}).get(call.name, {})
        instance_id, _ = await _maybe_await(tool.create(create_kwargs=kwargs.get("create_kwargs", {})))
        response, reward, _ = await _maybe_await(tool.execute(instance_id, arguments))
    except Exception as error:  # noqa: BLE001 (the model's call, whatever it was, gets an answer)
        if isinstance(error, KeyError) and tool is None:
            error = f"no tool named {call.name!r}"
        return f"Error when executing tool: {error}", 0.0
    finally:
        if tool is not None and instance_id is not None:
            await _maybe_await(tool.release(instance_id))
    text = response if isinstance(response, str) else (getattr(response, "text", None) or "")
    return truncate_tool_text(text, max_length, truncate_side), float(reward or 0.0)


def run_tool_calls(tools: Tools, calls: list[tuple[list[ToolCall], dict]], max_length: int, truncate_side: str
                   ) -> list[list[tuple[str, float]]]:
    """Every row's calls of one turn (``(calls, tools_kwargs)`` per row), all at once; their replies per row."""

    async def all_rows():
        rows = [asyncio.gather(*(call_tool(tools, c, kwargs, max_length, truncate_side) for c in row_calls))
                for row_calls, kwargs in calls]
        return await asyncio.gather(*rows)

    return [list(replies) for replies in asyncio.run(all_rows())]
