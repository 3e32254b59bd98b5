"""Tools a multi-turn rollout calls (``rollout.multi_turn.tool_config_path``), how it reads their calls, and
the interactions that answer as the user (``rollout.multi_turn.interaction_config_path``).

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
verl's function tools (``multi_turn.function_tool_path``, ``data.tool_config.read_function_tools``)
join them under the same interface (``CalledFunction``).

The model asks for a tool in Hermes' format (``multi_turn.format: hermes``, or ``qwen``: the same layout)::

    <tool_call>
    {"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}
    </tool_call>

or, for gpt-oss (``multi_turn.format: gpt-oss``), in OpenAI's harmony format::

    <|channel|>commentary to=functions.calc_gsm8k_reward <|constrain|>json<|message|>{"answer": "72"}<|call|>

The interaction config is verl's too: a list under ``interaction``, each with its ``class_name``,
``config`` and ``name`` (which a row's ``extra_info.interaction_kwargs.name`` picks).
``verl.interactions.gsm8k_interaction.Gsm8kInteraction`` is klppo's ``Gsm8kInteraction``; any
other class is imported, and used as verl uses it (each method may be a coroutine)::

    interaction = cls(config={**config, "name": name})
    interaction.start_interaction(instance_id, **interaction_kwargs)
    over, text, reward, metrics = interaction.generate_response(instance_id, messages, **interaction_kwargs)
    interaction.finalize_interaction(instance_id)
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

from klppo.data.tool_config import (
    FUNCTION_TOOL_KEY, INTERACTION_CONFIG_KEY, read_config_list, read_function_tools, read_tool_config,
)
from klppo.errors import UserError
from klppo.rewards import gsm8k

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


# gpt-oss (OpenAI's harmony format): a call is a message addressed to a function (``to=functions.NAME``
# in its header), ended by <|call|>, one of the model's EOS tokens. Its reasoning (the analysis
# channel) may mention calls that are not calls, so it is removed first (verl's GptOssToolParser).
_HARMONY_ANALYSIS = re.compile(r"(?:<\|start\|>assistant)?<\|channel\|>analysis<\|message\|>.*?(?:<\|end\|>|\Z)",
                               re.DOTALL)
_HARMONY_CALL = re.compile(r"(?:<\|start\|>assistant)?((?:(?!<\|(?:start|end|message|call|return)\|>).)*)"
                           r"<\|message\|>(.*?)<\|call\|>", re.DOTALL)
_HARMONY_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>")


def parse_gpt_oss_tool_calls(text: str) -> list[ToolCall]:
    """The calls of a gpt-oss turn's text (decoded with its special tokens), in order: every message whose
    header names ``to=functions.NAME``, its body the arguments as written (a body that is not JSON gets
    the error as its reply, as verl answers it). A turn may open with the header itself, right after
    the generation prompt's ``<|start|>assistant`` (verl's parser misses those)."""
    text = _HARMONY_ANALYSIS.sub("", text)
    calls = []
    for header, body in _HARMONY_CALL.findall(text):
        recipient = _HARMONY_RECIPIENT.search(header)
        if recipient:
            calls.append(ToolCall(recipient.group(1), body.strip()))
    return calls


def gpt_oss_replies(replies: list[str], names: list[str]) -> str:
    """Tool replies as gpt-oss reads them, each from its function to the assistant on the commentary
    channel, then the next turn's opening (verl writes them so: gpt-oss's chat template renders a tool
    message only after the assistant message that called it)."""
    messages = "".join(f"<|start|>functions.{name} to=assistant<|channel|>commentary<|message|>{reply}<|end|>"
                       for reply, name in zip(replies, names))
    return messages + "<|start|>assistant"


TOOL_CALL_PARSERS = {"hermes": parse_hermes_tool_calls, "qwen": parse_hermes_tool_calls,
                     "gpt-oss": parse_gpt_oss_tool_calls}


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


def load_tools(path: Optional[str | Path], function_tool_path: Optional[str | Path] = None) -> Tools:
    """The tools a verl tool config lists, each built once for the run, and the functions a verl
    function-tool file registers (``@function_tool``); a ``UserError`` naming the entry for a file, class
    or schema that is not right, or for two tools of one name."""
    entries = read_tool_config(path) if path else []
    by_name = {e.name: tool_class(e.class_name, e.where)(e.config, e.schema) for e in entries}
    schemas = [e.schema for e in entries]
    for function in read_function_tools(function_tool_path) if function_tool_path else []:
        if function.name in by_name:
            raise UserError(f"{FUNCTION_TOOL_KEY} = {str(function_tool_path)!r}: its tool {function.name!r} has the name "
                            f"of one in {path}; give each tool its own name")
        by_name[function.name] = CalledFunction(function.fn)
        schemas.append(function.schema)
    return Tools(by_name, schemas)


class CalledFunction:
    """A function tool under verl's tool interface: no state (``create``/``release`` do nothing), each call
    ``fn(**arguments)`` (in a worker thread unless it is a coroutine function), its return read as verl reads
    it: a str, a dict (as JSON), anything with a ``text``, or ``(reply, reward[, metrics])``."""

    def __init__(self, fn):
        self.fn = fn

    def create(self, create_kwargs=None):
        return None, None

    async def execute(self, instance_id, arguments: dict):
        if inspect.iscoroutinefunction(self.fn):
            returned = await self.fn(**arguments)
        else:
            returned = await asyncio.to_thread(self.fn, **arguments)
        reward, metrics = 0.0, {}
        if isinstance(returned, tuple):
            if not 1 <= len(returned) <= 3:
                raise TypeError(f"a function tool returns (reply,), (reply, reward) or (reply, reward, metrics), not a "
                                f"tuple of {len(returned)}")
            returned, reward, metrics = (*returned, None, None)[:3]
            reward = 0.0 if reward is None else float(reward)
        return _reply_text(returned), reward, metrics or {}

    def release(self, instance_id):
        pass


def _reply_text(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if hasattr(value, "text"):  # verl's ToolResponse
        return value.text or ""
    return str(value)


def tool_class(class_name: str, where: str, built_in: dict | None = None) -> type:
    """klppo's own class for a verl tool (or interaction) it has, else the class at the Python path ``class_name``."""
    built_in = BUILT_IN if built_in is None else built_in
    if class_name in built_in:
        return built_in[class_name]
    module_name, _, attribute = class_name.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as error:
        raise UserError(f"{where}: class_name {class_name!r} cannot be imported ({error}); klppo has "
                        f"{', '.join(sorted(built_in))} built in, and imports any other from the Python path (make "
                        "its module importable)") from None


def _run_all(coroutines: list) -> list:
    async def gathered():
        return await asyncio.gather(*coroutines)

    return list(asyncio.run(gathered()))


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


async def call_tool(tools: Tools, call: ToolCall, tools_kwargs: dict, max_length: int, truncate_side: str
                    ) -> tuple[str, Optional[float]]:
    """One call's reply text (cut to ``max_length`` characters) and its reward (None where the tool gave
    none). A call the tool cannot take (unknown name, arguments that are not JSON, an error inside the
    tool) gets the error as its reply and reward 0, as verl replies, so the model sees what went wrong."""
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
    return truncate_tool_text(text, max_length, truncate_side), None if reward is None else float(reward)


def run_tool_calls(tools: Tools, calls: list[tuple[list[ToolCall], dict]], max_length: int, truncate_side: str
                   ) -> list[list[tuple[str, Optional[float]]]]:
    """Every row's calls of one turn (``(calls, tools_kwargs)`` per row), all at once; their replies per row."""

    async def row(row_calls: list[ToolCall], kwargs: dict) -> list[tuple[str, Optional[float]]]:
        return list(await asyncio.gather(*(call_tool(tools, c, kwargs, max_length, truncate_side) for c in row_calls)))

    return _run_all([row(row_calls, kwargs) for row_calls, kwargs in calls])


# ---- interactions: the user's side of a conversation ----


class Gsm8kInteraction:
    """verl's ``Gsm8kInteraction``: reads the policy's last turn as its answer (gsm8k's strict extraction:
    "#### <number>"); a right answer ends the conversation, a wrong one asks the policy to try again."""

    def __init__(self, config: dict):
        self.config = config
        self._instances: dict[str, dict] = {}

    def start_interaction(self, instance_id: Optional[str] = None, ground_truth: Any = None, **kwargs) -> str:
        instance_id = instance_id or uuid.uuid4().hex
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    def generate_response(self, instance_id: str, messages: list[dict], **kwargs) -> tuple[bool, str, float, dict]:
        said = next((m.get("content") for m in reversed(messages) if m.get("role") == "assistant"), "")
        self._instances[instance_id]["response"] = said
        reward = self.calculate_score(instance_id)
        if reward == 1.0:
            return True, "Your response is correct!", reward, {}
        return False, "Your response is incorrect! You need to reflect on your answer and try again.", reward, {}

    def calculate_score(self, instance_id: str, **kwargs) -> float:
        state = self._instances[instance_id]
        return gsm8k.compute_score(state["response"], state["ground_truth"], method="strict", format_score=0.0,
                                   score=1.0)

    def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)


BUILT_IN_INTERACTIONS = {"verl.interactions.gsm8k_interaction.Gsm8kInteraction": Gsm8kInteraction,
                         "klppo.rollout.tools.Gsm8kInteraction": Gsm8kInteraction}


def load_interactions(path: str | Path) -> dict[str, Any]:
    """The interactions a verl interaction config lists, by name (its ``name``, else the class's name
    without "Interaction", lower-cased, as verl names it), each built once for the run."""
    entries = read_config_list(path, INTERACTION_CONFIG_KEY, "interaction",
                               "interaction config YAML (interaction: [{name, class_name, config}])")
    interactions = {}
    for i, entry in enumerate(entries):
        where = f"{path} interaction[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise UserError(f"{where}: each interaction needs a class_name (e.g. "
                            "verl.interactions.gsm8k_interaction.Gsm8kInteraction)")
        simple = entry["class_name"].rsplit(".", 1)[-1]
        name = entry.get("name") or (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()
        if name in interactions:
            raise UserError(f"{where}: a second interaction named {name!r}; give each its own name")
        cls = tool_class(entry["class_name"], where, BUILT_IN_INTERACTIONS)
        interactions[name] = cls(config={**(entry.get("config") or {}), "name": name})
    return interactions


def check_interaction_rows(interactions: dict[str, Any], extra_infos: list[dict], places: list[str]) -> None:
    """Every row names one of ``interactions`` in ``extra_info.interaction_kwargs.name`` (verl refuses a row
    that does not)."""
    for extra, place in zip(extra_infos, places):
        kwargs = (extra or {}).get("interaction_kwargs")
        name = kwargs.get("name") if isinstance(kwargs, dict) else None
        if name not in interactions:
            problem = "has no extra_info.interaction_kwargs.name" if name is None else f"names interaction {name!r}"
            raise UserError(f"{place}: {problem}, but {INTERACTION_CONFIG_KEY} has {', '.join(sorted(interactions))}; "
                            "give every row interaction_kwargs with the name of one of them (verl's "
                            "gsm8k_multiturn_w_interaction preprocessing writes name, query and ground_truth)")


def start_interactions(interactions: dict[str, Any], kwargs_per_row: list[dict]) -> list[tuple]:
    """Start one instance per row of the interaction its kwargs name: (interaction, instance id, kwargs) each."""

    async def start(kwargs: dict) -> tuple:
        interaction = interactions[kwargs["name"]]
        instance_id = await _maybe_await(interaction.start_interaction(uuid.uuid4().hex, **kwargs))
        return interaction, instance_id, kwargs

    return _run_all([start(kwargs) for kwargs in kwargs_per_row])


def interaction_turns(rows: list[tuple[tuple, list[dict]]]) -> list[tuple[bool, str, Optional[float]]]:
    """Each row's interaction's answer to the chat so far (all rows at once): (the conversation is over, the
    text, the turn's score or None)."""

    async def answer(started: tuple, messages: list[dict]) -> tuple[bool, str, Optional[float]]:
        interaction, instance_id, kwargs = started
        over, text, score, _ = await _maybe_await(interaction.generate_response(instance_id, messages, **kwargs))
        return bool(over), str(text), None if score is None else float(score)

    return _run_all([answer(started, messages) for started, messages in rows])


def finish_interactions(started: list[tuple]) -> None:
    """Let every row's interaction forget its instance (``finalize_interaction``, where it has one)."""

    async def finish(interaction, instance_id, kwargs) -> None:
        if hasattr(interaction, "finalize_interaction"):
            await _maybe_await(interaction.finalize_interaction(instance_id))

    _run_all([finish(*s) for s in started])
