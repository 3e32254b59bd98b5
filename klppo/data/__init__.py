"""Parquet datasets (RL prompts with optional recorded responses, SFT), tokenisation and batching."""

from klppo.data.parquet import read_parquet_rows, row_error
from klppo.data.rl_dataset import PromptRecord, collate_prompts, load_rl_dataset, tokenize_responses
from klppo.data.sampler import PromptBatches
from klppo.data.sft_dataset import SFTExample, collate_sft, load_sft_dataset

__all__ = [
    "PromptBatches",
    "PromptRecord",
    "SFTExample",
    "collate_prompts",
    "collate_sft",
    "load_rl_dataset",
    "load_sft_dataset",
    "read_parquet_rows",
    "row_error",
    "tokenize_responses",
]
