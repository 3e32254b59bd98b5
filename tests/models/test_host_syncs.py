"""Host-device syncs in the hot paths, counted on CPU by wrapping the tensor methods that read a
device value on the host: a forward (and its backward, recomputation included) reads sequence
lengths a fixed number of times, not once per attention layer; a batch's index goes to each
device once; a fused optimiser step decides on a non-finite gradient norm without the host."""

from collections import Counter

import pytest
import torch
from transformers import Qwen2ForCausalLM, Qwen2ForTokenClassification

from klppo.models.attention import PACKED_SDPA, use_packed_attention
from klppo.models.forward import response_logprobs, response_values
from klppo.models.fused_head import head_logit_scale
from klppo.models.rng import seeded
from klppo.models.tiny import tiny_model_config
from klppo.rollout.batch import RolloutBatch
from klppo.trainer.update import optimizer_step

SYNCING = ("tolist", "item", "__bool__", "__int__", "__float__", "nonzero")


@pytest.fixture
def syncs(monkeypatch) -> Counter:
    """Calls of the tensor methods that wait for the device (on CUDA), by name."""
    counts: Counter = Counter()
    for name in SYNCING:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
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
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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


def syncs_of(run, counts: Counter) -> int:
    counts.clear()
    run()
    return sum(counts.values())


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
    assert four <= 4, four  # the lengths, the packed positions and the read-out, once each


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
