"""``RolloutBatch``: the typed record that flows through one PPO iteration.

Legend: B responses in the batch (prompts x rollout.n), P prompt length (left-padded),
T response length (right-padded). Masks are bool, True = real token. A response includes its
closing EOS when it has one.

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
from typing import Any, Optional

import torch

from klppo.data.rl_dataset import PromptRecord, collate_prompts


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor  # (B, P) long, left-padded
    prompt_mask: torch.Tensor  # (B, P) bool
    response_ids: torch.Tensor  # (B, T) long, right-padded
    response_mask: torch.Tensor  # (B, T) bool
    group_index: torch.Tensor  # (B,) long: the prompt each response answers (GRPO/RLOO groups)
    data_sources: list[str]  # (B,) picks the reward function
    ground_truths: list[Any]  # (B,)
    extra_infos: list[dict]  # (B,)
    recorded_scores: Optional[torch.Tensor] = None  # (B,) float: scores recorded in offline data
    # Offline data's behaviour log-probs (the ``rollout_log_probs`` column; verl's name for the
    # rollout's log-probs): (B, T) float, 0 on padding and on rows without them; None when no row has them.
    rollout_log_probs: Optional[torch.Tensor] = None
    has_rollout_log_probs: Optional[torch.Tensor] = None  # (B,) bool: the rows whose response has them

    old_log_prob: Optional[torch.Tensor] = None  # (B, T) actor log-probs before the update
    ref_log_prob: Optional[torch.Tensor] = None  # (B, T) reference log-probs
    values: Optional[torch.Tensor] = None  # (B, T) critic values before the update
    token_level_scores: Optional[torch.Tensor] = None  # (B, T) score at the last response token
    token_level_rewards: Optional[torch.Tensor] = None  # (B, T) scores - beta * KL
    advantages: Optional[torch.Tensor] = None  # (B, T)
    returns: Optional[torch.Tensor] = None  # (B, T)
    # Set by the actor update when rollout correction is on (``klppo.trainer.rollout_correction``):
    rollout_is_weights: Optional[torch.Tensor] = None  # (B, T) detached importance weights, 0 on padding
    loss_mask: Optional[torch.Tensor] = None  # (B, T) bool: response tokens rejection keeps; None = response_mask

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
    def input_ids(self) -> torch.Tensor:
        """(B, P + T) prompt then response."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """(B, P + T) bool."""
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    def select(self, indices: torch.Tensor | list[int]) -> RolloutBatch:
        """The sub-batch of rows ``indices`` (tensors indexed, lists picked), in that order.

        The index is copied to each device once and without waiting for it: a blocking copy per
        field would stall the host until the device caught up, once per field and micro-batch.
        """
        idx = torch.as_tensor(indices, dtype=torch.long)
        rows = idx.tolist()  # host-side indices (a list or CPU tensor: no device involved)
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


def mask_after_eos(response_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B, T) bool mask that keeps every token up to and including the first EOS."""
    is_eos = response_ids == eos_token_id
    # Count EOS seen strictly before each position; a token is real while none has been seen.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return eos_before == 0


def assemble_batch(
    records: list[PromptRecord],
    n: int,
    pad_token_id: int,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    recorded_scores: Optional[torch.Tensor] = None,
    rollout_log_probs: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> RolloutBatch:
    """Pair ``n`` responses per record (grouped by prompt) with the record's repeated prompt.

    ``rollout_log_probs``: the behaviour log-probs (B, T) and which rows have them (B,), or None.
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
        ground_truths=repeat([r.ground_truth for r in records]),
        extra_infos=repeat([r.extra_info for r in records]),
        recorded_scores=recorded_scores,
        rollout_log_probs=None if rollout_log_probs is None else rollout_log_probs[0],
        has_rollout_log_probs=None if rollout_log_probs is None else rollout_log_probs[1],
    )
