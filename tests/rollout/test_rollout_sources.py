"""Response sources: recorded (offline) and generated (hf), grouped by prompt, masks right."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from klppo.data.rl_dataset import load_rl_dataset
from klppo.rollout.batch import mask_after_eos, right_pad
from klppo.rollout.hf import SamplingParams, hf_rollout
from klppo.rollout.offline import offline_rollout


def test_mask_after_eos_keeps_tokens_through_the_first_eos():
    ids = torch.tensor([[4, 5, 1, 7, 1], [4, 5, 6, 7, 8], [1, 2, 3, 4, 5]])
    assert mask_after_eos(ids, eos_token_id=1).int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


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
