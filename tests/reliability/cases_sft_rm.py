"""Bad inputs to ``klppo sft`` and ``klppo rm`` (``--config x.yaml``): data files, config values, model
folders, output folders and resume targets."""

from __future__ import annotations

import pytest

from bad_input_kit import DROP, Workspace, ranked_row, register, rows, sft_row

CASES: dict = {}
sft = lambda *expect: register(CASES, "sft", *expect)  # noqa: E731
rm = lambda *expect: register(CASES, "rm", *expect)  # noqa: E731

MESSAGES = "write the prompt as plain text (a string) or as a list of messages"
SFT_ROW6 = "train.parquet row 6, column"
RM_ROW4 = "train.parquet row 4, column"
RANKING_FIX = "list of 0-based indices into 'responses'"
ONE_FORM = "give exactly one of 'ranking', 'rankings', 'scores' or 'chosen'+'rejected' per row"
UNWRITABLE = "/sys/kernel/klppo_run"  # sysfs refuses new files even to root, for whom os.access always says yes


# ---- SFT data: a bad value in row 6 of 8 ----

@sft(f"{SFT_ROW6} 'prompt'", "got None", MESSAGES)
def sft_row6_prompt_is_null(ws: Workspace):
    return ws.sft(rows(sft_row, 6, prompt=None))


@sft(f"{SFT_ROW6} 'prompt'", "message 0 has role 'bot'", "use one of system, user, assistant")
def sft_row6_unknown_role(ws):
    return ws.sft(rows(sft_row, 6, prompt=[{"role": "bot", "content": "hi"}]))


@sft("plain.parquet row 6, column 'prompt'", "prompt is an empty string", "give every row a prompt")
def sft_row6_plain_string_prompt_is_empty(ws):
    table = rows(sft_row)
    for i, row in enumerate(table):
        row["prompt"] = "" if i == 6 else f"What is {i} + 3?"
    return ws.sft(ws.parquet(table, "plain.parquet"))


@sft(f"{SFT_ROW6} 'response'", "expected a response string, got None", "give every row a string response")
def sft_row6_response_is_null(ws):
    return ws.sft(rows(sft_row, 6, response=None))


@sft("second.parquet row 0, column 'response'", "expected a response string, got 3")
def sft_second_file_has_numeric_responses(ws):
    first = ws.parquet(rows(sft_row), "first.parquet")
    second = ws.parquet([{**sft_row(i), "response": i + 3} for i in range(8)], "second.parquet")
    return ws.sft(first, {"data.train_files": [str(first), str(second)]})


@sft("train.parquet", "has no column 'response'", "data.response_key")
def sft_file_without_response_column(ws):
    return ws.sft(rows(lambda i: {"prompt": sft_row(i)["prompt"], "answer": "x"}))


@sft("train.parquet", "has no column 'completion'")
def sft_response_key_names_a_missing_column(ws):
    return ws.sft(None, {"data.response_key": "completion"})


@sft(f"{SFT_ROW6} 'prompt'", "longer than data.max_length=96", "data.truncation=left|right")
def sft_row6_example_too_long(ws):
    return ws.sft(rows(sft_row, 6, response="nine " * 200))


@sft(f"{SFT_ROW6} 'prompt'", "chat template cannot render its messages")
def sft_row6_messages_the_chat_template_refuses(ws):
    from cases_ppo import REFUSING_TEMPLATE

    model = ws.model_copy()
    (model / "chat_template.jinja").write_text(REFUSING_TEMPLATE)
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 + 3?"}]
    return ws.sft(rows(sft_row, 6, prompt=prompt), {"model.partial_pretrain": str(model)})


@sft("val.parquet", "not found")
def sft_val_file_missing(ws):
    return ws.sft(None, {"data.val_files": str(ws.root / "val.parquet")})


# ---- SFT config values ----

@sft("data.truncation", "middle")
def sft_yaml_unknown_truncation(ws):
    return ws.sft(None, {"data.truncation": "middle"})


@sft("data.max_length")
def sft_yaml_max_length_zero(ws):
    return ws.sft(None, {"data.max_length": 0})


@sft("actor_rollout_ref")
def sft_yaml_with_a_ppo_section(ws):
    return ws.sft(None, {"actor_rollout_ref.model.path": str(ws.model)})


@sft("data.micro_batch_size_per_gpu")
def sft_yaml_micro_batch_not_dividing(ws):
    return ws.sft(None, {"data.micro_batch_size_per_gpu": 3})


@sft("optim.lr", "fast")
def sft_yaml_string_learning_rate(ws):
    return ws.sft(None, {"optim.lr": "fast"})


@sft("model.partial_pretrain")
def sft_yaml_without_a_model(ws):
    return ws.sft(None, {"model.partial_pretrain": DROP})


# ---- SFT model folders, output folder, resume targets ----

@sft("model.partial_pretrain", "holds no model weights")
def sft_model_folder_without_weights(ws):
    model = ws.model_copy()
    (model / "model.safetensors").unlink()
    return ws.sft(None, {"model.partial_pretrain": str(model)})


@sft("model.partial_pretrain", "turns ordinary text into no tokens", "tokenizer.json included")
def sft_model_folder_without_tokenizer_files(ws):
    model = ws.model_copy()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / name).unlink()
    return ws.sft(None, {"model.partial_pretrain": str(model)})


@sft("model.partial_pretrain", "the tokenizer in", "cannot be read")
def sft_tokenizer_json_damaged(ws):
    model = ws.model_copy()
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    return ws.sft(None, {"model.partial_pretrain": str(model)})


@sft("trainer.default_local_dir", "which is a file")
def sft_output_folder_below_a_file(ws):
    ws.write("taken", "a file")
    return ws.sft(None, {"trainer.default_local_dir": str(ws.root / "taken" / "deeper" / "run")})


@sft("trainer.resume_from_path", "holds no trainer_state.pt")
def sft_resume_from_a_folder_of_junk(ws):
    ws.write("junk/notes.txt", "not a checkpoint")
    return ws.sft(None, {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": str(ws.root / "junk")})


@sft("is a checkpoint of a reward-model run, not of an SFT run")
def sft_resume_from_a_reward_model_checkpoint(ws):
    other = ws.trained("rm")
    return ws.sft(None, {"trainer.resume_mode": "resume_path",
                         "trainer.resume_from_path": str(other / "global_step_1")})


@sft("the newest checkpoint is damaged", "trainer_state.pt", "trainer.resume_mode=disable")
def sft_auto_resume_from_a_truncated_state(ws):
    run = ws.trained("sft", into="run")
    state = run / "global_step_1" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:300])
    return ws.sft()


# ---- ranked data: a bad value in row 4 of 8 ----

@rm(f"{RM_ROW4} 'ranking'", "index 5, out of range for 3 responses", "0-based positions")
def rm_row4_ranking_index_out_of_range(ws):
    return ws.rm(rows(ranked_row, 4, ranking=[0, 5, 1]))


@rm(f"{RM_ROW4} 'ranking'", "lists response 1 twice", "at most once")
def rm_row4_ranking_repeats_an_index(ws):
    return ws.rm(rows(ranked_row, 4, ranking=[1, 1, 0]))


@rm(f"{RM_ROW4} 'scores'", "'ranking' and 'scores' are given together", ONE_FORM)
def rm_row4_ranking_and_scores_both_given(ws):
    return ws.rm(rows(ranked_row, 4, scores=[1.0, 0.5, 0.0]))


@rm(f"{RM_ROW4} 'rejected'", "expected the rejected response as a string, got None")
def rm_row4_chosen_without_rejected(ws):
    return ws.rm(rows(ranked_row, 4, responses=None, ranking=None, chosen="4 is great"))


@rm(f"{RM_ROW4} 'responses'", "given together with 'chosen'/'rejected'")
def rm_row4_pair_with_responses_too(ws):
    return ws.rm(rows(ranked_row, 4, ranking=None, chosen="4 is great", rejected="4 is bad"))


@rm(f"{RM_ROW4} 'ranking'", "lists 1 response(s); a ranking needs at least 2", RANKING_FIX)
def rm_row4_ranking_of_one(ws):
    return ws.rm(rows(ranked_row, 4, ranking=[2]))


@rm(f"{RM_ROW4} 'ranking'", "has 4 entries but the row has 3 responses")
def rm_row4_ranking_longer_than_responses(ws):
    table = rows(ranked_row, 4, ranking=[0, 1, 2, 0])
    return ws.rm(table)


@rm(f"{RM_ROW4} 'ranking'", "no ranking given", ONE_FORM)
def rm_row4_without_any_ranking(ws):
    return ws.rm(rows(ranked_row, 4, ranking=None))


@rm(f"{RM_ROW4} 'responses'", "has 1 response, but a ranking needs at least 2")
def rm_row4_one_response(ws):
    table = [{**ranked_row(i), "ranking": None, "scores": [1.0, 0.5, 0.0]} for i in range(8)]
    table[4].update(responses=["4 is great"], scores=[1.0])
    return ws.rm(table)


@rm(f"{RM_ROW4} 'scores'", "score 2 is inf, not a finite number")
def rm_row4_infinite_score(ws):
    table = [{**ranked_row(i), "ranking": None, "scores": [1.0, 0.5, 0.0]} for i in range(8)]
    table[4]["scores"] = [1.0, 0.5, float("inf")]
    return ws.rm(table)


@rm(f"{RM_ROW4} 'rankings'", "non-empty list of rankings", "[[2, 0, 1], [0, 2]]")
def rm_row4_annotator_rankings_empty(ws):
    table = [{**ranked_row(i), "ranking": None, "rankings": [[0, 1, 2], [1, 0]]} for i in range(8)]
    table[4]["rankings"] = []
    return ws.rm(table)


@rm(f"{RM_ROW4} 'prompt'", "got None", MESSAGES)
def rm_row4_prompt_is_null(ws):
    return ws.rm(rows(ranked_row, 4, prompt=None))


@rm(f"{RM_ROW4} 'prompt'", "encodes to no tokens")
def rm_row4_prompt_encodes_to_no_tokens(ws):
    model = ws.model_copy()
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return ws.rm(rows(ranked_row, 4, prompt=[{"role": "user", "content": ""}]), {"model.partial_pretrain": str(model)})


@rm(f"{RM_ROW4} 'prompt'", "longer than data.max_prompt_length=64", "data.truncation=left|right")
def rm_row4_prompt_too_long(ws):
    return ws.rm(rows(ranked_row, 4, prompt=[{"role": "user", "content": "seven " * 200}]))


# ---- reward-model config, model folders, output folder, resume targets ----

@rm("is a PPO config", "run it with klppo ppo")
def rm_given_a_ppo_config_file(ws):
    return ["rm", *ws.ppo()[1:]]


@rm("loss.type", "hinge")
def rm_yaml_unknown_loss(ws):
    return ws.rm(None, {"loss.type": "hinge"})


@rm("data.max_response_length")
def rm_yaml_negative_response_length(ws):
    return ws.rm(None, {"data.max_response_length": -4})


@rm("model.partial_pretrain", "cannot be read", "copy the folder again")
def rm_model_weights_truncated(ws):
    model = ws.model_copy()
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:3000])
    return ws.rm(None, {"model.partial_pretrain": str(model)})


@rm("model.partial_pretrain", "turns ordinary text into no tokens")
def rm_model_folder_without_tokenizer_files(ws):
    model = ws.model_copy()
    (model / "tokenizer.json").unlink()
    return ws.rm(None, {"model.partial_pretrain": str(model)})


@rm("trainer.default_local_dir", "cannot write into", "a folder you can write to")
def rm_output_folder_not_writable(ws):
    from klppo.errors import UserError
    from klppo.run.setup import check_run_dir

    try:
        check_run_dir(UNWRITABLE)
    except UserError:
        return ws.rm(None, {"trainer.default_local_dir": UNWRITABLE})
    pytest.skip(f"{UNWRITABLE} is writable on this machine")


@rm("trainer.default_local_dir", "is an existing file")
def rm_output_folder_is_a_file(ws):
    ws.write("taken.txt", "a file")
    return ws.rm(None, {"trainer.default_local_dir": str(ws.root / "taken.txt")})


@rm("is a checkpoint of an SFT run, not of a reward-model run")
def rm_resume_from_an_sft_checkpoint(ws):
    other = ws.trained("sft")
    return ws.rm(None, {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": str(other / "global_step_1")})


@rm("is truncated", "resume from another checkpoint or start fresh")
def rm_auto_resume_from_a_truncated_shard(ws):
    run = ws.trained("rm", into="run")
    shard = next((run / "global_step_1" / "weights").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    return ws.rm()


@rm("latest_checkpointed_iteration.txt", "not a step number")
def rm_auto_resume_with_a_non_numeric_pointer(ws):
    run = ws.trained("rm", into="run")
    (run / "latest_checkpointed_iteration.txt").write_text("step one")
    return ws.rm()


@rm("trainer.resume_from_path", "not a folder")
def rm_resume_from_a_file(ws):
    ws.write("global_step_3", "not a folder")
    return ws.rm(None, {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": str(ws.root / "global_step_3")})


# ---- resuming: the checkpoint's state is restored before the run writes anything ----

@sft("data position", "does not fit 2 batches per epoch", "data.train_batch_size and data files the checkpoint")
def sft_auto_resume_whose_data_position_does_not_fit_the_data(ws):
    run = ws.trained("sft", into="run")
    ws.shift_data_position(run / "global_step_1", 5)
    return ws.sft(None, {"trainer.total_training_steps": 2})


@rm("data position", "does not fit 2 batches per epoch", "data.train_batch_size and data files the checkpoint")
def rm_resume_path_whose_data_position_does_not_fit_the_data(ws):
    other = ws.trained("rm")
    ws.shift_data_position(other / "global_step_1", 7)
    return ws.rm(None, {"trainer.total_training_steps": 2, "trainer.resume_mode": "resume_path",
                        "trainer.resume_from_path": str(other / "global_step_1")})


# ---- regex-valued keys ----

@sft("model.target_modules", "is not a valid regular expression", "unterminated character set")
def sft_lora_target_modules_regex_that_does_not_compile(ws):
    return ws.sft(None, {"model.lora_rank": 8, "model.target_modules": "[qv]_proj|[o_proj"})


@rm("model.exclude_modules", "is not a valid regular expression", "give a list of module names")
def rm_lora_exclude_modules_regex_that_does_not_compile(ws):
    return ws.rm(None, {"model.lora_rank": 8, "model.exclude_modules": "score)"})


# ---- tokenizers whose special tokens have no embedding row ----

@sft("model.partial_pretrain", "has pad_token '<|padding|>' at id 384", "use the model's own tokenizer")
def sft_tokenizer_pad_token_past_the_embedding_rows(ws):
    return ws.sft(None, {"model.partial_pretrain": str(ws.model_with_new_special_tokens(pad_token="<|padding|>"))})


@rm("model.partial_pretrain", "has bos_token '<|begin|>' at id 384", "384 embedding rows")
def rm_tokenizer_bos_token_past_the_embedding_rows(ws):
    return ws.rm(None, {"model.partial_pretrain": str(ws.model_with_new_special_tokens(bos_token="<|begin|>"))})


# ---- broken chat templates: the error blames the template's file, not row 0 ----

@sft("model.partial_pretrain", "chat_template.jinja' cannot render even one user message",
     "'str object' has no attribute 'title_case'")
def sft_chat_template_that_fails_on_every_conversation(ws):
    model = ws.model_copy()
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'].title_case() }}{% endfor %}")
    return ws.sft(None, {"model.partial_pretrain": str(model)})


@rm("model.partial_pretrain", "tokenizer_config.json' cannot render even one user message", "'mesages' is undefined")
def rm_chat_template_in_tokenizer_config_with_an_undefined_name(ws):
    """The older layout: the template inside tokenizer_config.json."""
    import json

    model = ws.model_copy()
    (model / "chat_template.jinja").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in mesages %}{{ m['content'] }}{% endfor %}{{ mesages[0]['role'] }}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return ws.rm(None, {"model.partial_pretrain": str(model)})


# ---- weights of the wrong shape: one rule on one process and on ranks ----

@rm("model.partial_pretrain", "'model.embed_tokens.weight'", "has shape [300, 32]", "needs [384, 32]")
def rm_model_embeddings_of_the_wrong_shape_sharded(ws):
    from cases_ppo import with_reshaped_weight

    path = with_reshaped_weight(ws, "model.embed_tokens.weight", (300, 32))
    return ws.rm(None, {"model.partial_pretrain": path, "model.fsdp_config.dtype": "bfloat16"})


# ---- content that would be misread ----

@sft(f"{SFT_ROW6} 'prompt'", "chat messages written as JSON", "write the list of messages itself")
def sft_row6_prompt_is_chat_messages_as_json_text(ws):
    from cases_ppo import json_text_prompts

    return ws.sft(json_text_prompts(rows(sft_row), 6))


@rm(f"{RM_ROW4} 'prompt'", "chat messages written as JSON")
def rm_row4_prompt_is_chat_messages_as_json_text(ws):
    from cases_ppo import json_text_prompts

    return ws.rm(json_text_prompts(rows(ranked_row), 4))
