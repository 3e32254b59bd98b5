"""SFT warm start: learns the responses, writes the folder PPO starts from."""

import torch
from transformers import AutoModelForCausalLM

from klppo.config import load_sft_config
from klppo.monitoring.logger import read_metrics
from klppo.commands.main_sft import run_sft


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


def test_sft_lowers_the_loss_and_saves_a_folder_ppo_can_start_from(tiny_model_dir, task_dir, tmp_path, ppo_overrides):
    cfg = load_sft_config(None, [
        f"data.train_files={task_dir / 'sft.parquet'}", f"data.val_files={task_dir / 'sft.parquet'}",
        "data.max_length=96", "data.train_batch_size=16", "data.micro_batch_size_per_gpu=8",
        f"model.partial_pretrain={tiny_model_dir}", "optim.lr=3e-3", "trainer.total_epochs=3",
        f"trainer.default_local_dir={tmp_path / 'sft'}", "trainer.logger=[]", "trainer.device=cpu",
    ])
    out = run_sft(cfg, print_fn=quiet)
    records = read_metrics(tmp_path / "sft")
    assert len(records) == 12  # 64 examples / 16 per step * 3 epochs
    assert records[-1]["train/loss"] < 0.7 * records[0]["train/loss"]
    assert records[-1]["val/loss"] < records[0]["train/loss"]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model(torch.tensor([[3, 4, 5]])).logits.shape[-1] == model.config.vocab_size

    from klppo.commands.main_ppo import run_ppo

    records = run_ppo(None, ppo_overrides(**{"actor_rollout_ref.model.path": out, "trainer.total_training_steps": 1}),
                      print_fn=quiet)
    assert records[-1]["step"] == 1


def test_multiturn_sft_trains_on_whole_conversations_with_verls_keys(tiny_model_dir, task_dir, tmp_path):
    """verl's data.multiturn keys: conversations of two exchanges each, the loss on both answers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(task_dir / "sft.parquet").to_pylist()
    turns = lambda row: row["prompt"] + [{"role": "assistant", "content": row["response"]}]  # noqa: E731
    chats = [{"conversation": turns(a) + turns(b)} for a, b in zip(rows[0::2], rows[1::2])]
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "chats.parquet")
    printed = []
    cfg = load_sft_config(None, [
        f"data.train_files={tmp_path / 'chats.parquet'}", "data.multiturn.enable=true",
        "data.multiturn.messages_key=conversation", "data.max_length=192", "data.train_batch_size=16",
        "data.micro_batch_size_per_gpu=8", f"model.partial_pretrain={tiny_model_dir}", "optim.lr=3e-3",
        "trainer.total_epochs=4", f"trainer.default_local_dir={tmp_path / 'sft'}", "trainer.logger=[]",
        "trainer.device=cpu"])
    run_sft(cfg, print_fn=lambda *a, **k: printed.append(" ".join(map(str, a))))
    records = read_metrics(tmp_path / "sft")
    assert len(records) == 8  # 32 conversations / 16 per step * 4 epochs
    assert records[-1]["train/loss"] < 0.8 * records[0]["train/loss"]
    assert any(line.startswith("loaded 32 conversations from") for line in printed)


def test_verls_gsm8k_sft_command_trains_through_verls_module_path(tiny_model_dir, task_dir, tmp_path, capsys):
    """examples/sft/gsm8k/run_qwen_05_sp2.sh's overrides, on verl-format data, via -m klppo.trainer.fsdp_sft_trainer."""
    from klppo.trainer.fsdp_sft_trainer import main

    code = main([f"data.train_files={task_dir / 'train.parquet'}", f"data.val_files={task_dir / 'val.parquet'}",
                 "data.prompt_key=extra_info", "data.response_key=extra_info", "optim.lr=3e-3",
                 "data.prompt_dict_keys=['question']", "+data.response_dict_keys=['answer']",
                 "data.micro_batch_size=4", "data.train_batch_size=8", "data.max_length=96",
                 f"model.partial_pretrain={tiny_model_dir}", f"trainer.default_local_dir={tmp_path / 'sft'}",
                 "trainer.logger=console", "trainer.total_training_steps=4", "ulysses_sequence_parallel_size=2",
                 "use_remove_padding=true", "trainer.device=cpu"])
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("warning: 3 verl settings in this config have no effect in klppo")
    assert "warning: 32 of the 32 prompts in" in out  # the questions are plain text, encoded as they are
    records = read_metrics(tmp_path / "sft")
    assert len(records) == 4 and records[-1]["train/loss"] < records[0]["train/loss"]


def test_sft_and_reward_model_training_read_at_most_their_row_caps(tiny_model_dir, task_dir, tmp_path,
                                                                   word_ranking_file):
    from klppo.commands.main_rm import run_rm
    from klppo.config import load_rm_config

    cfg = load_sft_config(None, [
        f"data.train_files={task_dir / 'sft.parquet'}", "data.train_max_samples=32", "data.max_length=96",
        "data.train_batch_size=16", f"model.partial_pretrain={tiny_model_dir}", "trainer.total_epochs=1",
        f"trainer.default_local_dir={tmp_path / 'sft'}", "trainer.logger=[]", "trainer.device=cpu"])
    run_sft(cfg, print_fn=quiet)
    assert len(read_metrics(tmp_path / "sft")) == 2  # 32 of the 64 examples / 16 per step
    rm = load_rm_config(None, [
        f"data.train_files={word_ranking_file(tmp_path / 'ranked.parquet', 20, 0)}", "data.train_max_samples=8",
        "data.train_batch_size=4",
        f"model.partial_pretrain={tiny_model_dir}", "trainer.total_epochs=1",
        f"trainer.default_local_dir={tmp_path / 'rm'}", "trainer.logger=[]", "trainer.device=cpu"])
    run_rm(rm, print_fn=quiet)
    assert len(read_metrics(tmp_path / "rm")) == 2  # 8 prompts / 4 per step
