"""LoRA PPO runs of the tiny model in one process: only the adapters (and the critic's head) train,
the reference is the actor with its starting adapters, checkpoints hold the adapters, exports load
in transformers and peft, a resumed or rolled-back run is exact, and under bf16 the sampler
computes the actor's log-probs and a reference forward may come first."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from klppo.config import load_ppo_config
from klppo.data.batching import MicroBatching
from klppo.distributed import close, read_sharded_contents
from klppo.errors import UserError
from klppo.models.lora import is_adapter
from klppo.monitoring.logger import read_metrics
from klppo.rollout.hf import hf_rollout
from klppo.rollout.offline import offline_rollout
from klppo.run import state as run_state
from klppo.run.build import PPOParts, build_ppo
from klppo.trainer.forwards import compute_log_prob, reference_model
from klppo.commands.main_ppo import run_ppo
from klppo.trainer.ppo_trainer import PPOTrainer
from klppo.trainer.responses import generation_model, uses_gathered_copy

STEPS = 4
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


@pytest.fixture(scope="module")
def lora_overrides(tiny_model_dir, task_dir):
    """overrides(run_dir, **changes): an offline GAE run with a LoRA actor and a LoRA critic, KL in the
    reward, packed token-budget micro-batches and a checkpoint every 2 steps."""

    def overrides(run_dir: Path, **changes) -> list[str]:
        settings = {
            "data.train_files": task_dir / "offline.parquet", "data.max_prompt_length": 64,
            "data.max_response_length": 16, "data.train_batch_size": 8,
            "actor_rollout_ref.model.path": tiny_model_dir, "actor_rollout_ref.model.use_remove_padding": "true",
            "actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.model.lora_alpha": 16,
            "critic.model.lora_rank": 4, "actor_rollout_ref.rollout.name": "offline", "actor_rollout_ref.rollout.n": 2,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.actor.use_dynamic_bsz": "true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 128, "actor_rollout_ref.actor.optim.lr": 1e-2,
            "critic.optim.lr": 1e-3, "algorithm.use_kl_in_reward": "true", "trainer.total_training_steps": STEPS,
            "algorithm.kl_ctrl.probe_every": 1,  # the tests read every step's sampled KL
            "trainer.save_freq": 2, "trainer.logger": "[]", "trainer.device": "cpu",
            "trainer.default_local_dir": run_dir,
        }
        settings.update(changes)
        return [f"{k}={v}" for k, v in settings.items()]

    return overrides


@pytest.fixture(scope="module")
def trained(lora_overrides, tmp_path_factory):
    """(the parts after a finished LoRA run, its run folder, its metrics). The run drops its critic
    before the export; ``parts.critic_names`` keeps the critic's parameter names by id."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    parts = build_ppo(load_ppo_config(None, lora_overrides(run_dir)), log=quiet)
    parts.critic_names = {id(p): n for n, p in parts.critic.named_parameters()}
    records = PPOTrainer(parts, print_fn=quiet).fit()
    return parts, run_dir, records


def test_only_the_adapters_and_the_critics_head_are_in_the_optimisers(trained):
    parts, _, _ = trained
    actor_names = {id(p): n for n, p in parts.actor.named_parameters()}
    optimised = {actor_names[id(p)] for group in parts.actor_optimizer.param_groups for p in group["params"]}
    assert optimised and all(is_adapter(name) for name in optimised)
    assert optimised == {n for n in actor_names.values() if is_adapter(n)}
    critic_names = parts.critic_names
    critic_optimised = {critic_names[id(p)] for group in parts.critic_optimizer.param_groups for p in group["params"]}
    head = {n for n in critic_names.values() if not n.startswith("model.")}  # the value head, outside the backbone
    assert head and {n for n in critic_optimised if not is_adapter(n)} == head
    assert any(is_adapter(n) for n in critic_optimised)


def test_no_reference_model_is_loaded_and_the_kl_is_zero_before_the_first_update(trained):
    parts, _, records = trained
    assert parts.ref is None and parts.settings.ref_in_actor
    assert records[0]["actor/kl_to_ref"] == 0.0 and records[0]["actor/reward_kl_penalty"] == 0.0
    assert records[-1]["actor/kl_to_ref"] != 0.0  # the adapters moved the policy away from the base
    # The offline probe samples from the policy and scores with the adapters off: also exactly 0 at first.
    assert records[0]["actor/kl_to_ref_sampled"] == 0.0 and records[-1]["actor/kl_to_ref_sampled"] > 0.0


def test_the_base_weights_stay_as_loaded_and_the_reference_is_the_base_model(trained, tiny_model_dir):
    parts, _, _ = trained
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    weights = parts.actor.state_dict()
    for name, value in base.state_dict().items():
        adapted = name.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        assert torch.equal(weights.get(adapted, weights.get(name)), value), name
    adapters = {n: p.detach().clone() for n, p in parts.actor.named_parameters() if is_adapter(n)}
    with torch.no_grad(), reference_model(parts) as ref:  # new adapters start at lora_B = 0: the base model
        torch.testing.assert_close(ref(IDS).logits, base(IDS).logits, rtol=0, atol=0)
    assert all(p.requires_grad == is_adapter(n) for n, p in parts.actor.named_parameters())  # flags untouched
    assert all(torch.equal(p, adapters[n]) for n, p in parts.actor.named_parameters() if n in adapters)


def test_the_merged_export_and_the_adapter_give_the_adapted_models_logits(trained, tiny_model_dir):
    from peft import PeftModel

    parts, run_dir, _ = trained
    with torch.no_grad():
        adapted = parts.actor(IDS).logits
        merged = AutoModelForCausalLM.from_pretrained(run_dir / "actor_hf")
        torch.testing.assert_close(merged(IDS).logits, adapted, rtol=1e-5, atol=1e-5)
        assert not any(is_adapter(name) for name in merged.state_dict())
        with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                                 run_dir / "actor_adapter")
        torch.testing.assert_close(with_adapter(IDS).logits, adapted, rtol=1e-5, atol=1e-5)
    with safe_open(str(run_dir / "actor_adapter" / "adapter_model.safetensors"), "pt") as f:
        assert f.keys() and all(".lora_A." in k or ".lora_B." in k for k in f.keys())


def test_klppo_export_of_the_last_checkpoint_writes_what_the_run_exported(trained, lora_overrides, tmp_path):
    from safetensors.torch import load_file

    from klppo.commands.export import export_checkpoint
    from klppo.config import format_config

    _, run_dir, _ = trained
    config = tmp_path / "config.yaml"  # the fixture's run was built in code, so it wrote no config.yaml
    config.write_text(format_config(load_ppo_config(None, lora_overrides(run_dir))))
    written = export_checkpoint(str(run_dir), str(tmp_path / "hf"), config=str(config), print_fn=quiet)
    assert written == [tmp_path / "hf", tmp_path / "hf_adapter"]
    for ours, theirs in ((tmp_path / "hf" / "model.safetensors", run_dir / "actor_hf" / "model.safetensors"),
                         (tmp_path / "hf_adapter" / "adapter_model.safetensors",
                          run_dir / "actor_adapter" / "adapter_model.safetensors")):
        a, b = load_file(ours), load_file(theirs)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), ours


def test_checkpoints_hold_the_adapters_and_their_optimiser_state_only(trained):
    _, run_dir, _ = trained
    keys = read_sharded_contents(run_dir / "global_step_4" / "weights").keys
    actor = [k for k in keys if k.startswith(("actor.", "actor_optimizer."))]
    assert actor and all(".lora_A." in k or ".lora_B." in k or k.startswith("actor_optimizer.param_groups")
                         for k in actor)
    assert any(k.startswith("actor_optimizer.state.") and k.endswith(".exp_avg") for k in actor)
    assert not any("base_layer" in k or "embed_tokens" in k for k in keys)


def test_a_resumed_lora_run_repeats_the_uninterrupted_run_exactly(trained, lora_overrides, tmp_path):
    _, run_dir, records = trained
    run_ppo(None, lora_overrides(tmp_path / "run", **{"trainer.total_training_steps": 2}), print_fn=quiet)
    resumed = run_ppo(None, lora_overrides(tmp_path / "run"), print_fn=quiet)
    comparable = [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in records[2:]]
    assert [r["step"] for r in resumed] == [3, 4]
    assert [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in resumed] == comparable
    with safe_open(str(run_dir / "actor_adapter" / "adapter_model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "run" / "actor_adapter" / "adapter_model.safetensors"), "pt") as b:
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())


def test_rolling_back_to_the_initial_weights_restores_the_adapters_starting_values(lora_overrides, tiny_model_dir,
                                                                                     tmp_path):
    parts = build_ppo(load_ppo_config(None, lora_overrides(tmp_path / "run", **{"trainer.total_training_steps": 1})),
                      log=quiet)
    start = {n: p.detach().clone() for n, p in parts.actor.named_parameters() if is_adapter(n)}
    trainer = PPOTrainer(parts, print_fn=quiet)
    trainer.step = 1  # the actor updates after the critic's warm-up steps (none)
    trainer.train_step()
    assert any(not torch.equal(p, start[n]) for n, p in parts.actor.named_parameters() if n in start)
    run_state.restore_initial_actor(parts)
    assert all(torch.equal(p, start[n]) for n, p in parts.actor.named_parameters() if n in start)
    assert not parts.actor_optimizer.state
    with torch.no_grad():  # lora_B is zero again: the actor is the base model
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        torch.testing.assert_close(parts.actor(IDS).logits, base(IDS).logits, rtol=0, atol=0)


def test_a_run_starts_from_a_saved_adapter_which_is_its_reference(trained, lora_overrides, tmp_path):
    _, run_dir, _ = trained
    overrides = lora_overrides(tmp_path / "run", **{"actor_rollout_ref.model.lora_rank": 0,
                                                    "actor_rollout_ref.model.lora_adapter_path": run_dir / "actor_adapter",
                                                    "trainer.total_training_steps": 1})
    parts = build_ppo(load_ppo_config(None, overrides), log=quiet)
    with safe_open(str(run_dir / "actor_adapter" / "adapter_model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    weights = dict(parts.actor.named_parameters())
    for key, value in saved.items():
        name = key.removeprefix("base_model.model.").replace(".weight", ".default.weight")
        assert torch.equal(weights[name], value), name
    records = PPOTrainer(parts, print_fn=quiet).fit()
    # The reference is the actor as it started, the saved adapter included: no KL before an update.
    assert records[0]["actor/kl_to_ref"] == 0.0 and records[0]["actor/reward_kl_penalty"] == 0.0
    assert records[0]["actor/kl_to_ref_sampled"] == 0.0


def test_with_lora_reference_base_the_reference_of_a_saved_adapter_is_the_base_model(trained, lora_overrides,
                                                                                      tiny_model_dir, tmp_path):
    _, run_dir, _ = trained
    overrides = lora_overrides(tmp_path / "run", **{"actor_rollout_ref.model.lora_adapter_path": run_dir / "actor_adapter",
                                                    "actor_rollout_ref.ref.lora_reference": "base",
                                                    "trainer.total_training_steps": 1})
    parts = build_ppo(load_ppo_config(None, overrides), log=quiet)
    with torch.no_grad(), reference_model(parts) as ref:
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        torch.testing.assert_close(ref(IDS).logits, base(IDS).logits, rtol=0, atol=0)
    assert PPOTrainer(parts, print_fn=quiet).fit()[0]["actor/kl_to_ref"] > 0.0  # the saved adapter is not the base


def test_target_modules_that_match_no_layer_are_refused_naming_the_layers(lora_overrides, tmp_path):
    overrides = lora_overrides(tmp_path / "run", **{"actor_rollout_ref.model.target_modules": "[qproj]"})
    with pytest.raises(UserError, match=r"actor_rollout_ref.model.target_modules = \('qproj',\).*adapts no layer.*"
                                        r"'q_proj'.*list some of them, or use all-linear"):
        build_ppo(load_ppo_config(None, overrides), log=quiet)


def test_online_lora_run_generates_with_a_merged_copy_and_validates(lora_overrides, task_dir, tmp_path):
    overrides = lora_overrides(tmp_path / "run", **{
        "data.train_files": task_dir / "train.parquet", "data.val_files": task_dir / "val.parquet",
        "actor_rollout_ref.rollout.name": "hf", "trainer.test_freq": 1, "trainer.total_training_steps": 1,
        "trainer.save_freq": -1, "algorithm.adv_estimator": "grpo", "actor_rollout_ref.rollout.n": 2,
        "algorithm.use_kl_in_reward": "false", "actor_rollout_ref.actor.use_kl_loss": "true"})
    records = run_ppo(None, overrides, print_fn=quiet)
    assert records[0]["step"] == 0 and records[0]["val-aux/kl_to_ref"] == 0.0
    assert records[-1]["response_length/mean"] > 0 and "val-aux/kl_to_ref" in records[-1]
    assert (tmp_path / "run" / "actor_adapter" / "adapter_config.json").is_file()
    assert read_metrics(tmp_path / "run")[-1]["step"] == 1


@pytest.fixture
def bf16_parts(lora_overrides, tmp_path, monkeypatch):
    """build(**changes) -> the parts of an offline LoRA run whose actor computes in bf16: FSDP2's mixed
    precision over a process group of one (gloo), left when the test ends."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    built = []

    def build(**changes) -> PPOParts:
        overrides = lora_overrides(tmp_path / f"run{len(built)}", **{
            "actor_rollout_ref.actor.fsdp_config.dtype": "bfloat16", "trainer.save_freq": -1, **changes})
        built.append(build_ppo(load_ppo_config(None, overrides), log=quiet))
        return built[-1]

    yield build
    for parts in built:
        close(parts.env)


def train_steps(parts: PPOParts, steps: int) -> None:
    trainer = PPOTrainer(parts, print_fn=quiet)
    for step in range(1, steps + 1):
        trainer.step = step
        trainer.train_step()


@pytest.mark.parametrize("dtype, decoding", [("bfloat16", "dynamic"), ("bfloat16", "static"), ("float32", "static")],
                         ids=["bf16-new-copy", "bf16-kept-copy", "fp32-kept-merged-copy"])
def test_a_lora_actors_sampler_computes_the_actors_log_probs_after_updates(bf16_parts, dtype, decoding):
    """The sampler is a copy built for the generation (dynamic), or built once and refreshed in place
    (a static cache: the KL probe of each step wrote the new adapters into it, bf16 keeping them,
    fp32 merging them)."""
    parts = bf16_parts(**{"actor_rollout_ref.actor.optim.lr": 1e-4, "actor_rollout_ref.actor.fsdp_config.dtype": dtype,
                          "actor_rollout_ref.rollout.hf_decoding": decoding})
    assert parts.env.is_distributed == (dtype == "bfloat16") and uses_gathered_copy(parts)  # FSDP2 for mixed precision
    train_steps(parts, 3)
    assert (parts.kept_generation_model is not None) == (decoding == "static")
    s = parts.settings
    with generation_model(parts) as (sampler, _):
        batch = hf_rollout(sampler, parts.train_records[:4], parts.tokenizer, s.sampling)
        sampled = compute_log_prob(sampler, batch, MicroBatching(), temperature=s.forwards.temperature)
    actor = compute_log_prob(parts.actor, batch, MicroBatching(), temperature=s.forwards.temperature)
    with reference_model(parts) as ref:
        base = compute_log_prob(ref, batch, MicroBatching(), temperature=s.forwards.temperature)
    mask = batch.response_mask
    assert (actor - base)[mask].abs().max() > 2e-3  # three small updates moved the policy
    # The same bf16 forward recomputed on other batch shapes moves log-probs by about 1e-5 here; the
    # merged bf16 copy (W + dW rounded to bf16) was 1e-3 off the actor, as far as the base model.
    torch.testing.assert_close(sampled[mask], actor[mask], rtol=0, atol=1e-4)


def test_a_bf16_lora_run_whose_first_forward_is_the_reference_trains_as_one_that_starts_with_the_actor(bf16_parts):
    # A reference forward first (as in rollout correction's bypass mode, where pi_old is recorded)
    # once fixed FSDP2's mixed-precision dtypes while the adapters were frozen: bf16 gradients then
    # failed to reach the fp32 adapters at the first backward. The probe's gathered copy re-reads
    # the flags when it gathers (FSDPModule.unshard); generating through the sharded actor does not.
    changes = {"trainer.total_training_steps": 2, "actor_rollout_ref.rollout.generation_weights": "sharded"}
    reference_first, actor_first = bf16_parts(**changes), bf16_parts(**changes)
    batch = offline_rollout(reference_first.train_records[:2], n=2, tokenizer=reference_first.tokenizer,
                            max_response_length=16)
    with reference_model(reference_first) as ref:
        compute_log_prob(ref, batch, MicroBatching(), temperature=1.0)
    compute_log_prob(actor_first.actor, batch, MicroBatching(), temperature=1.0)
    got = PPOTrainer(reference_first, print_fn=quiet).fit()
    expected = PPOTrainer(actor_first, print_fn=quiet).fit()
    timeless = [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in got]
    assert timeless == [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in expected]
    assert got[0]["actor/kl_to_ref"] == 0.0 and got[-1]["actor/kl_to_ref"] > 0.0
