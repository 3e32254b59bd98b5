"""The run report's plots: one PNG per panel, guard events as labelled vertical lines on each.

Drawn with matplotlib's object API on the Agg canvas (no pyplot, no display, no global state).
A panel whose metrics a run did not log (no critic: no value-loss panel) is left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

EVENT_COLORS = {
    "rollback": "tab:red",
    "early_stop": "black",
    "skip_nonfinite": "tab:orange",
    "stop_nonfinite": "tab:purple",
    "warn_entropy": "tab:olive",
    "warn_clipfrac": "tab:cyan",
    "skip_grad_spike": "tab:orange",
    "rollback_grad_spike": "tab:red",
    "stop_grad_spike": "black",
    "entropy_collapse": "tab:olive",
    "entropy_surge": "tab:pink",
    "reward_divergence": "tab:brown",
}
MAX_EVENT_LABELS = 12  # beyond this the lines stay, their text labels would only overlap


@dataclass
class Series:
    label: str
    steps: list[int]
    values: list[float]  # non-finite values are NaN (a gap in the line)
    marker: str = ""
    linestyle: str = "-"  # "" draws the markers alone (the steps a guard acted on, over their curve)


@dataclass
class Band:
    label: str
    steps: list[int]
    low: list[float]
    high: list[float]


@dataclass
class Span:
    label: str
    start: int
    end: int
    color: str = "tab:gray"


@dataclass
class Axis:
    ylabel: str
    series: list[Series]
    hlines: list[tuple[str, float]] = field(default_factory=list)  # (label, y): targets, thresholds
    stacked: bool = False  # stacked areas (phase timings) instead of lines
    overlay: list[Series] = field(default_factory=list)  # lines over the stacked areas (the step's total)
    bands: list[Band] = field(default_factory=list)  # shaded ranges around a curve (a window's median +- spread)
    spans: list[Span] = field(default_factory=list)  # shaded step windows (an entropy collapse's window)


@dataclass
class Panel:
    name: str  # the PNG's file stem
    title: str
    axes: list[Axis]
    event_kinds: tuple[str, ...] | None = None  # the guard events drawn on it; None: all of them


def series(records: Sequence[Mapping], key: str, label: str | None = None, marker: str = "") -> Series:
    """The (step, value) points of ``key`` in the records that hold it."""
    points = [(r["step"], float(r[key])) for r in records if key in r]
    values = [v if math.isfinite(v) else math.nan for _, v in points]
    return Series(label or key, [s for s, _ in points], values, marker)


def _has_data(s: Series) -> bool:
    return any(math.isfinite(v) for v in s.values)


def build_panels(records: Sequence[Mapping], lines: Mapping[str, list[tuple[str, float]]]) -> list[Panel]:
    """The report's panels, each with the series this run logged; ``lines``: hlines by panel name."""
    keys = {k for r in records for k in r}
    val_keys = sorted(k for k in keys if k.startswith("val-core/"))
    phases = [k for k in dict.fromkeys(k for r in records for k in r)  # in the loop's order
              if k.startswith("timing_s/") and k != "timing_s/step"]
    wanted = [
        Panel("reward", "Reward", [Axis("score", [series(records, "critic/score/mean", "train critic/score/mean")]
                                        + [series(records, k, marker="o") for k in val_keys])]),
        Panel("kl", "KL to the reference (per token)", [Axis("KL", [
            series(records, "actor/kl_to_ref"), series(records, "actor/reward_kl_penalty")], lines.get("kl", []))]),
        Panel("kl_coef", "KL coefficient", [Axis("beta", [series(records, "actor/reward_kl_penalty_coeff")])]),
        Panel("clipfrac", "Clip fraction", [Axis("fraction", [series(records, "actor/pg_clipfrac")],
                                                 lines.get("clipfrac", []))]),
        Panel("entropy", "Policy entropy", [Axis("nats per token", [series(records, "actor/entropy")],
                                                 lines.get("entropy", []))]),
        Panel("value", "Critic", [Axis("value loss", [series(records, "critic/vf_loss")]),
                                  Axis("explained var", [series(records, "critic/vf_explained_var")], [("", 0.0)])]),
        Panel("throughput", "Throughput", [
            Axis("tokens / s", [series(records, "perf/throughput")]),
            Axis("comm / compute", [series(records, "perf/overlap_ratio", "overlap ratio", marker="o")], [("", 1.0)]),
            Axis("tokens per rank", [series(records, "global_seqlen/minmax_diff", "max - min, unbalanced"),
                                     series(records, "global_seqlen/balanced_max", "max, balanced"),
                                     series(records, "global_seqlen/balanced_min", "min, balanced")])]),
        Panel("timing", "Phase timings", [Axis("seconds", [series(records, k, k.removeprefix("timing_s/"))
                                                           for k in phases], stacked=True,
                                               overlay=[series(records, "timing_s/step", "step (total)")])]),
    ]
    return drawable(wanted)


def drawable(panels: Sequence[Panel]) -> list[Panel]:
    """The panels with a finite point to draw, each without the series and axes that have none."""
    kept = []
    for panel in panels:
        for axis in panel.axes:
            axis.series = [s for s in axis.series if _has_data(s)]
        panel.axes = [a for a in panel.axes if a.series]
        if panel.axes:
            kept.append(panel)
    return kept


def _draw_stacked(ax, axis: Axis) -> None:
    steps = sorted({s for ser in axis.series for s in ser.steps})
    layers = []
    for ser in axis.series:
        by_step = dict(zip(ser.steps, ser.values))
        layers.append([0.0 if math.isnan(by_step.get(s, math.nan)) else by_step[s] for s in steps])
    ax.stackplot(steps, layers, labels=[s.label for s in axis.series], alpha=0.8)
    for ser in axis.overlay:
        ax.plot(ser.steps, ser.values, color="black", linewidth=1.0, label=ser.label)


def _draw_events(ax, events: Sequence[Mapping], with_labels: bool) -> None:
    labelled = with_labels and len(events) <= MAX_EVENT_LABELS
    for e in events:
        color = EVENT_COLORS.get(e["kind"], "tab:gray")
        ax.axvline(e["step"], color=color, linestyle="--", linewidth=1.0, alpha=0.9)
        if labelled:
            ax.annotate(e["kind"], xy=(e["step"], 1.0), xycoords=("data", "axes fraction"), rotation=90,
                        va="top", ha="right", fontsize=7, color=color)


def _draw_lines(ax, axis: Axis) -> None:
    """An axis's shaded windows, bands, curves (or bare markers) and horizontal lines, back to front."""
    for span in axis.spans:
        ax.axvspan(span.start, span.end, color=span.color, alpha=0.15, label=span.label or None)
    for band in axis.bands:
        ax.fill_between(band.steps, band.low, band.high, color="tab:gray", alpha=0.25, linewidth=0, label=band.label)
    for ser in axis.series:
        ax.plot(ser.steps, ser.values, marker=ser.marker or None, markersize=4 if ser.linestyle else 7,
                linestyle=ser.linestyle or "none", linewidth=1.4, label=ser.label)
    for label, y in axis.hlines:
        ax.axhline(y, color="gray", linestyle=":", linewidth=1.2)
        if label:
            ax.annotate(f"{label} {y:g}", xy=(0.0, y), xycoords=("axes fraction", "data"), va="bottom", fontsize=7,
                        color="dimgray")


def save_panel(panel: Panel, events: Sequence[Mapping], path: Path) -> Path:
    """Draw ``panel`` (one row per axis, shared step axis) with the guard events; write a PNG."""
    if panel.event_kinds is not None:
        events = [e for e in events if e["kind"] in panel.event_kinds]
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8, 2.6 * len(panel.axes) + 0.6), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panel.axes), 1, sharex=True, squeeze=False)[:, 0]
    for i, (ax, axis) in enumerate(zip(axes, panel.axes)):
        if axis.stacked:
            _draw_stacked(ax, axis)
        else:
            _draw_lines(ax, axis)
        _draw_events(ax, events, with_labels=i == 0)
        handles, labels = ax.get_legend_handles_labels()
        if axis.stacked:  # the legend lists the layers top-down, as they are stacked
            handles, labels = handles[::-1], labels[::-1]
        if i == 0:  # one legend entry per kind of guard event
            for kind in dict.fromkeys(e["kind"] for e in events):
                handles.append(Line2D([], [], color=EVENT_COLORS.get(kind, "tab:gray"), linestyle="--"))
                labels.append(kind)
        if handles:
            points = sum(len(ser.steps) for ser in axis.series)
            ax.legend(handles, labels, fontsize=7, loc="best" if points <= 2000 else "upper left")  # best is O(points)
        ax.set_ylabel(axis.ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].set_title(panel.title)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
