"""Shared fixtures for the data tests: a tiny tokenizer and a Parquet writer."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from klppo.data.arithmetic import arithmetic_corpus
from klppo.models.tiny import train_tiny_tokenizer


@pytest.fixture(scope="session")
def tok():
    """Byte-level BPE with a ChatML template, pad and eos, left padding."""
    return train_tiny_tokenizer(arithmetic_corpus(200, seed=0))


@pytest.fixture(scope="session")
def base_tok():
    """The same tokenizer without a chat template, as a base model's."""
    return train_tiny_tokenizer(arithmetic_corpus(200, seed=0), chat_template=False)


@pytest.fixture
def write_parquet(tmp_path):
    """write_parquet(rows, name="x.parquet") -> path of a Parquet file holding ``rows``."""

    def write(rows, name="data.parquet"):
        path = tmp_path / name
        pq.write_table(pa.Table.from_pylist(rows), path)
        return str(path)

    return write


@pytest.fixture
def rl_row():
    """rl_row(content="...", **overrides) -> one valid verl-format RL row."""

    def make(content="Tom has 7 apples and gets 5 more.", **overrides):
        row = {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": content}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "12"},
            "extra_info": {"split": "train", "index": 0},
        }
        row.update(overrides)
        return row

    return make
