"""Packed forwards (use_remove_padding) must score every sequence exactly as the padded forward does."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM, Qwen2ForTokenClassification

from klppo.data.batching import RowSpans, pack, row_spans
from klppo.models.attention import PACKED_SDPA, PACKED_VARLEN, set_packed_attention, use_packed_attention
from klppo.models.forward import response_logprobs, response_values
from klppo.models.tiny import tiny_model_config

# PACKED_VARLEN runs fp32 packed rows as one sdpa call with a block-diagonal mask (no varlen kernel on CPU)
IMPLEMENTATIONS = ["sdpa", "eager", PACKED_SDPA, PACKED_VARLEN]


def _models(implementation: str):
    """A tiny actor and critic with large random weights, so sequences that leak into each other show."""
    config = tiny_model_config(64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    config.initializer_range, config.num_labels = 0.5, 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        actor, critic = Qwen2ForCausalLM(config).eval(), Qwen2ForTokenClassification(config).eval()
    actor.set_attn_implementation(implementation)
    critic.set_attn_implementation(implementation)
    return actor, critic


def _batch(prompt_lens=(6, 3, 1, 4, 2), response_lens=(7, 1, 4, 0, 3), prompt_width=6, response_width=8):
    """Left-padded prompts + right-padded responses (one empty response, one 1-token prompt)."""
    g = torch.Generator().manual_seed(1)
    rows, width = len(prompt_lens), prompt_width + response_width
    ids = torch.randint(2, 64, (rows, width), generator=g)
    mask = torch.zeros(rows, width, dtype=torch.bool)
    for row, (p, t) in enumerate(zip(prompt_lens, response_lens)):
        mask[row, prompt_width - p : prompt_width + t] = True
    return torch.where(mask, ids, 0), mask, response_width


def _alone(model, ids, mask, response_width, row):
    """Log-probs of one sequence forwarded on its own, without any padding."""
    seq = ids[row, mask[row]].unsqueeze(0)
    response = int(mask[row, -response_width:].sum())
    log_probs, _ = response_logprobs(model, seq, torch.ones_like(seq, dtype=torch.bool), max(response, 1))
    return log_probs[0, :response]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_packed_log_probs_entropies_and_values_equal_the_padded_ones(implementation):
    actor, critic = _models(implementation)
    ids, mask, width = _batch()
    with torch.no_grad():
        lp, ent = response_logprobs(actor, ids, mask, width, with_entropy=True, temperature=0.7)
        lp_packed, ent_packed = response_logprobs(actor, ids, mask, width, with_entropy=True, temperature=0.7, packed=True)
        values = response_values(critic, ids, mask, width)
        values_packed = response_values(critic, ids, mask, width, packed=True)
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp_packed, lp, **tol)
    torch.testing.assert_close(ent_packed, ent, **tol)
    torch.testing.assert_close(values_packed, values, **tol)
    response_mask = mask[:, -width:]
    assert (lp[~response_mask] == 0).all() and (values_packed[~response_mask] == 0).all()
    assert lp.abs().sum() > 0 and values.abs().sum() > 0


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_every_packed_sequence_scores_as_if_it_were_alone(implementation):
    actor, _ = _models(implementation)
    ids, mask, width = _batch()
    with torch.no_grad():
        packed, _ = response_logprobs(actor, ids, mask, width, packed=True)
        for row in range(len(ids)):
            alone = _alone(actor, ids, mask, width, row)
            torch.testing.assert_close(packed[row, : len(alone)], alone, atol=1e-5, rtol=1e-5)


def test_a_packed_row_over_the_budget_is_split_with_the_same_results():
    actor, critic = _models(PACKED_SDPA)
    ids, mask, width = _batch()
    with torch.no_grad():
        whole, _ = response_logprobs(actor, ids, mask, width, packed=True)
        split, _ = response_logprobs(actor, ids, mask, width, packed=True, max_tokens=10)
        values = response_values(critic, ids, mask, width, packed=True)
        values_split = response_values(critic, ids, mask, width, packed=True, max_tokens=10)
    torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(values_split, values, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("packed", [True, False])
def test_forwards_from_the_rows_spans_equal_forwards_that_read_the_mask_bit_for_bit(packed):
    """Spans marked not contiguous send every forward back to reading the mask (nonzero) as before."""
    actor, critic = _models(PACKED_SDPA)
    ids, mask, width = _batch()
    spans = row_spans(mask)
    by_mask = RowSpans(spans.starts, spans.lengths, contiguous=False)
    results = []
    for given in (None, spans, by_mask):
        actor.zero_grad()
        lp, ent = response_logprobs(actor, ids, mask, width, with_entropy=True, packed=packed, max_tokens=12, spans=given)
        values = response_values(critic, ids, mask, width, packed=packed, max_tokens=12, spans=given)
        (lp.sum() + ent.sum()).backward()
        results.append([lp, ent, values, *(p.grad for p in actor.parameters())])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other, results[0]))


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_with_the_cache_on_transformers_lets_packed_sequences_see_each_other(implementation):
    # Why every forward passes use_cache=False: with a cache, masking_utils skips the search
    # for packed sequences in position_ids and the row is one long causal sequence.
    actor, _ = _models(implementation)
    ids, mask, _ = _batch()
    packed = pack(ids, mask)
    with torch.no_grad():
        isolated = actor(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits
        leaked = actor(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=True).logits
    first = int(packed.cu_seqlens[1])
    torch.testing.assert_close(leaked[:, :first], isolated[:, :first])  # the first sequence has no one before it
    assert (leaked[:, first:] - isolated[:, first:]).abs().max() > 1e-2


@pytest.mark.parametrize("packed_attention", [PACKED_SDPA, PACKED_VARLEN])
def test_packed_attention_gradients_equal_sdpa_gradients(packed_attention):
    ids, mask, width = _batch()
    grads = {}
    for implementation in ("sdpa", packed_attention):
        actor, _ = _models(implementation)
        lp, ent = response_logprobs(actor, ids, mask, width, with_entropy=True, packed=True)
        (lp.sum() + ent.sum()).backward()
        grads[implementation] = [p.grad.clone() for p in actor.parameters()]
    for a, b in zip(grads["sdpa"], grads[packed_attention]):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)  # sums over the whole row: fp32 noise


@pytest.mark.parametrize("packed_attention", [PACKED_SDPA, PACKED_VARLEN])
def test_packed_attention_generates_like_sdpa_and_is_not_saved(tmp_path, packed_attention):
    ids, mask, _ = _batch(response_lens=(0, 0, 0, 0, 0), response_width=0)  # left-padded prompts
    plain, _ = _models("sdpa")
    switched, _ = _models("sdpa")
    assert set_packed_attention(switched, packed_attention) == packed_attention
    kwargs = dict(input_ids=ids, attention_mask=mask.long(), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(switched.generate(**kwargs), plain.generate(**kwargs))
    switched.save_pretrained(tmp_path)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "sdpa"


def test_use_packed_attention_keeps_eager():
    actor, _ = _models("eager")
    assert use_packed_attention(actor) == "eager"
