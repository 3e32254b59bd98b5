"""Multi-turn rollouts with tools and simulated users (``rollout.multi_turn``; verl's tool agent loop).

Each response is a conversation: the policy speaks a turn (up to and including its EOS); where the
turn calls tools (``tools.TOOL_CALL_PARSERS``), their replies are rendered as the chat template
renders ``tool`` messages (gpt-oss: as verl writes them, ``tools.gpt_oss_replies``) and appended,
and the policy speaks again. Where it calls none and the row has an interaction
(``multi_turn.interaction_config_path``, the row's ``extra_info.interaction_kwargs.name``), the
interaction answers as the user, and the policy speaks again unless the interaction ends the
conversation. A response ends when a turn gets no answer, at
``max_assistant_turns`` turns of the policy or ``max_user_turns`` answers (replies and users' turns),
or when the next answer would not fit in ``response_length``; the policy's last turn is cut there.

The policy trains on its own turns only: the batch's ``response_mask`` marks them and
``response_attention_mask`` marks every token (the answers too), which every forward reads as
context. GAE and REINFORCE++ skip the answers (``algo.advantages``), and the score sits at the
policy's last token.

How a turn is generated is a ``TurnGenerator``: ``hf.hf_rollout`` gives Hugging Face generate's,
``vllm.VLLMEngine.generate`` the engine's (with the log-probs it sampled each token with, which the
batch keeps as ``rollout_log_probs``: 0 on the replies, which nothing sampled).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from klppo.data.chat_template import encode_chats
from klppo.data.rl_dataset import PromptRecord
from klppo.errors import UserError
from klppo.rollout.batch import RolloutBatch, assemble_batch, right_pad
from klppo.rollout.tools import (
    HARMONY_TOKENS, NO_TOOLS, TOOL_CALL_PARSERS, Tools, check_interaction_rows, finish_interactions, gpt_oss_replies,
    interaction_turns, run_tool_calls, start_interactions,
)


class Turn(NamedTuple):
    """What the policy said in one turn: its tokens (ending at its first EOS or at its budget) and, where
    the sampler reports them, the log-prob it drew each with."""

    tokens: list[int]
    log_probs: Optional[list[float]] = None


# (rows, contexts, budgets) -> each conversation's next turn. ``rows``: which conversations of the call
# (their places in the batch); ``budgets``: tokens each may still add. Every conversation still going
# takes its turn in each call, so the k-th call is every row's k-th turn. No rows: a stand-in turn that
# no conversation takes (a rank keeping step with others that decode together), which must leave the
# random streams as they were.
TurnGenerator = Callable[[list[int], list[list[int]], list[int]], list[Turn]]


@dataclass(frozen=True)
class MultiTurn:
    """``rollout.multi_turn`` (verl's keys), with the run's tools and interactions built."""

    tools: Tools = NO_TOOLS
    max_assistant_turns: Optional[int] = None  # None: until the budget ends or a turn gets no answer
    max_user_turns: Optional[int] = None  # answers: tools' replies and users' turns
    max_parallel_calls: int = 1  # calls of one turn that run; the rest are dropped, as verl drops them
    max_tool_response_length: int = 256  # characters of one reply
    tool_response_truncate_side: str = "middle"
    template_kwargs: dict = field(default_factory=dict)  # data.apply_chat_template_kwargs
    interactions: dict = field(default_factory=dict)  # name -> interaction (verl's BaseInteraction's methods)
    format: str = "hermes"  # how calls are written: hermes (qwen: the same) or gpt-oss (tools.TOOL_CALL_PARSERS)


@dataclass
class _Conversation:
    prompt: list[int]
    tools_kwargs: dict
    messages: list[dict]  # the chat so far, for an interaction to read
    interaction: Optional[tuple] = None  # (interaction, instance id, its kwargs)
    tokens: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)  # per token: the policy's (True) or an answer's
    log_probs: Optional[list[float]] = field(default_factory=list)  # per token, the sampler's; None: not reported
    assistant_turns: int = 0
    user_turns: int = 0
    tool_rewards: list[float] = field(default_factory=list)  # each call's reward, where its tool gave one
    turn_scores: list[float] = field(default_factory=list)  # each user's turn's score, where its interaction gave one
    done: bool = False
    single_turn: bool = False  # verl's single_turn_agent: nothing answers its turn

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens

    @property
    def num_turns(self) -> int:
        return self.assistant_turns + self.user_turns + 1  # verl counts the prompt as a turn

    @property
    def extra_fields(self) -> dict:
        """What verl's agent loop hands its reward managers about the conversation (``tool_extra_fields``)."""
        return {"turn_scores": list(self.turn_scores), "tool_rewards": list(self.tool_rewards)}


def check_conversation_rows(settings: Optional[MultiTurn], records: list[PromptRecord]) -> None:
    """The rows' agent loops (verl's ``agent_name`` column) and interactions are ones this run has, checked
    when the data is read: verl runs a ``tool_agent`` row as a conversation whatever ``multi_turn.enable``
    says, so such rows without it would train on other responses than verl's; every conversation of a
    run with interactions names one of them."""
    if settings is None:
        tool_rows = [r for r in records if r.agent_name == "tool_agent"]
        if tool_rows:
            raise UserError(f"{tool_rows[0].where}: agent_name is 'tool_agent' (verl's tool agent loop, a conversation) "
                            f"but actor_rollout_ref.rollout.multi_turn.enable is false; set it to true (with "
                            "multi_turn.tool_config_path), or drop the agent_name column for one-turn responses")
        return
    if settings.interactions:
        talking = [r for r in records if r.agent_name != "single_turn_agent"]
        check_interaction_rows(settings.interactions, [r.extra_info for r in talking], [r.where for r in talking])


def check_tool_format(settings: Optional[MultiTurn], tokenizer, eos_ids: Sequence[int]) -> None:
    """A gpt-oss run's tokenizer has harmony's special tokens, and a call (``<|call|>``) ends a turn."""
    if settings is None or settings.format != "gpt-oss" or not settings.tools:
        return
    vocab = tokenizer.get_vocab()
    missing = [t for t in HARMONY_TOKENS if t not in vocab]
    key = "actor_rollout_ref.rollout.multi_turn.format"
    if missing:
        raise UserError(f"{key} = gpt-oss reads OpenAI's harmony format, but the model's tokenizer has no "
                        f"{', '.join(missing)}: it is not a gpt-oss tokenizer; set {key} to the model's own format "
                        "(hermes for Qwen)")
    if vocab["<|call|>"] not in eos_ids:
        raise UserError(f"{key} = gpt-oss: a tool call ends at <|call|>, but it is not among the ids that end a turn "
                        f"(the tokenizer's EOS and generation_config.eos_token_id: {list(eos_ids)}); add "
                        f"{vocab['<|call|>']} to the model folder's generation_config.json eos_token_id, as "
                        "gpt-oss's own lists it")


def system_prefix_length(tokenizer, template_kwargs: dict) -> int:
    """Tokens the chat template puts before any message on its own (a default system prompt), which
    a reply rendered alone must not repeat (verl's ``initialize_system_prompt``)."""
    one, two = encode_chats(tokenizer, [[{"role": "user", "content": ""}], [{"role": "user", "content": ""}] * 2],
                            add_generation_prompt=False, template_kwargs=template_kwargs)
    return len(one) - (len(two) - len(one))


def answer_tokens(tokenizer, messages: Sequence[dict], prefix_length: int, template_kwargs: dict) -> list[int]:
    """Messages answering the policy (tools' replies, a user's turn) as the chat template renders them,
    up to the next assistant turn's opening (the generation prompt), without the template's system prefix."""
    try:
        (ids,) = encode_chats(tokenizer, [list(messages)], add_generation_prompt=True, template_kwargs=template_kwargs)
    except UserError as error:
        raise UserError(f"rollout.multi_turn: the chat template cannot render the {messages[0]['role']} message that "
                        f"answers a turn on its own, as verl renders it too ({error}); use a model whose template "
                        "renders tool and user messages without the conversation before them") from None
    return ids[prefix_length:]


def multi_turn_rollout(records: list[PromptRecord], n: int, tokenizer, generate_turn: TurnGenerator,
                       settings: MultiTurn, response_length: int,
                       keep_going: Callable[[bool], bool] = lambda active: active,
                       share: Callable[[Callable], object] = lambda compute: compute()) -> RolloutBatch:
    """``n`` conversations per record (rows grouped by prompt, as ``hf_rollout``), on CPU.

    ``keep_going(any row of mine active)``: whether to generate another turn; ranks that decode a
    sharded model together (``synced_gpus``) must all call ``generate_turn`` as often, so theirs
    says whether any rank has a row left, and a rank without one decodes a stand-in row.
    ``share(compute)``: the answers of a turn (tools' replies, users' turns), computed once for ranks
    that hold the same conversations and must feed their engine the same tokens (a tensor-parallel
    vLLM engine's: ``distributed.env.computed_by_first_rank``); here, by default. Interactions are
    started and finished there too, so a group's conversation is one instance of its interaction.
    """
    rows = [_Conversation(list(r.prompt_ids), (r.extra_info or {}).get("tools_kwargs") or {}, _messages(r),
                          single_turn=r.agent_name == "single_turn_agent") for r in records for _ in range(n)]
    answered = bool(settings.tools or settings.interactions)
    prefix = system_prefix_length(tokenizer, settings.template_kwargs) if answered else 0
    talking = [row for row in rows if not row.single_turn]
    if settings.interactions and talking:
        kwargs = [(r.extra_info or {}).get("interaction_kwargs") for r in records for _ in range(n)]
        talking_kwargs = [k for k, row in zip(kwargs, rows) if not row.single_turn]
        # Started where the answers are computed (once per group); every member keeps the instance ids.
        ids = share(lambda: [instance for _, instance, _ in start_interactions(settings.interactions, talking_kwargs)])
        for row, instance, k in zip(talking, ids, talking_kwargs):
            row.interaction = (settings.interactions[k["name"]], instance, k)
    while keep_going(any(not row.done for row in rows)):
        active = [i for i, row in enumerate(rows) if not row.done]
        if not active:  # another rank still decodes: one stand-in token, thrown away
            generate_turn([], [rows[0].prompt], [1])
            continue
        turns = generate_turn(active, [rows[i].context for i in active],
                              [response_length - len(rows[i].tokens) for i in active])
        calling, users = [], []
        for row, turn in zip([rows[i] for i in active], turns):
            _append(row, turn.tokens, True, turn.log_probs)
            row.assistant_turns += 1
            if settings.interactions:
                row.messages.append({"role": "assistant",
                                     "content": tokenizer.decode(turn.tokens, skip_special_tokens=True)})
            ends = _ends_here(row, settings, response_length)
            calls = [] if ends else _calls(turn.tokens, tokenizer, settings)
            if calls:
                calling.append((row, calls))
            elif row.interaction is not None and not ends:
                users.append(row)
            else:
                row.done = True
        if calling:
            _append_replies(calling, tokenizer, settings, prefix, response_length, share)
        if users:
            _append_user_turns(users, tokenizer, settings, prefix, response_length, share)
    if settings.interactions:
        share(lambda: finish_interactions([row.interaction for row in talking]))
    return _as_batch(records, n, rows, tokenizer.pad_token_id)


def _messages(record: PromptRecord) -> list[dict]:
    prompt = record.raw_prompt
    return [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


def _ends_here(row: _Conversation, settings: MultiTurn, response_length: int) -> bool:
    """Whether the conversation ends with the turn the policy just took, whatever it said (verl's checks)."""
    return (row.single_turn or len(row.tokens) >= response_length
            or bool(settings.max_assistant_turns) and row.assistant_turns >= settings.max_assistant_turns
            or bool(settings.max_user_turns) and row.user_turns >= settings.max_user_turns)


def _calls(turn: list[int], tokenizer, settings: MultiTurn) -> list:
    """The tool calls of a turn that run (none without tools)."""
    if not settings.tools:
        return []
    return TOOL_CALL_PARSERS[settings.format](tokenizer.decode(turn))[: settings.max_parallel_calls]


def _append_replies(calling: list, tokenizer, settings: MultiTurn, prefix: int, response_length: int,
                    share: Callable) -> None:
    """Run every calling row's tools at once and append each row's replies, or end the row where they
    would not fit."""
    replies = share(lambda: run_tool_calls(settings.tools, [(calls, row.tools_kwargs) for row, calls in calling],
                                           settings.max_tool_response_length, settings.tool_response_truncate_side))
    for (row, calls), answered in zip(calling, replies):
        messages = [{"role": "tool", "content": text} for text, _ in answered]
        row.messages += messages
        row.tool_rewards += [reward for _, reward in answered if reward is not None]
        if settings.format == "gpt-oss":
            text = gpt_oss_replies([m["content"] for m in messages], [call.name for call in calls])
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = answer_tokens(tokenizer, messages, prefix, settings.template_kwargs)
        _answer(row, ids, response_length)


def _append_user_turns(users: list[_Conversation], tokenizer, settings: MultiTurn, prefix: int,
                       response_length: int, share: Callable) -> None:
    """Each row's interaction answers as the user (all rows at once); a row ends where the answer would not
    fit or the interaction says the conversation is over (its answer appended first, as verl appends it)."""
    answers = share(lambda: interaction_turns([(row.interaction, row.messages) for row in users]))
    for row, (over, text, score) in zip(users, answers):
        row.turn_scores += [] if score is None else [score]
        message = {"role": "user", "content": text}
        row.messages.append(message)
        _answer(row, answer_tokens(tokenizer, [message], prefix, settings.template_kwargs), response_length)
        row.done = row.done or over


def _answer(row: _Conversation, ids: list[int], response_length: int) -> None:
    """Append an answer to the policy's turn (not the policy's: never trained on), or end the row where
    the answer would leave no room for another turn."""
    if len(row.tokens) + len(ids) >= response_length:
        row.done = True
        return
    _append(row, ids, False, [0.0] * len(ids))
    row.user_turns += 1


def _append(row: _Conversation, tokens: list[int], by_policy: bool, log_probs: Optional[list[float]]) -> None:
    row.tokens += tokens
    row.policy += [by_policy] * len(tokens)
    row.log_probs = None if row.log_probs is None or log_probs is None else row.log_probs + list(log_probs)


def _as_batch(records: list[PromptRecord], n: int, rows: list[_Conversation], pad_token_id: int) -> RolloutBatch:
    response_ids, attention = right_pad([row.tokens for row in rows], pad_token_id)
    policy = torch.zeros_like(attention)
    for i, row in enumerate(rows):
        policy[i, : len(row.policy)] = torch.tensor(row.policy, dtype=torch.bool)
    turns = torch.tensor([row.num_turns for row in rows], dtype=torch.long)
    log_probs = None
    if all(row.log_probs is not None for row in rows) and any(row.log_probs for row in rows):
        values = torch.zeros(response_ids.shape, dtype=torch.float32)
        for i, row in enumerate(rows):
            values[i, : len(row.log_probs)] = torch.tensor(row.log_probs, dtype=torch.float32)
        log_probs = (values * policy, torch.ones(len(rows), dtype=torch.bool))
    return assemble_batch(records, n, pad_token_id, response_ids, policy, rollout_log_probs=log_probs,
                          turns=(attention, turns), tool_extra_fields=[row.extra_fields for row in rows])
