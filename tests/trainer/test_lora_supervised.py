"""SFT and reward-model training with LoRA (``model.lora_rank``): they learn, and write a merged
Hugging Face folder and the adapter alone, which give the same outputs."""

import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from klppo.config import load_rm_config, load_sft_config
from klppo.monitoring.logger import read_metrics
from klppo.commands.main_rm import run_rm
from klppo.commands.main_sft import run_sft

IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


def test_lora_sft_lowers_the_loss_and_writes_a_merged_folder_and_its_adapter(tiny_model_dir, task_dir, tmp_path):
    cfg = load_sft_config(None, [
        f"data.train_files={task_dir / 'sft.parquet'}", "data.max_length=96", "data.train_batch_size=16",
        f"model.partial_pretrain={tiny_model_dir}", "model.lora_rank=16", "model.lora_alpha=32", "optim.lr=1e-2",
        "trainer.total_epochs=2", "trainer.save_freq=4", f"trainer.default_local_dir={tmp_path / 'sft'}",
        "trainer.logger=[]", "trainer.device=cpu",
    ])
    out = run_sft(cfg, print_fn=quiet)
    records = read_metrics(tmp_path / "sft")
    # The frozen random embeddings of the tiny model (std 0.02, behind a unit-RMS norm) keep its
    # logits small whatever the adapters do, so the loss falls less far than with full fine-tuning.
    assert len(records) == 8 and records[-1]["train/loss"] < records[0]["train/loss"] - 0.1
    merged = AutoModelForCausalLM.from_pretrained(out)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "sft" / "adapter")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, adapted(IDS).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(merged(IDS).logits, base(IDS).logits)
    # Weights outside the adapted layers (embeddings, norms) are the base model's.
    merged_state, base_state = merged.state_dict(), base.state_dict()
    assert torch.equal(merged_state["model.embed_tokens.weight"], base_state["model.embed_tokens.weight"])
    assert torch.equal(merged_state["model.norm.weight"], base_state["model.norm.weight"])


def test_lora_reward_model_trains_its_score_head_and_the_adapter_carries_it(tiny_model_dir, tmp_path,
                                                                          word_ranking_file):
    cfg = load_rm_config(None, [
        f"data.train_files={word_ranking_file(tmp_path / 'train.parquet', 64, 0)}",
        f"data.val_files={word_ranking_file(tmp_path / 'val.parquet', 32, 1)}",
        "data.max_prompt_length=64", "data.max_response_length=16", "data.train_batch_size=16",
        f"model.partial_pretrain={tiny_model_dir}", "model.lora_rank=8", "optim.lr=1e-2", "trainer.total_epochs=4",
        f"trainer.default_local_dir={tmp_path / 'rm'}", "trainer.logger=[]", "trainer.device=cpu",
    ])
    out = run_rm(cfg, print_fn=quiet)
    records = read_metrics(tmp_path / "rm")
    assert records[-1]["train/loss"] < records[0]["train/loss"] and records[-1]["val/pair_accuracy"] > 0.6
    with safe_open(str(tmp_path / "rm" / "adapter" / "adapter_model.safetensors"), "pt") as f:
        assert "base_model.model.score.weight" in f.keys()
    merged = AutoModelForSequenceClassification.from_pretrained(out)
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1,
                                                              pad_token_id=merged.config.pad_token_id)
    adapted = PeftModel.from_pretrained(base, tmp_path / "rm" / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, adapted(IDS).logits, rtol=1e-5, atol=1e-5)
