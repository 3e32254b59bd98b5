"""The memory plan at the start of every PPO run (``trainer.plan_check``), before any model loads.

``error`` (the default) stops a run whose estimated peak exceeds the device's memory by more
than ERROR_MARGIN, with the plan's knobs in the message, instead of letting it die later in
the phase that peaks; nearer the limit (from WARN_AT) it warns. The margin is the estimate's
calibrated error on top (``benchmarks/plan_accuracy.py``: within 15% per phase), so a run it
stops is one that would not fit, and a run that might fit is let through with a warning.
"""

from __future__ import annotations

from typing import Callable

from klppo.config import PPOConfig
from klppo.errors import UserError
from klppo.plan.estimate import Estimate, Knob, device_bytes_from, estimate, knobs
from klppo.plan.batches import LengthSample, sample_lengths
from klppo.plan.inputs import Lengths, read_shapes
from klppo.plan.tables import format_start_block

ERROR_MARGIN = 1.2  # stop above 1.2x the device's memory: beyond the estimate's 15% error
WARN_AT = 0.9  # warn above 90%: the allocator's fragmentation and other processes need room


def plan_run(cfg: PPOConfig, *, world_size: int, device: str, device_bytes: int, lengths: Lengths,
             first_step: bool = False) -> tuple[Estimate, list[Knob]]:
    """The estimate of ``cfg`` on ``world_size`` ranks and the knobs, when it does not fit
    (``first_step``: the first step's phases, before the optimiser state exists)."""
    shapes = read_shapes(cfg)
    e = estimate(cfg, shapes, lengths, world_size=world_size, device=device, device_bytes=device_bytes,
                 first_step=first_step)
    over = e.peak.total > e.settings.device_bytes
    return e, knobs(cfg, shapes, lengths, e) if over else []


def verdict(e: Estimate) -> str:
    """error (over the margin) | warn (near or over the memory) | ok."""
    ratio = e.peak.total / e.settings.device_bytes
    return "error" if ratio > ERROR_MARGIN else "warn" if ratio > WARN_AT else "ok"


def tokenizer_of(path: str, chat_template: str | None = None):
    """The model folder's tokenizer (files only; ``chat_template`` replacing its own), or None
    where it has none: lengths are then bounds."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def length_sample(cfg: PPOConfig) -> LengthSample:
    """Token lengths of a sample of data.train_files (``batches.sample_lengths``)."""
    model = cfg.actor_rollout_ref.model
    return sample_lengths(cfg, tokenizer_of(model.tokenizer_path or model.path, model.custom_chat_template))


def lengths_of(sample: LengthSample) -> Lengths:
    return Lengths.of(sample.prompt_tokens, sample.response_tokens)


def plan_check_mode(cfg: PPOConfig) -> str:
    """trainer.plan_check as error | warn | off: YAML 1.1 reads a bare ``off`` as false."""
    value = cfg.trainer.plan_check
    return ("error" if value else "off") if isinstance(value, bool) else value


def check_at_start(cfg: PPOConfig, *, world_size: int, device: str, free_bytes: Callable[[], int],
                   print_fn: Callable = print) -> Estimate | None:
    """Print the plan's short block and act on ``trainer.plan_check``; raises a ``UserError`` with the
    knobs for a run over the margin under ``error``."""
    mode = plan_check_mode(cfg)
    if mode == "off":
        return None
    device_bytes = device_bytes_from(cfg, None, free_bytes)
    try:
        e, advice = plan_run(cfg, world_size=world_size, device=device, device_bytes=device_bytes,
                             lengths=lengths_of(length_sample(cfg)))
    except Exception as exc:  # noqa: BLE001 - the plan advises; it must not fail a run its inputs would pass
        # An input the plan cannot read (a missing file, a damaged config.json) is refused by the
        # run's own checks right after, with their more specific message: say so and leave it to them.
        text = str(exc).splitlines()[0] if str(exc) else ""
        print_fn(f"[plan] not estimated ({type(exc).__name__}: {text})" if not isinstance(exc, UserError)
                 else f"[plan] not estimated: {text}")
        return None
    block = format_start_block(e, advice, mode)
    result = verdict(e)
    if result == "error" and mode == "error":
        raise UserError(f"the memory plan's peak exceeds the device's memory by more than {ERROR_MARGIN - 1:.0%}; "
                        "set one of the knobs below, or trainer.plan_check=warn to run anyway "
                        f"(trainer.plan_device_memory sets the memory planned for)\n{block}")
    print_fn(block)
    if result != "ok":
        print_fn(f"warning: the memory plan's peak is {e.peak.total / device_bytes:.0%} of the device's memory "
                 f"({e.peak.phase}); the run may run out of memory there")
    return e
