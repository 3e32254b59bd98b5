"""A corpus of bad inputs: each exits non-zero with one line naming the place and the fix,
prints no traceback, and leaves an existing run directory exactly as it was."""

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoModelForTokenClassification

from klppo.cli import main
from klppo.models.tiny import build_tiny_model_folder

GOOD_ROW = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "What is 2 + 3?"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"index": 0},
            "responses": ["2 + 3 = 5 #### 5", "2 + 3 = 6 #### 6"]}


def row(**changes):
    r = dict(GOOD_ROW)
    r.update(changes)
    return {k: v for k, v in r.items() if v is not DROP}


DROP = object()

# name -> (rows of the train file, or a callable writing the file; extra overrides; text expected in the message)
PARQUET_CASES = {
    "missing_file": (None, [], "not found"),
    "not_parquet": (b"PAR1 garbage", [], "bad.parquet"),
    "empty_file": ([], [], "bad.parquet"),
    "missing_prompt_column": ([row(prompt=DROP)], [], "'prompt'"),
    "empty_string_prompt": ([row(prompt="")], [], "row 0"),
    "empty_prompt": ([row(prompt=[])], [], "row 0"),
    "message_without_content": ([row(prompt=[{"role": "user"}])], [], "content"),
    "unknown_role": ([row(prompt=[{"role": "wizard", "content": "hi"}])], [], "role"),
    "prompt_is_a_number": ([row(prompt=7)], [], "row 0"),
    "empty_data_source": ([row(data_source="")], [], "data_source"),
    "responses_a_string": ([row(responses="2 + 3 = 5")], [], "responses"),
    "responses_empty": ([row(responses=[])], [], "responses"),
    "responses_of_ints": ([row(responses=[1, 2])], [], "responses"),
    "scores_length_mismatch": ([row(scores=[1.0])], [], "scores"),
    "rollout_log_probs_too_short": ([row(rollout_log_probs=[[-1.0], [-1.0]])], [], "rollout_log_probs"),
    "fewer_responses_than_n": ([row()], ["actor_rollout_ref.rollout.n=3"], "rollout.n"),
    "prompt_too_long": ([row(prompt=[{"role": "user", "content": "seven " * 200}])], [], "max_prompt_length"),
    "unknown_data_source": ([row(data_source="my/task")], [], "custom_reward_function"),
}

CONFIG_CASES = {
    "unknown_top_level_key": (["trainr.save_freq=2"], "did you mean 'trainer'"),
    "misspelled_nested_key": (["actor_rollout_ref.actor.clip_ration=0.2"], "actor_rollout_ref.actor.clip_ratio"),
    "misplaced_key": (["actor_rollout_ref.clip_ratio=0.2"], "actor_rollout_ref.actor.clip_ratio"),
    "misplaced_lr": (["data.lr=1e-6"], "optim.lr"),
    "string_for_int": (["data.train_batch_size=many"], "data.train_batch_size"),
    "bool_for_int": (["data.train_batch_size=true"], "data.train_batch_size"),
    "unknown_estimator": (["algorithm.adv_estimator=ppo"], "gae"),
    "mini_batch_larger_than_the_step": (["actor_rollout_ref.actor.ppo_mini_batch_size=4096"], "ppo_mini_batch_size"),
    "micro_batch_not_dividing": (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"], "micro"),
    "negative_lr": (["actor_rollout_ref.actor.optim.lr=-1"], "optim.lr"),
    "dual_clip_below_one": (["actor_rollout_ref.actor.clip_ratio_c=0.5"], "clip_ratio_c"),
    "group_estimator_with_one_response": (["algorithm.adv_estimator=grpo_passk", "actor_rollout_ref.rollout.n=1"], "rollout.n"),
    "resume_path_without_path": (["trainer.resume_mode=resume_path"], "resume_from_path"),
    "override_without_equals": (["trainer.total_training_steps"], "trainer.total_training_steps"),
    "rollback_above_early_stop": (["trainer.guard.rollback_kl=0.5"], "early_stop_kl"),
    "fsdp_size_zero": (["critic.model.fsdp_config.fsdp_size=0"], "fsdp_size"),
}


@pytest.fixture
def run_dir(tmp_path):
    """An earlier run's directory that a failing command must leave untouched."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 1, "x": 1.0}\n')
    return d


def _base(train, model, run_dir):
    return ["ppo", f"data.train_files={train}", "data.train_batch_size=4", "data.max_prompt_length=64",
            f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.name=offline",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            f"trainer.default_local_dir={run_dir}", "trainer.device=cpu", "trainer.logger=[]"]


def _expect_one_line_error(capsys, argv, place, run_dir):
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code != 0
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert place in err, err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


def _write_train(tmp_path, content):
    path = tmp_path / "bad.parquet"
    if content is None:
        return tmp_path / "missing.parquet"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content:
        pq.write_table(pa.Table.from_pylist(content), path)
    else:
        pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    return path


@pytest.mark.parametrize("case", sorted(PARQUET_CASES))
def test_bad_parquet_is_refused_with_one_line(case, capsys, tmp_path, tiny_model_dir, run_dir):
    content, extra, place = PARQUET_CASES[case]
    train = _write_train(tmp_path, content)
    _expect_one_line_error(capsys, _base(train, tiny_model_dir, run_dir) + extra, place, run_dir)


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_config_is_refused_before_anything_loads(case, capsys, tmp_path, tiny_model_dir, run_dir):
    overrides, place = CONFIG_CASES[case]
    train = _write_train(tmp_path, [row()] * 4)
    _expect_one_line_error(capsys, _base(train, tiny_model_dir, run_dir) + overrides, place, run_dir)


def test_missing_and_malformed_config_files(capsys, tmp_path, run_dir):
    _expect_one_line_error(capsys, ["validate-config", tmp_path / "nope.yaml"], "nope.yaml", run_dir)
    broken = tmp_path / "broken.yaml"
    broken.write_text("data: [unclosed\n")
    _expect_one_line_error(capsys, ["validate-config", broken], "broken.yaml", run_dir)


def _model_cases(tmp_path, tiny_model_dir):
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    classifier = tmp_path / "classifier"
    AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(classifier)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model_dir / name, classifier)
    other_tokenizer = build_tiny_model_folder(tmp_path / "other_tok", ["completely different words"] * 20,
                                              vocab_size=300, hidden_size=16, num_hidden_layers=1,
                                              num_attention_heads=2, num_key_value_heads=1)
    return [
        ([f"actor_rollout_ref.model.path={tmp_path / 'absent'}"], "actor_rollout_ref.model.path"),
        ([f"actor_rollout_ref.model.path={no_config}"], "config.json"),
        ([f"actor_rollout_ref.model.path={classifier}"], "ForCausalLM"),
        ([f"critic.model.path={other_tokenizer}"], "critic.model.path"),
        (["reward_model.enable=true", f"reward_model.model.path={other_tokenizer}"], "reward_model.model.path"),
        ([f"custom_reward_function.path={tmp_path / 'no_reward.py'}"], "custom_reward_function.path"),
    ]


def test_bad_model_folders_and_reward_files(capsys, tmp_path, tiny_model_dir, run_dir):
    train = _write_train(tmp_path, [row()] * 4)
    reward = tmp_path / "reward.py"
    reward.write_text("def other(*a, **k):\n    return 1.0\n")
    cases = _model_cases(tmp_path, tiny_model_dir)
    cases.append(([f"custom_reward_function.path={reward}"], "custom_reward_function.name"))
    for extra, place in cases:
        _expect_one_line_error(capsys, _base(train, tiny_model_dir, run_dir) + extra, place, run_dir)


def test_the_corpus_has_at_least_30_cases():
    assert len(PARQUET_CASES) + len(CONFIG_CASES) + 2 + 7 >= 30
