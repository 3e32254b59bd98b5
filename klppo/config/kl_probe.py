"""The offline KL probe's size and cadence as a run uses them (``algorithm.kl_ctrl.probe_prompts``
and ``probe_every``), resolved once for the run's settings and for ``klppo plan``.

An offline run's responses were not sampled by the policy, so its KL(pi || ref) is measured on
responses the policy samples for the step's first ``probe_prompts`` prompts (unless it is
importance-weighted on the recorded ones). On issue #33's workload (a 5.0M-parameter Qwen2,
32-token responses, one thread) a probe of 8 prompts cost 343 ms, 23% of an offline step
(benchmarks/README.md, "The offline KL probe"). The default cadence, every 4th step, is what
the KL guards need: they act on the next measurement, up to 3 steps late (a rollback returns to
the last certified checkpoint, and the step after every save is measured, which certifies it);
the adaptive controller, which moves beta by every step's KL, keeps measuring every step.
"""

from __future__ import annotations

from klppo.config.schema import PPOConfig

PROBE_EVERY = 4  # steps between sampled measurements by default (1 with an adaptive KL controller)


def probe_every(cfg: PPOConfig) -> int:
    """Steps between the sampled probe's measurements: ``probe_every``, or by default 1 where the
    adaptive controller reads the offline KL (the KL in the reward), else ``PROBE_EVERY``."""
    kl = cfg.algorithm.kl_ctrl
    if kl.probe_every is not None:
        return kl.probe_every
    return 1 if cfg.algorithm.use_kl_in_reward and kl.type == "adaptive" else PROBE_EVERY


def probe_prompts(cfg: PPOConfig) -> int:
    """Prompts the probe samples for: ``probe_prompts``, at most the step's own."""
    return min(cfg.algorithm.kl_ctrl.probe_prompts, cfg.data.train_batch_size)
