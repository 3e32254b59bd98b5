"""verl's function tools (rollout.multi_turn.function_tool_path): a Python file of @function_tool functions,
run as verl runs it without verl installed, each function a tool whose schema its type hints and
docstring give."""

import json
import sys
import textwrap

import pytest
from transformers import AutoTokenizer
from transformers.utils import get_json_schema

from klppo.data.tool_config import read_function_tools
from klppo.errors import UserError
from klppo.rollout.multi_turn import MultiTurn, multi_turn_rollout
from klppo.rollout.tools import ToolCall, load_tools, run_tool_calls
from tests.rollout.test_multi_turn import GSM8K_TOOL_CONFIG, ScriptedPolicy, record

# As verl's docs write them: the decorator and ToolResponse imported from verl.
FUNCTIONS = textwrap.dedent('''\
    import asyncio

    from verl.tools.function_tool import function_tool
    from verl.tools.schemas import ToolResponse


    @function_tool
    def add(a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        return str(a + b)


    @function_tool("lookup")
    async def find(word: str, limit: int = 3) -> dict:
        """Look a word up.

        Args:
            word: The word.
            limit: How many senses.
        """
        await asyncio.sleep(0)
        return {"word": word, "senses": limit}


    @function_tool(schema={"type": "function", "function": {"name": "score", "description": "Scores an answer.",
                                                            "parameters": {"type": "object", "properties": {}}}})
    def score(answer="") -> tuple:
        return ToolResponse(text=f"scored {answer}"), 0.5, {"calls": 1}


    def helper():  # not a tool
        return 1
    ''')


def write(tmp_path, text: str, name: str = "my_tools.py"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_files_functions_are_tools_with_the_schemas_verl_builds(tmp_path):
    tools = read_function_tools(write(tmp_path, FUNCTIONS))
    assert [t.name for t in tools] == ["add", "lookup", "score"]
    expected = get_json_schema(tools[0].fn)["function"]
    assert tools[0].schema == {"type": "function", "function": {"name": "add", "description": expected["description"],
                                                                "parameters": expected["parameters"]}}
    assert tools[1].schema["function"]["name"] == "lookup"  # renamed; the schema's other parts are find's
    assert tools[1].schema["function"]["parameters"]["required"] == ["word"]
    assert tools[2].schema["function"]["description"] == "Scores an answer."
    assert "verl" not in sys.modules  # the stand-ins are gone once the file has run


def test_calls_run_the_functions_and_read_their_replies_as_verl_reads_them(tmp_path):
    tools = load_tools(None, write(tmp_path, FUNCTIONS))
    calls = [ToolCall("add", json.dumps({"a": 2, "b": 40})), ToolCall("lookup", json.dumps({"word": "ppo"})),
             ToolCall("score", json.dumps({"answer": "72"})), ToolCall("add", json.dumps({"a": 1}))]
    (replies,) = run_tool_calls(tools, [(calls, {})], max_length=200, truncate_side="middle")
    assert replies[:3] == [("42", 0.0), ('{"word": "ppo", "senses": 3}', 0.0), ("scored 72", 0.5)]
    text, reward = replies[3]  # a call the function cannot take gets the error as its reply
    assert text.startswith("Error when executing tool:") and "'b'" in text and reward == 0.0


def test_a_conversation_calls_a_function_tool_beside_the_yaml_tools(tmp_path, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    yaml_path = write(tmp_path, GSM8K_TOOL_CONFIG, "tools.yaml")
    tools = load_tools(yaml_path, write(tmp_path, FUNCTIONS))
    assert list(tools.by_name) == ["calc_gsm8k_reward", "add", "lookup", "score"] and len(tools.schemas) == 4
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 30, "b": 42}}\n</tool_call>'
    batch = multi_turn_rollout([record(tokenizer)], 1, tokenizer, ScriptedPolicy(tokenizer, [call, "#### 72"]),
                               MultiTurn(tools), response_length=200)
    reply = batch.response_ids[0][batch.response_attention[0] & ~batch.response_mask[0]].tolist()
    assert tokenizer.decode(reply) == "<|im_start|>tool\n72<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("text, message", [
    ("x = 1\n", "registers no tool; decorate each tool function with @function_tool"),
    ("raise RuntimeError('no sandbox here')\n", "fails when run: RuntimeError: no sandbox here"),
    ("from verl.tools.function_tool import function_tool\n\n@function_tool\ndef f(a):\n    return a\n",
     "@function_tool 'f': no schema can be built from it"),
    ("from verl.tools.function_tool import function_tool\n\n@function_tool\ndef f(*args: int) -> str:\n"
     '    """F.\n\n    Args:\n        args: numbers\n    """\n', "its parameters args are variadic"),
    (FUNCTIONS + "\n@function_tool('add')\ndef other(a: int) -> str:\n    '''A.\n\n    Args:\n        a: a\n    '''\n",
     "registers add twice"),
])
def test_a_function_tool_file_that_is_not_right_names_the_fix(tmp_path, text, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("*", r"\*")):
        read_function_tools(write(tmp_path, text))


def test_a_missing_file_or_a_name_a_yaml_tool_has_is_refused(tmp_path):
    with pytest.raises(UserError, match="function_tool_path = '.*nothing.py' is not a file"):
        read_function_tools(tmp_path / "nothing.py")
    renamed = FUNCTIONS.replace('@function_tool("lookup")', '@function_tool("calc_gsm8k_reward")')
    with pytest.raises(UserError, match="its tool 'calc_gsm8k_reward' has the name of one in"):
        load_tools(write(tmp_path, GSM8K_TOOL_CONFIG, "tools.yaml"), write(tmp_path, renamed))


# What a file registering with verl's own decorator needs of an installed verl (0.8+): its registry
# of FunctionTool carriers, whose pydantic schema klppo dumps as verl does.
FAKE_VERL_FUNCTION_TOOL = textwrap.dedent('''\
    from dataclasses import dataclass

    FUNCTION_TOOL_REGISTRY = {}


    class Schema:
        def __init__(self, data):
            self.data = data

        def model_dump(self, exclude_unset=False, exclude_none=False):
            return dict(self.data)


    @dataclass
    class FunctionTool:
        name: str
        fn: object
        tool_schema: Schema


    def function_tool(fn):
        FUNCTION_TOOL_REGISTRY[fn.__name__] = FunctionTool(fn.__name__, fn, Schema({"type": "function", "function": {
            "name": fn.__name__, "description": "from verl's registry"}}))
        return fn
    ''')


def test_where_verl_is_installed_the_file_registers_with_verl_and_klppo_reads_its_registry(tmp_path, monkeypatch):
    package = tmp_path / "site" / "verl"
    (package / "tools").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "utils.py").write_text("ANSWER = 42\n")  # the rest of verl stays importable from the file
    (package / "tools" / "__init__.py").write_text("")
    (package / "tools" / "function_tool.py").write_text(FAKE_VERL_FUNCTION_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
        monkeypatch.delitem(sys.modules, name)
    path = write(tmp_path, "from verl.tools.function_tool import function_tool\nfrom verl.utils import ANSWER\n\n\n"
                           "@function_tool\ndef answer() -> int:\n    return ANSWER\n")
    try:
        (tool,) = read_function_tools(path)
    finally:  # the fake verl leaves with the test
        for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
            del sys.modules[name]
    assert tool.name == "answer" and tool.fn() == 42
    assert tool.schema == {"type": "function", "function": {"name": "answer", "description": "from verl's registry"}}
