"""The offline KL probe's cadence in a run: every 4th step by default and the step after each
checkpoint (whose KL certifies it for rollbacks, whatever save_freq is); a resumed run probes
on the same steps as the uninterrupted one."""

from klppo.checkpoint.state import load_checkpoint
from klppo.commands.main_ppo import run_ppo

quiet = lambda *a, **k: None  # noqa: E731


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/"))}


def test_an_offline_run_probes_every_4th_step_and_after_each_checkpoint_and_resumes_alike(
        ppo_overrides, tmp_path, crash_after_logging):
    changes = {"trainer.total_training_steps": 6, "trainer.save_freq": 3}  # fixed KL coefficient: cadence 4
    full = run_ppo(None, ppo_overrides(tmp_path / "full", **changes), print_fn=quiet)
    assert [r["step"] for r in full if "actor/kl_to_ref_sampled" in r] == [1, 4, 5]
    assert all(r["actor/kl_to_ref"] == r["actor/kl_to_ref_sampled"] for r in full if "actor/kl_to_ref_sampled" in r)
    assert [r["step"] for r in full if "timing_s/kl_probe" in r] == [1, 4, 5]
    assert load_checkpoint(tmp_path / "full" / "global_step_6")["guard"]["good_checkpoints"] == [3]

    with crash_after_logging(5):  # its newest checkpoint is step 3's, which step 4 certifies again
        run_ppo(None, ppo_overrides(tmp_path / "crashed", **changes), print_fn=quiet)
    resumed = run_ppo(None, ppo_overrides(tmp_path / "crashed", **changes), print_fn=quiet)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [_comparable(r) for r in resumed] == [_comparable(r) for r in full[3:]]
