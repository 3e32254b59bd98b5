"""Log-prob, entropy and value forwards: padding must not change what a sequence scores."""

import torch
from transformers import AutoModelForCausalLM

from klppo.algo import logprobs_from_logits
from klppo.models.forward import position_ids_from_mask, response_logprobs, response_values
from klppo.models.load import load_critic


def test_position_ids_count_real_tokens_only():
    mask = torch.tensor([[False, False, True, True, True], [True, True, True, True, False]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


def _padded_pair(prompt, response, pad_id=0, left_pad=3, right_pad=2):
    """One sequence twice: unpadded, and with left-padded prompt + right-padded response."""
    ids = torch.tensor([prompt + response])
    padded = torch.tensor([[pad_id] * left_pad + prompt + response + [pad_id] * right_pad])
    mask = torch.tensor([[False] * left_pad + [True] * (len(prompt) + len(response)) + [False] * right_pad])
    return ids, padded, mask


def test_padding_does_not_change_response_log_probs_or_values(tiny_model_dir):
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    critic = load_critic(str(tiny_model_dir), key="critic.model.path", device=torch.device("cpu"))
    prompt, response = [5, 9, 14, 20], [33, 41, 7]
    ids, padded, mask = _padded_pair(prompt, response)
    full_mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        lp, ent = response_logprobs(actor, ids, full_mask, 3, with_entropy=True)
        lp_pad, ent_pad = response_logprobs(actor, padded, mask, 5, with_entropy=True)
        v = response_values(critic, ids, full_mask, 3)
        v_pad = response_values(critic, padded, mask, 5)
    torch.testing.assert_close(lp_pad[:, :3], lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_pad[:, :3], ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_pad[:, :3], v, atol=1e-5, rtol=1e-5)


def test_response_log_probs_are_the_models_next_token_log_probs(tiny_model_dir):
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[5, 9, 14, 20, 33, 41]])
    with torch.no_grad():
        logits = actor(ids).logits / 0.5
        expected = logprobs_from_logits(logits[:, 3:5], ids[:, 4:6])
        got, _ = response_logprobs(actor, ids, torch.ones_like(ids, dtype=torch.bool), 2, temperature=0.5)
    torch.testing.assert_close(got, expected)


def test_critic_head_starts_from_the_seed_and_keeps_the_backbone(tiny_model_dir):
    a = load_critic(str(tiny_model_dir), key="k", device=torch.device("cpu"), seed=3)
    b = load_critic(str(tiny_model_dir), key="k", device=torch.device("cpu"), seed=3)
    actor = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.testing.assert_close(a.score.weight, b.score.weight)
    torch.testing.assert_close(a.model.embed_tokens.weight, actor.model.embed_tokens.weight)
