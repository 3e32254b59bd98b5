"""Reward-model training from rankings: learns a learnable preference, saves a usable folder."""

import pytest
import torch

from klppo.config import load_rm_config
from klppo.models.forward import sequence_scores
from klppo.models.load import load_reward_model
from klppo.monitoring.logger import read_metrics
from klppo.rollout.batch import right_pad
from klppo.data.ranked import ranked_pairs
from klppo.commands.main_rm import run_rm


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


def test_ranked_pairs_cover_every_ordered_pair_and_skip_ties():
    assert ranked_pairs([[2, 0, 1]]) == [(2, 0), (2, 1), (0, 1)]
    assert ranked_pairs([[0, [1, 2]]]) == [(0, 1), (0, 2)]
    assert ranked_pairs([[0, 1], [1, 0]]) == [(0, 1), (1, 0)]


@pytest.mark.parametrize("loss", ["bradley_terry", "plackett_luce"])
def test_reward_model_learns_the_ranking_well_above_chance(tiny_model_dir, tmp_path, loss, word_ranking_file):
    cfg = load_rm_config(None, [
        f"data.train_files={word_ranking_file(tmp_path / 'train.parquet', 64, 0)}",
        f"data.val_files={word_ranking_file(tmp_path / 'val.parquet', 32, 1)}",
        "data.max_prompt_length=64", "data.max_response_length=16", "data.train_batch_size=16",
        "data.micro_batch_size_per_gpu=8", f"model.partial_pretrain={tiny_model_dir}", "optim.lr=3e-3",
        "trainer.total_epochs=8", f"loss.type={loss}", f"trainer.default_local_dir={tmp_path / 'rm'}",
        "trainer.logger=[]", "trainer.device=cpu",
    ])
    out = run_rm(cfg, print_fn=quiet)
    records = read_metrics(tmp_path / "rm")
    assert records[-1]["val/pair_accuracy"] >= 0.9  # chance is 0.5
    assert records[-1]["train/loss"] < records[0]["train/loss"]

    # The saved folder loads as a reward model and scores the best word above the worst.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = load_reward_model(str(out), key="reward_model.model.path", device=torch.device("cpu"))
    texts = [f"3 + 4 is {w}" for w in ("great", "bad")]
    batch, mask = right_pad([tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts],
                            tokenizer.pad_token_id)
    with torch.no_grad():
        scores = sequence_scores(model, batch, mask)
    assert scores[0] > scores[1]
