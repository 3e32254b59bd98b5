"""Plain-text prompts end to end: a base model (its tokenizer has no chat template) trains with
offline PPO (and validates), SFT and a reward model on prompts that are strings."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from klppo.config import load_rm_config, load_sft_config
from klppo.data.arithmetic import arithmetic_corpus
from klppo.errors import UserError
from klppo.models.load import load_tokenizer
from klppo.models.tiny import build_tiny_model_folder
from klppo.monitoring.logger import read_metrics
from klppo.commands.main_ppo import run_ppo
from klppo.commands.main_rm import run_rm
from klppo.commands.main_sft import run_sft
from tests.conftest import TINY


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory):
    """The tiny model as a base model: its tokenizer has no chat template."""
    out = tmp_path_factory.mktemp("base_model")
    return build_tiny_model_folder(out, arithmetic_corpus(200, 0), seed=0, chat_template=False, **TINY)


def _as_plain_text(src, dst):
    """``src`` with each prompt's chat messages replaced by the text of its last message."""
    rows = pq.read_table(src).to_pylist()
    for row in rows:
        row["prompt"] = row["prompt"][-1]["content"]
    pq.write_table(pa.Table.from_pylist(rows), dst)
    return dst


def test_a_base_models_tokenizer_loads_and_has_no_chat_template(base_model_dir):
    assert not (base_model_dir / "chat_template.jinja").exists()
    assert load_tokenizer(str(base_model_dir)).chat_template is None


def test_offline_ppo_and_its_validation_run_on_plain_text_prompts(ppo_overrides, base_model_dir, task_dir, tmp_path):
    train = _as_plain_text(task_dir / "offline.parquet", tmp_path / "offline_plain.parquet")
    val = _as_plain_text(task_dir / "val.parquet", tmp_path / "val_plain.parquet")
    records = run_ppo(None, ppo_overrides(**{"actor_rollout_ref.model.path": base_model_dir,
                                             "data.train_files": train, "data.val_files": val,
                                             "trainer.test_freq": 2}), print_fn=quiet)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "val-core/openai/gsm8k/reward/mean@1" in records[-1] and "actor/pg_loss" in records[-1]
    # the prompts the model saw are the text itself, no template
    tokenizer = AutoTokenizer.from_pretrained(base_model_dir)
    text = pq.read_table(train).to_pylist()[0]["prompt"]
    assert "<|im_start|>" not in tokenizer.decode(tokenizer(text)["input_ids"])


def test_sft_runs_on_plain_text_prompts(base_model_dir, task_dir, tmp_path):
    data = _as_plain_text(task_dir / "sft.parquet", tmp_path / "sft_plain.parquet")
    cfg = load_sft_config(None, [
        f"data.train_files={data}", "data.max_length=96", "data.train_batch_size=16",
        "data.micro_batch_size_per_gpu=8", f"model.partial_pretrain={base_model_dir}", "optim.lr=3e-3",
        "trainer.total_training_steps=3", f"trainer.default_local_dir={tmp_path / 'sft'}", "trainer.logger=[]",
        "trainer.device=cpu",
    ])
    run_sft(cfg, print_fn=quiet)
    records = read_metrics(tmp_path / "sft")
    assert len(records) == 3 and records[-1]["train/loss"] < records[0]["train/loss"]


def test_a_reward_model_trains_on_plain_text_prompts(base_model_dir, tmp_path, word_ranking_file):
    data = _as_plain_text(word_ranking_file(tmp_path / "words.parquet", 32, 0), tmp_path / "words_plain.parquet")
    cfg = load_rm_config(None, [
        f"data.train_files={data}", f"data.val_files={data}", "data.max_prompt_length=64",
        "data.max_response_length=16", "data.train_batch_size=16", "data.micro_batch_size_per_gpu=8",
        f"model.partial_pretrain={base_model_dir}", "optim.lr=3e-3", "trainer.total_training_steps=2",
        f"trainer.default_local_dir={tmp_path / 'rm'}", "trainer.logger=[]", "trainer.device=cpu",
    ])
    run_rm(cfg, print_fn=quiet)
    assert "val/pair_accuracy" in read_metrics(tmp_path / "rm")[-1]


def test_a_base_model_with_chat_message_prompts_is_refused_naming_the_row(ppo_overrides, base_model_dir, task_dir):
    with pytest.raises(UserError) as err:
        run_ppo(None, ppo_overrides(**{"actor_rollout_ref.model.path": base_model_dir}), print_fn=quiet)
    message = str(err.value)
    assert message.startswith(f"{task_dir / 'offline.parquet'} row 0, column 'prompt': the prompt is chat messages")
    assert "no chat template" in message and "plain text" in message
