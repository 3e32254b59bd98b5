"""``klppo report RUN_DIR``: plots, guard events and a short diagnosis of a run, as Markdown or HTML.

Reads what a run leaves in its directory: ``metrics.jsonl`` (one record per step, verl's
metric names), ``events.jsonl`` (the guard's actions) and ``config.yaml`` (for the KL target
and the guard's thresholds). Writes ``RUN_DIR/report/report.md`` with one PNG per plot beside
it, unless ``--out`` / ``--format`` say otherwise.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Sequence

import yaml

from klppo.cli_support import run_cli
from klppo.errors import UserError, reading
from klppo.monitoring.jsonl import EVENTS_FILE
from klppo.monitoring.health_report import health_blocks, health_panels, health_summary
from klppo.monitoring.logger import METRICS_FILE
from klppo.monitoring.plots import build_panels, save_panel, series
from klppo.monitoring.report_common import Run, step_ranges  # noqa: F401 (step_ranges: the report's API)
from klppo.monitoring.report_common import config_value as _get, steps_word as _steps_word, training as _training

# What the "rolled back at 12" part of a diagnosis sentence says for each kind of guard event.
EVENT_VERBS = {
    "rollback": "rolled back",
    "early_stop": "stopped early",
    "skip_nonfinite": "skipped the update",
    "stop_nonfinite": "stopped on non-finite values",
    "warn_entropy": "warned of low entropy",
    "warn_clipfrac": "warned of clipping",
}
STOP_KINDS = ("early_stop", "stop_nonfinite")
SUMMARY_KEYS = ("critic/score/mean", "actor/kl_to_ref", "actor/reward_kl_penalty_coeff", "actor/pg_clipfrac",
                "actor/entropy", "critic/vf_loss", "critic/vf_explained_var", "perf/throughput", "perf/time_per_step")


def _read_text(path: Path) -> str:
    """A run file's text; a file that cannot be read or is not UTF-8 is a ``UserError`` naming it."""
    with reading(path, "run file", "is it the file klppo wrote? restore it, or move it away"):
        data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise UserError(f"{path}, line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); it is not a file klppo "
                        "wrote: restore it, or delete that line") from None


def _read_jsonl(path: Path, numbers: bool = False) -> list[dict]:
    """The records of a JSON-lines file, each a JSON object with an integer ``step`` (and, with
    ``numbers``, every other value a number: what metrics.jsonl holds)."""
    records = []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}, line {number}: not a JSON object ({exc.msg}); is the file complete?") from exc
        if not isinstance(record, dict) or type(record.get("step")) is not int:
            raise UserError(f"{path}, line {number}: expected a JSON object with an integer 'step'; "
                            "correct or delete that line")
        odd = next((k for k, v in record.items() if numbers and type(v) not in (int, float)), None)
        if odd is not None:
            raise UserError(f"{path}, line {number}: '{odd}' is {json.dumps(record[odd])[:40]}, not a number; "
                            "metrics are numbers: correct or delete that line")
        records.append(record)
    return records


def _read_config(path: Path) -> dict:
    """The run's config.yaml as a dict ({} when absent); a file that is not YAML is a ``UserError`` naming it."""
    if not path.exists():
        return {}
    try:
        config = yaml.safe_load(_read_text(path))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise UserError(f"{path} is not valid YAML{where} ({problem}); restore the config.yaml the run wrote, or "
                        "move it away to report without the KL target and guard thresholds") from None
    if config is None:  # an empty file
        return {}
    if not isinstance(config, dict):  # read as {}, it would be reported as missing, its thresholds dropped
        raise UserError(f"{path} holds a {type(config).__name__}, not a run's config (a mapping of sections such as "
                        "trainer:); restore the config.yaml the run wrote, or move it away to report without the KL "
                        "target and guard thresholds")
    return config


def load_run(run_dir: str | Path) -> Run:
    """The metrics, events and config of a run directory; a ``UserError`` if it holds no metrics."""
    path = Path(run_dir)
    if not path.exists():
        raise UserError(f"run directory {path} does not exist (pass the run's trainer.default_local_dir)")
    if not path.is_dir():
        raise UserError(f"{path} is not a folder; pass the run's folder (its trainer.default_local_dir), "
                        "not a file in it")
    metrics = path / METRICS_FILE
    if metrics.is_dir():
        raise UserError(f"{metrics} is a folder, not the run's metrics file; pass a run folder that klppo wrote "
                        "(its trainer.default_local_dir)")
    if not metrics.is_file():
        raise UserError(f"{path} has no {METRICS_FILE}: not a run directory, or the run logged no step yet")
    records = _read_jsonl(metrics, numbers=True)
    events_path = path / EVENTS_FILE
    events = _read_jsonl(events_path) if events_path.exists() else []
    for number, event in enumerate(events, start=1):
        if not isinstance(event.get("kind"), str):
            raise UserError(f"{events_path}, event {number}: no 'kind' (rollback, early_stop, ...)")
    return Run(path, records, events, _read_config(path / "config.yaml"))


def threshold_lines(config: dict) -> dict[str, list[tuple[str, float]]]:
    """Horizontal lines by panel: the adaptive KL target and the guard's thresholds, when configured."""
    kl = []
    adaptive = _get(config, "algorithm.kl_ctrl.type") == "adaptive"
    if adaptive and _get(config, "algorithm.use_kl_in_reward") is not False:
        kl.append(("target_kl", _get(config, "algorithm.kl_ctrl.target_kl")))
    kl += [(name, _get(config, f"trainer.guard.{name}")) for name in ("rollback_kl", "early_stop_kl")]
    lines = {
        "kl": kl,
        "entropy": [("entropy_floor", _get(config, "trainer.guard.entropy_floor"))],
        "clipfrac": [("clipfrac_max", _get(config, "trainer.guard.clipfrac_max"))],
    }
    return {panel: [(n, float(v)) for n, v in pairs if isinstance(v, (int, float))] for panel, pairs in lines.items()}


# ---- diagnosis ----


def _event_suffix(events: Sequence[dict], steps: Sequence[int], kinds: Sequence[str]) -> str:
    inside = set(steps)
    hits = [e for e in events if e["kind"] in kinds and e["step"] in inside]
    return "".join(f"; {EVENT_VERBS.get(e['kind'], e['kind'])} at {e['step']}" for e in hits)


def _kl_sentences(run: Run, lines: list[tuple[str, float]]) -> list[str]:
    key = next((k for k in ("actor/kl_to_ref", "actor/reward_kl_penalty") if _training(run, k)[0]), None)
    if key is None:
        return []
    steps, values = _training(run, key)
    out = []
    for label, limit in lines:
        above = [s for s, v in zip(steps, values) if v > limit]
        if above:
            suffix = _event_suffix(run.events, above, ("rollback", "early_stop"))
            peak = max(v for v in values if math.isfinite(v))
            out.append(f"KL exceeded {label} = {limit:g} at {_steps_word(above)}{suffix} ({key}, max {peak:.3g}).")
    return out


def _trend(run: Run, key: str, what: str) -> list[str]:
    steps, values = _training(run, key)
    values = [v for v in values if math.isfinite(v)]
    if len(values) < 2:
        return []
    k = max(1, len(values) // 10)
    first, last = statistics.fmean(values[:k]), statistics.fmean(values[-k:])
    verb = "rose" if last > first else "fell" if last < first else "stayed"
    change = f"{verb} from {first:.3g} to {last:.3g}" if verb != "stayed" else f"stayed at {first:.3g}"
    return [f"{what} ({key}) {change} (mean of the first vs the last 10% of steps)."]


def _validation(run: Run) -> list[str]:
    out = []
    for key in sorted({k for r in run.records for k in r if k.startswith("val-core/")}):
        s = series(run.records, key)
        if len(s.steps) >= 2:
            out.append(f"validation {key} went from {s.values[0]:.3g} (step {s.steps[0]}) "
                       f"to {s.values[-1]:.3g} (step {s.steps[-1]}).")
    return out


def _entropy_floor(run: Run, label: str, floor: float) -> list[str]:
    steps, values = _training(run, "actor/entropy")
    below = [s for s, v in zip(steps, values) if v < floor]
    if not below:
        return []
    return [f"entropy (actor/entropy) fell below {label} = {floor:g} at step {below[0]} "
            f"({len(below)} of {len(steps)} steps below, min {min(values):.3g})."]


def _clipfrac_max(run: Run, label: str, limit: float) -> list[str]:
    steps, values = _training(run, "actor/pg_clipfrac")
    above = [s for s, v in zip(steps, values) if v > limit]
    if not above:
        return []
    return [f"clip fraction (actor/pg_clipfrac) exceeded {label} = {limit:g} at {_steps_word(above)}."]


def _critic(run: Run) -> list[str]:
    _, values = _training(run, "critic/vf_explained_var")
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return []
    tail = statistics.fmean(values[-max(1, len(values) // 10):])
    if tail < 0:
        return [f"critic/vf_explained_var ended at {tail:.3g} (last 10% of steps): the critic predicts returns "
                "worse than their mean."]
    return []


def _nonfinite(run: Run) -> list[str]:
    out = []
    for key in sorted({k for r in run.records for k in r if k != "step"}):
        bad = [r["step"] for r in run.records if key in r and not math.isfinite(float(r[key]))]
        if bad:
            out.append(f"{key} was not finite at {_steps_word(bad)}.")
    return out[:5]


def _speed(run: Run) -> list[str]:
    tput = [v for v in _training(run, "perf/throughput")[1] if math.isfinite(v)]
    step_s = [v for v in _training(run, "timing_s/step")[1] if math.isfinite(v)]
    if not tput or not step_s:
        return []
    text = f"median throughput {statistics.median(tput):.4g} tokens/s, {statistics.median(step_s):.3g} s per step"
    phases: dict[str, float] = {}
    for r in run.records:
        for k, v in r.items():
            if k.startswith("timing_s/") and k != "timing_s/step" and math.isfinite(v):
                phases[k] = phases.get(k, 0.0) + v
    if phases:
        slowest = max(phases, key=phases.get)
        share = phases[slowest] / sum(step_s)
        text += f"; the slowest phase is {slowest.removeprefix('timing_s/')} ({share:.0%} of step time)"
    return [text + "."]


def _ending(run: Run) -> list[str]:
    steps = [r["step"] for r in run.records if r["step"] >= 1]
    planned = _get(run.config, "trainer.total_training_steps")
    stops = [e for e in run.events if e["kind"] in STOP_KINDS]
    if stops:
        return [f"the guard stopped the run at step {stops[-1]['step']} ({stops[-1]['kind']})."]
    if steps and isinstance(planned, int) and steps[-1] < planned:
        return [f"the run ended at step {steps[-1]} of {planned} (still running, or interrupted)."]
    return []


def _event_summary(events: Sequence[dict]) -> str:
    if not events:
        return "no guard events."
    by_kind: dict[str, list[int]] = {}
    for e in events:
        by_kind.setdefault(e["kind"], []).append(e["step"])
    return "guard events: " + "; ".join(f"{kind} at {_steps_word(steps)}" for kind, steps in by_kind.items()) + "."


def diagnose(run: Run) -> list[str]:
    """Short sentences on what the numbers and events of a run say, most important first."""
    lines = threshold_lines(run.config)
    if not any(r["step"] >= 1 for r in run.records):
        return ["no training step was logged.", _event_summary(run.events)]
    out = _ending(run) + health_summary(run) + _kl_sentences(run, lines["kl"]) + _nonfinite(run)
    out += _trend(run, "critic/score/mean", "reward") + _validation(run)
    for label, limit in lines["entropy"]:
        out += _entropy_floor(run, label, limit)
    out += _trend(run, "actor/entropy", "entropy")
    for label, limit in lines["clipfrac"]:
        out += _clipfrac_max(run, label, limit)
    return out + _critic(run) + _speed(run) + [_event_summary(run.events)]


# ---- the document ----


def _summary_rows(run: Run) -> list[list[str]]:
    rows = []
    for key in SUMMARY_KEYS:
        steps, values = _training(run, key)
        finite = [v for v in values if math.isfinite(v)]
        if finite:
            rows.append([key, f"{values[0]:.4g}", f"{values[-1]:.4g}", f"{min(finite):.4g}", f"{max(finite):.4g}"])
    return rows


def _event_rows(events: Sequence[dict]) -> list[list[str]]:
    rows = []
    for e in events:
        numbers = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in e.items() if k not in ("step", "kind", "message"))
        rows.append([str(e["step"]), e["kind"], str(e.get("message", "")), numbers])
    return rows


def build_blocks(run: Run, images: list[tuple[str, str]], health_images: Sequence[tuple[str, str]] = ()) -> list:
    """The report as blocks: ("h1"|"h2"|"p", text), ("ul", items), ("table", header, rows), ("img", alt, file);
    ``health_images``: the health section's plots (``images``: the rest)."""
    steps = [r["step"] for r in run.records]
    names = [_get(run.config, f"trainer.{k}") for k in ("project_name", "experiment_name")]
    where = f"{run.path.resolve()}" + (f" ({names[0]}/{names[1]})" if all(names) else "")
    blocks: list[tuple] = [
        ("h1", f"Run report: {run.path.name}"),
        ("p", f"{where}: {len(run.records)} records, steps {min(steps)} to {max(steps)}, "
              f"{len(run.events)} guard events." if steps else f"{where}: no records."),
    ]
    if not run.config:
        blocks.append(("p", "config.yaml not found: no KL target or guard thresholds are drawn."))
    blocks += [("h2", "Diagnosis"), ("ul", diagnose(run))] + health_blocks(run, health_images) + [("h2", "Guard events")]
    rows = _event_rows(run.events)
    blocks.append(("table", ["step", "kind", "message", "values"], rows) if rows else ("p", "No guard events."))
    summary = _summary_rows(run)
    if summary:
        blocks += [("h2", "Summary"), ("table", ["metric", "first", "last", "min", "max"], summary)]
    blocks.append(("h2", "Plots"))
    if not images:
        blocks.append(("p", "No metrics to plot."))
    for title, file in images:
        blocks += [("h3", title), ("img", title, file)]
    return blocks


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: list[tuple]) -> str:
    out = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            out.append("#" * int(kind[1]) + " " + block[1])
        elif kind == "p":
            out.append(block[1])
        elif kind == "ul":
            out.append("\n".join(f"- {item}" for item in block[1]))
        elif kind == "table":
            header, rows = block[1], block[2]
            lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
            out.append("\n".join(lines))
        elif kind == "img":
            out.append(f"![{block[1]}]({block[2]})")
    return "\n\n".join(out) + "\n"


def render_html(blocks: list[tuple]) -> str:
    esc = html.escape
    out = ["<!DOCTYPE html>", "<html><head><meta charset='utf-8'><title>klppo run report</title><style>",
           "body{font-family:sans-serif;max-width:60em;margin:auto}table{border-collapse:collapse}"
           "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}img{max-width:100%}", "</style></head><body>"]
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3", "p"):
            out.append(f"<{kind}>{esc(block[1])}</{kind}>")
        elif kind == "ul":
            out.append("<ul>" + "".join(f"<li>{esc(item)}</li>" for item in block[1]) + "</ul>")
        elif kind == "table":
            head = "".join(f"<th>{esc(h)}</th>" for h in block[1])
            body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in block[2])
            out.append(f"<table><tr>{head}</tr>{body}</table>")
        elif kind == "img":
            out.append(f"<img src='{esc(block[2])}' alt='{esc(block[1])}'>")
    return "\n".join(out + ["</body></html>"]) + "\n"


def report_path(run_dir: Path, out: str | None, fmt: str | None) -> tuple[Path, str]:
    """(report file, format): ``--out`` ending in .md / .html is the file, else a folder for it."""
    if out is not None and Path(out).suffix in (".md", ".html"):
        return Path(out), fmt or Path(out).suffix[1:]
    fmt = fmt or "md"
    folder = Path(out) if out is not None else run_dir / "report"
    return folder / f"report.{fmt}", fmt


def _check_writable_folder(folder: Path) -> None:
    """Before anything is written: no part of ``folder``'s path is a file."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise UserError(f"cannot write the report to {folder}: '{existing}' is a file, not a folder; pass --out a "
                        "folder (or a .md / .html file) whose parents are folders")


def _save_panels(panels, events: Sequence[dict], folder: Path) -> list[tuple[str, str]]:
    """Each panel as ``folder/<name>.png``; their (title, file name)."""
    for panel in panels:
        save_panel(panel, events, folder / f"{panel.name}.png")
    return [(panel.title, f"{panel.name}.png") for panel in panels]


def write_report(run_dir: str | Path, out: str | None = None, fmt: str | None = None) -> Path:
    """Write the report (and its PNGs beside it); returns the report's path."""
    run = load_run(run_dir)
    path, fmt = report_path(run.path, out, fmt)
    _check_writable_folder(path.parent)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        images = _save_panels(build_panels(run.records, threshold_lines(run.config)), run.events, path.parent)
        blocks = build_blocks(run, images, _save_panels(health_panels(run), run.events, path.parent))
        path.write_text(render_html(blocks) if fmt == "html" else render_markdown(blocks))
    except OSError as exc:
        raise UserError(f"cannot write the report to {path.parent} ({(exc.strerror or str(exc)).lower()}); pass --out "
                        "a folder you can write to") from exc
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="klppo report", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="a run's directory (its trainer.default_local_dir)")
    parser.add_argument("--out", help="report file (.md or .html), or a folder for it (default: RUN_DIR/report)")
    parser.add_argument("--format", choices=("md", "html"), help="md (default) or html")
    args = parser.parse_args(argv)
    return run_cli(lambda: print(f"report written to {write_report(args.run_dir, args.out, args.format)}"))


if __name__ == "__main__":
    sys.exit(main())
