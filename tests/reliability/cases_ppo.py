"""Bad inputs to ``klppo ppo --config x.yaml``: prompt files, config values, model folders, output folders."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
from transformers import AutoTokenizer

from bad_input_kit import Workspace, ppo_row, register, rows
from klppo.data.rollout_log_probs import encode_responses

CASES: dict = {}
case = lambda *expect: register(CASES, "ppo", *expect)  # noqa: E731

MESSAGES = "write the prompt as plain text (a string) or as a list of messages"
ROW5 = "train.parquet row 5, column"


def bad_row(**changes):
    return rows(ppo_row, 5, **changes)


# ---- the prompt file: a bad value in row 5 of 8 ----

@case(f"{ROW5} 'prompt'", "plain text or a list of chat messages", MESSAGES)
def ppo_row5_prompt_is_null(ws: Workspace):
    return ws.ppo(bad_row(prompt=None))


@case(f"{ROW5} 'prompt'", "got []", MESSAGES)
def ppo_row5_prompt_is_an_empty_list(ws):
    return ws.ppo(bad_row(prompt=[]))


@case(f"{ROW5} 'prompt'", "message 0 has no string 'content'", MESSAGES)
def ppo_row5_message_without_content(ws):
    return ws.ppo(bad_row(prompt=[{"role": "user"}]))


@case(f"{ROW5} 'prompt'", "message 1 has no string 'role'", MESSAGES)
def ppo_row5_second_message_without_role(ws):
    return ws.ppo(bad_row(prompt=[{"role": "system", "content": "Be brief."}, {"content": "What is 1 + 1?"}]))


@case(f"{ROW5} 'prompt'", "role 'wizard'", "use one of system, user, assistant")
def ppo_row5_unknown_role(ws):
    return ws.ppo(bad_row(prompt=[{"role": "wizard", "content": "What is 1 + 1?"}]))


@case(f"{ROW5} 'data_source'", "expected a non-empty string, got None", "e.g. 'openai/gsm8k'")
def ppo_row5_data_source_is_null(ws):
    return ws.ppo(bad_row(data_source=None))


@case(f"{ROW5} 'data_source'", "got ''", "e.g. 'openai/gsm8k'")
def ppo_row5_data_source_is_empty(ws):
    return ws.ppo(bad_row(data_source=""))


@case("train.parquet row 5", "my/task", "custom_reward_function")
def ppo_row5_data_source_without_a_reward(ws):
    return ws.ppo(bad_row(data_source="my/task"))


@case("train.parquet row 5", "ground_truth")
def ppo_row5_gsm8k_row_without_ground_truth(ws):
    return ws.ppo(bad_row(reward_model=None))


@case("data.train_files, ", "train.parquet row 5", "'Natalia sold 48 clips", "no answer can equal",
      "give the final number alone")
def ppo_row5_gsm8k_ground_truth_is_the_whole_solution(ws):
    return ws.ppo(bad_row(reward_model={"style": "rule", "ground_truth": "Natalia sold 48 clips. #### 72"}))


@case("data.val_files, ", "val.parquet row 2", "'eight'", "no answer can equal")
def ppo_val_row2_gsm8k_ground_truth_is_a_word(ws):
    val = ws.parquet(rows(ppo_row, 2, reward_model={"style": "rule", "ground_truth": "eight"}), "val.parquet")
    return ws.ppo(None, {"data.val_files": str(val)})


@case(f"{ROW5} 'responses'", "non-empty list of strings, got None", "one per recorded response")
def ppo_row5_offline_responses_null(ws):
    return ws.ppo(bad_row(responses=None))


@case(f"{ROW5} 'responses'", "got []", "one per recorded response")
def ppo_row5_offline_responses_empty(ws):
    return ws.ppo(bad_row(responses=[]))


@case(f"{ROW5} 'responses'", "response 1 is None, not a string")
def ppo_row5_offline_response_is_null(ws):
    return ws.ppo(bad_row(responses=["5 + 3 = 8 #### 8", None]))


@case(f"{ROW5} 'scores'", "expected a list of 2 numbers", "one finite number per response")
def ppo_row5_scores_shorter_than_responses(ws):
    table = rows(ppo_row, None)
    for i, row in enumerate(table):
        row["scores"] = [1.0] if i == 5 else [1.0, 0.0]
    return ws.ppo(table)


@case(f"{ROW5} 'scores'", "score 1 is nan, not a finite number")
def ppo_row5_score_is_nan(ws):
    table = rows(ppo_row, None)
    for i, row in enumerate(table):
        row["scores"] = [1.0, float("nan") if i == 5 else 0.0]
    return ws.ppo(table)


IMPORTANCE_WEIGHTED = {"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.offline_kl": "importance_weighted"}
IW_NEEDS = ("which algorithm.kl_ctrl.offline_kl=importance_weighted needs for every row", "klppo score-logprobs",
            "or set algorithm.kl_ctrl.offline_kl=sampled")


@case(f"{ROW5} 'rollout_log_probs'", "no behaviour log-probs", *IW_NEEDS)
def ppo_row5_without_log_probs_for_the_importance_weighted_kl(ws):
    # Once weighed as mu = 1 without a word: the KL the guards and the controller read was wrong.
    tokenizer = AutoTokenizer.from_pretrained(ws.model)
    table = rows(ppo_row, None)
    for i, row in enumerate(table):  # the others are whole: one log-prob per token and the closing EOS
        row["rollout_log_probs"] = None if i == 5 else [[-1.0] * len(ids) for ids in
                                                        encode_responses(row["responses"], tokenizer)]
    return ws.ppo(table, dict(IMPORTANCE_WEIGHTED))


@case("train.parquet row 0, column 'rollout_log_probs'", "no behaviour log-probs", *IW_NEEDS)
def ppo_no_log_probs_column_for_the_importance_weighted_kl_of_a_kl_loss(ws):
    # Once a TypeError at step 1, after every model had loaded.
    return ws.ppo(None, {"actor_rollout_ref.actor.use_kl_loss": True,
                         "algorithm.kl_ctrl.offline_kl": "importance_weighted"})


@case(f"{ROW5} 'scores'", "scores given without responses", "add a 'responses' column")
def ppo_row5_scores_without_responses_when_generating(ws):
    table = rows(ppo_row, 5, responses=None, scores=[1.0, 0.0])
    for row in table:
        row.pop("responses", None)
    return ws.ppo(table, {"actor_rollout_ref.rollout.name": "hf"})


@case(f"{ROW5} 'prompt'", "longer than data.max_prompt_length=64", "data.truncation=left|right")
def ppo_row5_prompt_too_long(ws):
    return ws.ppo(bad_row(prompt=[{"role": "user", "content": "seven " * 200}]))


@case("train.parquet row 5", "rollout.n")
def ppo_row5_fewer_responses_than_rollout_n(ws):
    return ws.ppo(bad_row(responses=["5 + 3 = 8 #### 8"]))


@case(f"{ROW5} 'prompt'", "encodes to no tokens", "non-empty prompt")
def ppo_row5_prompt_encodes_to_no_tokens(ws):
    model = ws.model_copy()
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return ws.ppo(bad_row(prompt=[{"role": "user", "content": ""}]), {"actor_rollout_ref.model.path": str(model)})


REFUSING_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system "
                     "messages') }}{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                     "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@case(f"{ROW5} 'prompt'", "chat template cannot render its messages", "no system messages", "the form the model's")
def ppo_row5_messages_the_chat_template_refuses(ws):
    model = ws.model_copy()
    (model / "chat_template.jinja").write_text(REFUSING_TEMPLATE)
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 5 + 3?"}]
    return ws.ppo(bad_row(prompt=prompt), {"actor_rollout_ref.model.path": str(model)})


@case("val.parquet row 3, column 'prompt'", "encodes to no tokens", "non-empty prompt")
def ppo_val_row3_prompt_encodes_to_no_tokens(ws):
    model = ws.model_copy()
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    val = ws.parquet(rows(ppo_row, 3, prompt=[{"role": "user", "content": ""}]), "val.parquet")
    return ws.ppo(None, {"actor_rollout_ref.model.path": str(model), "data.val_files": str(val)})


@case("val.parquet row 5, column 'prompt'", "got []", MESSAGES)
def ppo_val_file_row5_prompt_empty(ws):
    val = ws.parquet(rows(ppo_row, 5, prompt=[]), "val.parquet")
    return ws.ppo(None, {"data.val_files": str(val)})


@case("plain.parquet row 5, column 'prompt'", "empty string", "give every row a prompt")
def ppo_plain_text_prompt_that_is_empty(ws):
    table = rows(ppo_row)
    for row in table:  # plain-text prompts are fine; row 5's is empty
        row["prompt"] = row["prompt"][0]["content"]
    table[5]["prompt"] = ""
    return ws.ppo(ws.parquet(table, "plain.parquet"))


@case(f"{ROW5} 'prompt'", "chat messages written as JSON", "json.loads it before writing the file")
def ppo_row5_prompt_is_chat_messages_as_json_text(ws):
    return ws.ppo(json_text_prompts(rows(ppo_row), 5))


def json_text_prompts(table: list[dict], bad_at: int) -> list[dict]:
    """Plain-text prompts (a column of strings), row ``bad_at``'s being its messages as JSON text."""
    for i, row in enumerate(table):
        row["prompt"] = json.dumps(row["prompt"]) if i == bad_at else row["prompt"][0]["content"]
    return table


# ---- the prompt files themselves ----

@case("second.parquet", "not found", "data.train_files")
def ppo_second_train_file_missing(ws):
    first = ws.parquet(rows(ppo_row), "first.parquet")
    return ws.ppo(first, {"data.train_files": [str(first), str(ws.root / "second.parquet")]})


@case("csv.parquet", "not a readable Parquet file", "pyarrow.parquet.write_table")
def ppo_train_file_is_csv(ws):
    return ws.ppo(ws.write("csv.parquet", "data_source,prompt\nopenai/gsm8k,hi\n"))


@case("cut.parquet", "not a readable Parquet file")
def ppo_train_file_truncated(ws):
    path = ws.parquet(rows(ppo_row), "cut.parquet")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return ws.ppo(path)


@case("empty.parquet", "has no rows")
def ppo_train_file_without_rows(ws):
    path = ws.root / "empty.parquet"
    pq.write_table(pa.Table.from_pylist(rows(ppo_row)).slice(0, 0), path)
    return ws.ppo(path)


@case("data_folder", "not found")
def ppo_train_file_is_a_folder(ws):
    (ws.root / "data_folder").mkdir()
    return ws.ppo(ws.root / "data_folder")


@case("train.parquet", "has no column 'question'", "data.prompt_key")
def ppo_prompt_key_names_a_missing_column(ws):
    return ws.ppo(None, {"data.prompt_key": "question"})


@case("train.parquet", "has no column 'data_source'")
def ppo_file_without_data_source_column(ws):
    table = rows(ppo_row)
    for row in table:
        del row["data_source"]
    return ws.ppo(table)


# ---- config values in the YAML file ----

@case("actor_rollout_ref.actor.clip_ration", "actor_rollout_ref.actor.clip_ratio")
def ppo_yaml_misspelled_key(ws):
    return ws.ppo(None, {"actor_rollout_ref.actor.clip_ration": 0.2})


@case("data.train_batch_size", "eight")
def ppo_yaml_string_for_an_int(ws):
    return ws.ppo(None, {"data.train_batch_size": "eight"})


@case("data.train_batch_size", "8.5")
def ppo_yaml_fraction_for_an_int(ws):
    return ws.ppo(None, {"data.train_batch_size": 8.5})


@case("actor_rollout_ref.actor.optim.lr")
def ppo_yaml_list_for_a_float(ws):
    return ws.ppo(None, {"actor_rollout_ref.actor.optim.lr": [1e-6, 2e-6]})


@case("data")
def ppo_yaml_section_is_a_number(ws):
    argv = ws.ppo()
    path = ws.root / "config.yaml"
    path.write_text(path.read_text().replace("data:\n", "data: 5\nunused:\n", 1))
    return argv


@case("trainer.logger", "consle")
def ppo_yaml_unknown_logger(ws):
    return ws.ppo(None, {"trainer.logger": ["consle"]})


@case("algorithm.adv_estimator", "gae")
def ppo_yaml_unknown_estimator(ws):
    return ws.ppo(None, {"algorithm.adv_estimator": "ppo"})


@case("ppo_mini_batch_size")
def ppo_yaml_mini_batch_larger_than_the_step(ws):
    return ws.ppo(None, {"actor_rollout_ref.actor.ppo_mini_batch_size": 4096})


@case("trainer.resume_mode")
def ppo_yaml_unknown_resume_mode(ws):
    return ws.ppo(None, {"trainer.resume_mode": "latest"})


@case("data.train_files")
def ppo_yaml_train_files_null(ws):
    return ws.ppo(None, {"data.train_files": None})


@case("trainer.experiment_name", "data.nope")
def ppo_yaml_interpolation_to_a_missing_key(ws):
    return ws.ppo(None, {"trainer.experiment_name": "run_${data.nope}"})


@case("config.yaml", "not UTF-8 text", "line 2", "iconv")
def ppo_yaml_latin1_comment(ws):
    argv = ws.ppo()
    path = ws.root / "config.yaml"
    path.write_bytes(path.read_bytes().replace(b"data:\n", "data:\n  # r\xe9sum\xe9\n".encode("latin-1"), 1))
    return argv


@case("config.yaml", "key 'data' is given twice", "keep one of them")
def ppo_yaml_section_given_twice(ws):
    argv = ws.ppo()
    path = ws.root / "config.yaml"
    path.write_text(path.read_text() + "data:\n  seed: 3\n")
    return argv


@case("is an SFT or reward-model config", "klppo sft or klppo rm")
def ppo_given_an_sft_config_file(ws):
    argv = ws.sft()
    return ["ppo", *argv[1:]]


@case("missing.yaml", "does not exist")
def ppo_config_file_missing(ws):
    return ["ppo", "--config", str(ws.root / "missing.yaml")]


@case("data.train_batch_size", "many")
def ppo_override_of_the_yaml_with_a_wrong_type(ws):
    return ws.ppo(None, None, "data.train_batch_size=many")


# ---- model folders ----

@case("actor_rollout_ref.model.path", "does not exist")
def ppo_model_folder_missing(ws):
    return ws.ppo(None, {"actor_rollout_ref.model.path": str(ws.root / "no_model")})


@case("actor_rollout_ref.model.path", "holds no model weights", "with its weights")
def ppo_model_folder_without_weights(ws):
    model = ws.model_copy()
    (model / "model.safetensors").unlink()
    return ws.ppo(None, {"actor_rollout_ref.model.path": str(model)})


@case("actor_rollout_ref.model.path", "cannot be read", "copy the folder again")
def ppo_model_weights_truncated(ws):
    model = ws.model_copy()
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    return ws.ppo(None, {"actor_rollout_ref.model.path": str(model)})


@case("actor_rollout_ref.model.path", "turns ordinary text into no tokens", "tokenizer.json included")
def ppo_model_folder_without_tokenizer_files(ws):
    model = ws.model_copy()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    return ws.ppo(None, {"actor_rollout_ref.model.path": str(model)})


@case("actor_rollout_ref.model.path", "the model config", "cannot be read")
def ppo_model_config_json_damaged(ws):
    model = ws.model_copy()
    (model / "config.json").write_text('{"model_type": "qwen2", ')
    return ws.ppo(None, {"actor_rollout_ref.model.path": str(model)})


@case("critic.model.path", "does not exist")
def ppo_critic_folder_missing(ws):
    return ws.ppo(None, {"algorithm.adv_estimator": "gae", "critic.model.path": str(ws.root / "no_critic")})


@case("actor_rollout_ref.model.path", "4096 embedding rows", "not the model's tokenizer")
def ppo_tokenizer_far_smaller_than_the_model(ws):
    model = ws.model_copy()
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 4096}))
    return ws.ppo(None, {"actor_rollout_ref.model.path": str(model)})


@case("actor_rollout_ref.model.path", "has eos_token '<|end|>' at id 384", "384 embedding rows",
      "resize_token_embeddings")
def ppo_tokenizer_eos_token_past_the_embedding_rows(ws):
    return ws.ppo(None, {"actor_rollout_ref.model.path": str(ws.model_with_new_special_tokens(eos_token="<|end|>"))})


@case("actor_rollout_ref.model.path", "has token 'calculate' at id 384", "384 embedding rows")
def ppo_tokenizer_with_an_added_word_past_the_embedding_rows(ws):
    from transformers import AutoTokenizer

    model = ws.model_copy()
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.add_tokens(["calculate"])
    tokenizer.save_pretrained(model)
    return ws.ppo(None, {"actor_rollout_ref.model.path": str(model)})


@case("critic.model.path", "has pad_token '<|padding|>' at id 384", "ids 0 to 383")
def ppo_critic_tokenizer_pad_token_past_the_embedding_rows(ws):
    critic = ws.model_with_new_special_tokens(pad_token="<|padding|>")
    return ws.ppo(None, {"algorithm.adv_estimator": "gae", "critic.model.path": str(critic)})


# ---- broken side files of a model folder: the error blames the file, not a data row ----

GENERATION = "generation_config.json' cannot be read"


def with_side_file(ws: Workspace, name: str, text: str, *overrides: str, changes: dict | None = None):
    model = ws.model_copy()
    (model / name).write_text(text)
    return ws.ppo(None, {"actor_rollout_ref.model.path": str(model), **(changes or {})}, *overrides)


@case("actor_rollout_ref.model.path", GENERATION, "Expecting property name enclosed in double quotes: line 1",
      "remove it to use the model config's")
def ppo_generation_config_that_is_not_json(ws):
    return with_side_file(ws, "generation_config.json", '{"eos_token_id": 1,')


@case("actor_rollout_ref.model.path", GENERATION, "Expecting property name enclosed in double quotes")
def ppo_generation_config_that_is_not_json_on_a_sharded_actor(ws):
    """bf16 makes a process group of one: the sharded loading path, with the same rule."""
    return with_side_file(ws, "generation_config.json", '{"eos_token_id": 1,',
                          changes={"actor_rollout_ref.actor.fsdp_config.dtype": "bfloat16"})


@case("actor_rollout_ref.model.path", GENERATION, "`max_new_tokens` must be greater than 0")
def ppo_generation_config_with_an_invalid_value(ws):
    return with_side_file(ws, "generation_config.json", '{"eos_token_id": 1, "max_new_tokens": -5}',
                          changes={"actor_rollout_ref.rollout.name": "hf"})


@case("actor_rollout_ref.model.path", "generation_config.json' holds a list, not a mapping of settings")
def ppo_generation_config_that_is_a_list(ws):
    return with_side_file(ws, "generation_config.json", "[1, 2]")


@case("actor_rollout_ref.model.path", "chat_template.jinja' cannot render even one user message",
      "Unexpected end of template", "fix the template")
def ppo_chat_template_with_a_jinja_syntax_error(ws):
    return with_side_file(ws, "chat_template.jinja", "{% for m in messages %}{{ m['content'] }}")


@case("actor_rollout_ref.model.custom_chat_template: the chat template cannot render even one user message",
      "Unexpected end of template", "remove the key to use the one saved with the tokenizer")
def ppo_custom_chat_template_with_a_jinja_syntax_error(ws):
    return ws.ppo(changes={"actor_rollout_ref.model.custom_chat_template": "{% for m in messages %}{{ m['content'] }}"})


# ---- one rule on one process and on ranks (bf16 shards over a process group of one) ----

def with_reshaped_weight(ws: Workspace, name: str, shape: tuple[int, ...]) -> str:
    import torch
    from safetensors.torch import load_file, save_file

    model = ws.model_copy()
    weights = load_file(model / "model.safetensors")
    weights[name] = torch.zeros(shape)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return str(model)


@case("actor_rollout_ref.model.path", "'model.layers.1.mlp.up_proj.weight'", "has shape [64, 32]", "needs [128, 32]")
def ppo_model_weight_of_the_wrong_shape(ws):
    return ws.ppo(None, {"actor_rollout_ref.model.path": with_reshaped_weight(ws, "model.layers.1.mlp.up_proj.weight",
                                                                              (64, 32))})


@case("actor_rollout_ref.model.path", "'model.layers.1.mlp.up_proj.weight'", "has shape [64, 32]", "needs [128, 32]")
def ppo_model_weight_of_the_wrong_shape_on_a_sharded_actor(ws):
    path = with_reshaped_weight(ws, "model.layers.1.mlp.up_proj.weight", (64, 32))
    return ws.ppo(None, {"actor_rollout_ref.model.path": path, "actor_rollout_ref.actor.fsdp_config.dtype": "bfloat16"})


def two_label_reward_model(ws: Workspace) -> str:
    import shutil

    from transformers import AutoModelForSequenceClassification

    out = ws.root / "two_labels"
    AutoModelForSequenceClassification.from_pretrained(ws.model, num_labels=2).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ws.model / name, out / name)
    return str(out)


@case("reward_model.model.path", "'score.weight'", "has shape [2, 32]", "one output (num_labels=1)")
def ppo_reward_model_with_two_labels(ws):
    return ws.ppo(None, {"reward_model.enable": True, "reward_model.model.path": two_label_reward_model(ws)})


@case("reward_model.model.path", "'score.weight'", "has shape [2, 32]", "one output (num_labels=1)")
def ppo_reward_model_with_two_labels_sharded(ws):
    return ws.ppo(None, {"reward_model.enable": True, "reward_model.model.path": two_label_reward_model(ws),
                         "reward_model.model.fsdp_config.dtype": "bfloat16"})


# ---- the reward file ----

@case("custom_reward_function.path", "SyntaxError", "line 3", "fix the file")
def ppo_reward_file_with_a_syntax_error(ws):
    reward = ws.write("reward.py", "import math\n\ndef compute_score(data_source, solution_str, ground_truth\n")
    return ws.ppo(None, {"custom_reward_function.path": str(reward)})


@case("custom_reward_function.name 'compute_score' is not defined", "callables there: score")
def ppo_reward_file_without_the_named_function(ws):
    reward = ws.write("reward.py", "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                   "    return 0.0\n")
    return ws.ppo(None, {"custom_reward_function.path": str(reward)})


# ---- output folders ----

@case("trainer.default_local_dir", "is an existing file, not a folder")
def ppo_output_folder_is_a_file(ws):
    ws.write("taken", "a file")
    return ws.ppo(None, {"trainer.default_local_dir": str(ws.root / "taken")})


@case("trainer.default_local_dir", "which is a file", "whose parents are folders")
def ppo_output_folder_below_a_file(ws):
    ws.write("taken", "a file")
    return ws.ppo(None, {"trainer.default_local_dir": str(ws.root / "taken" / "run")})



# ---- the user's reward function: cannot take verl's call, raises, or returns no number ----

SCORE = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
IN_ORDER = {"data.train_batch_size": 8, "data.shuffle": False}  # row 5 is scored at step 1


def with_reward(ws: Workspace, body: str, changes: dict | None = None, header: str = SCORE):
    reward = ws.write("reward.py", header + body)
    return ws.ppo(None, {"custom_reward_function.path": str(reward), **(changes or {})})


@case("custom_reward_function.name 'compute_score'", "takes (data_source, solution_str, ground_truth)",
      "extra_info=...", "give it those four parameters")
def ppo_reward_function_without_extra_info(ws):
    return with_reward(ws, "    return 0.0\n", header="def compute_score(data_source, solution_str, ground_truth):\n")


@case("custom_reward_function.name 'compute_score'", "takes (solution, answer)",
      "missing a required argument: 'solution'")
def ppo_reward_function_with_its_own_parameter_names(ws):
    return with_reward(ws, "    return 0.0\n", header="def compute_score(solution, answer):\n")


@case("custom_reward_function.name 'compute_score'", "takes ()", "or add **kwargs")
def ppo_reward_function_is_a_class_without_parameters(ws):
    return with_reward(ws, "    pass\n", header="class compute_score:\n")


@case("train.parquet row 5: reward function custom_reward_function compute_score in", "raised KeyError: 'answer'",
      "fix the function")
def ppo_reward_function_raises_on_row_5(ws):
    return with_reward(ws, "    if extra_info['index'] == 5:\n        raise KeyError('answer')\n    return 0.0\n",
                       IN_ORDER)


@case("train.parquet row 5: reward function", "returned 'high' (str); return a number")
def ppo_reward_function_returns_a_string_for_row_5(ws):
    return with_reward(ws, "    return 'high' if extra_info['index'] == 5 else 1.0\n", IN_ORDER)


@case("train.parquet row 5: reward function", "returned a dict without a 'score' key (keys: acc)")
def ppo_reward_function_returns_a_dict_without_score_for_row_5(ws):
    return with_reward(ws, "    return {'acc': 1.0} if extra_info['index'] == 5 else {'score': 1.0}\n", IN_ORDER)


@case("train.parquet row 5: reward function", "returned [1.0, 0.0] (list)")
def ppo_reward_function_returns_a_list_for_row_5(ws):
    return with_reward(ws, "    return [1.0, 0.0] if extra_info['index'] == 5 else 1.0\n", IN_ORDER)


@case("train.parquet row 5: reward function", "raised KeyError: 'answer'", "fix the function")
def ppo_async_reward_function_raises_on_row_5(ws):
    """An async def function's calls are awaited together; the one that failed still names its row."""
    return with_reward(ws, "    if extra_info['index'] == 5:\n        raise KeyError('answer')\n    return 0.0\n",
                       IN_ORDER, header=SCORE.replace("def ", "async def "))


@case("custom_reward_function.name 'compute_score'", "which has no parameter 'scale'",
      "custom_reward_function.reward_kwargs passes on every call")
def ppo_reward_kwargs_the_function_cannot_take(ws):
    return with_reward(ws, "    return 1.0\n", {"custom_reward_function.reward_kwargs": {"scale": 2.0}})


@case("custom_reward_function.name 'compute_score'", "is a generator function", "returns the score")
def ppo_reward_function_yields_its_score(ws):
    return with_reward(ws, "    yield 1.0\n")


@case("custom_reward_function.path", "failed to import (SystemExit: needs a GPU)", "fix the file")
def ppo_reward_file_that_exits_when_imported(ws):
    return with_reward(ws, "    return 0.0\n", header="import sys\nsys.exit('needs a GPU')\n" + SCORE)


@case("train.parquet row 5: reward function", "raised SystemExit: 3")
def ppo_reward_function_that_exits_on_row_5(ws):
    return with_reward(ws, "    if extra_info['index'] == 5:\n        raise SystemExit(3)\n    return 0.0\n", IN_ORDER)


@case("val.parquet row 0: reward function custom_reward_function compute_score in",
      "raised ZeroDivisionError: division by zero")
def ppo_reward_function_raises_in_validation_before_training(ws):
    table = rows(ppo_row)
    for row in table:
        row["extra_info"] = {"index": row["extra_info"]["index"], "split": "val"}
    val = ws.parquet(table, "val.parquet")
    return with_reward(ws, "    return 1 / 0 if extra_info.get('split') == 'val' else 0.0\n", {"data.val_files": str(val)})


# ---- resuming: the checkpoint's state is restored before the run writes anything ----

@case("data position", "does not fit 2 batches per epoch", "data.train_batch_size and data files the checkpoint")
def ppo_auto_resume_whose_data_position_does_not_fit_the_data(ws):
    run = ws.trained("ppo", into="run")
    ws.shift_data_position(run / "global_step_1", 5)
    return ws.ppo(None, {"trainer.total_training_steps": 2})


@case("train.parquet row 5: reward function", "raised KeyError: 'answer'")
def ppo_auto_resume_whose_next_step_the_reward_function_fails(ws):
    ws.trained("ppo", into="run")
    return with_reward(ws, "    if extra_info['index'] == 5:\n        raise KeyError('answer')\n    return 0.0\n",
                       {"trainer.total_training_steps": 2, **IN_ORDER})


# ---- reward models: a folder without a trained score head would score at random ----

@case("reward_model.model.path", "holds Qwen2ForCausalLM with no trained score head", "'score.weight'",
      "klppo rm trains one from this folder")
def ppo_reward_model_folder_is_a_causal_lm(ws):
    return ws.ppo(None, {"reward_model.enable": True, "reward_model.model.path": str(ws.model_copy())})


@case("reward_model.model.extra_paths[0]", "no trained score head")
def ppo_second_reward_model_is_a_causal_lm(ws):
    trained = ws.trained("rm") / "hf"
    return ws.ppo(None, {"reward_model.enable": True, "reward_model.model.path": str(trained),
                         "reward_model.model.extra_paths": [str(ws.model_copy())]})


@case("trainer_state.pt' 'guard' holds events that are not guard events", "resume from another checkpoint")
def ppo_auto_resume_whose_guard_events_were_rewritten(ws):
    import torch

    state_file = ws.trained("ppo", into="run") / "global_step_1" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=True)
    state["guard"]["events"] = [{"step": 1, "kind": "rollback", "text": "written by another tool"}]
    torch.save(state, state_file)
    return ws.ppo(None, {"trainer.total_training_steps": 2})
