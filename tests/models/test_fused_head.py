"""The chunked LM head must give the naive path's log-probs, entropies and gradients.

Naive path: the whole (N, V) logits, upcast to fp32, divided by the temperature, then
klppo.algo's logprobs_from_logits / entropy_from_logits, differentiated by autograd.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    HyperCLOVAXConfig,
    HyperCLOVAXForCausalLM,
    Qwen2ForCausalLM,
)

from klppo.algo import entropy_from_logits, logprobs_from_logits, sum_pi_squared_from_logits
from klppo.errors import UserError
from klppo.models.forward import HeadSettings, position_ids_from_mask, response_logprobs, response_token_scores
from klppo.models.fused_head import chunked_logprobs, chunked_token_scores, fused_lm_head, head_logit_scale
from klppo.models.load import enable_activation_checkpointing
from klppo.models.tiny import tiny_model_config

HERE = Path(__file__).parent
TOL = dict(atol=1e-5, rtol=1e-5)
TEMPERATURES = [1.0, 0.7, 1.3]


def _naive(hidden, weight, bias, labels, temperature):
    logits = F.linear(hidden, weight, bias).float() / temperature
    return logprobs_from_logits(logits, labels), entropy_from_logits(logits)


def _assert_bf16_close(got: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    """Within 2% in norm: bf16 gradients summed in another order differ by a few bf16 steps
    (2**-8 relative), which elementwise tolerances cannot take where terms cancel."""
    error = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
    assert error < 2e-2, (name, error)


def _loss(lp, ent, g, uses):
    """A loss that weights each token differently; ``uses`` picks which outputs it reads."""
    if uses == "both":
        return (lp * g).sum() + (ent * g.flip(0)).sum()
    return (lp * g).sum() if uses == "log_probs" else (ent * g).sum()


def _case(seed: int, with_bias: bool):
    """Random N, H, V, inputs scaled like a model's (logits of order 1), and a chunk_logits giving
    vocabulary slices of 1 entry, uneven slices, exactly V entries or more than V."""
    g = torch.Generator().manual_seed(seed)
    n, h, v = (int(torch.randint(lo, hi, (), generator=g)) for lo, hi in ((1, 70), (4, 40), (3, 300)))
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h**0.5).requires_grad_()
    bias = (torch.randn(v, generator=g) * 0.1).requires_grad_() if with_bias else None
    labels = torch.randint(v, (n,), generator=g)
    width = [1, 3, 7, max(1, v - 1), v, v + 5][seed % 6]
    return hidden, weight, bias, labels, torch.randn(n, generator=g), n * width


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("uses", ["both", "log_probs", "entropy"])
def test_chunked_head_equals_the_naive_path_in_values_and_gradients(seed, temperature, uses):
    hidden, weight, bias, labels, g, chunk = _case(seed, with_bias=seed % 2 == 0)
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    lp, ent = _naive(hidden, weight, bias, labels, temperature)
    expected = torch.autograd.grad(_loss(lp, ent, g, uses), inputs)
    with_entropy = uses != "log_probs" or seed % 3 == 0  # entropy computed but unused, sometimes
    lp_c, ent_c = chunked_logprobs(hidden, weight, labels, bias=bias, temperature=temperature, chunk_logits=chunk,
                                   with_entropy=with_entropy)
    torch.testing.assert_close(lp_c, lp, **TOL)
    if with_entropy:
        torch.testing.assert_close(ent_c, ent, **TOL)
    else:
        assert ent_c is None
    got = torch.autograd.grad(_loss(lp_c, ent_c, g, uses), inputs)
    for name, a, b in zip(["hidden", "weight", "bias"], got, expected):
        torch.testing.assert_close(a, b, **TOL, msg=name)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_the_sum_of_squared_probabilities_comes_from_the_same_pass_measured_and_leaves_the_gradients_alone(
        seed, temperature):
    hidden, weight, bias, labels, g, chunk = _case(seed, with_bias=seed % 2 == 0)
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    logits = F.linear(hidden, weight, bias).float() / temperature
    lp, ent, squares = chunked_token_scores(hidden, weight, labels, bias=bias, temperature=temperature,
                                            chunk_logits=chunk, with_entropy=seed % 2 == 1, with_sum_pi_squared=True)
    torch.testing.assert_close(squares, torch.softmax(logits, -1).square().sum(-1), **TOL)
    torch.testing.assert_close(squares, sum_pi_squared_from_logits(logits), **TOL)
    assert not squares.requires_grad and (ent is None) == (seed % 2 == 0)
    got = torch.autograd.grad((lp * g).sum(), inputs)
    expected = torch.autograd.grad((logprobs_from_logits(logits, labels) * g).sum(), inputs)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **TOL)


def test_sum_of_squared_probabilities_is_one_over_v_for_a_uniform_distribution_and_one_for_a_certain_one():
    v = 50
    assert sum_pi_squared_from_logits(torch.zeros(3, v)).allclose(torch.full((3,), 1 / v))
    certain = torch.full((1, v), -1e4)
    certain[0, 7] = 0.0
    assert sum_pi_squared_from_logits(certain).item() == pytest.approx(1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("uses", ["both", "log_probs"])
def test_one_slice_keeps_its_logits_for_backward_and_gives_the_recomputed_gradients_bit_for_bit(
        monkeypatch, dtype, temperature, uses):
    from klppo.models import fused_head

    hidden, weight, bias, labels, g, _ = _case(4, with_bias=True)
    hidden, weight, bias = (t.detach().to(dtype).requires_grad_() for t in (hidden, weight, bias))
    linears, linear, keeps_logits = [], F.linear, fused_head._keeps_logits
    monkeypatch.setattr(fused_head.F, "linear", lambda *a: linears.append(1) or linear(*a))

    def scores_and_grads(keeps: bool):
        monkeypatch.setattr(fused_head, "_keeps_logits", keeps_logits if keeps else lambda *a: False)
        linears.clear()
        lp, ent = chunked_logprobs(hidden, weight, labels, bias=bias, temperature=temperature, with_entropy=True,
                                   entropy_grad=uses == "both")
        grads = torch.autograd.grad(_loss(lp, ent, g.to(dtype), uses), (hidden, weight, bias))
        return [lp, ent, *grads], len(linears)

    kept, kept_matmuls = scores_and_grads(True)
    recomputed, recomputed_matmuls = scores_and_grads(False)
    assert (kept_matmuls, recomputed_matmuls) == (1, 2)  # one slice (the default chunk): no second matmul
    assert all(torch.equal(a, b) for a, b in zip(kept, recomputed))


def test_bf16_head_runs_its_matmul_in_bf16_and_its_softmax_in_fp32():
    hidden, weight, _, labels, g, _ = _case(3, with_bias=False)
    hidden16, weight16 = (t.detach().bfloat16().requires_grad_() for t in (hidden, weight))
    lp, ent = _naive(hidden16, weight16, None, labels, 1.3)
    expected = torch.autograd.grad(_loss(lp, ent, g, "both"), [hidden16, weight16])
    lp_c, ent_c = chunked_logprobs(hidden16, weight16, labels, temperature=1.3, chunk_logits=4 * len(labels),
                                   with_entropy=True)
    got = torch.autograd.grad(_loss(lp_c, ent_c, g, "both"), [hidden16, weight16])
    assert lp_c.dtype == ent_c.dtype == torch.float32
    assert got[0].dtype == got[1].dtype == torch.bfloat16
    torch.testing.assert_close(lp_c, lp, **TOL)  # the same bf16 logits, the same math in fp32
    torch.testing.assert_close(ent_c, ent, **TOL)
    for a, b in zip(got, expected):  # bf16 matmuls, the hidden states' gradient summed over slices
        _assert_bf16_close(a, b)


@pytest.fixture
def aot_compiled(monkeypatch):
    """The head's compiled slice functions traced whole by dynamo (fullgraph: no graph break) and run
    through AOT autograd's functionalisation, without inductor's code generation (torch's own,
    and slow to compile on a CPU); a fresh cache of compiled functions."""
    import klppo.models.fused_head as fused_head

    compile_ = torch.compile
    traced = []

    def compile_whole(fn, **kwargs):
        traced.append(fn.__name__)
        return compile_(fn, backend="aot_eager", fullgraph=True, **kwargs)

    monkeypatch.setattr(torch, "compile", compile_whole)
    monkeypatch.setattr(fused_head, "_COMPILED", {})
    monkeypatch.setattr(fused_head, "_COMPILE_FAILED", [])
    return traced


@pytest.mark.parametrize("seed", [0, 3, 5])
def test_the_compiled_slices_give_the_eager_values_and_gradients_for_any_token_count(aot_compiled, seed):
    """CUDA compiles each slice's elementwise work (``compiled=None``); forced here on CPU, for three
    token counts and slice widths (the last slice narrower) with one compilation each."""
    hidden, weight, bias, labels, g, chunk = _case(seed, with_bias=True)
    inputs = [hidden, weight, bias]
    results = []
    for compiled in (False, True):
        lp, ent = chunked_logprobs(hidden, weight, labels, bias=bias, temperature=0.7, chunk_logits=chunk,
                                   with_entropy=True, compiled=compiled)
        results.append([lp, ent, *torch.autograd.grad(_loss(lp, ent, g, "both"), inputs)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, **TOL)
    assert sorted(set(aot_compiled)) == ["_fold_slice", "_slice_grad"] and len(aot_compiled) == 2


def test_the_compiled_slices_measure_the_sum_of_squared_probabilities_as_the_eager_ones(aot_compiled):
    """The optimal token baseline's running sum, through the compiled fold (one more argument)."""
    hidden, weight, bias, labels, _, chunk = _case(3, with_bias=True)
    with torch.no_grad():
        eager, compiled = (chunked_token_scores(hidden, weight, labels, bias=bias, temperature=0.7, chunk_logits=chunk,
                                                with_sum_pi_squared=True, compiled=c) for c in (False, True))
    for a, b in zip(eager, compiled):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, **TOL)
    assert aot_compiled == ["_fold_slice"]


def test_a_head_whose_compilation_fails_runs_eagerly_after_one_warning(monkeypatch):
    import warnings

    import klppo.models.fused_head as fused_head

    def refuse(fn, **kwargs):
        def fails(*args):
            raise RuntimeError("inductor cannot\nlong traceback")
        return fails

    monkeypatch.setattr(torch, "compile", refuse)
    monkeypatch.setattr(fused_head, "_COMPILED", {})
    monkeypatch.setattr(fused_head, "_COMPILE_FAILED", [])
    hidden, weight, bias, labels, _, chunk = _case(1, with_bias=False)
    eager, _ = chunked_logprobs(hidden, weight, labels, chunk_logits=chunk, compiled=False)
    with pytest.warns(UserWarning, match="torch.compile failed .RuntimeError: inductor cannot.; its slices run eagerly"):
        fell_back, _ = chunked_logprobs(hidden, weight, labels, chunk_logits=chunk, compiled=True)
    assert torch.equal(fell_back, eager)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert torch.equal(chunked_logprobs(hidden, weight, labels, chunk_logits=chunk, compiled=True)[0], eager)


def test_the_head_compiles_on_cuda_only_unless_told():
    import klppo.models.fused_head as fused_head

    calls = []
    fn = lambda x: calls.append(x) or "eager"  # noqa: E731
    fn.__name__ = "fn"
    assert fused_head._on_device(fn, None, torch.zeros(1)) == "eager"  # CPU: eager, pinned numbers kept
    assert fused_head._on_device(fn, False, torch.zeros(1, device="meta")) == "eager"
    assert HeadSettings().compiled is None


def test_chunk_logits_below_one_are_refused():
    hidden, weight, _, labels, _, _ = _case(0, with_bias=False)
    with pytest.raises(ValueError, match="chunk_logits=0"):
        chunked_logprobs(hidden, weight, labels, chunk_logits=0)


# ---- inside a Hugging Face model ----


def _model(tied: bool) -> Qwen2ForCausalLM:
    config = tiny_model_config(61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    config.tie_word_embeddings = tied
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config)


def _batch():
    """Left-padded prompts + right-padded responses, one response empty, one column all padding."""
    g = torch.Generator().manual_seed(1)
    prompts, responses, p_width, r_width = (5, 2, 1, 3), (6, 1, 4, 0), 5, 7
    ids = torch.randint(2, 61, (4, p_width + r_width), generator=g)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for row, (p, t) in enumerate(zip(prompts, responses)):
        mask[row, p_width - p : p_width + t] = True
    return torch.where(mask, ids, 0), mask, r_width


def _scores_and_grads(model, head: HeadSettings, *, packed: bool, temperature: float, with_entropy: bool, **kw):
    ids, mask, width = _batch()
    model.zero_grad()
    lp, ent = response_logprobs(model, ids, mask, width, temperature=temperature, with_entropy=with_entropy,
                                packed=packed, head=head, **kw)
    weights = torch.linspace(-1, 1, lp.numel()).view_as(lp)
    ((lp * weights).sum() + (0.3 * ent.sum() if with_entropy else 0)).backward()
    return lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("with_entropy", [True, False])
def test_fused_head_gives_the_unfused_log_probs_entropies_and_parameter_gradients(packed, tied, temperature, with_entropy):
    model = _model(tied)
    kw = dict(packed=packed, temperature=temperature, with_entropy=with_entropy)
    lp, ent, grads = _scores_and_grads(model, HeadSettings(fused=False), **kw)
    lp_f, ent_f, grads_f = _scores_and_grads(model, HeadSettings(fused=True, chunk_logits=40), **kw)
    torch.testing.assert_close(lp_f, lp, **TOL)
    if with_entropy:
        torch.testing.assert_close(ent_f.detach(), ent.detach(), **TOL)
    assert grads_f.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_f[name], grads[name], **TOL, msg=name)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_a_models_sums_of_squared_probabilities_are_the_same_fused_or_not_packed_or_padded(packed, with_entropy):
    model, (ids, mask, width) = _model(tied=False), _batch()
    with torch.no_grad():
        reference = response_token_scores(model, ids, mask, width, temperature=0.7, with_sum_pi_squared=True,
                                          head=HeadSettings(fused=False))
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids_from_mask(mask)).logits
        by_hand = torch.softmax(logits[:, -width - 1:-1].float() / 0.7, -1).square().sum(-1)
        torch.testing.assert_close(reference.sum_pi_squared, torch.where(mask[:, -width:], by_hand, 0.0), **TOL)
        for head in (HeadSettings(fused=False), HeadSettings(fused=True, chunk_logits=40)):
            got = response_token_scores(model, ids, mask, width, temperature=0.7, with_entropy=with_entropy,
                                        with_sum_pi_squared=True, packed=packed, head=head)
            torch.testing.assert_close(got.sum_pi_squared, reference.sum_pi_squared, **TOL)
            torch.testing.assert_close(got.log_probs, reference.log_probs, **TOL)
            assert (got.entropy is not None) == with_entropy


def test_fused_head_works_with_gradient_checkpointing_and_split_packed_rows():
    model = _model(tied=True)
    lp, ent, grads = _scores_and_grads(model, HeadSettings(fused=False), packed=True, temperature=0.7, with_entropy=True)
    enable_activation_checkpointing(model)
    model.train()
    lp_f, ent_f, grads_f = _scores_and_grads(model, HeadSettings(fused=True, chunk_logits=100), packed=True,
                                             temperature=0.7, with_entropy=True, max_tokens=12)
    torch.testing.assert_close(lp_f, lp, **TOL)
    torch.testing.assert_close(ent_f, ent, **TOL)
    for name in grads:
        torch.testing.assert_close(grads_f[name], grads[name], **TOL, msg=name)


@pytest.mark.parametrize("head", [HeadSettings(fused=False, entropy_chunking=True),
                                  HeadSettings(fused=False, entropy_checkpointing=True),
                                  HeadSettings(fused=False, entropy_chunking=True, entropy_checkpointing=True),
                                  HeadSettings(fused=False, entropy_chunking=True, entropy_chunk_rows=3)])
def test_entropy_chunking_and_checkpointing_do_not_change_numbers(head):
    model = _model(tied=True)
    lp, ent, grads = _scores_and_grads(model, HeadSettings(fused=False), packed=False, temperature=1.3, with_entropy=True)
    lp_o, ent_o, grads_o = _scores_and_grads(model, head, packed=False, temperature=1.3, with_entropy=True)
    assert torch.equal(lp_o, lp) and torch.equal(ent_o, ent)
    for name in grads:
        torch.testing.assert_close(grads_o[name], grads[name], **TOL, msg=name)


@pytest.mark.parametrize("head", [HeadSettings(fused=True, chunk_logits=40), HeadSettings(fused=False),
                                  HeadSettings(fused=False, entropy_checkpointing=True)])
@pytest.mark.parametrize("packed", [False, True])
def test_an_entropy_without_gradient_changes_no_number_of_a_loss_without_it(head, packed):
    """The actor's update with entropy_coeff 0: the same log-probs, entropies and gradients bit for bit
    as with the entropy in the loss at weight 0, and the entropy is a plain measurement."""
    model, ids_mask_width = _model(tied=False), _batch()

    def run(entropy_grad: bool):
        model.zero_grad()
        lp, ent = response_logprobs(model, *ids_mask_width, temperature=0.7, with_entropy=True,
                                    entropy_grad=entropy_grad, packed=packed, head=head)
        loss = (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum()
        (loss - 0.0 * ent.sum() if entropy_grad else loss).backward()
        return lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}

    lp, ent, grads = run(entropy_grad=True)
    lp_m, ent_m, grads_m = run(entropy_grad=False)
    assert not ent_m.requires_grad and torch.equal(lp_m, lp) and torch.equal(ent_m, ent.detach())
    assert all(torch.equal(grads_m[name], grads[name]) for name in grads)


def test_the_head_is_restored_after_the_forward_even_when_it_fails():
    model = _model(tied=True)
    keys = list(model.state_dict())
    with pytest.raises(RuntimeError):
        with fused_lm_head(model, torch.zeros(1, 3, dtype=torch.long)):
            model(torch.ones(1, 3, dtype=torch.long), logits_to_keep=torch.arange(2))  # 2 positions, 3 labels
    assert "forward" not in vars(model.lm_head)
    assert list(model.state_dict()) == keys
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model(torch.ones(1, 3, dtype=torch.long)).logits.shape == (1, 3, 61)


# ---- models that change their logits after the head ----

# Tiny members of the families that do (random weights, 61 tokens, one decoder block each).
_SIZES = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, pad_token_id=0, bos_token_id=0, eos_token_id=1)
RESCALING = {
    "granite": lambda: GraniteForCausalLM(GraniteConfig(**_SIZES, logits_scaling=8.0)),  # logits / 8
    "hyperclovax": lambda: HyperCLOVAXForCausalLM(HyperCLOVAXConfig(**_SIZES, logits_scaling=0.25)),  # logits * 0.25
    "cohere": lambda: CohereForCausalLM(CohereConfig(**_SIZES, logit_scale=3.0)),  # logits * 3
}


def _gemma2() -> Gemma2ForCausalLM:
    """Gemma2's final soft-capping: logits = 30 tanh(head / 30), no constant factor."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Gemma2ForCausalLM(Gemma2Config(**_SIZES, head_dim=16, final_logit_softcapping=30.0))


def _own_scores(model, temperature: float):
    """The model's own logits at the response positions of ``_batch()`` -> log-probs and entropies (B, T)."""
    ids, mask, width = _batch()
    logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids_from_mask(mask),
                   use_cache=False).logits[:, -width - 1 : -1].float() / temperature
    real = mask[:, -width:]
    return (torch.where(real, logprobs_from_logits(logits, ids[:, -width:]), 0.0),
            torch.where(real, entropy_from_logits(logits), 0.0))


@pytest.mark.parametrize("family", sorted(RESCALING))
@pytest.mark.parametrize("packed", [False, True])
def test_a_model_that_rescales_its_logits_gets_its_own_log_probs_and_entropies(family, packed):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = RESCALING[family]()
    with torch.no_grad():
        for param in model.parameters():  # logits of order 10 before the model's rescaling
            param.normal_(0.0, 0.5)
    expected_lp, expected_ent = _own_scores(model, 0.7)
    for head in (HeadSettings(), HeadSettings(fused=True, chunk_logits=40), HeadSettings(fused=False)):
        lp, ent, grads = _scores_and_grads(model, head, packed=packed, temperature=0.7, with_entropy=True)
        torch.testing.assert_close(lp, expected_lp, **TOL, msg=f"{head}")
        torch.testing.assert_close(ent.detach(), expected_ent, **TOL, msg=f"{head}")
        if head.fused is False:
            unfused_grads = grads
        else:
            fused_grads = grads
    for name in unfused_grads:  # of order 1 after a rescaling by 3, summed in another order: 1e-4
        torch.testing.assert_close(fused_grads[name], unfused_grads[name], atol=1e-4, rtol=1e-4, msg=name)
    assert HeadSettings().fused_for(model)  # the rescaling is folded in, not given up on


def test_a_model_that_soft_caps_its_logits_gets_the_whole_logits_and_refuses_the_fused_head():
    model = _gemma2()
    assert not HeadSettings().fused_for(model) and not HeadSettings(fused=False).fused_for(model)
    lp, ent, _ = _scores_and_grads(model, HeadSettings(), packed=False, temperature=1.0, with_entropy=True)
    expected_lp, expected_ent = _own_scores(model, 1.0)
    torch.testing.assert_close(lp, expected_lp, **TOL)
    torch.testing.assert_close(ent.detach(), expected_ent, **TOL)
    with pytest.raises(UserError, match="soft-capping.*use_fused_kernels=false"):
        _scores_and_grads(model, HeadSettings(fused=True), packed=False, temperature=1.0, with_entropy=False)


def test_measuring_the_logit_scale_moves_no_random_stream_and_keeps_each_modules_mode():
    model = RESCALING["granite"]()
    model.train()
    model.model.layers[0].eval()  # a module in another mode than its parent keeps it
    torch.manual_seed(5)
    expected_after = torch.rand(3)
    torch.manual_seed(5)
    assert head_logit_scale(model) == 1 / 8
    assert torch.equal(torch.rand(3), expected_after)
    assert model.training and not model.model.layers[0].training and model.model.norm.training
    assert "forward" not in vars(model.lm_head)


def test_fused_head_without_autograd_gives_the_same_scores():
    model, (ids, mask, width) = _model(tied=False), _batch()
    with torch.no_grad():
        lp, ent = response_logprobs(model, ids, mask, width, with_entropy=True, packed=True)
    with torch.inference_mode():
        lp_f, ent_f = response_logprobs(model, ids, mask, width, with_entropy=True, packed=True,
                                        head=HeadSettings(fused=True, chunk_logits=50))
    torch.testing.assert_close(lp_f, lp, **TOL)
    torch.testing.assert_close(ent_f, ent, **TOL)


# ---- under FSDP2 ----


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_worker(folder: Path, nproc: int) -> None:
    """The worker as one plain process (a group of one, no rendezvous) or under torchrun."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    runner = [] if nproc == 1 else ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                                    "--master_addr=127.0.0.1", f"--master_port={_free_port()}"]
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, *runner, str(HERE / "fused_head_fsdp_worker.py"), str(folder)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def fsdp_runs(request, tmp_path_factory):
    """(plain model, ranks, {case: (log-probs, entropies, grads)}) from FSDP2 over 1 or 2 ranks."""
    folder = tmp_path_factory.mktemp("fused_fsdp")
    cases = {f"{layout}/{'fused' if fused else 'unfused'}": dict(packed=layout == "packed", fused=fused)
             for layout in ("padded", "packed") for fused in (False, True)}
    cases.update({f"bf16/{'fused' if fused else 'unfused'}": dict(packed=True, fused=fused, param_dtype=torch.bfloat16)
                  for fused in (False, True)})
    model = _model(tied=True)
    torch.save(dict(model=model, batch=_batch(), cases=cases), folder / "inputs.pt")
    _run_worker(folder, request.param)
    return model, request.param, torch.load(folder / "results.pt", weights_only=False)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_fused_head_under_fsdp2_gives_the_unsharded_log_probs_and_gradients(fsdp_runs, layout):
    model, ranks, results = fsdp_runs
    lp, ent, grads = _scores_and_grads(model, HeadSettings(fused=False), packed=layout == "packed", temperature=0.7,
                                       with_entropy=True)
    grads = {name: g * ranks for name, g in grads.items()}  # every rank ran the same batch; FSDP2 sums
    for case in (f"{layout}/unfused", f"{layout}/fused"):
        lp_s, ent_s, grads_s = results[case]
        torch.testing.assert_close(lp_s, lp, **TOL, msg=case)
        torch.testing.assert_close(ent_s, ent.detach(), **TOL, msg=case)
        assert grads_s.keys() == grads.keys()
        for name in grads:
            torch.testing.assert_close(grads_s[name], grads[name], **TOL, msg=f"{case} {name}")


def test_fused_head_under_fsdp2_bf16_mixed_precision_matches_the_unfused_head(fsdp_runs):
    _, _, results = fsdp_runs
    (lp, ent, grads), (lp_f, ent_f, grads_f) = results["bf16/unfused"], results["bf16/fused"]
    torch.testing.assert_close(lp_f, lp, **TOL)  # the same bf16 logits, the same fp32 softmax
    torch.testing.assert_close(ent_f, ent, **TOL)
    for name in grads:  # bf16 matmuls over other splits of the work
        _assert_bf16_close(grads_f[name], grads[name], name)



def test_the_default_head_is_fused_where_the_model_allows_it_and_whole_logits_elsewhere():
    model = _model(tied=True)
    assert HeadSettings().fused_for(model) and not HeadSettings(fused=False).fused_for(model)
    assert head_logit_scale(model) == 1.0
    assert not HeadSettings().fused_for(_gemma2())  # soft-capped: the head's numbers are not the logits
