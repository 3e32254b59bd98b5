"""On CPU, ``generate`` decodes greedily over ``InverseCdfSampling``'s draw (``klppo.rollout.sampling``):
the tokens must come from exactly the distribution transformers' own sampling draws from (the
same temperature, top-k and top-p, worked by hand here), never a token of probability 0, and
only where transformers would sample (CPU, do_sample)."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

import klppo.rollout.sampling as sampling
from klppo.rollout.hf import _call_generate, neutral_generation_config
from klppo.rollout.sampling import draw_tokens, with_sampling


def _assert_frequencies(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    """The draws' counts fit ``probs`` (Pearson's chi-square within 6 standard deviations of its mean,
    the count of possible tokens less one); tokens of probability 0 never drawn."""
    counts = torch.bincount(tokens.flatten(), minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0
    expected = counts.sum() * probs[probs > 0]
    chi2, dof = float(((counts[probs > 0] - expected) ** 2 / expected).sum()), int((probs > 0).sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof), (chi2, dof)


def test_draws_follow_the_softmax_and_skip_tokens_of_probability_zero():
    logits = torch.tensor([-math.inf, 0.0, 1.0, -math.inf, 2.0, -1.0, -math.inf, 0.5])
    torch.manual_seed(0)
    tokens = draw_tokens(logits.expand(200_000, -1))
    _assert_frequencies(tokens, logits.softmax(-1).double())


def test_a_uniform_number_of_zero_draws_the_first_token_with_probability(monkeypatch):
    monkeypatch.setattr(sampling.torch, "rand", lambda shape, **kw: torch.zeros(shape, **kw))
    logits = torch.tensor([[-math.inf, -math.inf, 0.3, 0.1], [0.0, 1.0, -math.inf, 2.0]])
    assert draw_tokens(logits).flatten().tolist() == [2, 0]


def _warped_by_hand(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Transformers' sampling distribution: softmax(z / T) over the top_k largest (0: all), then the
    smallest set of the most likely whose mass reaches top_p (ties aside), renormalised."""
    probs = (logits / temperature).softmax(-1).double()
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, token in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        keep[token], mass = True, mass + float(probs[token])
    kept = probs * keep
    return kept / kept.sum()


@pytest.mark.parametrize("knobs", [dict(temperature=0.7, top_k=0, top_p=1.0), dict(temperature=1.3, top_k=6, top_p=1.0),
                                   dict(temperature=1.0, top_k=0, top_p=0.8)], ids=["temperature", "top-k", "top-p"])
def test_generate_on_cpu_samples_transformers_own_distribution(tiny_model_dir, knobs):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    torch.manual_seed(0)
    for param in model.parameters():  # weights wider than the initialisation's: a spread-out next token
        param.data.normal_(0.0, 0.3)
    model.get_output_embeddings().weight.data.mul_(7.0)  # logits of std ~2.5: the knobs change the distribution
    prompt = torch.tensor([[5, 9, 13, 7]])
    with torch.no_grad():
        logits = model(prompt).logits[0, -1]
    expected = _warped_by_hand(logits, **knobs)
    config = GenerationConfig(max_new_tokens=1, do_sample=True, pad_token_id=0, eos_token_id=[1], **knobs)
    greedy, processors = with_sampling(config, torch.device("cpu"))
    assert not greedy.do_sample and len(processors) == 1
    model.generation_config = greedy
    rows = 40_000
    with torch.no_grad():
        out = _call_generate(model, prompt.expand(rows, -1), torch.ones(rows, 4, dtype=torch.bool), False, processors)
    _assert_frequencies(out[:, -1], expected)


def test_only_cpu_sampling_is_drawn_by_klppo(tiny_model_dir):
    from types import SimpleNamespace

    from klppo.rollout.hf import SamplingParams

    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    sampled = neutral_generation_config(SamplingParams(temperature=0.7, top_k=5, top_p=0.9), tokenizer)
    greedy = neutral_generation_config(SamplingParams(do_sample=False), tokenizer)
    on_cpu, processors = with_sampling(sampled, torch.device("cpu"))
    assert not on_cpu.do_sample and [type(w).__name__ for w in processors[0].warpers] == [
        "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"]  # generate's own order
    assert sampled.do_sample  # the caller's config is left as it was
    assert with_sampling(sampled, torch.device("cuda")) == (sampled, [])  # one multinomial kernel there
    assert with_sampling(greedy, torch.device("cpu")) == (greedy, [])
