"""Host-device syncs in the hot paths, counted on CPU by wrapping the tensor methods that read a
device value on the host: a forward (and its backward, recomputation included) reads the rows'
spans once, not once per attention layer; an update reads them once for all its micro-batches
(none per micro-batch); a batch's index goes to each device once; a fused optimiser step decides
on a non-finite gradient norm without the host."""

import os
import sys
from collections import Counter

import pytest
import torch
from transformers import Qwen2ForCausalLM, Qwen2ForTokenClassification

from klppo.data.batching import MicroBatching
from klppo.models.attention import PACKED_SDPA, use_packed_attention
from klppo.models.forward import response_logprobs, response_values
from klppo.models.load import enable_activation_checkpointing
from klppo.models.fused_head import head_logit_scale
from klppo.models.rng import seeded
from klppo.models.tiny import tiny_model_config
from klppo.rollout.batch import RolloutBatch
from klppo.run.settings import ActorUpdateSettings, CriticUpdateSettings
from klppo.trainer.update import optimizer_step, update_actor, update_critic

SYNCING = ("tolist", "item", "__bool__", "__int__", "__float__", "nonzero")


class Syncs(Counter):
    """Calls of the syncing tensor methods by name; ``callers``: the file each was called from."""

    callers: list[str]

    def clear(self) -> None:
        super().clear()
        self.callers = []

    def in_klppo(self) -> int:
        """The calls klppo's own code made (transformers' and torch's left out)."""
        return sum(f"{os.sep}klppo{os.sep}" in caller for caller in self.callers)


@pytest.fixture
def syncs(monkeypatch) -> Syncs:
    """Calls of the tensor methods that wait for the device (on CUDA), by name."""
    counts = Syncs()
    counts.clear()
    for name in SYNCING:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            counts.callers.append(sys._getframe(1).f_code.co_filename)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return counts


def model(layers: int, cls=Qwen2ForCausalLM, checkpointing: bool = False):
    config = tiny_model_config(50, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                               num_key_value_heads=1)
    config.num_labels = 1
    with seeded(0, torch.device("cpu")):
        m = cls(config)
    m.config.use_cache = False
    if checkpointing:
        enable_activation_checkpointing(m)
    assert use_packed_attention(m) == PACKED_SDPA
    return m


def batch(padded: bool):
    """3 rows of prompt (4) + response (5); with padding when ``padded``."""
    ids = torch.randint(1, 50, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 9, dtype=torch.bool)
    if padded:
        mask[0, :2] = False  # a shorter prompt
        mask[1, 7:] = False  # a shorter response
    return ids, mask


def syncs_of(run, counts: Syncs, klppo_only: bool = False) -> int:
    counts.clear()
    run()
    return counts.in_klppo() if klppo_only else sum(counts.values())


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("padded", [True, False])
def test_a_forward_and_backward_read_lengths_as_often_with_four_layers_as_with_two(syncs, packed, padded):
    ids, mask = batch(padded)

    def run(layers: int):
        m = model(layers, checkpointing=True)
        head_logit_scale(m)  # measured once per model, by a forward of its own: not this forward's

        def step():
            log_prob, entropy = response_logprobs(m, ids, mask, 5, packed=packed, with_entropy=True)
            (log_prob.sum() + entropy.sum()).backward()  # recomputes every layer's forward
        return step

    two, four = syncs_of(run(2), syncs), syncs_of(run(4), syncs)
    assert two == four, f"{four - two} more host syncs with 2 more layers"
    # klppo reads the rows' spans (packing, the read positions and trimming are host arithmetic);
    # transformers' mask preparation adds its own, once per forward: a packed row's search for
    # packed sequences in the position ids (masking_utils.find_packed_sequence_indices), a padded
    # batch's checks of its mask
    assert syncs.in_klppo() == 1 and four <= 3, syncs.callers


def rollout_batch(rows: int, seed: int = 0) -> RolloutBatch:
    """``rows`` responses of 3-9 tokens to prompts of 2-6 (left-padded to 6, right-padded to 9),
    scored as a PPO step would have scored them."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens = torch.randint(2, 7, (rows,), generator=g), torch.randint(3, 10, (rows,), generator=g)
    prompt_mask = torch.arange(6) >= 6 - prompt_lens[:, None]
    response_mask = torch.arange(9) < response_lens[:, None]
    ids = lambda width: torch.randint(3, 50, (rows, width), generator=g)  # noqa: E731
    scores = lambda: torch.randn(rows, 9, generator=g) * response_mask  # noqa: E731
    return RolloutBatch(prompt_ids=ids(6) * prompt_mask, prompt_mask=prompt_mask, response_ids=ids(9) * response_mask,
                        response_mask=response_mask, group_index=torch.arange(rows) // 2, data_sources=["t"] * rows,
                        ground_truths=[None] * rows, extra_infos=[{}] * rows, old_log_prob=-scores().abs() - 3,
                        ref_log_prob=-scores().abs() - 3, values=scores(), advantages=scores(), returns=scores())


def actor_settings(max_tokens: int) -> ActorUpdateSettings:
    return ActorUpdateSettings(
        mini_batch_rows=8, micro=MicroBatching(max_tokens=max_tokens, packed=True), ppo_epochs=2, clip_ratio_low=0.2,
        clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True,
        kl_loss_coef=0.001, kl_loss_type="low_var_kl", grad_clip=1.0, temperature=1.0)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_an_update_reads_the_rows_once_however_many_micro_batches_it_runs(syncs, checkpointing):
    """16 rows, 2 mini-batches, 2 epochs: a token budget of 160 runs 4 micro-batches, one of 40
    at least twice as many; a fused AdamW (torch's on CUDA parameters, klppo's ``build_optimizer``) steps 4
    times without the host reading the gradient norm. klppo's code in the whole update: the rows'
    spans, once; transformers' packed-sequence search adds one per micro-batch's forward."""
    counts, micro_batches = [], []
    for budget in (160, 40):
        actor = model(2, checkpointing=checkpointing)
        head_logit_scale(actor)  # measured once per model, with one host sync of its own
        optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-3, fused=True)
        forwards = []
        hook = actor.register_forward_hook(lambda *args: forwards.append(1))
        total = syncs_of(lambda: update_actor(actor, optimizer, rollout_batch(16), actor_settings(budget)), syncs)
        hook.remove()
        micro_batches.append(len(forwards))  # the model-level forward: once per micro-batch, recomputed or not
        counts.append((syncs.in_klppo(), total))
    assert micro_batches[0] == 4 and micro_batches[1] >= 8, micro_batches
    assert counts == [(1, 1 + m) for m in micro_batches], (micro_batches, counts)
    critic = model(2, Qwen2ForTokenClassification)
    optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-3, fused=True)
    critic_settings = CriticUpdateSettings(mini_batch_rows=8, micro=MicroBatching(max_tokens=40, packed=True),
                                           ppo_epochs=2, cliprange_value=0.5, loss_agg_mode="token-mean", grad_clip=1.0)
    assert syncs_of(lambda: update_critic(critic, optimizer, rollout_batch(16), critic_settings), syncs, True) == 1


def test_critic_values_read_lengths_once_per_forward_not_per_layer(syncs):
    ids, mask = batch(padded=True)
    counts = [syncs_of(lambda: response_values(model(layers, Qwen2ForTokenClassification), ids, mask, 5, packed=True),
                       syncs) for layers in (2, 4)]
    assert counts[0] == counts[1]


def test_a_packed_row_without_bounds_still_splits_its_sequences_reading_them_in_each_layer(syncs):
    # Callers outside klppo's forwards (generation, tests) pass no bounds: cu_seq_lens_q is read per layer.
    m = model(2)
    ids = torch.randint(1, 50, (1, 7), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    syncs.clear()
    together = m(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu, use_cache=False).logits
    assert syncs["tolist"] == 2  # once per layer
    apart = torch.cat([m(input_ids=ids[:, :3]).logits, m(input_ids=ids[:, 3:]).logits], dim=1)
    torch.testing.assert_close(together, apart)


def test_select_copies_the_index_to_each_device_once_without_waiting(monkeypatch):
    moves = []
    original = torch.Tensor.to

    def to(self, *args, **kwargs):
        if self.dtype == torch.long and self.dim() == 1 and len(self) == 2:
            moves.append((args, kwargs.get("non_blocking", False)))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    meta = lambda *shape, dtype=torch.float32: torch.zeros(*shape, dtype=dtype, device="meta")  # noqa: E731
    b = RolloutBatch(prompt_ids=meta(4, 3, dtype=torch.long), prompt_mask=meta(4, 3, dtype=torch.bool),
                     response_ids=meta(4, 5, dtype=torch.long), response_mask=meta(4, 5, dtype=torch.bool),
                     group_index=meta(4, dtype=torch.long), data_sources=list("abcd"), ground_truths=[None] * 4,
                     extra_infos=[{}] * 4, old_log_prob=meta(4, 5), advantages=meta(4, 5))
    picked = b.select([3, 1])
    assert moves == [((torch.device("meta"),), True)]  # one copy for six tensors, non-blocking
    assert picked.data_sources == ["d", "b"] and picked.advantages.shape == (2, 5)


def test_a_fused_optimizer_skips_a_non_finite_step_without_a_host_sync(monkeypatch):
    def step(grad: float):
        torch.manual_seed(0)
        net = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.1, fused=True)
        net(torch.ones(1, 3)).sum().backward()
        net.weight.grad.fill_(grad)
        before = [p.detach().clone() for p in net.parameters()]
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "__bool__", lambda self: pytest.fail("host sync in a fused optimizer step"))
            norm = optimizer_step(net, opt, grad_clip=1.0)
        after = list(net.parameters())
        steps = [float(s["step"]) for s in opt.state.values()]
        return norm, [torch.equal(a, b) for a, b in zip(after, before)], steps, opt

    norm, unchanged, steps, opt = step(float("nan"))
    assert torch.isnan(norm) and unchanged == [True, True] and steps == [0.0, 0.0]
    assert not hasattr(opt, "found_inf")
    norm, unchanged, steps, _ = step(1.0)
    assert torch.isfinite(norm) and unchanged == [False, False] and steps == [1.0, 1.0]
