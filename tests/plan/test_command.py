"""``klppo plan`` and the run-start check: numbers checked against the model's shape, the check's
three modes, and no weights loaded anywhere on the way."""

import json
import re
import shutil
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
import transformers

from klppo.cli import main as klppo_main
from klppo.config import load_ppo_config
from klppo.data.arithmetic import write_arithmetic_offline_parquet, write_arithmetic_parquet
from klppo.errors import UserError
from klppo.plan.inputs import lora_parameters
from klppo.plan.model_shape import read_model_shape
from tests.test_example_configs import is_example_config
from klppo.commands.main_ppo import run_ppo

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [p for p in sorted((ROOT / "examples").rglob("*.yaml")) if "sft" not in p.stem and is_example_config(p)]
QWEN05 = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
              num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, model_type="qwen2",
              architectures=["Qwen2ForCausalLM"])
P05, GiB = 494_032_768, 2**30


class WeightsLoaded(Exception):
    pass


@pytest.fixture
def no_weights(monkeypatch):
    """Every way klppo loads weights raises WeightsLoaded."""
    def refuse(*args, **kwargs):
        raise WeightsLoaded

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)


@pytest.fixture(scope="module")
def qwen05_dir(tmp_path_factory, tiny_model_dir):
    """Qwen2.5-0.5B's config.json (no weights) with the tiny model's tokenizer, for the length sample."""
    out = tmp_path_factory.mktemp("qwen05")
    (out / "config.json").write_text(json.dumps(QWEN05))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def plan_data(tmp_path_factory):
    """Prompts for every example's batch (gsm8k's is 256) and offline prompts with 4 responses each."""
    out = tmp_path_factory.mktemp("plan_data")
    write_arithmetic_parquet(out / "train.parquet", 512, seed=1)
    write_arithmetic_offline_parquet(out / "offline.parquet", 64, seed=2, n_responses=4)
    return out


def _rows(text: str) -> dict[str, list[float]]:
    """The memory table's rows: phase -> weights, optim, grads, activ, logits, fsdp, gen, other, total."""
    rows = {}
    for line in text.splitlines():
        cells = line.replace("<- peak", "").split()
        if len(cells) == 10 and re.fullmatch(r"[a-z_]+", cells[0]) and all(re.fullmatch(r"[0-9.]+", c) for c in cells[1:]):
            rows[cells[0]] = [float(c) for c in cells[1:]]
    return rows


def _plan(capsys, *argv) -> str:
    assert klppo_main(["plan", *argv]) == 0
    return capsys.readouterr().out


def _example_overrides(path: Path, model: Path, task: Path) -> list[str]:
    """The example with the planned model and, where its data is prepared by a script, this test's."""
    cfg = load_ppo_config(str(path), [f"actor_rollout_ref.model.path={model}"])
    offline = cfg.actor_rollout_ref.rollout.name == "offline"
    data = ROOT / cfg.data.train_files if (ROOT / cfg.data.train_files).is_file() else \
        task / ("offline.parquet" if offline else "train.parquet")
    out = [f"actor_rollout_ref.model.path={model}", f"data.train_files={data}", "data.val_files=null",
           "trainer.device=cpu"]
    if cfg.reward_model.enable:
        out.append(f"reward_model.model.path={model}")
    if cfg.critic.model.path is not None:
        out.append(f"critic.model.path={model}")
    return out


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_plan_of_each_example_holds_its_models_fp32_weights_and_adam_state(path, qwen05_dir, plan_data, capsys,
                                                                            no_weights):
    overrides = _example_overrides(path, qwen05_dir, plan_data)
    out = _plan(capsys, str(path), *overrides, "--device-memory", "64GiB")
    cfg = load_ppo_config(str(path), overrides)
    shape = read_model_shape(str(qwen05_dir))
    lora = cfg.actor_rollout_ref.model.lora_rank
    actor_trained = lora_parameters(shape, cfg.actor_rollout_ref.model, lora) if lora else P05
    critic = cfg.algorithm.adv_estimator == "gae"
    ref = (cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss) and not lora
    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    weights = (P05 * (1 + ref) + (P05 + 897) * critic) * 4 / world  # a critic: the backbone + an 896 -> 1 head
    optim = 8 * (actor_trained + (P05 + 897) * critic) / world
    row = _rows(out)["update_actor"]
    assert row[0] == pytest.approx(weights / GiB, abs=0.006) and row[1] == pytest.approx(optim / GiB, abs=0.006)
    assert "Time per step" in out or "FLOPs per step" in out


def test_more_gpus_in_the_command_shrink_the_sharded_parts(qwen05_dir, plan_data, capsys, no_weights):
    overrides = _example_overrides(ROOT / "examples/arithmetic/ppo.yaml", qwen05_dir, plan_data)
    one = _rows(_plan(capsys, "examples/arithmetic/ppo.yaml", *overrides, "--device-memory", "64GiB"))
    four = _rows(_plan(capsys, "examples/arithmetic/ppo.yaml", *overrides, "--device-memory", "64GiB",
                       "--gpus-per-node", "4", "--device", "cuda", "--device-name", "H100"))
    assert four["update_actor"][0] == pytest.approx(one["update_actor"][0] / 4, abs=0.006)
    assert four["update_actor"][1] == pytest.approx(one["update_actor"][1] / 4, abs=0.006)


def test_time_table_uses_the_stated_mfu_and_peak(qwen05_dir, plan_data, capsys, no_weights):
    overrides = _example_overrides(ROOT / "examples/arithmetic/ppo.yaml", qwen05_dir, plan_data)
    out = _plan(capsys, "examples/arithmetic/ppo.yaml", *overrides, "--device-memory", "80GiB", "--device", "cuda",
                "--peak-tflops", "100", "--mfu", "0.5")
    step = next(line for line in out.splitlines() if line.startswith("step "))
    tflops, seconds = (float(x) for x in step.split()[1:3])
    assert seconds == pytest.approx(tflops / 50, rel=0.01)  # 0.5 x 100 TFLOP/s on one device


def _run(ppo_overrides, tmp_path, *changes):
    """(whether the run reached loading weights, the UserError it stopped with or None, what it printed)."""
    printed = []
    with pytest.raises((UserError, WeightsLoaded)) as info:
        run_ppo(None, ppo_overrides(tmp_path / "run") + list(changes), print_fn=printed.append)
    error = info.value
    # the loader reports a failing read as a damaged folder (a UserError raised from WeightsLoaded)
    loaded = isinstance(error, WeightsLoaded) or isinstance(error.__cause__ or error.__context__, WeightsLoaded)
    return loaded, (None if loaded else error), "\n".join(map(str, printed))


def test_run_over_the_memory_stops_before_loading_with_the_knobs(ppo_overrides, tmp_path, no_weights):
    loaded, error, printed = _run(ppo_overrides, tmp_path, "trainer.plan_device_memory=1MiB", "trainer.plan_check=error")
    assert not loaded and error is not None
    message = str(error)
    assert "trainer.plan_check=warn" in message and "knobs that lower the peak" in message and "GiB" in message


def test_plan_check_warn_warns_and_goes_on_to_load(ppo_overrides, tmp_path, no_weights):
    loaded, _, printed = _run(ppo_overrides, tmp_path, "trainer.plan_device_memory=1MiB", "trainer.plan_check=warn")
    assert loaded
    assert "[plan] memory per rank" in printed and "warning: the memory plan's peak" in printed


def test_plan_check_off_is_silent(ppo_overrides, tmp_path, no_weights):
    loaded, _, printed = _run(ppo_overrides, tmp_path, "trainer.plan_device_memory=1MiB", "trainer.plan_check=off")
    assert loaded and "[plan]" not in printed, (_, printed)


def test_a_run_that_fits_prints_the_block_without_a_warning(ppo_overrides, tmp_path, no_weights):
    loaded, _, printed = _run(ppo_overrides, tmp_path, "trainer.plan_device_memory=64GiB", "trainer.plan_check=error")
    assert loaded
    assert ": fits" in printed and "warning" not in printed


def test_a_gold_reward_model_is_planned_as_a_resident_reward_model(ppo_overrides, tiny_model_dir, tmp_path):
    from klppo.config import load_ppo_config
    from klppo.plan.check import plan_run
    from klppo.plan.inputs import Lengths

    def peaks(*changes):
        cfg = load_ppo_config(None, ppo_overrides(tmp_path / "run") + list(changes))
        e, _ = plan_run(cfg, world_size=1, device="cpu", device_bytes=64 << 30, lengths=Lengths.of([32], [16]))
        return {p.phase: p for p in e.phases}

    without = peaks("data.val_files=v.parquet")
    with_gold = peaks("data.val_files=v.parquet", f"trainer.gold_reward.model_path={tiny_model_dir}")
    assert with_gold.keys() == without.keys()
    weights = dict(with_gold["validate"].items)["gold_reward_model weights"]
    assert weights > 0 and "gold_reward_model weights" not in dict(without["validate"].items)
    # loaded with the others: mapped from its fp32 file in setup (nothing read yet), resident after
    assert with_gold["setup"].total == without["setup"].total
    assert all(with_gold[name].total == without[name].total + weights for name in without if name != "setup")


def test_clip_covs_forward_per_mini_batch_is_in_the_actors_update_time(qwen05_dir, plan_data, capsys, no_weights):
    overrides = _example_overrides(ROOT / "examples/arithmetic/ppo.yaml", qwen05_dir, plan_data)
    options = ("--device-memory", "80GiB", "--device", "cuda", "--peak-tflops", "100", "--mfu", "0.5")

    def update_tflops(*extra) -> float:
        out = _plan(capsys, "examples/arithmetic/ppo.yaml", *overrides, *extra, *options)
        timed = out[out.index("Time per step"):]
        return float(next(line for line in timed.splitlines() if line.startswith("update_actor ")).split()[1])

    plain = update_tflops()
    assert update_tflops("actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov") == pytest.approx(plain * 4 / 3,
                                                                                                      rel=0.01)
