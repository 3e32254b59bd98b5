"""Several cases of each class of bad input, through the real executable (``python -m klppo.cli``).

The cases are the corpus's own (``cases_*.py``); here each runs in a fresh process, as a user
runs it, so what reaches the terminal is checked whole: exit status 2, at most 3 lines on
stderr starting ``error: ``, no traceback (library warnings would show up here too), and the
workspace byte-identical. The processes run two at a time: each spends seconds importing torch and transformers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bad_input_corpus import CORPUS
from bad_input_kit import Workspace, check_refused, snapshot

ROOT = Path(__file__).parents[2]

CLASSES = {  # class of bad input -> corpus cases run through the executable
    "config file not UTF-8": ["ppo_yaml_latin1_comment", "validate_latin1_value_at_line_12"],
    "model weights missing or damaged": ["ppo_model_folder_without_weights", "rm_model_weights_truncated"],
    "tokenizer missing or unusable": ["ppo_model_folder_without_tokenizer_files",
                                      "sft_model_folder_without_tokenizer_files",
                                      "rm_model_folder_without_tokenizer_files"],
    "prompt encodes to no tokens": ["ppo_val_row3_prompt_encodes_to_no_tokens", "rm_row4_prompt_encodes_to_no_tokens"],
    "resume target damaged or foreign": ["sft_resume_from_a_folder_of_junk", "sft_resume_from_a_reward_model_checkpoint",
                                         "rm_auto_resume_from_a_truncated_shard"],
    "output folder unusable": ["ppo_output_folder_is_a_file", "sft_output_folder_below_a_file",
                               "rm_output_folder_not_writable"],
    # (warnings such as "coroutine was never awaited" would show here, not in the in-process corpus)
    "user code that fails": ["ppo_async_reward_function_raises_on_row_5", "ppo_reward_function_raises_on_row_5",
                             "ppo_reward_function_without_extra_info"],
    "broken side file of a model folder": ["ppo_generation_config_that_is_not_json",
                                           "sft_chat_template_that_fails_on_every_conversation"],
    "token ids past the embedding rows": ["ppo_tokenizer_eos_token_past_the_embedding_rows",
                                          "rm_tokenizer_bos_token_past_the_embedding_rows"],
    "checkpoint refused once restored": ["ppo_auto_resume_whose_data_position_does_not_fit_the_data",
                                         "sft_auto_resume_whose_data_position_does_not_fit_the_data"],
    "one rule on one process and on ranks": ["ppo_model_weight_of_the_wrong_shape_on_a_sharded_actor",
                                             "rm_model_embeddings_of_the_wrong_shape_sharded"],
}
ONE_COMMAND = {"user code that fails"}  # the reward function is PPO's alone
NAMES = [name for names in CLASSES.values() for name in names]


def _run(name: str, root: Path, model: Path, trained) -> dict:
    case = CORPUS[name]
    ws = Workspace(root / name, model, trained)
    try:
        argv = case.build(ws)
    except pytest.skip.Exception as skipped:
        return {"skip": str(skipped)}
    before = snapshot(ws.root, model)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "klppo.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ws.root)
    return {"code": done.returncode, "err": done.stderr, "before": before, "after": snapshot(ws.root, model)}


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model_dir, request) -> dict:
    root = tmp_path_factory.mktemp("cli_cases")
    runs = request.getfixturevalue("trained_runs")  # made once, before the threads start
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_run, name, root, tiny_model_dir, lambda: runs) for name in NAMES}
    return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("name", NAMES)
def test_the_klppo_executable_refuses_a_bad_input_in_at_most_3_lines_and_changes_nothing(name, results):
    result = results[name]
    if "skip" in result:
        pytest.skip(result["skip"])
    check_refused(result["code"], result["err"], CORPUS[name].expect, result["before"], result["after"])


def test_every_class_has_several_cases_from_at_least_two_commands():
    for name, names in CLASSES.items():
        commands = {CORPUS[n].command for n in names}
        assert len(names) >= 2 and (len(commands) >= 2 or name in ONE_COMMAND), names
