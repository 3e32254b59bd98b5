"""Multi-turn rollouts with tools (rollout.multi_turn): the conversation loop against a scripted
policy, verl's tool config and Hermes calls, and what the batch says the policy trains on."""

import json
import textwrap

import pytest
import torch
from transformers import AutoTokenizer

from klppo.data.rl_dataset import PromptRecord
from klppo.errors import UserError
from klppo.rollout.multi_turn import (
    MultiTurn, Turn, answer_tokens, check_tool_format, multi_turn_rollout, system_prefix_length,
)
from klppo.rollout.tools import (
    HARMONY_TOKENS, Gsm8kTool, ToolCall, check_interaction_rows, load_interactions, load_tools, parse_gpt_oss_tool_calls,
    parse_hermes_tool_calls, truncate_tool_text,
)

# verl's examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml, as it is.
GSM8K_TOOL_CONFIG = textwrap.dedent("""\
    tools:
      - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
        config:
          type: native
        tool_schema:
          type: "function"
          function:
            name: "calc_gsm8k_reward"
            description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct)"
            parameters:
              type: "object"
              properties:
                answer:
                  type: "string"
                  description: "The model's answer to the GSM8K math problem, must be a digits"
              required: ["answer"]
    """)


# verl's examples/sglang_multiturn/config/interaction_config/gsm8k_interaction_config.yaml, as it is.
GSM8K_INTERACTION_CONFIG = textwrap.dedent("""\
    interaction:
      - name: "gsm8k"
        class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"
        config: {}
    """)


def reply_tokens(tokenizer, replies: list[str], prefix_length: int) -> list[int]:
    """Tool replies as the loop renders them (``answer_tokens`` of ``tool`` messages)."""
    return answer_tokens(tokenizer, [{"role": "tool", "content": text} for text in replies], prefix_length, {})


def call(answer: str, name: str = "calc_gsm8k_reward") -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"answer": "{answer}"}}}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def tools(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text(GSM8K_TOOL_CONFIG)
    return load_tools(path)


@pytest.fixture
def interactions(tmp_path):
    path = tmp_path / "interactions.yaml"
    path.write_text(GSM8K_INTERACTION_CONFIG)
    return load_interactions(path)


def record(tokenizer, index: int = 0, truth: str = "72") -> PromptRecord:
    kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}}
    return PromptRecord(index=index, data_source="openai/gsm8k", raw_prompt=[{"role": "user", "content": "8 * 9?"}],
                        prompt_ids=tokenizer.encode("What is 8 * 9?"), ground_truth=truth,
                        extra_info={"tools_kwargs": kwargs,
                                    "interaction_kwargs": {"name": "gsm8k", "query": "8 * 9?", "ground_truth": truth}})


class ScriptedPolicy:
    """Says the texts of ``script`` in turn (each closed by EOS, cut at its budget) and records what it was given."""

    def __init__(self, tokenizer, script: list[str]):
        self.tokenizer, self.script, self.seen = tokenizer, list(script), []

    def __call__(self, rows, contexts, budgets):
        self.seen.append((contexts, budgets))
        text = self.script.pop(0)
        turn = self.tokenizer.encode(text) + [self.tokenizer.eos_token_id]
        return [Turn(turn[:budget]) for budget in budgets]


def test_a_tool_call_gets_the_tools_reply_and_the_policy_trains_on_its_own_turns_only(tokenizer, tools):
    policy = ScriptedPolicy(tokenizer, [f"Let me check. {call('72')}", "#### 72"])
    settings = MultiTurn(tools)
    batch = multi_turn_rollout([record(tokenizer)], 1, tokenizer, policy, settings, response_length=200)

    first = tokenizer.encode(f"Let me check. {call('72')}") + [tokenizer.eos_token_id]
    reply = reply_tokens(tokenizer, ["Current parsed answer='72' reward=1.0"], 0)
    second = tokenizer.encode("#### 72") + [tokenizer.eos_token_id]
    tokens = batch.response_ids[0][batch.response_attention[0]].tolist()
    assert tokens == first + reply + second
    assert batch.response_mask[0].tolist()[: len(tokens)] == [True] * len(first) + [False] * len(reply) + [True] * len(second)
    assert tokenizer.decode(reply) == "<|im_start|>tool\nCurrent parsed answer='72' reward=1.0<|im_end|>\n<|im_start|>assistant\n"
    assert batch.num_turns.tolist() == [4]  # verl's count: 2 of the policy, 1 reply, and the prompt
    # the second turn was generated after the prompt, the first turn and the reply, with what was left
    (contexts, budgets) = policy.seen[1]
    assert contexts == [record(tokenizer).prompt_ids + first + reply] and budgets == [200 - len(first) - len(reply)]


def test_a_conversation_ends_without_a_call_at_the_turn_limit_or_where_the_reply_would_not_fit(tokenizer, tools):
    three = [f"try {call('1')}", f"again {call('2')}", f"last {call('72')}"]
    at_limit = multi_turn_rollout([record(tokenizer)], 1, tokenizer, ScriptedPolicy(tokenizer, three),
                                  MultiTurn(tools, max_assistant_turns=2), response_length=300)
    assert at_limit.num_turns.tolist() == [4]  # two turns of the policy, the reply between them
    assert at_limit.response_mask[0][at_limit.response_attention[0]].tolist()[-1]  # it ends with the policy's turn

    no_call = multi_turn_rollout([record(tokenizer)], 1, tokenizer, ScriptedPolicy(tokenizer, ["#### 72"]),
                                 MultiTurn(tools), response_length=300)
    assert no_call.num_turns.tolist() == [2] and bool(no_call.response_mask.eq(no_call.response_attention).all())

    first = len(tokenizer.encode(three[0])) + 1
    tight = multi_turn_rollout([record(tokenizer)], 1, tokenizer, ScriptedPolicy(tokenizer, three),
                               MultiTurn(tools), response_length=first + 5)  # no room for the reply
    assert tight.num_turns.tolist() == [2] and int(tight.response_attention.sum()) == first

    cut = multi_turn_rollout([record(tokenizer)], 1, tokenizer, ScriptedPolicy(tokenizer, three),
                             MultiTurn(tools), response_length=7)  # the first turn is cut at the budget
    assert int(cut.response_attention.sum()) == 7 and bool(cut.response_mask.all())


def test_rows_that_end_early_wait_while_the_others_go_on(tokenizer, tools):
    """Every live conversation takes its turn in one call; a finished one is left out."""
    seen = []

    def policy(rows, contexts, budgets):
        seen.append(rows)
        calls = [call("72"), "#### 72"] if len(seen) == 1 else ["#### 72"] * len(contexts)
        turns = [tokenizer.encode(text) + [tokenizer.eos_token_id] for text in calls]
        return [Turn(tokens, [-0.5] * len(tokens)) for tokens in turns]

    batch = multi_turn_rollout([record(tokenizer)], 2, tokenizer, policy, MultiTurn(tools), response_length=200)
    assert seen == [[0, 1], [0]] and batch.num_turns.tolist() == [4, 2]
    # the sampler's log-probs are kept for the policy's tokens, 0 on the reply and the padding
    assert bool(batch.has_rollout_log_probs.all())
    assert bool((batch.rollout_log_probs == torch.where(batch.response_mask, -0.5, 0.0)).all())
    assert batch.group_index.tolist() == [0, 0] and batch.response_ids.shape[1] == int(batch.response_attention.sum(-1).max())


def test_gsm8k_tool_scores_as_verls_does(tokenizer):
    tool = Gsm8kTool({}, {})
    instance, _ = tool.create(create_kwargs={"ground_truth": "72"})
    assert tool.execute(instance, {"answer": "71"}) == ("Current parsed answer='71' reward=0.0", -0.05, {})
    assert tool.execute(instance, {"answer": "#### 72"}) == ("Current parsed answer='#### 72' reward=1.0", 0.0, {})
    assert tool.execute(instance, {"answer": 72}) == ("Current parsed answer='72' reward=1.0", -0.05, {})  # no better
    tool.release(instance)


def test_hermes_calls_and_truncated_replies():
    text = f"a {call('1')} b {call('2', name='other')} <tool_call>not json</tool_call> <tool_call>{{\"name\": 1}}</tool_call>"
    assert parse_hermes_tool_calls(text) == [ToolCall("calc_gsm8k_reward", '{"answer": "1"}'),
                                             ToolCall("other", '{"answer": "2"}')]
    assert parse_hermes_tool_calls("no call") == []
    assert truncate_tool_text("abcdefgh", 4, "left") == "abcd...(truncated)"
    assert truncate_tool_text("abcdefgh", 4, "right") == "(truncated)...efgh"
    assert truncate_tool_text("abcdefgh", 4, "middle") == "ab...(truncated)...gh"
    assert truncate_tool_text("abc", 4, "middle") == "abc"


# A harmony chat template of the tiny model's (gpt-oss's own renders more, in the same tokens).
HARMONY_TEMPLATE = ("{% for m in messages %}{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + '<|end|>' }}"
                    "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}")


@pytest.fixture(scope="module")
def harmony(tiny_model_dir):
    """The tiny tokenizer with gpt-oss's special tokens and a harmony chat template."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens([*HARMONY_TOKENS, "<|constrain|>", "<|return|>"], special_tokens=True)
    tokenizer.chat_template = HARMONY_TEMPLATE
    return tokenizer


def harmony_call(answer: str, name: str = "calc_gsm8k_reward") -> str:
    return f'<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{{"answer": "{answer}"}}<|call|>'


def test_gpt_oss_calls_are_read_from_harmony_messages_and_never_from_its_reasoning():
    reasoning = f"<|channel|>analysis<|message|>maybe {harmony_call('1')} or not<|end|>"
    assert parse_gpt_oss_tool_calls(harmony_call("72")) == [ToolCall("calc_gsm8k_reward", '{"answer": "72"}')]
    # after its reasoning, a call is a new message of the assistant's; verl's parser reads only these
    assert parse_gpt_oss_tool_calls(reasoning + "<|start|>assistant" + harmony_call("7")) == [
        ToolCall("calc_gsm8k_reward", '{"answer": "7"}')]
    assert parse_gpt_oss_tool_calls(reasoning) == []
    assert parse_gpt_oss_tool_calls("<|channel|>analysis<|message|>cut short " + harmony_call("3")) == []
    assert parse_gpt_oss_tool_calls("<|channel|>final<|message|>#### 72<|return|>") == []
    assert parse_gpt_oss_tool_calls("<|channel|>commentary to=browser.search <|message|>{}<|call|>") == []
    # the recipient may stand in the role's part of the header; a body that is not JSON is kept for its error reply
    assert parse_gpt_oss_tool_calls("<|start|>assistant to=functions.f<|channel|>commentary<|message|>not json<|call|>"
                                    ) == [ToolCall("f", "not json")]


def test_gpt_oss_replies_are_written_as_verl_writes_them_and_the_policy_trains_on_its_turns(harmony, tools):
    turns = [harmony.encode(harmony_call("72")), harmony.encode("<|channel|>final<|message|>#### 72<|return|>")]

    def policy(rows, contexts, budgets):
        return [Turn(turns.pop(0))]

    settings = MultiTurn(tools, format="gpt-oss")
    batch = multi_turn_rollout([record(harmony)], 1, harmony, policy, settings, response_length=200)
    tokens = batch.response_ids[0][batch.response_attention[0]].tolist()
    policy_tokens = batch.response_ids[0][batch.response_mask[0]].tolist()
    reply = tokens[len(harmony.encode(harmony_call("72"))): len(tokens) - len(harmony.encode("<|channel|>final"
                                                                                              "<|message|>#### 72<|return|>"))]
    assert harmony.decode(reply) == ("<|start|>functions.calc_gsm8k_reward to=assistant<|channel|>commentary<|message|>"
                                     "Current parsed answer='72' reward=1.0<|end|><|start|>assistant")
    assert harmony.decode(policy_tokens) == harmony_call("72") + "<|channel|>final<|message|>#### 72<|return|>"
    assert batch.num_turns.tolist() == [4]


def test_a_gpt_oss_run_needs_harmonys_tokens_and_a_call_that_ends_a_turn(tokenizer, harmony, tools):
    settings = MultiTurn(tools, format="gpt-oss")
    call_id = harmony.convert_tokens_to_ids("<|call|>")
    check_tool_format(settings, harmony, (harmony.eos_token_id, call_id))
    check_tool_format(MultiTurn(tools), tokenizer, (tokenizer.eos_token_id,))  # hermes needs nothing of the kind
    with pytest.raises(UserError, match=r"format = gpt-oss reads OpenAI's harmony format, but the model's tokenizer "
                                        r"has no <\|start\|>, .*: it is not a gpt-oss tokenizer"):
        check_tool_format(settings, tokenizer, (tokenizer.eos_token_id,))
    with pytest.raises(UserError, match=rf"add {call_id} to the model folder's generation_config.json eos_token_id"):
        check_tool_format(settings, harmony, (harmony.eos_token_id,))


def test_calls_the_tools_cannot_take_are_answered_with_the_error(tokenizer, tools):
    script = [f"{call('5', name='nope')} {call('72')}", "done"]
    batch = multi_turn_rollout([record(tokenizer)], 1, tokenizer, ScriptedPolicy(tokenizer, script),
                               MultiTurn(tools, max_parallel_calls=1), response_length=300)
    reply = batch.response_ids[0][batch.response_attention[0] & ~batch.response_mask[0]]
    assert "Error when executing tool: no tool named 'nope'" in tokenizer.decode(reply.tolist())
    assert "reward=1.0" not in tokenizer.decode(reply.tolist())  # the second call was over max_parallel_calls


def test_user_tools_are_imported_and_may_be_async(tmp_path, monkeypatch, tokenizer):
    (tmp_path / "my_tools.py").write_text(textwrap.dedent("""\
        class Echo:
            def __init__(self, config, tool_schema):
                self.prefix = config["prefix"]
            async def create(self, instance_id=None, **kwargs):
                return "id", None
            async def execute(self, instance_id, parameters, **kwargs):
                return type("Response", (), {"text": self.prefix + parameters["answer"]})(), 0.5, {}
            async def release(self, instance_id, **kwargs):
                pass
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "tools.yaml"
    config.write_text(json.dumps({"tools": [{"class_name": "my_tools.Echo", "config": {"prefix": "echo: "},
                                             "tool_schema": {"type": "function", "function": {"name": "echo"}}}]}))
    tools = load_tools(config)
    assert tools.schemas == [{"type": "function", "function": {"name": "echo"}}]
    batch = multi_turn_rollout([record(tokenizer)], 1, tokenizer,
                               ScriptedPolicy(tokenizer, [call("hi", name="echo"), "bye"]), MultiTurn(tools),
                               response_length=300)
    assert "echo: hi" in tokenizer.decode(batch.response_ids[0][~batch.response_mask[0] & batch.response_attention[0]])


@pytest.mark.parametrize("content, message", [
    ("tools: nope", "has no 'tools' list"),
    ("tools: [{config: {}}]", "needs a class_name"),
    ("tools: [{class_name: verl.tools.gsm8k_tool.Gsm8kTool, tool_schema: {}}]", "tool_schema.function.name is missing"),
    ("tools: [{class_name: no_such_module.Tool, tool_schema: {function: {name: x}}}]", "cannot be imported"),
])
def test_a_tool_config_that_is_not_right_names_the_fix(tmp_path, content, message):
    path = tmp_path / "tools.yaml"
    path.write_text(content)
    with pytest.raises(UserError, match=message):
        load_tools(path)
    with pytest.raises(UserError, match="cannot read it"):
        load_tools(tmp_path / "missing.yaml")


def test_a_reply_does_not_repeat_the_templates_system_prompt(tokenizer):
    """Qwen's template opens every conversation with a default system prompt: a reply rendered alone
    would open with it again, so its tokens are dropped (verl's initialize_system_prompt)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = "{{ '<|im_start|>system\nbe kind<|im_end|>\n' }}" + tokenizer.chat_template
    prefix = system_prefix_length(tokenizer, {})
    assert prefix == len(tokenizer.encode("<|im_start|>system\nbe kind<|im_end|>\n"))
    reply = reply_tokens(tokenizer, ["42"], prefix)
    assert tokenizer.decode(reply) == "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


def test_the_score_sits_at_the_policys_last_token():
    from klppo.rewards.token_scores import scores_at_last_token

    mask = torch.tensor([[True, True, False, False, True, False], [True, False, False, False, False, False],
                         [False] * 6])
    scores = scores_at_last_token(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert scores.tolist() == [[0, 0, 0, 0, 1.0, 0], [2.0, 0, 0, 0, 0, 0], [3.0, 0, 0, 0, 0, 0]]


def test_vllm_conversations_stay_awake_throughout_and_draw_a_seed_per_turn(monkeypatch, tokenizer, tools):
    """A sleeping GPU engine wakes once for all of a conversation's turns (a sleep between them would
    discard the weights), each turn of each conversation has a seed of its own, and the engine's
    log-probs of the policy's tokens become the batch's rollout_log_probs."""
    from klppo.rollout.hf import SamplingParams
    from klppo.rollout.vllm import request_seed
    from tests import fake_vllm
    from tests.rollout.test_vllm_engine_calls import engine, generations_from_released_weights

    said = tokenizer.encode(call("72")) + [tokenizer.eos_token_id]
    log = fake_vllm.install(monkeypatch, response=said + [5, 6])
    e = engine(monkeypatch)
    e.load_weights([])
    records = [record(tokenizer, 0), record(tokenizer, 1)]
    batch = e.generate(records, SamplingParams(n=1, max_new_tokens=300), [11, 12], tokenizer,
                       MultiTurn(tools, max_assistant_turns=2))
    generations = [call for call in log if call[0] == "generate"]
    assert len(generations) == 2 and generations_from_released_weights(log) == 0
    assert [name for name in log.names() if name in ("wake_up", "sleep", "generate")] == [
        "sleep", "wake_up", "wake_up", "generate", "generate", "sleep"]  # built; load; KV cache; both turns; asleep
    assert [[p.seed for p in params] for _, params in generations] == [
        [request_seed(11, 0), request_seed(12, 0)], [request_seed(11, 1), request_seed(12, 1)]]
    assert [p.max_tokens for p in generations[1][1]] == [300 - int(batch.response_attention[0].sum()) + len(said)] * 2
    assert batch.num_turns.tolist() == [4, 4]
    assert bool((batch.rollout_log_probs == torch.where(batch.response_mask, -1.0, 0.0)).all())


@pytest.mark.vllm
def test_vllm_samples_each_turn_from_the_policy_the_trainer_scores_on_the_whole_conversation(vllm_model_dir, tmp_path):
    """The engine's log-probs of the policy's tokens, turn after turn with the tools' replies between, are
    the trainer's log-probs of the same conversation (one forward reading the replies as context)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tools = tmp_path / "tools.yaml"
    tools.write_text(GSM8K_TOOL_CONFIG)
    worker = Path(__file__).with_name("vllm_multi_turn_worker.py")
    root = Path(__file__).parents[2]
    done = subprocess.run([sys.executable, str(worker), str(vllm_model_dir), str(tools), str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=600, cwd=root,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-6000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["turns"] == [6] * 8 and result["replies"] > 0  # 3 turns of the policy, 2 replies, the prompt
    assert result["gap"] < 1e-4


def test_an_interaction_answers_as_the_user_until_it_ends_the_conversation(tokenizer, interactions):
    policy = ScriptedPolicy(tokenizer, ["#### 71", "#### 72", "never said"])
    batch = multi_turn_rollout([record(tokenizer)], 1, tokenizer, policy, MultiTurn(interactions=interactions),
                               response_length=300)
    wrong = "Your response is incorrect! You need to reflect on your answer and try again."
    texts = [tokenizer.decode(answer_tokens_of(batch, k)) for k in range(2)]
    assert texts == [f"<|im_start|>user\n{wrong}<|im_end|>\n<|im_start|>assistant\n",
                     "<|im_start|>user\nYour response is correct!<|im_end|>\n<|im_start|>assistant\n"]
    assert batch.num_turns.tolist() == [5] and len(policy.seen) == 2  # the right answer ended it
    assert not batch.response_mask[0][batch.response_attention[0]].tolist()[-1]  # its last words are the user's


def answer_tokens_of(batch, k: int) -> list[int]:
    """The k-th run of answer tokens (not the policy's) in row 0."""
    runs, inside = [], False
    for token, mine, real in zip(batch.response_ids[0].tolist(), batch.response_mask[0].tolist(),
                                 batch.response_attention[0].tolist()):
        if real and not mine:
            if not inside:
                runs.append([])
            runs[-1].append(token)
        inside = real and not mine
    return runs[k]


def test_tools_answer_a_call_and_the_interaction_a_turn_without_one(tokenizer, tools, interactions):
    policy = ScriptedPolicy(tokenizer, [call("71"), "#### 71", "#### 72"])
    batch = multi_turn_rollout([record(tokenizer)], 1, tokenizer, policy, MultiTurn(tools, interactions=interactions,
                                                                                   max_user_turns=2),
                               response_length=400)
    assert "reward=0.0" in tokenizer.decode(answer_tokens_of(batch, 0))  # the tool's reply to the call
    assert "incorrect" in tokenizer.decode(answer_tokens_of(batch, 1))  # the user's to "#### 71"
    # max_user_turns=2: the turn after the second answer is the last, and nothing answers it
    assert len(policy.seen) == 3 and batch.num_turns.tolist() == [6]
    assert batch.response_mask[0][batch.response_attention[0]].tolist()[-1]


def test_reward_functions_get_what_verls_reward_managers_add_about_the_conversation(tokenizer, tools, interactions):
    """verl hands the reward function each conversation's num_turns, its tools' rewards and its users' turn
    scores in extra_info (tool_extra_fields); ReTool's reward reads num_turns."""
    policy = ScriptedPolicy(tokenizer, [call("71"), "#### 71", call("72"), "#### 72"])
    batch = multi_turn_rollout([record(tokenizer)], 1, tokenizer, policy, MultiTurn(tools, interactions=interactions),
                               response_length=400)
    (info,) = batch.reward_extra_infos
    # the gsm8k tool: -0.05 for a wrong answer, 0 for a right one; the interaction: 0 wrong, 1 right (and over)
    assert info["tool_rewards"] == [-0.05, 0.0] and info["turn_scores"] == [0.0, 1.0]
    assert info["num_turns"] == 9  # the prompt, 4 turns of the policy, 2 replies, 2 users' turns
    assert info["tools_kwargs"] == record(tokenizer).extra_info["tools_kwargs"]  # the row's own extra_info too
    assert "num_turns" not in batch.extra_infos[0]  # the record's dict is left as it was
    single = multi_turn_rollout([record(tokenizer)], 1, tokenizer, ScriptedPolicy(tokenizer, ["#### 72"]),
                                MultiTurn(tools), response_length=400)
    assert single.reward_extra_infos[0]["tool_rewards"] == [] and single.reward_extra_infos[0]["num_turns"] == 2


def test_interaction_configs_name_their_interactions_as_verl_does(tmp_path, interactions):
    assert list(interactions) == ["gsm8k"]
    path = tmp_path / "unnamed.yaml"
    path.write_text("interaction: [{class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction}]")
    assert list(load_interactions(path)) == ["gsm8k"]  # the class's name without "Interaction"
    path.write_text("interaction: [{class_name: nowhere.Interaction}]")
    with pytest.raises(UserError, match="cannot be imported"):
        load_interactions(path)
    check_interaction_rows(interactions, [{"interaction_kwargs": {"name": "gsm8k"}}], ["a.parquet row 0"])
    with pytest.raises(UserError, match="a.parquet row 1: names interaction 'chat'"):
        check_interaction_rows(interactions, [{"interaction_kwargs": {"name": "gsm8k"}},
                                              {"interaction_kwargs": {"name": "chat"}}], ["a.parquet row 0", "a.parquet row 1"])
    with pytest.raises(UserError, match="has no extra_info.interaction_kwargs.name"):
        check_interaction_rows(interactions, [{}], ["a.parquet row 0"])


def test_a_template_that_cannot_render_a_reply_alone_says_so(tokenizer):
    strict = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    strict.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('conversations start with the "
                            "user') }}{% endif %}" + strict.chat_template)
    with pytest.raises(UserError, match="cannot render the tool message that answers a turn on its own"):
        reply_tokens(strict, ["42"], 0)


def test_verls_agent_name_column_picks_each_rows_loop(tokenizer, tools, interactions, tmp_path):
    """A single_turn_agent row gets no answer, whatever it says; a tool_agent row needs multi_turn.enable (verl
    runs it as a conversation either way); other loops are refused when the file is read."""
    import dataclasses

    import pyarrow as pa
    import pyarrow.parquet as pq

    from klppo.data.rl_dataset import load_rl_dataset
    from klppo.rollout.multi_turn import check_conversation_rows

    talk, alone = record(tokenizer, 0), dataclasses.replace(record(tokenizer, 1), agent_name="single_turn_agent",
                                                           extra_info={})
    policy = ScriptedPolicy(tokenizer, [call("71"), "#### 72"])
    batch = multi_turn_rollout([talk, alone], 1, tokenizer, policy, MultiTurn(tools, interactions=interactions),
                               response_length=300)
    # the conversation: a call, the tool's reply, "#### 72", the user's "correct" (2 + 2 + the prompt)
    assert batch.num_turns.tolist() == [5, 2] and [len(rows) for rows, _ in policy.seen] == [2, 1]
    check_conversation_rows(MultiTurn(tools, interactions=interactions), [talk, alone])  # alone needs no interaction
    with pytest.raises(UserError, match="x.parquet row 0: agent_name is 'tool_agent' .*multi_turn.enable is false"):
        check_conversation_rows(None, [dataclasses.replace(talk, agent_name="tool_agent", where="x.parquet row 0")])

    row = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "hi"}], "agent_name": "react_agent"}
    pq.write_table(pa.Table.from_pylist([row]), tmp_path / "agents.parquet")
    with pytest.raises(UserError, match="agent_name.*names agent loop 'react_agent'.*tool_agent and single_turn_agent"):
        load_rl_dataset(tmp_path / "agents.parquet", tokenizer, max_prompt_length=64, log=lambda *a: None)
