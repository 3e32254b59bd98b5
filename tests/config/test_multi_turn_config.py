"""rollout.multi_turn's settings: what cannot work is an error naming the key, and tools or interactions
that nothing reaches are a warning."""

import pytest

from klppo.config import load_ppo_config
from klppo.errors import UserError

BASE = ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m"]
MT = "actor_rollout_ref.rollout.multi_turn"


@pytest.mark.parametrize("changes, message", [
    (["actor_rollout_ref.rollout.name=offline"], f"{MT}.enable = true needs generated conversations, but "
                                                 "actor_rollout_ref.rollout.name = 'offline'"),
    (["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.hf_decoding=compiled"],
     "actor_rollout_ref.rollout.hf_decoding = 'compiled' sizes one static cache per batch shape"),
    (["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.ignore_eos=true"],
     "actor_rollout_ref.rollout.ignore_eos = true never ends a turn"),
    (["actor_rollout_ref.rollout.name=hf", f"{MT}.max_assistant_turns=0"], f"{MT}.max_assistant_turns = 0 must be >= 1"),
    (["actor_rollout_ref.rollout.name=hf", f"{MT}.max_parallel_calls=0"], f"{MT}.max_parallel_calls = 0 must be >= 1"),
    (["actor_rollout_ref.rollout.name=hf", f"{MT}.format=llama3_json"],
     f"{MT}.format = 'llama3_json' is not one of 'hermes', 'qwen', 'gpt-oss'"),
])
def test_multi_turn_settings_that_cannot_work_are_errors_naming_the_key(changes, message):
    with pytest.raises(UserError) as info:
        load_ppo_config(None, [*BASE, f"{MT}.enable=true", *changes])
    assert message in str(info.value)


def test_a_run_where_nothing_answers_a_turn_says_so():
    notes: list[str] = []
    load_ppo_config(None, [*BASE, "actor_rollout_ref.rollout.name=hf", f"{MT}.enable=true"], notes=notes)
    assert any("nothing answers a turn, so every response is one turn" in n for n in notes)
    notes.clear()
    load_ppo_config(None, [*BASE, "actor_rollout_ref.rollout.name=hf", f"{MT}.enable=true",
                           f"{MT}.function_tool_path=tools.py"], notes=notes)
    assert not notes  # verl's function tools answer turns
    notes.clear()
    cfg = load_ppo_config(None, [*BASE, "actor_rollout_ref.rollout.name=sglang", f"{MT}.tool_config_path=t.yaml"],
                          notes=notes)
    assert any(f"{MT}.tool_config_path has no effect while {MT}.enable = false" in n for n in notes)
    assert cfg.actor_rollout_ref.rollout.name == "hf"  # sglang's conversations generate with hf


def test_qwen_format_of_verls_sglang_configs_reads_hermes_tool_calls():
    """verl's SGLang configs name format qwen: SGLang's Qwen 2.5 parser reads the Hermes layout."""
    cfg = load_ppo_config(None, [*BASE, "actor_rollout_ref.rollout.name=sglang", f"{MT}.enable=true", f"{MT}.format=qwen"])
    assert cfg.actor_rollout_ref.rollout.multi_turn.format == "qwen"


@pytest.mark.parametrize("loop, message", [
    ("tool_agent", "agent.default_agent_loop = 'tool_agent' makes every row without an agent_name a conversation with "
                   f"tools (as verl runs it), but {MT}.enable is false"),
    ("react_agent", "agent.default_agent_loop = 'react_agent' is not one of 'single_turn_agent', 'tool_agent'"),
])
def test_verls_default_agent_loop_that_klppo_would_not_run_as_verl_is_an_error(loop, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_ppo_config(None, [*BASE, "actor_rollout_ref.rollout.name=hf",
                               f"actor_rollout_ref.rollout.agent.default_agent_loop={loop}"])
    cfg = load_ppo_config(None, [*BASE, "actor_rollout_ref.rollout.name=hf", f"{MT}.enable=true",
                                 f"{MT}.tool_config_path=t.yaml", "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
                                 "actor_rollout_ref.rollout.agent.num_workers=4"])  # verl's worker count: no effect
    assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "tool_agent"
