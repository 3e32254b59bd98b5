"""verl's tool and interaction config YAMLs (``rollout.multi_turn.tool_config_path`` and
``interaction_config_path``), read and checked without building anything: the trainer builds the
tools from these entries (``rollout.tools``), and ``klppo plan`` renders prompts with their schemas,
importing no tool's code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
