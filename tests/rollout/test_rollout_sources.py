"""Response sources: recorded (offline) and generated (hf), grouped by prompt, masks right."""

from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from klppo.data.rl_dataset import load_rl_dataset
from klppo.rollout.batch import eos_token_ids, mask_after_eos, right_pad
from klppo.rollout.hf import SamplingParams, hf_rollout
from klppo.rollout.offline import offline_rollout


def test_mask_after_eos_keeps_tokens_through_the_first_eos():
    ids = torch.tensor([[4, 5, 1, 7, 1], [4, 5, 6, 7, 8], [1, 2, 3, 4, 5]])
    assert mask_after_eos(ids, eos_token_id=1).int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_mask_after_eos_ends_a_response_at_the_first_of_several_eos_ids():
    ids = torch.tensor([[4, 9, 1, 7], [4, 1, 9, 7], [4, 5, 6, 7]])
    assert mask_after_eos(ids, (1, 9)).int().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]


def test_the_eos_ids_are_the_tokenizers_then_every_other_the_generation_config_lists():
    tokenizer = SimpleNamespace(eos_token_id=151645)  # Qwen2.5-Instruct's <|im_end|>
    assert eos_token_ids(tokenizer, SimpleNamespace(eos_token_id=[151645, 151643])) == (151645, 151643)
    assert eos_token_ids(tokenizer, SimpleNamespace(eos_token_id=151643)) == (151645, 151643)
    assert eos_token_ids(tokenizer, SimpleNamespace(eos_token_id=None)) == eos_token_ids(tokenizer) == (151645,)


def test_right_pad_builds_ids_and_mask():
    ids, mask = right_pad([[3, 4], [5], []], pad_id=0)
    assert ids.tolist() == [[3, 4], [5, 0], [0, 0]]
    assert mask.int().tolist() == [[1, 1], [1, 0], [0, 0]]


def test_offline_rollout_takes_the_first_n_responses_grouped_by_prompt(tiny_model_dir, task_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    records = load_rl_dataset(str(task_dir / "offline.parquet"), tokenizer, max_prompt_length=64,
                              require_responses=True, log=lambda *a: None)[:3]
    batch = offline_rollout(records, n=2, tokenizer=tokenizer, max_response_length=32)
    assert len(batch) == 6 and batch.group_index.tolist() == [0, 0, 1, 1, 2, 2]
    texts = [tokenizer.decode(ids[m].tolist(), skip_special_tokens=True)
             for ids, m in zip(batch.response_ids, batch.response_mask)]
    assert texts == [r for rec in records for r in rec.responses[:2]]
    last = batch.response_mask.sum(-1) - 1
    assert (batch.response_ids[torch.arange(6), last] == tokenizer.eos_token_id).all()
    assert torch.equal(batch.prompt_ids[0], batch.prompt_ids[1])


def test_hf_rollout_samples_n_per_prompt_and_masks_after_eos(tiny_model_dir, task_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    records = load_rl_dataset(str(task_dir / "train.parquet"), tokenizer, max_prompt_length=64, log=lambda *a: None)[:2]
    torch.manual_seed(0)
    batch = hf_rollout(model, records, tokenizer, SamplingParams(n=3, max_new_tokens=8))
    assert len(batch) == 6 and batch.response_length <= 8
    assert batch.group_index.tolist() == [0, 0, 0, 1, 1, 1]
    assert (batch.response_ids[~batch.response_mask] == tokenizer.pad_token_id).all()
    torch.manual_seed(0)
    again = hf_rollout(model, records, tokenizer, SamplingParams(n=3, max_new_tokens=8))
    assert torch.equal(again.response_ids, batch.response_ids)  # same seed, same samples


def test_hf_rollout_stops_at_every_eos_the_models_generation_config_lists(tiny_model_dir, task_dir):
    # A second EOS, as Qwen2.5-Instruct's generation_config.json lists <|endoftext|> beside <|im_end|>:
    # the third token of the first sampled response stands in for it.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    records = load_rl_dataset(str(task_dir / "train.parquet"), tokenizer, max_prompt_length=64, log=lambda *a: None)[:4]
    params = SamplingParams(n=2, max_new_tokens=8)
    torch.manual_seed(0)
    free = hf_rollout(model, records, tokenizer, params)
    second = int(free.response_ids[0, 2])
    assert second not in (tokenizer.eos_token_id, *free.response_ids[0, :2].tolist()) and free.response_mask[0].all()
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, second]
    torch.manual_seed(0)  # the same draws: every row samples what it did, up to where it stops
    batch = hf_rollout(model, records, tokenizer, params)
    expected = mask_after_eos(free.response_ids, (tokenizer.eos_token_id, second))
    assert batch.response_mask[0].sum() == 3 and batch.response_ids[0, 2] == second  # stopped at it, and kept it
    assert torch.equal(batch.response_mask, expected[:, : batch.response_length])
    assert torch.equal(batch.response_ids, free.response_ids.masked_fill(~expected, tokenizer.pad_token_id)[:, : batch.response_length])


def _model_with_generation_config(folder, **generation) -> AutoModelForCausalLM:
    """The tiny model, with a generation_config that asks generate for processors of its own."""
    model = AutoModelForCausalLM.from_pretrained(folder)
    for key, value in generation.items():
        setattr(model.generation_config, key, value)
    return model


def test_hf_rollout_greedy_ignores_the_folders_generation_processors(tiny_model_dir, task_dir):
    """Greedy decoding is the argmax of the model's own logits at every step, even when the
    folder's generation_config blocks repeats (the tiny model's greedy responses repeat tokens)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = _model_with_generation_config(tiny_model_dir, no_repeat_ngram_size=1, repetition_penalty=3.0)
    records = load_rl_dataset(str(task_dir / "train.parquet"), tokenizer, max_prompt_length=64, log=lambda *a: None)[:2]
    batch = hf_rollout(model, records, tokenizer, SamplingParams(n=1, max_new_tokens=6, do_sample=False))
    for row in range(len(batch)):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row]].tolist()
        response = batch.response_ids[row][batch.response_mask[row]].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        assert logits.argmax(-1).tolist() == response
    assert model.generation_config.no_repeat_ngram_size == 1  # the model's own config is left as it was


def test_hf_rollout_samples_from_the_scored_softmax_despite_the_folders_processors(tiny_model_dir, task_dir):
    """First-token frequencies of many samples match softmax(logits / T), although the folder's
    generation_config suppresses the likeliest tokens and penalises the prompt's tokens."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    record = load_rl_dataset(str(task_dir / "train.parquet"), tokenizer, max_prompt_length=64, log=lambda *a: None)[0]
    temperature = 0.5
    with torch.no_grad():
        probs = (model(torch.tensor([record.prompt_ids])).logits[0, -1] / temperature).softmax(-1)
    likeliest = probs.topk(20).indices.tolist()
    model = _model_with_generation_config(tiny_model_dir, suppress_tokens=likeliest, repetition_penalty=5.0)
    n = 4000
    torch.manual_seed(0)
    batch = hf_rollout(model, [record], tokenizer, SamplingParams(n=n, max_new_tokens=1, temperature=temperature))
    first = batch.response_ids[:, 0]
    for tokens in (likeliest, sorted(set(record.prompt_ids))):
        expected = float(probs[tokens].sum())
        observed = float(torch.isin(first, torch.tensor(tokens)).float().mean())
        sd = (expected * (1 - expected) / n) ** 0.5
        assert abs(observed - expected) < 5 * sd, (tokens, observed, expected)


def test_hf_rollout_with_ignore_eos_decodes_every_token_even_where_eos_is_likeliest(tiny_model_dir, task_dir):
    """ignore_eos (benchmarks): EOS is not sampled before max_new_tokens, so every response has
    them all; without it, a model that favours EOS stops at once."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    eos = tokenizer.eos_token_id
    model.lm_head.register_forward_hook(lambda module, args, out: out.index_add(
        -1, torch.tensor([eos]), torch.full((*out.shape[:-1], 1), 50.0)))
    records = load_rl_dataset(str(task_dir / "train.parquet"), tokenizer, max_prompt_length=64, log=lambda *a: None)[:2]
    torch.manual_seed(0)
    stopped = hf_rollout(model, records, tokenizer, SamplingParams(n=2, max_new_tokens=8))
    assert stopped.response_mask.sum(-1).tolist() == [1] * 4
    full = hf_rollout(model, records, tokenizer, SamplingParams(n=2, max_new_tokens=8, ignore_eos=True))
    assert full.response_mask.sum(-1).tolist() == [8] * 4 and not (full.response_ids == eos).any()
