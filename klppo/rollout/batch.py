"""``RolloutBatch``: the typed record that flows through one PPO iteration.

Legend: B responses in the batch (prompts x rollout.n), P prompt length (left-padded),
T response length (right-padded). Masks are bool, True = real token. A response includes its
closing EOS when it has one.

``response_mask`` marks the tokens the policy sampled: the ones every loss, KL, advantage and
entropy counts (verl's ``response_mask``). A multi-turn rollout (``rollout.multi_turn``) puts a
tool's reply between two of the policy's turns: those tokens are read as context by every forward
but never trained on, so such a batch also has ``response_attention_mask`` (every token of the
response, verl's ``attention_mask`` over it); ``response_attention`` is that mask, or
``response_mask`` where the two are one.

The rollout fills the first block of fields; the scoring phases fill the ``Optional`` ones in
the order of the loop (old log-probs, reference log-probs, values, scores, rewards,
advantages and returns).

Where a batch lives (one rule): the rollouts build it on CPU; whoever hands it to a phase
moves it once to the run's device, ``batch.to(env.device)`` (the loop after the rollout,
validation before scoring). Every phase (scoring forwards, reward functions and models,
updates, validation's scorer) takes its batch there and returns tensors there. The device
is the rank's (``DistEnv.device``), never read off a model's parameters: FSDP2's
``offload_policy`` keeps those on CPU while the model computes on the GPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from klppo.data.rl_dataset import PromptRecord, collate_prompts


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor  # (B, P) long, left-padded
    prompt_mask: torch.Tensor  # (B, P) bool
    response_ids: torch.Tensor  # (B, T) long, right-padded
    response_mask: torch.Tensor  # (B, T) bool
    group_index: torch.Tensor  # (B,) long: the prompt each response answers (GRPO/RLOO groups)
    data_sources: list[str]  # (B,) the rows' data_source: validation's metrics are grouped by it
    ground_truths: list[Any]  # (B,)
    extra_infos: list[dict]  # (B,)
    recorded_scores: Optional[torch.Tensor] = None  # (B,) float: scores recorded in offline data
    # (B,) what picks each row's reward function where data.reward_fn_key names another column; None = data_sources.
    reward_sources: Optional[list[str]] = None
    # Multi-turn rollouts: (B, T) bool, every response token a forward reads (the policy's turns and the
    # tools' replies between them); None = response_mask (a single turn).
    response_attention_mask: Optional[torch.Tensor] = None
    num_turns: Optional[torch.Tensor] = None  # (B,) long, multi-turn rollouts: turns of the conversation (verl's)
    # (B,) multi-turn rollouts: {"turn_scores": [...], "tool_rewards": [...]}, each conversation's users' turn
    # scores and tools' rewards (verl's tool_extra_fields, which its reward managers add to extra_info).
    tool_extra_fields: Optional[list[dict]] = None
    # Offline data's behaviour log-probs (the ``rollout_log_probs`` column; verl's name for the
    # rollout's log-probs): (B, T) float, 0 on padding and on rows without them; None when no row has them.
    rollout_log_probs: Optional[torch.Tensor] = None
    has_rollout_log_probs: Optional[torch.Tensor] = None  # (B,) bool: the rows whose response has them

    old_log_prob: Optional[torch.Tensor] = None  # (B, T) actor log-probs before the update
    # (B, T) sum_v pi_old(v)^2 of each response token's distribution, where measured
    # (``config.batch_sizes.measures_sum_pi_squared``): the optimal token baseline reads it.
    sum_pi_squared: Optional[torch.Tensor] = None
    ref_log_prob: Optional[torch.Tensor] = None  # (B, T) reference log-probs
    values: Optional[torch.Tensor] = None  # (B, T) critic values before the update
    token_level_scores: Optional[torch.Tensor] = None  # (B, T) score at the last response token
    # (B,) what a reward function returned beside each score (verl's reward_extra_info: numbers
    # only, ``rewards.score.reward_components``); None when no reward function scored the batch.
    reward_components: Optional[list[dict[str, float]]] = None
    token_level_rewards: Optional[torch.Tensor] = None  # (B, T) scores - beta * KL
    advantages: Optional[torch.Tensor] = None  # (B, T)
    returns: Optional[torch.Tensor] = None  # (B, T)
    # Set by the actor update when rollout correction is on (``klppo.trainer.rollout_correction``):
    rollout_is_weights: Optional[torch.Tensor] = None  # (B, T) detached importance weights, 0 on padding
    loss_mask: Optional[torch.Tensor] = None  # (B, T) bool: response tokens rejection keeps; None = response_mask
    # (B,) long: each row's place in the batch the step trains on (set with its advantages), which
    # orders what the ranks gather whatever rows each holds (``trainer.cov_selection``).
    row_id: Optional[torch.Tensor] = None
    # Set per mini-batch by Clip-Cov / KL-Cov (``trainer.cov_selection``): (B, T) bool, the tokens
    # whose gradient is cut, or whose loss gets the KL term.
    cov_tokens: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def response_length(self) -> int:
        return self.response_ids.shape[1]

    @property
    def update_mask(self) -> torch.Tensor:
        """(B, T) bool: the tokens the losses count, ``loss_mask`` when rejection set one."""
        return self.response_mask if self.loss_mask is None else self.loss_mask

    @property
    def scored_as(self) -> list[str]:
        """(B,) the data source each response's reward function is called with."""
        return self.data_sources if self.reward_sources is None else self.reward_sources

    @property
    def reward_extra_infos(self) -> list[dict]:
        """(B,) the ``extra_info`` each response's reward function gets: its row's, and for a conversation
        what verl's reward managers add (``num_turns``, ``turn_scores``, ``tool_rewards``)."""
        if self.num_turns is None:
            return self.extra_infos
        fields = self.tool_extra_fields or [{}] * len(self)
        return [{**(info or {}), **extra, "num_turns": turns}
                for info, extra, turns in zip(self.extra_infos, fields, self.num_turns.tolist())]

    @property
    def response_attention(self) -> torch.Tensor:
        """(B, T) bool: every response token the model reads (``response_mask`` but in multi-turn rollouts)."""
        return self.response_mask if self.response_attention_mask is None else self.response_attention_mask

    @property
    def input_ids(self) -> torch.Tensor:
        """(B, P + T) prompt then response."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """(B, P + T) bool: the tokens every forward reads."""
        return torch.cat([self.prompt_mask, self.response_attention], dim=1)

    def select(self, indices: torch.Tensor | list[int]) -> RolloutBatch:
        """The sub-batch of rows ``indices`` (tensors indexed, lists picked), in that order.

        The index is copied to each device once and without waiting for it: a blocking copy per
        field would stall the host until the device caught up, once per field and micro-batch.
        """
        idx = torch.as_tensor(indices, dtype=torch.long)
        rows = idx.tolist() if isinstance(indices, torch.Tensor) else list(indices)  # host sync for a device index
        on_device: dict[torch.device, torch.Tensor] = {}
        picked = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                if value.device not in on_device:
                    on_device[value.device] = idx.to(value.device, non_blocking=True)
                picked[field.name] = value[on_device[value.device]]
            elif isinstance(value, list):
                picked[field.name] = [value[i] for i in rows]
            else:
                picked[field.name] = value
        return RolloutBatch(**picked)

    def to(self, device: torch.device) -> RolloutBatch:
        moved = {
            f.name: (v.to(device) if isinstance(v := getattr(self, f.name), torch.Tensor) else v)
            for f in dataclasses.fields(self)
        }
        return RolloutBatch(**moved)


def right_pad(sequences: list[list[int]], pad_id: int, min_length: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists to a (B, T) long tensor and its (B, T) bool mask."""
    length = max(min_length, max((len(s) for s in sequences), default=0))
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = True
    return ids, mask


def mask_after_eos(response_ids: torch.Tensor, eos_token_id: int | Sequence[int]) -> torch.Tensor:
    """(B, T) bool mask that keeps every token up to and including the first EOS (any of the
    ids ``eos_token_ids`` gives, where a model ends its turn with more than one)."""
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    is_eos = torch.isin(response_ids, torch.tensor(ids, dtype=response_ids.dtype, device=response_ids.device))
    # Count EOS seen strictly before each position; a token is real while none has been seen.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return eos_before == 0


def eos_token_ids(tokenizer, generation_config=None) -> tuple[int, ...]:
    """Every token that ends a response: the tokenizer's EOS, then any other the model's generation
    config lists (``eos_token_id`` may be a list: Qwen2.5-Instruct's generation_config.json has
    ``[151645, 151643]``, ``<|im_end|>`` and ``<|endoftext|>``, its tokenizer only the first).
    Hugging Face ``generate`` stops at each id of its config's list; the trainer and vLLM must
    stop at the same set."""
    listed = getattr(generation_config, "eos_token_id", None)
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    ids = [tokenizer.eos_token_id] + [int(i) for i in listed]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def assemble_batch(
    records: list[PromptRecord],
    n: int,
    pad_token_id: int,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    recorded_scores: Optional[torch.Tensor] = None,
    rollout_log_probs: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    turns: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    tool_extra_fields: Optional[list[dict]] = None,
) -> RolloutBatch:
    """Pair ``n`` responses per record (grouped by prompt) with the record's repeated prompt.

    ``rollout_log_probs``: the behaviour log-probs (B, T) and which rows have them (B,), or None.
    ``turns``: a multi-turn rollout's ``response_attention_mask`` (B, T) and ``num_turns`` (B,), or None;
    ``tool_extra_fields``: its (B,) turn scores and tools' rewards.
    """
    prompt_ids, prompt_mask = collate_prompts(records, pad_token_id)

    def repeat(values: list) -> list:
        return [value for value in values for _ in range(n)]

    return RolloutBatch(
        prompt_ids=prompt_ids.repeat_interleave(n, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(n, dim=0),
        response_ids=response_ids,
        response_mask=response_mask,
        group_index=torch.arange(len(records)).repeat_interleave(n),
        data_sources=repeat([r.data_source for r in records]),
        reward_sources=repeat([r.scored_as for r in records]) if any(r.reward_source for r in records) else None,
        ground_truths=repeat([r.ground_truth for r in records]),
        extra_infos=repeat([r.extra_info for r in records]),
        recorded_scores=recorded_scores,
        response_attention_mask=None if turns is None else turns[0],
        num_turns=None if turns is None else turns[1],
        tool_extra_fields=tool_extra_fields,
        rollout_log_probs=None if rollout_log_probs is None else rollout_log_probs[0],
        has_rollout_log_probs=None if rollout_log_probs is None else rollout_log_probs[1],
    )


# Fields padded on the left (prompts are left-padded); every other (B, W) field is padded on the right.
LEFT_PADDED = ("prompt_ids", "prompt_mask")


def concat_batches(batches: list[RolloutBatch], pad_token_id: int) -> RolloutBatch:
    """The rows of ``batches``, one batch after another, as one batch (dynamic sampling's kept groups).

    Prompts and responses are padded to the widest batch's P and T (token ids with
    ``pad_token_id``, masks with False, numbers with 0); each batch's ``group_index`` is moved past
    the groups before it, so groups stay apart even when a prompt was drawn twice. A batch without
    behaviour log-probs gets rows without them (0, ``has_rollout_log_probs`` False) where another has them.
    """
    assert batches, "nothing to concatenate"
    batches = _with_rollout_log_probs_everywhere(batches)
    joined: dict[str, Any] = {}
    for field in dataclasses.fields(RolloutBatch):
        parts = [getattr(b, field.name) for b in batches]
        if all(part is None for part in parts):
            joined[field.name] = None
        elif isinstance(parts[0], list):
            joined[field.name] = [value for part in parts for value in part]
        elif field.name == "group_index":
            joined[field.name] = torch.cat(_renumbered_groups(parts))
        else:
            assert all(part is not None for part in parts), f"{field.name} is set in some batches only"
            joined[field.name] = torch.cat(_padded_to_widest(parts, field.name, pad_token_id))
    return RolloutBatch(**joined)


def _with_rollout_log_probs_everywhere(batches: list[RolloutBatch]) -> list[RolloutBatch]:
    """``batches``, those without behaviour log-probs given rows that say they have none, where another has them
    (offline data where only some prompts recorded them: one generation batch may hold none)."""
    if all(b.rollout_log_probs is None for b in batches) or all(b.rollout_log_probs is not None for b in batches):
        return batches
    filled = []
    for b in batches:
        if b.rollout_log_probs is None:
            device = b.response_mask.device
            b = dataclasses.replace(b, rollout_log_probs=torch.zeros(b.response_mask.shape, device=device),
                                    has_rollout_log_probs=torch.zeros(len(b), dtype=torch.bool, device=device))
        filled.append(b)
    return filled


def _renumbered_groups(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each batch's (B,) group ids made dense and moved past the previous batches' groups."""
    out, offset = [], 0
    for index in parts:
        uniques, dense = torch.unique(index, return_inverse=True)
        out.append(dense + offset)
        offset += uniques.numel()
    return out


def _padded_to_widest(parts: list[torch.Tensor], name: str, pad_token_id: int) -> list[torch.Tensor]:
    """(B_i,) parts as they are; (B_i, W_i) parts padded to the widest W (left for prompts)."""
    if parts[0].dim() == 1:
        return parts
    width = max(part.shape[1] for part in parts)
    value = pad_token_id if name.endswith("_ids") else (False if parts[0].dtype == torch.bool else 0)
    padded = []
    for part in parts:
        extra = part.new_full((part.shape[0], width - part.shape[1]), value)
        padded.append(torch.cat([extra, part] if name in LEFT_PADDED else [part, extra], dim=1))
    return padded
