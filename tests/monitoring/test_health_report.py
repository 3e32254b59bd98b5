"""``klppo report``'s health section: a paragraph per problem, with the run's numbers, and its plots.

Each run folder is written by hand, the way a run writes metrics.jsonl and events.jsonl.
"""

import json
import math

import pytest
import yaml

from klppo.monitoring.health_report import (
    LENGTH_CLIP_WARN, MAX_EPISODES, divergence_findings, entropy_findings, episodes, filter_cost_findings, findings,
    grad_findings, health_panels, health_summary, length_findings, nonfinite_findings, zero_spread_findings)
from klppo.monitoring.report import build_blocks, diagnose, load_run, render_markdown, write_report


def write_run(run_dir, records, events=(), config=None):
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if events:
        (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if config is not None:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    return load_run(run_dir)


def healthy_record(step):
    """A step of a healthy run: steady grad norms, entropy, spread in every group, short responses."""
    record = {"step": step, "critic/score/mean": 0.3 + 0.01 * step, "actor/entropy": 1.2,
              "actor/grad_norm": 3.0, "actor/grad_norm_skipped": 0, "actor/grad_norm_median": 3.0,
              "critic/score/zero_std_frac": 0.05, "critic/advantages/zero_frac": 0.05,
              "response_length/mean": 200.0, "response_length/clip_ratio": 0.02}
    if step % 10 == 0:
        record.update({"val-core/gsm8k/reward/mean@1": 0.3 + 0.01 * step, "val-gold/reward/mean": 0.3 + 0.01 * step})
    return record


def event(step, kind, **values):
    return {"step": step, "kind": kind, "message": f"{kind} at {step}", **values}


def spike_run(tmp_path):
    """Actor grad norm 42 against a window median of 3 at steps 12, 13 and 15 (4 optimiser steps skipped),
    rolled back to step 10 at step 15; a critic spike at step 25 seen only in the metrics."""
    records = [healthy_record(s) for s in range(1, 31)]
    for step, skipped in ((12, 1), (13, 2), (15, 1)):
        records[step - 1].update({"actor/grad_norm": 42.0, "actor/grad_norm_skipped": skipped})
    records[24].update({"critic/grad_norm": 20.0, "critic/grad_norm_median": 2.0, "critic/grad_norm_skipped": 1})
    spikes = [event(s, "skip_grad_spike", model="actor", grad_norm=g, median=3.0, ratio=g / 3.0,
                    log_ratio=math.log(g / 3.0)) for s, g in ((12, 30.0), (13, 42.0), (13, 40.0), (15, 33.0))]
    rollback = event(15, "rollback_grad_spike", skips=4, window=10, to_step=10)
    return write_run(tmp_path / "run", records, spikes + [rollback], {"trainer": {"guard": {"grad_spike": 3.0}}})


def test_a_grad_spike_episode_names_its_peak_skips_and_rollback(tmp_path):
    actor, critic = grad_findings(spike_run(tmp_path))
    assert (actor.first, actor.last) == (12, 15)
    assert actor.numbers["times"] == pytest.approx(14.0)
    assert actor.numbers["skipped"] == 4 and actor.numbers["rollbacks"] == 1  # the metric counts, not the events
    assert actor.text == ("Actor grad norm spiked to 14x its window median (42 vs 3) at steps "
                          "12-13, 15; 4 optimiser steps skipped; rolled back to step 10 at step 15 (4 skips within 10 "
                          "steps).")
    # No event for the critic: its peak comes from the logged median: 20 / 2 = 10x.
    assert (critic.first, critic.numbers["times"], critic.numbers["skipped"]) == (25, 10, 1)
    assert "Critic grad norm spiked to 10x its window median (20 vs 2) at step 25; 1 optimiser " \
           "step skipped." == critic.text


def test_spike_episodes_past_the_limit_are_counted_in_one_sentence(tmp_path):
    assert episodes([9, 1, 2, 4, 4], gap=2) == [[1, 2, 4], [9]]
    records = [healthy_record(s) for s in range(1, 61)]
    spiked = [1, 10, 20, 30, 40, 41, 50]
    for s in spiked:
        records[s - 1]["actor/grad_norm_skipped"] = 1
    found = grad_findings(write_run(tmp_path / "run", records))
    assert [(f.first, f.last) for f in found] == [(1, 1), (10, 10), (20, 20), (30, 30), (40, 50)]
    assert len(found) == MAX_EPISODES + 1 and found[-1].numbers["skipped"] == 3
    assert found[-1].text == "2 more actor grad-norm spike episodes at steps 40-41, 50; 3 more optimiser steps skipped."


def test_an_entropy_collapse_reports_its_largest_drop_over_the_windows_union(tmp_path):
    records = [dict(healthy_record(s), **{"actor/entropy": 1.8 if s < 20 else 1.8 - 0.112 * (s - 20)})
               for s in range(1, 51)]
    events = [event(s, "entropy_collapse", entropy=e, reference=1.8, change=e / 1.8 - 1, window=10, action="warn")
              for s, e in ((28, 0.9), (29, 0.72), (30, 0.68))]
    events.append(event(45, "entropy_surge", entropy=2.7, reference=1.2, change=1.25, window=5, action="rollback"))
    collapse, surge = entropy_findings(write_run(tmp_path / "run", records, events))
    assert (collapse.first, collapse.last, collapse.numbers["events"]) == (18, 30, 3)
    assert collapse.numbers["change"] == pytest.approx(0.68 / 1.8 - 1)  # -62%, the largest of the three
    assert collapse.text.startswith("Entropy collapsed 62% (1.8 -> 0.68) over steps 18-30 (action: warn): ")
    assert (surge.first, surge.last) == (40, 45)
    assert surge.text.startswith("Entropy surged 125% (1.2 -> 2.7) over steps 40-45 (action: rollback): ")


def test_zero_spread_groups_are_a_problem_without_filter_groups_and_a_cost_with_it(tmp_path):
    records = [dict(healthy_record(s), **{"critic/score/zero_std_frac": 0.2 if s <= 25 else 0.64,
                                          "critic/advantages/zero_frac": 0.4}) for s in range(1, 51)]
    (found,) = zero_spread_findings(write_run(tmp_path / "plain", records))
    assert found.numbers == pytest.approx({"mean": 0.42, "first": 0.2, "last": 0.64})
    assert found.text.startswith("42% of groups had zero reward spread on average (steps 1-50; 20% over the first 10% "
                                 "of steps, 64% over the last), and 40% of advantages were zero: ")
    assert "algorithm.filter_groups.enable=true" in found.text
    filtered = [dict(r, **{"training/filter_groups/gen_batches": 2 if r["step"] % 2 else 3,
                           "training/filter_groups/kept_groups": 8, "training/filter_groups/dropped_groups": 12})
                for r in records]
    (cost,) = findings(write_run(tmp_path / "filtered", filtered))
    assert cost.topic == "filter_cost" and cost.numbers == pytest.approx({"gen_batches": 2.5, "max": 3, "dropped": 0.6})
    assert cost.text.startswith("With filter_groups on, each step generated 2.5 batches on average (max 3, steps "
                                "1-50) to fill its batch with groups whose rewards differ; it dropped 60% of the ")
    cheap = [dict(r, **{"training/filter_groups/gen_batches": 1.2}) for r in filtered]
    assert filter_cost_findings(write_run(tmp_path / "cheap", cheap)) == []


def test_gold_reward_falling_while_the_training_reward_rises_is_reported_from_its_first_validation(tmp_path):
    records = [healthy_record(s) for s in range(1, 61)]
    events = [event(50, "reward_divergence", train_change=0.31, gold_change=-0.05, validations=3, action="warn"),
              event(60, "reward_divergence", train_change=0.35, gold_change=-0.08, validations=3, action="warn")]
    (found,) = divergence_findings(write_run(tmp_path / "run", records, events))
    assert (found.first, found.last, found.numbers["since"], found.numbers["events"]) == (30, 60, 30, 2)
    assert found.text.startswith("Training reward rose +0.31 over the last 3 validations while the gold reward fell "
                                 "-0.05 (from step 30, flagged at step 50; action: warn): the policy may be gaming ")
    assert found.text.endswith("; flagged again at step 60.")
    spread = [dict(events[0], train_shift=0.62, gold_shift=-0.1)]
    (found,) = divergence_findings(write_run(tmp_path / "spread", records, spread))
    assert "(from step 30, flagged at step 50, +0.62 vs -0.1 of their spreads; action: warn)" in found.text


def test_responses_cut_at_the_limit_are_reported_at_the_end_against_the_start(tmp_path):
    records = [dict(healthy_record(s), **{"response_length/clip_ratio": 0.05 if s <= 10 else 0.35,
                                          "response_length/mean": 180.0 if s <= 10 else 410.0}) for s in range(1, 41)]
    run = write_run(tmp_path / "run", records, config={"data": {"max_response_length": 512}})
    (found,) = length_findings(run)
    assert found.numbers == pytest.approx({"first": 0.05, "last": 0.35, "length_first": 180, "length_last": 410})
    assert found.text.startswith("Responses hit the length limit in 35% of samples at the end (from 5%; the last vs "
                                 "the first 10% of steps); mean length 180 -> 410 tokens (data.max_response_length = "
                                 "512): ")
    steady = [dict(r, **{"response_length/clip_ratio": LENGTH_CLIP_WARN * 0.9}) for r in records]
    assert length_findings(write_run(tmp_path / "steady", steady)) == []


def test_updates_skipped_for_non_finite_values_are_grouped_into_ranges(tmp_path):
    events = [event(s, "skip_nonfinite", **{"actor/grad_norm": float("nan")}) for s in (7, 8, 20)]
    (found,) = nonfinite_findings(write_run(tmp_path / "run", [healthy_record(s) for s in range(1, 31)], events))
    assert (found.first, found.last, found.numbers["skipped"]) == (7, 20, 3)
    assert found.text.startswith("The update was skipped for non-finite values (actor/grad_norm) at steps 7-8, 20: ")


def test_a_healthy_run_has_no_problem_and_says_what_was_looked_at(tmp_path):
    run = write_run(tmp_path / "run", [healthy_record(s) for s in range(1, 41)])
    assert findings(run) == [] and health_summary(run) == []
    assert not any(line.startswith("health:") for line in diagnose(run))
    text = render_markdown(build_blocks(run, []))  # the text alone: no plot to draw
    assert "## Health\n\nNo health problem found in the gradient norms, entropy, zero-spread groups, gold reward, " \
           "response length this run logged.\n" in text


def test_the_report_holds_the_health_paragraphs_and_plots_in_markdown(tmp_path):
    run = spike_run(tmp_path)
    assert diagnose(run)[0] == ("health: 2 problems found (grad-norm spikes at steps 12-15; grad-norm spikes at step "
                                "25); see Health.")
    panels = {p.name: p for p in health_panels(run)}
    assert sorted(panels) == ["health_gold", "health_grad_norm", "health_length", "health_zero_spread"]
    actor_axis, critic_axis = panels["health_grad_norm"].axes
    (band,) = actor_axis.bands  # the median up to the skip limit, median x grad_spike: 3 x 3
    assert band.label == "median x 3 (skip limit)" and band.high[0] == 9.0 and band.low[0] == 3.0
    skipped = next(s for s in actor_axis.series if s.label.startswith("skipped"))
    assert (skipped.label, skipped.steps, skipped.values) == ("skipped (4)", [12, 13, 15], [42.0, 42.0, 42.0])
    assert [s.label for s in panels["health_gold"].axes[0].series] == ["val-core/gsm8k/reward/mean@1",
                                                                       "val-gold/reward/mean"]
    report = write_report(run.path)
    text = report.read_text()
    assert "## Health\n\nActor grad norm spiked to 14x its window median" in text
    assert text.index("## Health") < text.index("## Guard events")
    for name in panels:
        assert (report.parent / f"{name}.png").read_bytes()[:4] == b"\x89PNG" and f"]({name}.png)" in text


def test_an_older_run_without_the_health_metrics_renders_html_without_health_plots(tmp_path):
    records = [{"step": s, "critic/score/mean": 0.1 * s, "actor/entropy": 1.0, "actor/kl_to_ref": 0.01}
               for s in range(1, 6)]
    events = [event(3, "rollback", kl=0.2, to_step=2), event(4, "warn_entropy", entropy=0.2)]
    run = write_run(tmp_path / "run", records, events)
    assert findings(run) == []
    report = write_report(run.path, fmt="html")
    text = report.read_text()
    assert "<h2>Health</h2>\n<p>No health problem found in the entropy this run logged.</p>" in text
    assert [p.name for p in health_panels(run)] == ["health_entropy"]  # entropy with its warn_entropy event
    bare = write_run(tmp_path / "bare", [{"step": s, "critic/score/mean": 0.1 * s} for s in range(1, 4)])
    html = write_report(bare.path, fmt="html").read_text()
    assert "<p>No health problem found; this run logged none of the health metrics" in html
    assert health_panels(bare) == [] and not list((bare.path / "report").glob("health_*.png"))
    assert "health_" not in html


def test_a_grad_guard_action_with_no_skip_near_it_is_a_finding_of_its_own(tmp_path):
    records = [healthy_record(s) for s in range(1, 21)]
    events = [event(9, "stop_grad_spike", skips=3, window=5)]
    (found,) = grad_findings(write_run(tmp_path / "run", records, events))
    assert (found.topic, found.first) == ("grad_action", 9)
    assert found.text == "Grad-norm spikes: Stopped the run at step 9 (3 skips within 5 steps)."


def test_without_the_detectors_k_the_grad_plot_has_no_band(tmp_path):
    run = write_run(tmp_path / "run", [healthy_record(s) for s in range(1, 6)])
    (axis,) = next(p for p in health_panels(run) if p.name == "health_grad_norm").axes  # no critic logged
    assert axis.bands == []
    assert [s.label for s in axis.series] == ["actor/grad_norm", "window median"]  # no skip: no markers
