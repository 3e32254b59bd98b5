"""A PPO run renders its prompts with data.apply_chat_template_kwargs, as verl does (Qwen3's
enable_thinking here), and warns about a name the model's template never reads."""

import shutil

from transformers import AutoTokenizer

from klppo.commands.main_ppo import run_ppo
from tests.conftest import THINKING_TEMPLATE


def test_offline_ppo_prompts_carry_what_the_template_kwargs_ask_for(ppo_overrides, tiny_model_dir, tmp_path):
    model = shutil.copytree(tiny_model_dir, tmp_path / "thinking_model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = THINKING_TEMPLATE  # an empty thought (2 special tokens) with enable_thinking=false
    tokenizer.save_pretrained(model)
    runs = {}
    for name, extra in (("plain", []), ("no_thinking", ["+data.apply_chat_template_kwargs.enable_thinking=false",
                                                        "+data.apply_chat_template_kwargs.enable_thinkng=false"])):
        printed = []
        overrides = ppo_overrides(run_dir=tmp_path / name, **{"actor_rollout_ref.model.path": model,
                                                               "trainer.total_training_steps": 1})
        (last,) = run_ppo(None, overrides + extra, print_fn=lambda *a, **k: printed.append(" ".join(map(str, a))))
        runs[name] = (last, printed)
    (plain, _), (no_thinking, printed) = runs["plain"], runs["no_thinking"]
    for stat in ("mean", "min", "max"):  # the same prompts (same seed), each 2 tokens longer
        assert no_thinking[f"prompt_length/{stat}"] == plain[f"prompt_length/{stat}"] + 2
    warnings = [line for line in printed if "apply_chat_template_kwargs" in line]
    assert warnings == ["warning: data.apply_chat_template_kwargs.enable_thinkng: the model's chat template never "
                        "reads 'enable_thinkng', so it changes no prompt; did you mean 'enable_thinking'?"]
