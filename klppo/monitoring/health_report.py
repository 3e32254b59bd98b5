"""The run report's health section: one paragraph per problem found, with its numbers, and its plots.

Pure functions from a run's metrics and guard events to findings (sentences with the numbers
behind them) and plot specs. What it reads is what the guard's detectors write:
events ``skip_grad_spike`` / ``rollback_grad_spike`` / ``stop_grad_spike``, ``entropy_collapse`` /
``entropy_surge``, ``reward_divergence``, ``skip_nonfinite`` / ``stop_nonfinite``; metrics
``<model>/grad_norm`` (``_skipped``, ``_median``), ``actor/entropy``,
``critic/score/zero_std_frac``, ``critic/advantages/zero_frac``, ``training/filter_groups/*``,
``val-gold/*`` beside ``val-core/*``, ``response_length/mean`` and ``response_length/clip_ratio``.
A run that logged none of them (an older run) gets the healthy sentence and no plot.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

from klppo.monitoring.plots import Axis, Band, Panel, Series, Span, drawable, series
from klppo.monitoring.report_common import Run, config_value, steps_word, training

# Skips this many steps apart or closer are one episode: a spike's tail often trips the detector
# again a step or two later, and one paragraph per episode reads better than one per skip.
EPISODE_GAP = 3
MAX_EPISODES = 4  # per model; the rest are counted in one more sentence
ZERO_SPREAD_WARN = 0.2  # a fifth of the groups giving no gradient is a fifth of generation wasted
FILTER_BATCHES_WARN = 2.0  # filter_groups generating twice the batch it keeps doubles generation time
LENGTH_CLIP_WARN = 0.1  # one response in ten cut at the limit: its reward scores an unfinished answer
# The detector's threshold k (skip when grad_norm > k x its reference level), for the plot's band;
# read from the config where the run wrote it, else no band is drawn.
GRAD_SPIKE_KEY = "trainer.guard.grad_spike"
GRAD_KINDS = ("skip_grad_spike", "rollback_grad_spike", "stop_grad_spike")
HEALTH_METRICS = {  # what the healthy sentence says was looked at, by the prefix of the metrics that show it
    "actor/grad_norm": "gradient norms", "actor/entropy": "entropy",
    "critic/score/zero_std_frac": "zero-spread groups", "val-gold/": "gold reward",
    "response_length/clip_ratio": "response length",
}

TOPIC_WORDS = {"grad_spike": "grad-norm spikes", "grad_action": "a grad-norm guard action",
               "nonfinite": "non-finite skips", "entropy_collapse": "entropy collapse", "entropy_surge": "entropy surge",
               "zero_spread": "zero-spread groups", "filter_cost": "costly filter_groups",
               "reward_divergence": "gold vs training reward divergence", "length_clip": "responses cut at the limit"}


@dataclass
class Finding:
    topic: str  # a key of TOPIC_WORDS
    first: int  # the steps it covers
    last: int
    numbers: dict[str, float]  # what the text says, as numbers
    text: str


def episodes(steps: Sequence[int], gap: int) -> list[list[int]]:
    """Sorted distinct steps split where two are more than ``gap`` apart: [1, 2, 4, 9], 2 -> [[1, 2, 4], [9]]."""
    groups: list[list[int]] = []
    for s in sorted(set(steps)):
        if groups and s - groups[-1][-1] <= gap:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def _tenths(values: Sequence[float]) -> tuple[float, float]:
    """Means of the first and the last 10% of ``values`` (at least one value each)."""
    k = max(1, len(values) // 10)
    return statistics.fmean(values[:k]), statistics.fmean(values[-k:])


def _finite(run: Run, key: str) -> tuple[list[int], list[float]]:
    steps, values = training(run, key)
    pairs = [(s, v) for s, v in zip(steps, values) if math.isfinite(v)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _of_kind(run: Run, *kinds: str) -> list[dict]:
    return sorted((e for e in run.events if e["kind"] in kinds), key=lambda e: e["step"])


def _number(event: dict, key: str, default: float = math.nan) -> float:
    value = event.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


# ---- gradient spikes and skipped steps ----


def skipped_by_step(run: Run, model: str) -> dict[int, int]:
    """Optimiser steps skipped for a grad-norm spike, by PPO step: ``<model>/grad_norm_skipped`` where
    logged, else the count of that model's ``skip_grad_spike`` events."""
    counts: dict[int, int] = {}
    for e in _of_kind(run, "skip_grad_spike"):
        if e.get("model", "actor") == model:
            counts[e["step"]] = counts.get(e["step"], 0) + 1
    for s, v in zip(*_finite(run, f"{model}/grad_norm_skipped")):
        if v > 0 or s in counts:
            counts[s] = int(round(v))
    return {s: n for s, n in counts.items() if n > 0}


def _spike_peak(run: Run, model: str, steps: Sequence[int]) -> tuple[float, float]:
    """(grad norm, reference level) of an episode's largest spike: from its events, else from the
    logged metrics (nan where neither says)."""
    inside = set(steps)
    spikes = [e for e in _of_kind(run, "skip_grad_spike") if e["step"] in inside and e.get("model", "actor") == model]
    if spikes:
        peak = max(spikes, key=lambda e: _number(e, "grad_norm") / _number(e, "median"))
        return _number(peak, "grad_norm"), _number(peak, "median")
    logged = {k: dict(zip(*_finite(run, f"{model}/{k}"))) for k in ("grad_norm", "grad_norm_median")}
    points = [(logged["grad_norm"][s], logged["grad_norm_median"][s])
              for s in steps if s in logged["grad_norm"] and logged["grad_norm_median"].get(s, 0.0) > 0]
    if not points:
        return math.nan, math.nan
    return max(points, key=lambda p: p[0] / p[1])


def _guard_actions(actions: Sequence[dict]) -> str:
    """'; rolled back to step 200 at step 215 (3 skips within 10 steps)' for each rollback / stop."""
    out = ""
    for e in actions:
        why = f" ({e['skips']} skips within {e['window']} steps)" if "skips" in e and "window" in e else ""
        if e["kind"] == "rollback_grad_spike":
            out += f"; rolled back to step {e.get('to_step', '?')} at step {e['step']}{why}"
        else:
            out += f"; stopped the run at step {e['step']}{why}"
    return out


def _grad_finding(run: Run, model: str, steps: list[int], skipped: int, actions: list[dict]) -> Finding:
    grad, median = _spike_peak(run, model, steps)
    times = grad / median if median > 0 else math.nan
    if math.isfinite(times):
        head = f"{model.capitalize()} grad norm spiked to {times:.3g}x its window median ({grad:.3g} vs {median:.3g})"
    else:
        head = f"{model.capitalize()} grad norm spiked"
    text = f"{head} at {steps_word(steps)}; {skipped} optimiser step{'s' if skipped != 1 else ''} skipped"
    last = max([steps[-1]] + [e["step"] for e in actions])
    numbers = {"times": times, "grad_norm": grad, "median": median, "skipped": float(skipped),
               "rollbacks": float(sum(e["kind"] == "rollback_grad_spike" for e in actions))}
    return Finding("grad_spike", steps[0], last, numbers, text + _guard_actions(actions) + ".")


def grad_findings(run: Run) -> list[Finding]:
    """One finding per grad-norm spike episode (actor, then critic), a rollback or stop the guard took
    for it named in the episode's sentence; the episodes past ``MAX_EPISODES`` counted in one more."""
    acts = _of_kind(run, "rollback_grad_spike", "stop_grad_spike")
    out, claimed = [], set()
    for model in ("actor", "critic"):
        counts = skipped_by_step(run, model)
        groups = episodes(counts, EPISODE_GAP)
        for steps in groups[:MAX_EPISODES]:
            mine = [e for e in acts if steps[0] <= e["step"] <= steps[-1] + EPISODE_GAP and id(e) not in claimed]
            claimed.update(id(e) for e in mine)
            out.append(_grad_finding(run, model, steps, sum(counts[s] for s in steps), mine))
        rest = [s for g in groups[MAX_EPISODES:] for s in g]
        if rest:
            n = sum(counts[s] for s in rest)
            out.append(Finding("grad_spike", rest[0], rest[-1], {"skipped": float(n)},
                               f"{len(groups) - MAX_EPISODES} more {model} grad-norm spike episodes at "
                               f"{steps_word(rest)}; {n} more optimiser steps skipped."))
    for e in (e for e in acts if id(e) not in claimed):  # a guard action with no skip logged near it
        text = _guard_actions([e]).removeprefix("; ")
        out.append(Finding("grad_action", e["step"], e["step"], {"to_step": _number(e, "to_step")},
                           f"Grad-norm spikes: {text[0].upper()}{text[1:]}."))
    return out


def nonfinite_findings(run: Run) -> list[Finding]:
    """The steps whose update was skipped for non-finite values, and a stop for them."""
    skips = _of_kind(run, "skip_nonfinite")
    stops = _of_kind(run, "stop_nonfinite")
    if not skips and not stops:
        return []
    steps = sorted({e["step"] for e in skips + stops})
    names = sorted({k for e in skips + stops for k in e if k not in ("step", "kind", "message")})
    what = f" ({', '.join(names)})" if names else ""
    text = f"The update was skipped for non-finite values{what} at {steps_word(sorted({e['step'] for e in skips}))}" \
        if skips else f"Non-finite values{what}"
    text += f"; the run stopped at step {stops[-1]['step']}" if stops else ""
    return [Finding("nonfinite", steps[0], steps[-1], {"skipped": float(len({e["step"] for e in skips}))},
                    text + ": look for a bad batch or a learning rate too high near the first of them.")]


# ---- entropy ----


def _entropy_episodes(events: Sequence[dict]) -> list[list[dict]]:
    """Events whose windows (step - window .. step) overlap or touch are one episode."""
    groups: list[list[dict]] = []
    for e in events:
        if groups and e["step"] - _number(e, "window", 0.0) <= groups[-1][-1]["step"] + 1:
            groups[-1].append(e)
        else:
            groups.append([e])
    return groups


def entropy_findings(run: Run) -> list[Finding]:
    """One finding per collapse or surge episode: the largest change in it, the window it spans."""
    out = []
    for kind, verb, why in (("entropy_collapse", "collapsed", "the policy is turning deterministic, so its samples "
                             "stop differing and exploration ends"),
                            ("entropy_surge", "surged", "the policy is spreading toward noise; look at the learning "
                             "rate and the KL near the start of the window")):
        for group in _entropy_episodes(_of_kind(run, kind)):
            pick = min if kind == "entropy_collapse" else max
            top = pick(group, key=lambda e: _number(e, "change", 0.0))
            first = max(1, int(group[0]["step"] - _number(group[0], "window", 0.0)))
            change, ref, now = _number(top, "change"), _number(top, "reference"), _number(top, "entropy")
            actions = ", ".join(dict.fromkeys(str(e.get("action", "?")) for e in group))
            text = (f"Entropy {verb} {abs(change):.0%} ({ref:.3g} -> {now:.3g}) over steps {first}-{group[-1]['step']} "
                    f"(action: {actions}): {why}.")
            out.append(Finding(kind, first, group[-1]["step"],
                               {"change": change, "reference": ref, "entropy": now, "events": float(len(group))}, text))
    return out


# ---- groups with zero reward spread ----


def _filtering(run: Run) -> bool:
    logged = any("training/filter_groups/gen_batches" in r for r in run.records)
    return logged or config_value(run.config, "algorithm.filter_groups.enable") is True


def zero_spread_findings(run: Run) -> list[Finding]:
    """Groups whose responses all scored the same give zero advantages: a step full of them teaches
    nothing. With filter_groups on they are resampled instead, and the cost is the extra generation."""
    if _filtering(run):
        return filter_cost_findings(run)
    steps, values = _finite(run, "critic/score/zero_std_frac")
    if not values:
        return []
    mean = statistics.fmean(values)
    first, last = _tenths(values)
    if max(mean, last) < ZERO_SPREAD_WARN:
        return []
    text = (f"{mean:.0%} of groups had zero reward spread on average (steps {steps[0]}-{steps[-1]}; {first:.0%} over "
            f"the first 10% of steps, {last:.0%} over the last)")
    adv = _finite(run, "critic/advantages/zero_frac")[1]
    if adv:
        text += f", and {statistics.fmean(adv):.0%} of advantages were zero"
    text += (": those groups teach nothing, their advantages being zero; algorithm.filter_groups.enable=true would "
             "resample them.")
    numbers = {"mean": mean, "first": first, "last": last}
    return [Finding("zero_spread", steps[0], steps[-1], numbers, text)]


def filter_cost_findings(run: Run) -> list[Finding]:
    """filter_groups keeps drawing batches until enough groups have reward spread: a cost when it
    needs many (prompts mostly too easy or too hard for the policy)."""
    steps, gen = _finite(run, "training/filter_groups/gen_batches")
    if not gen or statistics.fmean(gen) < FILTER_BATCHES_WARN:
        return []
    mean = statistics.fmean(gen)
    kept = sum(_finite(run, "training/filter_groups/kept_groups")[1])
    dropped = sum(_finite(run, "training/filter_groups/dropped_groups")[1])
    share = dropped / (kept + dropped) if kept + dropped > 0 else math.nan
    text = (f"With filter_groups on, each step generated {mean:.3g} batches on average (max {max(gen):g}, steps "
            f"{steps[0]}-{steps[-1]}) to fill its batch with groups whose rewards differ")
    text += f"; it dropped {share:.0%} of the groups it generated" if math.isfinite(share) else ""
    text += (": most prompts are too easy or too hard for the policy; filter the data by difficulty, or raise "
             "actor_rollout_ref.rollout.n so that groups differ more often.")
    return [Finding("filter_cost", steps[0], steps[-1], {"gen_batches": mean, "max": max(gen), "dropped": share},
                    text)]


# ---- gold vs training reward, response length ----


def _rose(change: float) -> str:
    return "rose" if change > 0 else "fell" if change < 0 else "stayed"


def divergence_findings(run: Run) -> list[Finding]:
    """The first ``reward_divergence`` event's numbers, from the first validation of its window;
    the later ones listed."""
    events = _of_kind(run, "reward_divergence")
    if not events:
        return []
    e = events[0]
    n = int(_number(e, "validations", 0.0))
    validated = sorted({r["step"] for r in run.records if r["step"] <= e["step"] and any(
        k.startswith("val-gold/") for k in r)})
    since = validated[-n] if 0 < n <= len(validated) else e["step"]
    train, gold = _number(e, "train_change"), _number(e, "gold_change")
    shifts = (f", {_number(e, 'train_shift'):+.3g} vs {_number(e, 'gold_shift'):+.3g} of their spreads"
              if "train_shift" in e else "")  # events written before the spreads have none
    text = (f"Training reward {_rose(train)} {train:+.3g} over the last {n} validations while the gold reward "
            f"{_rose(gold)} {gold:+.3g} (from step {since}, flagged at step {e['step']}{shifts}; action: "
            f"{e.get('action', '?')}): the policy may be gaming the reward; read a few high-scoring responses")
    later = [x["step"] for x in events[1:]]
    text += f"; flagged again at {steps_word(later)}." if later else "."
    return [Finding("reward_divergence", since, events[-1]["step"],
                    {"train_change": train, "gold_change": gold, "since": float(since), "events": float(len(events))},
                    text)]


def length_findings(run: Run) -> list[Finding]:
    """Responses cut at the length limit, measured over the last 10% of steps against the first."""
    steps, clip = _finite(run, "response_length/clip_ratio")
    if not clip:
        return []
    first, last = _tenths(clip)
    if last < LENGTH_CLIP_WARN:
        return []
    text = (f"Responses hit the length limit in {last:.0%} of samples at the end (from {first:.0%}; the last vs the "
            "first 10% of steps)")
    numbers = {"first": first, "last": last}
    lengths = _finite(run, "response_length/mean")[1]
    if lengths:
        numbers["length_first"], numbers["length_last"] = _tenths(lengths)
        text += f"; mean length {numbers['length_first']:.4g} -> {numbers['length_last']:.4g} tokens"
    limit = config_value(run.config, "data.max_response_length")
    text += f" (data.max_response_length = {limit})" if isinstance(limit, int) else ""
    text += ": a cut response is scored unfinished; raise the limit, or penalise length in the reward."
    return [Finding("length_clip", steps[0], steps[-1], numbers, text)]


def findings(run: Run) -> list[Finding]:
    """Every health problem the run's metrics and events show, the ones that stop training first."""
    return (grad_findings(run) + nonfinite_findings(run) + entropy_findings(run) + divergence_findings(run)
            + zero_spread_findings(run) + length_findings(run))


def _healthy_sentence(run: Run) -> str:
    keys = {k for r in run.records for k in r}
    looked = [what for prefix, what in HEALTH_METRICS.items() if any(k.startswith(prefix) for k in keys)]
    if not looked:
        return ("No health problem found; this run logged none of the health metrics (gradient norms, entropy, "
                "zero-spread groups, gold reward, response length).")
    return f"No health problem found in the {', '.join(looked)} this run logged."


def health_summary(run: Run) -> list[str]:
    """The diagnosis list's line on the health section (none for a healthy run)."""
    found = findings(run)
    if not found:
        return []
    where = [f"{TOPIC_WORDS[f.topic]} at " + (f"step {f.first}" if f.first == f.last else f"steps {f.first}-{f.last}")
             for f in found[:6]]
    more = f" and {len(found) - 6} more" if len(found) > 6 else ""
    return [f"health: {len(found)} problem{'s' if len(found) > 1 else ''} found ({'; '.join(where)}{more}); "
            "see Health."]


def health_blocks(run: Run, images: Sequence[tuple[str, str]]) -> list[tuple]:
    """The report's Health section: a paragraph per finding (or the healthy sentence), then its plots."""
    found = findings(run)
    blocks: list[tuple] = [("h2", "Health")]
    blocks += [("p", f.text) for f in found] or [("p", _healthy_sentence(run))]
    for title, file in images:
        blocks += [("h3", title), ("img", title, file)]
    return blocks


# ---- plots ----


def _points(label: str, steps: Sequence[int], by_step: dict[int, float], marker: str) -> Series:
    """Bare markers on a curve at ``steps`` (those the curve has a value for)."""
    at = [s for s in steps if s in by_step]
    return Series(label, at, [by_step[s] for s in at], marker=marker, linestyle="")


def _grad_axis(run: Run, model: str, k: float | None) -> Axis:
    """A model's grad norm, its reference level (the window median) and the band up to the skip
    limit (level x grad_spike), and the steps skipped for a spike."""
    records = [r for r in run.records if r["step"] >= 1]
    grad = series(records, f"{model}/grad_norm")
    median = series(records, f"{model}/grad_norm_median", "window median")
    median.linestyle = "--"
    at = [(s, m) for s, m in zip(median.steps, median.values) if math.isfinite(m)]
    bands = []
    if at and k is not None:
        bands.append(Band(f"median x {k:g} (skip limit)", [s for s, _ in at], [m for _, m in at],
                          [m * k for _, m in at]))
    counts = skipped_by_step(run, model)
    skipped = _points(f"skipped ({sum(counts.values())})", sorted(counts), dict(zip(grad.steps, grad.values)), "x")
    return Axis(f"{model} grad norm", [grad, median, skipped], bands=bands)


def _entropy_axis(run: Run) -> Axis:
    """Entropy with each collapse / surge episode's window shaded and its events marked."""
    ent = series([r for r in run.records if r["step"] >= 1], "actor/entropy")
    axis = Axis("nats per token", [ent])
    for kind, color, marker in (("entropy_collapse", "tab:olive", "v"), ("entropy_surge", "tab:pink", "^"),
                                ("warn_entropy", "tab:gray", "o")):
        events = _of_kind(run, kind)
        for i, group in enumerate(_entropy_episodes(events) if kind != "warn_entropy" else []):
            start = max(1, int(group[0]["step"] - _number(group[0], "window", 0.0)))
            axis.spans.append(Span(f"{kind} window" if i == 0 else "", start, group[-1]["step"], color))
        axis.series.append(_points(kind, [e["step"] for e in events], dict(zip(ent.steps, ent.values)), marker))
    return axis


def _gold_axis(run: Run) -> Axis:
    keys = sorted({k for r in run.records for k in r if k.startswith("val-gold/")
                   or (k.startswith("val-core/") and "/reward/" in k)})
    return Axis("reward at validation", [series(run.records, k, marker="o") for k in keys])


def health_panels(run: Run) -> list[Panel]:
    """The health section's plots, each only where the run logged its metrics (the entropy one only
    with an entropy event, the gold one only with a gold reward: the report's plots hold the rest)."""
    k = config_value(run.config, GRAD_SPIKE_KEY)
    k = float(k) if isinstance(k, (int, float)) and not isinstance(k, bool) else None
    train = [r for r in run.records if r["step"] >= 1]
    keys = {key for r in run.records for key in r}
    entropy_events = _of_kind(run, "entropy_collapse", "entropy_surge", "warn_entropy")
    wanted = [
        Panel("health_grad_norm", "Gradient norm, window and skipped steps",
              [_grad_axis(run, m, k) for m in ("actor", "critic")], GRAD_KINDS + ("skip_nonfinite", "stop_nonfinite")),
        Panel("health_entropy", "Entropy collapse and surge", [_entropy_axis(run)] if entropy_events else [],
              ("rollback", "early_stop")),
        Panel("health_zero_spread", "Groups with zero reward spread", [
            Axis("fraction", [series(train, "critic/score/zero_std_frac", "groups with zero reward spread"),
                              series(train, "critic/advantages/zero_frac", "zero advantages")]),
            Axis("filter_groups", [series(train, f"training/filter_groups/{name}", name.replace("_", " "))
                                   for name in ("gen_batches", "kept_groups", "dropped_groups")])], ()),
        Panel("health_gold", "Gold vs training reward at validation",
              [_gold_axis(run)] if any(key.startswith("val-gold/") for key in keys) else [], ("reward_divergence",)),
        Panel("health_length", "Response length", [
            Axis("tokens", [series(train, "response_length/mean")]),
            Axis("cut at the limit", [series(train, "response_length/clip_ratio")], [("", LENGTH_CLIP_WARN)])], ()),
    ]
    return drawable(wanted)
