"""Bad inputs to ``klppo validate-config`` (YAML files) and ``klppo report RUN_DIR`` (run folders)."""

from __future__ import annotations

import json

from bad_input_kit import Workspace, register

CASES: dict = {}
validate = lambda *expect: register(CASES, "validate-config", *expect)  # noqa: E731
report = lambda *expect: register(CASES, "report", *expect)  # noqa: E731

PPO_YAML = ("data:\n  train_files: train.parquet\n  train_batch_size: 8\n"
            "actor_rollout_ref:\n  model:\n    path: models/tiny\n  rollout:\n    n: 2\n"
            "  actor:\n    ppo_mini_batch_size: 4\n")
SFT_YAML = "data:\n  train_files: sft.parquet\n  max_length: 256\nmodel:\n  partial_pretrain: models/tiny\n"


def _validate(ws: Workspace, text: str | bytes, *extra: str) -> list[str]:
    return ["validate-config", str(ws.write("config.yaml", text)), *extra]


# ---- validate-config ----

@validate("config.yaml is a PPO config", "'actor_rollout_ref'", "validate it without --sft")
def validate_sft_flag_on_a_ppo_file(ws):
    return _validate(ws, PPO_YAML, "--sft")


@validate("config.yaml is an SFT or reward-model config", "'model'", "validate-config --sft")
def validate_an_sft_file_as_ppo(ws):
    return _validate(ws, SFT_YAML)


@validate("data.train_batch_size", "[8]")
def validate_list_for_an_int(ws):
    return _validate(ws, PPO_YAML.replace("train_batch_size: 8", "train_batch_size: [8]"))


@validate("data.shuffle", "maybe")
def validate_word_for_a_bool(ws):
    return _validate(ws, PPO_YAML.replace("  train_batch_size: 8\n", "  train_batch_size: 8\n  shuffle: maybe\n"))


@validate("tranier", "did you mean 'trainer'")
def validate_misspelled_section(ws):
    return _validate(ws, PPO_YAML + "tranier:\n  total_epochs: 2\n")


@validate("actor_rollout_ref.rollout", "is a section, not a value")
def validate_section_given_a_scalar(ws):
    return _validate(ws, PPO_YAML.replace("  rollout:\n    n: 2\n", "  rollout: vllm\n").replace("n: 2", "n: 1"))


@validate("config.yaml", "line 6", "indent with spaces, not tabs")
def validate_tab_at_line_6(ws):
    return _validate(ws, PPO_YAML.replace("    path: models/tiny", "\tpath: models/tiny"))


@validate("config.yaml", "not UTF-8 text", "line 12", "iconv")
def validate_latin1_value_at_line_12(ws):
    return _validate(ws, (PPO_YAML + "trainer:\n  experiment_name: caf\xe9\n").encode("latin-1"))


@validate("config.yaml", "is UTF-16 text; save it as UTF-8")
def validate_utf16_file(ws):
    return _validate(ws, PPO_YAML.encode("utf-16"))


@validate("config.yaml", "remove the !tag")
def validate_python_tag(ws):
    return _validate(ws, PPO_YAML + "trainer:\n  experiment_name: !!python/object/apply:os.getcwd []\n")


@validate("rollout.n")
def validate_grpo_passk_with_one_response(ws):
    return _validate(ws, PPO_YAML.replace("n: 2", "n: 1") + "algorithm:\n  adv_estimator: grpo_passk\n")


@validate("actor_rollout_ref.actor.optim.lr")
def validate_negative_learning_rate(ws):
    return _validate(ws, PPO_YAML + "    optim:\n      lr: -1.0e-6\n")


@validate("algorithm.kl_ctrl.type", "adaptive")
def validate_unknown_kl_controller(ws):
    return _validate(ws, PPO_YAML + "algorithm:\n  kl_ctrl:\n    type: pid\n")


@validate("early_stop_kl")
def validate_rollback_above_early_stop(ws):
    return _validate(ws, PPO_YAML + "trainer:\n  guard:\n    rollback_kl: 0.5\n    early_stop_kl: 0.2\n")


@validate("trainer.total_training_steps")
def validate_override_without_equals(ws):
    return _validate(ws, PPO_YAML, "trainer.total_training_steps")


@validate("key 'ppo_mini_batch_size' is given twice", "keep one of them")
def validate_key_given_twice(ws):
    return _validate(ws, PPO_YAML + "    ppo_mini_batch_size: 2\n")


@validate("config.yaml", "holds a list", "mapping of sections")
def validate_file_of_a_list(ws):
    return _validate(ws, "- data\n- trainer\n")


@validate("data.max_prompt_length", "write a whole number")
def validate_quoted_number(ws):
    return _validate(ws, PPO_YAML.replace("  train_batch_size: 8\n", "  train_batch_size: 8\n  max_prompt_length: '512'\n"))


@validate("actor_rollout_ref.model.target_modules", "is not a valid regular expression",
          "unterminated subpattern", "give a list of module names")
def validate_lora_target_modules_regex_that_does_not_compile(ws):
    return _validate(ws, PPO_YAML.replace("    path: models/tiny\n", "    path: models/tiny\n    lora_rank: 16\n"
                                          "    target_modules: .*(q|v_proj\n"))


@validate("critic.model.exclude_modules", "is not a valid regular expression", "nothing to repeat")
def validate_critic_exclude_modules_glob_given_as_a_regex(ws):
    return _validate(ws, PPO_YAML + "critic:\n  model:\n    lora_rank: 8\n    exclude_modules: '*lm_head'\n")


# ---- report ----

def _metrics(ws: Workspace, lines: list[str], name: str = "metrics.jsonl") -> list[str]:
    (ws.run / name).write_text("".join(line + "\n" for line in lines))
    return ["report", str(ws.run)]


def _good(step: int) -> str:
    return json.dumps({"step": step, "actor/kl_to_ref": 0.01 * step, "critic/score/mean": 0.1 * step})


@report("does not exist", "trainer.default_local_dir")
def report_on_a_missing_folder(ws):
    return ["report", str(ws.root / "no_run")]


@report("has no metrics.jsonl", "not a run directory")
def report_on_a_folder_without_metrics(ws):
    (ws.run / "metrics.jsonl").unlink()
    return ["report", str(ws.run)]


@report("metrics.jsonl, line 5", "not a JSON object")
def report_on_a_corrupt_line_5(ws):
    return _metrics(ws, [_good(s) for s in range(1, 5)] + ['{"step": 5, "actor/kl'] + [_good(s) for s in (6, 7, 8)])


@report("metrics.jsonl, line 4", "integer 'step'")
def report_on_a_line_without_step(ws):
    return _metrics(ws, [_good(s) for s in (1, 2, 3)] + ['{"actor/kl_to_ref": 0.1}', _good(5)])


@report("metrics.jsonl, line 3", "integer 'step'")
def report_on_a_line_that_is_a_list(ws):
    return _metrics(ws, [_good(1), _good(2), "[3, 0.1]", _good(4)])


@report("metrics.jsonl, line 6", "integer 'step'")
def report_on_a_string_step(ws):
    return _metrics(ws, [_good(s) for s in range(1, 6)] + ['{"step": "6", "actor/kl_to_ref": 0.1}'])


@report("metrics.jsonl, line 4", "actor/kl_to_ref", "number")
def report_on_a_metric_that_is_a_string(ws):
    return _metrics(ws, [_good(s) for s in (1, 2, 3)] + ['{"step": 4, "actor/kl_to_ref": "high"}', _good(5)])


@report("metrics.jsonl, line 2", "critic/score/mean", "number")
def report_on_a_metric_that_is_a_dict(ws):
    return _metrics(ws, [_good(1), '{"step": 2, "critic/score/mean": {"mean": 1}}', _good(3)])


@report("metrics.jsonl, line 2", "not UTF-8")
def report_on_metrics_that_are_not_text(ws):
    (ws.run / "metrics.jsonl").write_bytes(_good(1).encode() + b"\n\xff\xfe\x00junk\n" + _good(3).encode() + b"\n")
    return ["report", str(ws.run)]


@report("metrics.jsonl", "is a folder")
def report_on_metrics_that_are_a_folder(ws):
    (ws.run / "metrics.jsonl").unlink()
    (ws.run / "metrics.jsonl").mkdir()
    return ["report", str(ws.run)]


@report("is not a folder", "trainer.default_local_dir")
def report_on_a_file(ws):
    return ["report", str(ws.run / "metrics.jsonl")]


@report("events.jsonl, line 2", "not a JSON object")
def report_on_a_corrupt_events_line(ws):
    (ws.run / "events.jsonl").write_text('{"step": 1, "kind": "rollback", "message": "x"}\n{"step": 2, "ki\n'
                                         '{"step": 3, "kind": "rollback", "message": "y"}\n')
    return _metrics(ws, [_good(s) for s in (1, 2, 3)])


@report("events.jsonl, event 2", "no 'kind'")
def report_on_an_event_without_kind(ws):
    (ws.run / "events.jsonl").write_text('{"step": 1, "kind": "rollback", "message": "x"}\n{"step": 2}\n')
    return _metrics(ws, [_good(s) for s in (1, 2, 3)])


@report("config.yaml is not valid YAML at line 2", "move it away")
def report_with_a_broken_config_yaml(ws):
    (ws.run / "config.yaml").write_text("trainer:\n\tguard: {rollback_kl: 0.1\n")
    return _metrics(ws, [_good(s) for s in (1, 2, 3)])


@report("config.yaml holds a list, not a run's config", "move it away")
def report_with_a_config_yaml_that_is_a_list(ws):
    (ws.run / "config.yaml").write_text("- trainer\n- guard\n")
    return _metrics(ws, [_good(s) for s in (1, 2, 3)])


@report("cannot write the report", "taken' is a file, not a folder", "pass --out a folder")
def report_out_below_a_file(ws):
    ws.write("taken", "a file")
    return ["report", str(ws.run), "--out", str(ws.root / "taken" / "report")]


@report("events.jsonl", "cannot be read", "restore it, or move it away")
def report_on_events_that_are_a_folder(ws):
    (ws.run / "events.jsonl").mkdir()
    return _metrics(ws, [_good(s) for s in (1, 2, 3)])
