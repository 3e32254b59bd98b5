"""examples/gsm8k_tool: prepare.py writes verl's multi-turn tool rows from GSM8K's own files, its tool and
interaction files build, and its config points at them."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from klppo.config import load_ppo_config
from klppo.data.rl_dataset import load_rl_dataset
from klppo.models.load import load_tokenizer
from klppo.rollout.multi_turn import MultiTurn, check_conversation_rows
from klppo.rollout.tools import ToolCall, load_interactions, load_tools, run_tool_calls

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "gsm8k_tool"


def test_prepared_rows_carry_what_the_tool_and_the_interaction_need(tiny_model_dir, tmp_path):
    src = tmp_path / "gsm8k"
    src.mkdir()
    for split in ("train", "test"):
        pq.write_table(pa.table({"question": ["What is 6 * 12?"], "answer": ["6 * 12 = 72\n#### 72"]}),
                       src / f"{split}-00000-of-00001.parquet")
    done = subprocess.run([sys.executable, str(EXAMPLE / "prepare.py"), "--src", str(src), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    tools, interactions = load_tools(EXAMPLE / "tools.yaml"), load_interactions(EXAMPLE / "interactions.yaml")
    assert list(tools.by_name) == ["calc_gsm8k_reward"] and list(interactions) == ["gsm8k"]
    records = load_rl_dataset(tmp_path / "out" / "train.parquet", load_tokenizer(str(tiny_model_dir)),
                              max_prompt_length=1024, template_kwargs={"tools": tools.schemas}, log=lambda *a: None)
    check_conversation_rows(MultiTurn(tools, interactions=interactions), records)
    assert records[0].extra_info["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}
    cfg = load_ppo_config(str(EXAMPLE / "ppo.yaml"))
    assert (ROOT / cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path).resolve() == (EXAMPLE / "tools.yaml").resolve()


def test_the_calculator_function_tool_computes_arithmetic_and_runs_nothing_else():
    tools = load_tools(None, EXAMPLE / "calculator.py")
    assert tools.schemas[0]["function"]["name"] == "calculate"
    assert tools.schemas[0]["function"]["parameters"]["required"] == ["expression"]
    calls = [ToolCall("calculate", json.dumps({"expression": e})) for e in
             ("(12 + 30) * 4 / 7", "7 / 2", "-3 ** 2", "2 ** 1000 ** 2", "__import__('os').getcwd()", "1 / 0", "3 +")]
    (replies,) = run_tool_calls(tools, [(calls, {})], max_length=200, truncate_side="middle")
    assert [text for text, _ in replies] == [
        "24", "3.5", "-9", "Error: an exponent above 64", "Error: \"__import__('os').getcwd()\" is not arithmetic",
        "Error: division by zero", "Error: invalid syntax (<unknown>, line 1)"]
    cfg = load_ppo_config(str(EXAMPLE / "ppo.yaml"), ["actor_rollout_ref.rollout.multi_turn.function_tool_path="
                                                      "examples/gsm8k_tool/calculator.py"])
    assert cfg.actor_rollout_ref.rollout.multi_turn.function_tool_path == "examples/gsm8k_tool/calculator.py"
