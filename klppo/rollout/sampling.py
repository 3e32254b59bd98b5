"""Drawing each sampled token on CPU from one uniform number per row, inside ``generate``.

``generate`` samples with ``torch.multinomial``, which for one sample draws an exponential
number for every vocabulary entry and takes the argmax of probability / exponential. On CPU
that random stream is the cost: 1.3 ms a decoding step for 16 rows of 4,096 entries (2
threads), more than the rest of a 5M-parameter model's step, against 0.05 ms for the inverse of
each row's cumulative distribution at one uniform number. klppo's CPU generation therefore
decodes greedily over ``InverseCdfSampling``'s output: the token it drew, alone. The
distribution is exactly the one ``generate`` samples from: the same warpers (temperature,
top-k, top-p) in ``generate``'s order, after every other processor (``min_new_tokens``); the
random numbers come from torch's global generator, which checkpoints save and restore. On CUDA
``torch.multinomial`` is one kernel, and ``generate`` samples as it does.
"""

from __future__ import annotations

import copy
import math

import torch
from transformers import (
    GenerationConfig, LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper,
)


class InverseCdfSampling(LogitsProcessor):
    """Draws each row's next token from softmax(``warpers``(scores)) at one uniform number, by the
    inverse of its cumulative distribution (summed in float64), and returns scores that are 0 at
    that token and -inf elsewhere, so that a greedy step takes it."""

    def __init__(self, warpers: list[LogitsProcessor]) -> None:
        self.warpers = warpers

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        return one_hot_scores(scores, draw_tokens(scores))


def draw_tokens(scores: torch.Tensor) -> torch.Tensor:
    """(B, 1) a token per row of (B, V) ``scores``, drawn from softmax(scores).

    u is uniform on [0, total): the first index whose cumulative probability exceeds u lies in an
    interval of width p > 0, so a token of probability 0 (-inf) is never drawn, u = 0 included."""
    cdf = scores.softmax(-1, dtype=torch.float64).cumsum(-1)
    u = torch.rand((cdf.shape[0], 1), dtype=torch.float64, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1)


def one_hot_scores(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Scores like ``scores`` that are 0 at each row's ``tokens`` and -inf elsewhere."""
    return torch.full_like(scores, -math.inf).scatter_(1, tokens, 0.0)


def sampling_warpers(config: GenerationConfig) -> list[LogitsProcessor]:
    """The warpers ``generate`` applies when ``config`` samples (beams aside), in its order."""
    warpers: list[LogitsProcessor] = []
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=config.top_k))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=config.top_p))
    return warpers


def with_sampling(config: GenerationConfig, device: torch.device) -> tuple[GenerationConfig, LogitsProcessorList]:
    """``config`` and the logits processors that sample as it says on ``device``: on CPU a greedy copy
    and ``InverseCdfSampling``; elsewhere, or for greedy decoding, ``config`` itself and none.

    Only the sampling knobs the neutral config sets are carried over (``neutral_generation_config``:
    temperature, top-k, top-p); anything else that changes how ``generate`` samples keeps its own
    sampling."""
    others = ("min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h")
    if (not config.do_sample or device.type != "cpu" or (config.num_beams or 1) > 1
            or any(getattr(config, name, None) not in (None, 1.0, 0.0) for name in others)):
        return config, LogitsProcessorList()
    sampler = InverseCdfSampling(sampling_warpers(config))
    greedy = copy.deepcopy(config)
    greedy.do_sample, greedy.temperature, greedy.top_k, greedy.top_p = False, None, None, None
    return greedy, LogitsProcessorList([sampler])
