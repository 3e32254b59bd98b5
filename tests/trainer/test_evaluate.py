"""Validation follows the rule every phase does: a batch is scored on the run's device
(``DistEnv.device``), whatever device the rollout built it on; its sampling is seeded there."""

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from offload_kit import RecordingLinear

from klppo.data.rl_dataset import PromptRecord
from klppo.distributed import SINGLE_PROCESS, DistEnv
from klppo.rollout.batch import assemble_batch
from klppo.rollout.hf import Decoding, SamplingParams
from klppo.trainer import evaluate
from klppo.run.offload import Offloader
from klppo.run.settings import KLSettings
from klppo.safety.guards import GuardSettings, RunGuard


def records(n: int) -> list[PromptRecord]:
    return [PromptRecord(i, "arith", [], [5, 6, 7][: 1 + i % 3], None, {}) for i in range(n)]


def test_validation_scores_the_batch_on_the_runs_device_not_where_the_rollout_left_it(monkeypatch):
    # The meta device stands in for a GPU: the rollout hands back a CPU batch, as hf_rollout does.
    device = torch.device("meta")
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=device, is_distributed=False)
    rollout_devices, scored_devices = [], []

    def fake_rollout(actor, part, tokenizer, params, *, synced_gpus, device, decoding, multi_turn, keep_going):
        rollout_devices.append(device)
        ids = torch.tensor([[3, 4, 1]] * len(part) * params.n)
        return assemble_batch(part, params.n, 0, ids, torch.tensor([[True, True, False]] * len(ids)))

    def scorer(batch, places):
        scored_devices.append({t.device for t in (batch.input_ids, batch.attention_mask, batch.group_index)})
        return torch.ones(len(batch), batch.response_length)

    monkeypatch.setattr(evaluate, "hf_rollout", fake_rollout)
    metrics = evaluate.validate(None, records(5), None, scorer, SamplingParams(n=2), batch_size=3, env=env)
    assert rollout_devices == [device, device]  # generation computes on the run's device
    assert scored_devices == [{device}, {device}]
    assert metrics["val-core/arith/reward/mean@2"] == 3.0  # 3 ones per response, the padding included
    assert metrics["val-aux/response_length/mean"] == 2.0


def test_validation_leaves_the_training_random_stream_where_it_was(monkeypatch):
    env = DistEnv(rank=1, world_size=2, local_rank=0, device=torch.device("cpu"), is_distributed=False)
    drawn = []

    def fake_rollout(actor, part, tokenizer, params, *, synced_gpus, device, decoding, multi_turn, keep_going):
        drawn.append(torch.rand(1))  # sampling draws from the global stream
        ids = torch.tensor([[3, 4]] * len(part) * params.n)
        return assemble_batch(part, params.n, 0, ids, torch.ones_like(ids, dtype=torch.bool))

    monkeypatch.setattr(evaluate, "hf_rollout", fake_rollout)
    scorer = lambda batch, places: torch.zeros(len(batch), batch.response_length)  # noqa: E731
    torch.manual_seed(11)
    expected = torch.rand(4)
    torch.manual_seed(11)
    evaluate.validate(None, records(2), None, scorer, SamplingParams(), env=env)
    evaluate.validate(None, records(2), None, scorer, SamplingParams(), env=env)
    assert torch.equal(torch.rand(4), expected)
    assert torch.equal(drawn[0], drawn[1])  # seeded per call (and rank): the same draw each validation
    assert torch.equal(drawn[0], torch.rand(1, generator=torch.Generator().manual_seed(1)))


def test_the_offline_kl_probe_samples_and_scores_with_actor_and_reference_on_the_device(monkeypatch):
    # param_offload keeps both on CPU between phases; the probe runs after scoring has sent them back.
    actor, ref = RecordingLinear(), RecordingLinear()
    offloader = Offloader(torch.device("cuda", 0))  # nothing is moved for real: .to() is recorded
    offloader.register("actor", actor, param_offload=True)
    offloader.register("ref", ref, param_offload=True)
    kl_settings = KLSettings(True, "kl", "fixed", 0.1, 6.0, 10000, offline_kl="sampled", probe_prompts=2)
    parts = SimpleNamespace(actor=actor, ref=ref, offloader=offloader, tokenizer=None, env=SINGLE_PROCESS,
                            settings=SimpleNamespace(kl=kl_settings, sampling=SamplingParams(), hf_decoding=Decoding(),
                                                     forwards=SimpleNamespace(head=None)))
    where = []

    @contextmanager
    def plain_actor(parts):
        yield parts.actor, False

    def probe(*args, **kwargs):
        where.append((actor.moves[-1], ref.moves[-1]))
        return 0.25

    monkeypatch.setattr(evaluate, "generation_model", plain_actor)
    monkeypatch.setattr(evaluate, "sampled_kl_to_ref", probe)
    batch = SimpleNamespace(rollout_log_probs=None)  # recorded responses without behaviour log-probs
    kl, metrics = evaluate.offline_policy_kl(parts, batch, records(4), step=3)
    assert (kl, metrics) == (0.25, {"actor/kl_to_ref_sampled": 0.25})
    assert where == [("cuda", "cuda")]
    assert actor.moves[-1] == ref.moves[-1] == "cpu"  # and back afterwards


@pytest.mark.parametrize("every, saved_at, due", [
    (1, None, [1, 2, 3, 4, 5, 6, 7, 8]),
    (4, None, [1, 5]),  # every 4th step from the first
    (4, 2, [1, 3, 5]),  # and the step after a checkpoint the KL guard must certify, whatever save_freq is
    (4, 4, [1, 5]),
])
def test_the_offline_kl_probe_runs_on_its_cadence_and_after_each_checkpoint(every, saved_at, due):
    guard = RunGuard(GuardSettings(early_stop_kl=0.2, rollback_kl=0.15, rollback_lr=1e-6, max_rollbacks=1,
                                   max_nonfinite_steps=3, entropy_floor=None, clipfrac_max=None))
    kl_settings = KLSettings(False, "kl", "fixed", 0.1, 6.0, 10000, offline_kl="sampled", probe_every=every)
    parts = SimpleNamespace(settings=SimpleNamespace(kl=kl_settings))
    batch = SimpleNamespace(rollout_log_probs=None)
    measured = []
    for step in range(1, 9):
        if evaluate.offline_kl_due(parts, batch, step, guard):
            measured.append(step)
            guard.check_kl(step, 0.01)  # the measurement certifies a waiting checkpoint
        if step == saved_at:
            guard.checkpoint_saved(step)
    assert measured == due
    assert guard.good_checkpoints == ([saved_at] if saved_at else [])
