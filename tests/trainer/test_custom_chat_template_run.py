"""verl's actor_rollout_ref.model.custom_chat_template: the run renders every chat prompt with it
(and plans with it), the exported actor's tokenizer carries it, and score-logprobs takes it too."""

import shutil

import pyarrow.parquet as pq
from transformers import AutoTokenizer

from klppo.cli import main
from klppo.commands.main_ppo import run_ppo
from klppo.models.tiny import CHAT_TEMPLATE
from klppo.plan.check import length_sample

# The tiny model's ChatML with a system turn of two special tokens before every conversation.
CUSTOM = "{{ '<|im_start|><|im_end|>' }}" + CHAT_TEMPLATE


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


def test_a_run_renders_its_prompts_with_the_custom_template_and_exports_it(ppo_overrides, tmp_path):
    records = {}
    for name, extra in (("saved", {}), ("custom", {"actor_rollout_ref.model.custom_chat_template": repr(CUSTOM)})):
        (records[name],) = run_ppo(None, ppo_overrides(run_dir=tmp_path / name, **{
            "trainer.total_training_steps": 1, **extra}), print_fn=quiet)
    for stat in ("mean", "min", "max"):  # the same prompts, each two tokens longer
        assert records["custom"][f"prompt_length/{stat}"] == records["saved"][f"prompt_length/{stat}"] + 2
    assert AutoTokenizer.from_pretrained(tmp_path / "custom" / "actor_hf").chat_template == CUSTOM
    assert AutoTokenizer.from_pretrained(tmp_path / "saved" / "actor_hf").chat_template == CHAT_TEMPLATE


def test_the_plan_measures_prompts_with_the_custom_template(ppo_overrides):
    from klppo.config import load_ppo_config

    saved = length_sample(load_ppo_config(None, ppo_overrides()))
    custom = length_sample(load_ppo_config(None, ppo_overrides(**{
        "actor_rollout_ref.model.custom_chat_template": repr(CUSTOM)})))
    assert custom.prompt_tokens == tuple(n + 2 for n in saved.prompt_tokens)


def test_score_logprobs_with_the_template_scores_as_a_model_that_saved_it(tiny_model_dir, task_dir, tmp_path):
    saved_with_it = shutil.copytree(tiny_model_dir, tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(saved_with_it)
    tokenizer.chat_template = CUSTOM
    tokenizer.save_pretrained(saved_with_it)
    template_file = tmp_path / "custom.jinja"
    template_file.write_text(CUSTOM)
    outputs = {}
    for name, args in (("given", ["--model", str(tiny_model_dir), "--chat-template", f"@{template_file}"]),
                       ("saved", ["--model", str(saved_with_it)]),
                       ("plain", ["--model", str(tiny_model_dir)])):
        outputs[name] = tmp_path / f"{name}.parquet"
        assert main(["score-logprobs", *args, "--input", str(task_dir / "offline.parquet"),
                     "--output", str(outputs[name]), "--device", "cpu"]) == 0
    column = {name: pq.read_table(path).column("rollout_log_probs").to_pylist() for name, path in outputs.items()}
    assert column["given"] == column["saved"] != column["plain"]
