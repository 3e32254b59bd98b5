"""SFT's loss reads its log-probs through the LM head the PPO forwards use: the same numbers as
the whole logits give, without ever holding the (B, L, V) logits."""

import pytest
import torch
from transformers import Qwen2ForCausalLM

import klppo.models.fused_head as fused_head
from klppo.algo import logprobs_from_logits
from klppo.data.sft_dataset import SFTExample, collate_sft
from klppo.models.forward import HeadSettings, position_ids_from_mask
from klppo.models.tiny import tiny_model_config
from klppo.commands.main_sft import sft_loss

VOCAB = 61


def _model() -> Qwen2ForCausalLM:
    config = tiny_model_config(VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config)


def _batch():
    """Three right-padded rows of 9, 5 and 7 tokens; the loss on each row's last 4, 2 and 5 tokens."""
    g = torch.Generator().manual_seed(2)
    examples = [SFTExample(input_ids=torch.randint(2, VOCAB, (n,), generator=g).tolist(),
                           loss_mask=[False] * (n - r) + [True] * r) for n, r in ((9, 4), (5, 2), (7, 5))]
    return collate_sft(examples, pad_token_id=0)


def _whole_logits_loss(model, ids, mask, loss_mask, total_tokens):
    """The loss from the (B, L-1, V) fp32 logits, as SFT computed it before."""
    logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids_from_mask(mask),
                   use_cache=False).logits[:, :-1].float()
    return -(logprobs_from_logits(logits, ids[:, 1:]) * loss_mask[:, 1:]).sum() / total_tokens


def _loss_and_grads(model, loss_fn, *args):
    model.zero_grad()
    loss = loss_fn(model, *args)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("head", [HeadSettings(), HeadSettings(chunk_logits=50), HeadSettings(fused=False)],
                         ids=["default", "narrow-slices", "unfused"])
def test_the_sft_loss_and_its_gradients_are_those_of_the_whole_logits(head):
    model, (ids, mask, loss_mask) = _model(), _batch()
    total = loss_mask[:, 1:].sum()
    expected, expected_grads = _loss_and_grads(model, _whole_logits_loss, ids, mask, loss_mask, total)
    got, grads = _loss_and_grads(model, lambda *a: sft_loss(*a, head=head), ids, mask, loss_mask, total)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    for name in expected_grads:
        torch.testing.assert_close(grads[name], expected_grads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_the_sft_loss_never_holds_the_logits_of_the_whole_vocabulary(monkeypatch):
    model, (ids, mask, loss_mask) = _model(), _batch()
    head_widths, slices = [], []
    fused_head.head_logit_scale(model)  # its once-per-model measurement: 2 positions, by a forward of its own
    model.lm_head.register_forward_hook(lambda module, args, out: head_widths.append(out.shape[-1]))
    slice_logits = fused_head._slice_logits

    def recorded(*args):
        z = slice_logits(*args)
        slices.append(tuple(z.shape))
        return z

    monkeypatch.setattr(fused_head, "_slice_logits", recorded)
    sft_loss(model, ids, mask, loss_mask, loss_mask[:, 1:].sum()).backward()
    assert head_widths and all(width < VOCAB for width in head_widths)  # the head returns scores, not logits
    slices.clear()
    sft_loss(model, ids, mask, loss_mask, loss_mask[:, 1:].sum(), head=HeadSettings(chunk_logits=50)).backward()
    assert slices and all(width < VOCAB for _, width in slices)  # forward and backward, a slice at a time
