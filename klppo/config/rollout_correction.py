"""``algorithm.rollout_correction``'s threshold strings, parsed as verl 0.9.1 reads them.

``rollout_is_threshold``: a number (truncate the weights at it, TIS) or ``"lower_upper"``
(zero the weights outside [lower, upper], IcePop). ``rollout_rs``: comma-separated criteria
(``token_k1``, ``seq_mean_k3``, ...); ``rollout_rs_threshold``: one threshold for all of them
or one per criterion, comma-separated; a k1 criterion bounds the ratio mu / pi_old and takes
``"lower_upper"`` or an upper bound alone (lower = 1 / upper), the others one upper bound on
the divergence. Every parse raises ``ValueError`` with a message that names the fix; the
config checks report it against its key, and ``compile_ppo`` uses the parsed values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

if TYPE_CHECKING:
    from klppo.config.schema import PPOConfig

KEY = "algorithm.rollout_correction"
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")

Threshold = Union[float, str]


def rollout_correction_active(cfg: PPOConfig) -> bool:
    """Whether algorithm.rollout_correction changes the update (weights, rejection or bypass)."""
    rc = cfg.algorithm.rollout_correction
    return rc.rollout_is is not None or rc.rollout_rs is not None or rc.bypass_mode


def _number(text: str, key: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{key}: {text!r} is not a number; write e.g. 2.0, or 'lower_upper' like '0.5_2.0'") from None
    if not value > 0:
        raise ValueError(f"{key}: {text!r} must be > 0")
    return value


def parse_is_threshold(spec: Threshold) -> tuple[float, Optional[float]]:
    """(upper, lower or None) of ``rollout_is_threshold``."""
    key = f"{KEY}.rollout_is_threshold"
    if isinstance(spec, (int, float)):
        return _number(str(spec), key), None
    text = spec.strip()
    if "_" not in text:
        return _number(text, key), None
    lower_text, upper_text = text.split("_", 1)
    lower, upper = _number(lower_text, key), _number(upper_text, key)
    if lower > upper:
        raise ValueError(f"{key} = {spec!r}: the lower bound is above the upper one; write 'lower_upper'")
    return upper, lower


def parse_rs_options(options: str) -> tuple[str, ...]:
    """The distinct criteria of ``rollout_rs``, in the order given."""
    key = f"{KEY}.rollout_rs"
    names = [name.strip() for name in options.split(",") if name.strip()]
    if not names:
        raise ValueError(f"{key} = {options!r} names no criterion; use null or some of {', '.join(RS_OPTIONS)}")
    for name in names:
        if name not in RS_OPTIONS:
            raise ValueError(f"{key}: unknown criterion {name!r}; use a comma-separated list of "
                             f"{', '.join(RS_OPTIONS)}")
    return tuple(dict.fromkeys(names))


def parse_rs(options: str, spec: Optional[Threshold]) -> tuple[tuple[str, Optional[float], float], ...]:
    """``(criterion, lower, upper)`` for every criterion of ``rollout_rs`` (lower: k1 only)."""
    key = f"{KEY}.rollout_rs_threshold"
    names = parse_rs_options(options)
    if spec is None:
        raise ValueError(f"{key} is null but {KEY}.rollout_rs is set; give a threshold, e.g. 2.0 (one per criterion "
                         "or one for all)")
    parts = [str(spec)] if isinstance(spec, (int, float)) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) == 1:
        parts = parts * len(names)
    if len(parts) != len(names):
        raise ValueError(f"{key} = {spec!r} gives {len(parts)} thresholds for {len(names)} criteria; give one for "
                         "all or one per criterion, comma-separated")
    parsed = []
    for name, part in zip(names, parts):
        if name.endswith("k1"):
            lower_text, upper_text = part.split("_", 1) if "_" in part else (None, part)
            upper = _number(upper_text, f"{key} ({name})")
            lower = 1.0 / upper if lower_text is None else _number(lower_text, f"{key} ({name})")
            if lower > upper:
                raise ValueError(f"{key} ({name}) = {part!r}: the lower bound is above the upper one")
            parsed.append((name, lower, upper))
        elif "_" in part:
            raise ValueError(f"{key} ({name}) = {part!r}: a k2/k3 criterion takes one upper bound, not 'lower_upper'")
        else:
            parsed.append((name, None, _number(part, f"{key} ({name})")))
    return tuple(parsed)
