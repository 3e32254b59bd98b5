"""The memory plan: model shapes read without loading, and per-phase estimates that move the right
way with every knob the plan names (hand-worked sizes of a Qwen2.5-0.5B-shaped config)."""

import dataclasses
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from klppo.config import load_ppo_config
from klppo.models.fused_head import DEFAULT_CHUNK_LOGITS
from klppo.models.load import load_critic
from klppo.plan import memory
from klppo.plan.estimate import estimate, knobs, parse_size
from klppo.plan.inputs import Lengths, read_shapes
from klppo.plan.model_shape import read_model_shape

# Qwen2.5-0.5B's shape: 494,032,768 parameters (tied embeddings), as its model card states.
QWEN05 = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
              num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True, model_type="qwen2",
              architectures=["Qwen2ForCausalLM"])
P05 = 494_032_768
LENGTHS = Lengths(40.0, 200.0, 64, 256)


@pytest.fixture(scope="module")
def qwen05_dir(tmp_path_factory):
    """A folder with Qwen2.5-0.5B's config.json and no weights: all the planner needs."""
    out = tmp_path_factory.mktemp("qwen05")
    (out / "config.json").write_text(json.dumps(QWEN05))
    return out


def _cfg(model_dir, task_dir, *changes):
    return load_ppo_config(None, [
        f"data.train_files={task_dir / 'offline.parquet'}", "data.train_batch_size=16", "data.max_prompt_length=64",
        "data.max_response_length=256", f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.name=offline", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
        "actor_rollout_ref.model.use_remove_padding=true", "trainer.device=cpu", *changes])


def _plan(qwen05_dir, task_dir, *changes, world=1, device="cpu", device_bytes=80 * 2**30):
    cfg = _cfg(qwen05_dir, task_dir, *changes)
    return estimate(cfg, read_shapes(cfg), LENGTHS, world_size=world, device=device, device_bytes=device_bytes)


def _phase(e, name):
    return next(p for p in e.phases if p.phase == name)


def _item(e, phase, name):
    return sum(b for k, b in _phase(e, phase).items if k == name)


def test_shape_from_config_json_alone_counts_qwen25_05b(qwen05_dir):
    shape = read_model_shape(str(qwen05_dir))
    assert shape.parameters == P05 and shape.disk_dtypes == ()
    assert (shape.head_dim, shape.num_key_value_heads, shape.lm_head_parameters) == (64, 2, 0)


@pytest.mark.parametrize("kind, keys", [
    ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24)),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("deepseek_v3", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                         n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=8)),
])
def test_a_config_alone_counts_a_mixture_of_experts_model_as_transformers_builds_it(kind, keys, tmp_path):
    # The Llama layout counts one dense MLP per layer: Qwen3-30B-A3B's config gave 2.5B of its 30.5B parameters.
    from transformers import AutoConfig

    config = AutoConfig.for_model(kind, vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, **keys)
    config.save_pretrained(tmp_path)
    from klppo.monitoring.flops import decoder_weights_per_token

    model = AutoModelForCausalLM.from_config(config)
    shape = read_model_shape(str(tmp_path))
    assert shape.parameters == sum(p.numel() for p in model.parameters()) and shape.disk_dtypes == ()
    # the routed experts only: fewer than the layers hold
    assert shape.layer_weights == decoder_weights_per_token(model, config) < shape.parameters - 2 * shape.embedding_parameters


def test_a_mixture_of_experts_folder_plans_the_experts_a_token_is_routed_to(tmp_path):
    # Mixtral, hidden 32, 4 experts 48 wide, top 2: per layer attention (q, o 32 x 32; k, v 32 x 16), the
    # router (32 x 4) and 2 experts' gate, up and down; the dense layout charged one 48-wide MLP.
    from transformers import AutoConfig

    from klppo.plan.time import model_flops

    config = AutoConfig.for_model("mixtral", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                  num_experts_per_tok=2)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    shape = read_model_shape(str(tmp_path))
    attention, routed = 2 * 32 * 32 + 2 * 32 * 16, 32 * 4 + 2 * 3 * 32 * 48
    assert shape.layer_weights == 3 * (attention + routed)
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert shape.mlp_width == round(routed / (3 * 32)) == 97  # two experts' 96 and the router's share
    as_dense = dataclasses.replace(shape, intermediate_size=97, layer_weights=None)
    plan = memory.ModelPlan("actor", shape, shape.parameters, shape.parameters, 1, 4, False, False, False, False)
    assert memory.layer_activation_elements(plan) == memory.layer_activation_elements(
        dataclasses.replace(plan, shape=as_dense))
    # the plan's FLOPs (step_flops' every phase): a 12-token row, 7 response tokens; 78 causal pairs
    update = model_flops(shape, [12], training=True, head_positions=7)
    assert update == 3 * (2 * shape.layer_weights * 12 + 4 * 32 * 3 * 78 + 2 * 32 * 96 * 7)
    # every layer routes each token to 2 experts; save_pretrained stored them one by one, so the folder is
    # converted as it loads: copied, never mapped, and held whole by rank 0 of a sharded load
    assert (shape.routed_experts, shape.sparse_layers, shape.converts_on_load) == (2, 3, True)
    assert memory.routed_copies(shape) == 2 * 32 * 2


def _saved_elements_per_token(model, tokens: int = 256) -> float:
    """Elements of the tensors autograd saves in one forward (parameters left out), per token."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=torch.randint(0, 96, (1, tokens)))
    return sum(saved.values()) / tokens


def test_a_mixture_of_experts_layer_holds_what_the_plan_charges_beyond_a_dense_mlp_of_its_routed_width(tmp_path):
    # transformers' grouped experts keep each routed expert's input and output besides the experts' MLPs:
    # measured as the saved tensors of one Qwen3-MoE layer against a dense Qwen3 layer of the routed width
    from transformers import AutoConfig

    from klppo.plan.inputs import ModelPlan

    base = dict(vocab_size=96, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16)
    moe = AutoConfig.for_model("qwen3_moe", **base, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                               intermediate_size=96)
    dense = AutoConfig.for_model("qwen3", **base, intermediate_size=96)  # 2 experts x 48
    measured = [_saved_elements_per_token(AutoModelForCausalLM.from_config(c)) for c in (moe, dense)]
    planned = []
    for name, config in (("moe", moe), ("dense", dense)):
        config.save_pretrained(tmp_path / name)
        shape = read_model_shape(str(tmp_path / name))
        planned.append(memory.layer_activation_elements(ModelPlan("actor", shape, 0, 0, 1, 4, False, False, False, False)))
    extra_measured, extra_planned = measured[0] - measured[1], planned[0] - planned[1]
    # the copies (2 x hidden per routed expert), and the router's share of the MLP width (97 against 96)
    assert extra_planned == 2 * 64 * 2 + 4 * (97 - 96)
    assert extra_measured == pytest.approx(extra_planned, rel=0.1)


@pytest.mark.parametrize("kind, keys, expected", [
    ("qwen2", dict(use_sliding_window=False, sliding_window=32768, max_window_layers=2), [None] * 3),  # Qwen2.5's
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), [None, 16, 16]),
    ("mistral", dict(sliding_window=16), [16] * 3),  # every layer
    ("gemma3_text", dict(sliding_window=16, sliding_window_pattern=2), [16, None, 16]),
    ("llama", {}, [None] * 3),
])
def test_the_plan_reads_each_layers_sliding_window_as_transformers_does(kind, keys, expected, tmp_path):
    from transformers import AutoConfig

    from klppo.monitoring.flops import attention_windows

    config = AutoConfig.for_model(kind, vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, **keys)
    raw = {**config.to_diff_dict(), **keys, "model_type": kind}
    raw.pop("layer_types", None)  # as older config.json files are saved
    (tmp_path / "config.json").write_text(json.dumps(raw))
    windows = attention_windows(read_model_shape(str(tmp_path)))
    assert windows == attention_windows(config) == attention_windows(AutoConfig.from_pretrained(tmp_path)) == expected


def test_shape_from_safetensors_headers_equals_the_loaded_models_count(tiny_model_dir, tmp_path):
    loaded = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    shape = read_model_shape(str(tiny_model_dir))
    assert shape.parameters == sum(p.numel() for p in loaded.parameters())
    assert dict(shape.disk_dtypes) == {"F32": shape.parameters}
    critic = load_critic(str(tiny_model_dir), key="critic.model.path", device=torch.device("cpu"))
    assert shape.role_parameters("critic") == sum(p.numel() for p in critic.parameters())
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(tiny_model_dir / "config.json", config_only / "config.json")
    assert read_model_shape(str(config_only)).parameters == shape.parameters  # the formula agrees


def test_untied_bf16_model_counts_its_head_and_disk_dtype(tmp_path):
    config = Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    shape = read_model_shape(str(tmp_path))
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert shape.lm_head_parameters == 300 * 32 and dict(shape.disk_dtypes) == {"BF16": shape.parameters}


def test_plan_constants_agree_with_the_code_they_describe():
    assert memory.FUSED_CHUNK_LOGITS == DEFAULT_CHUNK_LOGITS


def test_one_process_holds_fp32_weights_grads_and_adam_state(qwen05_dir, task_dir):
    e = _plan(qwen05_dir, task_dir)
    assert _item(e, "update_actor", "actor weights") == _item(e, "update_actor", "ref weights") == 4 * P05
    assert _item(e, "update_actor", "actor optimiser") == 8 * P05  # exp_avg + exp_avg_sq
    assert _item(e, "old_log_prob", "actor optimiser") == 8 * P05  # steady state: held between updates
    assert _item(e, "setup", "actor optimiser") == 0  # created by the first step


def test_more_ranks_hold_less_per_rank_in_every_phase(qwen05_dir, task_dir):
    totals = [{p.phase: p.total for p in _plan(qwen05_dir, task_dir, world=w).phases} for w in (1, 2, 4)]
    for fewer, more in zip(totals, totals[1:]):
        assert all(more[k] < fewer[k] for k in fewer), (fewer, more)
    two = _plan(qwen05_dir, task_dir, world=2)
    assert _item(two, "update_actor", "actor weights") == 4 * P05 // 2


def test_checkpointing_keeps_fewer_activations(qwen05_dir, task_dir):
    off = _plan(qwen05_dir, task_dir, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384")
    on = _plan(qwen05_dir, task_dir, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
               "actor_rollout_ref.model.enable_gradient_checkpointing=true")
    actor = on.settings.model("actor")
    tokens = on.settings.passes.update_tokens
    assert memory.training_activation_bytes(actor, tokens) < memory.training_activation_bytes(
        dataclasses.replace(actor, checkpointing=False), tokens) / 5
    assert _phase(on, "update_actor").total < _phase(off, "update_actor").total


def test_lora_trains_a_smaller_optimiser_and_needs_no_reference(qwen05_dir, task_dir):
    full = _plan(qwen05_dir, task_dir)
    lora = _plan(qwen05_dir, task_dir, "actor_rollout_ref.model.lora_rank=16")
    # rank 16 on q, k, v, o, gate, up, down: 16 x ((896+896) + 2 (896+128) + (896+896) + 3 (896+4864)) per layer
    assert lora.settings.model("actor").trainable == 24 * 16 * (1792 + 2 * 1024 + 1792 + 3 * 5760)
    assert _item(lora, "update_actor", "actor optimiser") < _item(full, "update_actor", "actor optimiser") / 50
    assert lora.settings.model("ref") is None and _phase(lora, "update_actor").total < _phase(full, "update_actor").total


def test_a_smaller_token_budget_needs_less(qwen05_dir, task_dir):
    peaks = [_phase(_plan(qwen05_dir, task_dir, f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={b}",
                          "actor_rollout_ref.model.enable_gradient_checkpointing=false"), "update_actor")
             for b in (8192, 4096, 2048)]
    acts = [sum(b for k, b in p.items if k == "activations") for p in peaks]
    assert acts[0] > acts[1] > acts[2] and acts[1] == 2 * acts[2]


def test_offload_leaves_less_on_the_device(qwen05_dir, task_dir):
    gpu = dict(world=8, device="cuda")
    base = _plan(qwen05_dir, task_dir, **gpu)
    for key in ("param_offload", "optimizer_offload", "offload_policy"):
        off = _plan(qwen05_dir, task_dir, f"actor_rollout_ref.actor.fsdp_config.{key}=true", **gpu)
        pairs = [(_phase(off, p.phase).total, p.total) for p in base.phases]
        assert all(a <= b for a, b in pairs) and any(a < b for a, b in pairs), key


def test_the_fused_head_and_bf16_hold_less_than_whole_fp32_logits(qwen05_dir, task_dir):
    fused = _plan(qwen05_dir, task_dir)
    naive = _plan(qwen05_dir, task_dir, "actor_rollout_ref.model.use_fused_kernels=false")
    assert _item(fused, "update_actor", "LM head logits") < _item(naive, "update_actor", "LM head logits") / 5
    bf16 = _plan(qwen05_dir, task_dir, "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16", world=2, device="cuda")
    fp32 = _plan(qwen05_dir, task_dir, world=2, device="cuda")
    assert _phase(bf16, "update_actor").total < _phase(fp32, "update_actor").total


def test_one_process_generation_copies_the_weights_only_where_it_cannot_share_the_actors(qwen05_dir, task_dir):
    """The offline KL probe generates: in fp32 from the actor's own parameters, under bf16 from a bf16
    copy, under offload_policy from a copy on the GPU; the sharded actor needs none."""
    def copy(*changes, device="cpu"):
        return _item(_plan(qwen05_dir, task_dir, *changes, device=device), "kl_probe", "generation copy")

    bf16 = "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16"
    assert copy() == 0 and copy(device="cuda") == 0
    assert copy(bf16) == copy(bf16, device="cuda") == 2 * P05
    assert copy("actor_rollout_ref.actor.fsdp_config.offload_policy=true", device="cuda") == 4 * P05
    assert copy(bf16, "actor_rollout_ref.rollout.generation_weights=sharded") == 0


def test_a_static_kv_cache_holds_the_longest_prompt_the_data_allows_in_the_compute_dtype(qwen05_dir, task_dir):
    """Per row and layer: K and V of 2 heads x 64 dims; static: data.max_prompt_length (128) + 256
    tokens, dynamic: the longest prompt seen (64) + 256; auto is static on CUDA only."""
    def kv(*changes, device="cpu"):
        return _item(_plan(qwen05_dir, task_dir, "data.max_prompt_length=128", *changes, device=device),
                     "kl_probe", "KV cache")

    rows, per_token = _plan(qwen05_dir, task_dir).settings.passes.probe_rows, 24 * 2 * 2 * 64
    assert rows == 8 * 4  # kl_ctrl.probe_prompts x rollout.n
    assert kv() == rows * (64 + 256) * per_token * 4
    static = rows * (128 + 256) * per_token * 4
    assert kv(device="cuda") == kv("actor_rollout_ref.rollout.hf_decoding=compiled") == static
    assert kv("actor_rollout_ref.rollout.hf_decoding=static", "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16") == \
        rows * (128 + 256) * per_token * 2


def test_knobs_each_lower_the_peak_until_it_fits(qwen05_dir, task_dir):
    cfg = _cfg(qwen05_dir, task_dir)
    base = estimate(cfg, read_shapes(cfg), LENGTHS, world_size=1, device="cpu", device_bytes=6 * 2**30)
    found = knobs(cfg, read_shapes(cfg), LENGTHS, base)
    added = [k.peak_bytes for k in found if "(alone)" not in k.override]  # each on top of those above
    ranks = [k.peak_bytes for k in found if "(alone)" in k.override]  # the nodes doubled, 4x, 8x
    assert added and all(a > b for a, b in zip([base.peak.total, *added], added))
    assert all(a > b for a, b in zip([base.peak.total, *ranks], ranks))
    assert found[-1].fits and not any(k.fits for k in found[:-1])


def test_sizes_parse_with_units():
    assert parse_size("80GiB", "k") == 80 * 2**30 and parse_size("24GB", "k") == 24 * 10**9
    assert parse_size(1024, "k") == 1024 and parse_size("1.5TiB", "k") == int(1.5 * 2**40)
    with pytest.raises(Exception, match="e.g. 80GiB"):
        parse_size("lots", "trainer.plan_device_memory")


def test_a_bf16_lora_actors_vllm_engine_holds_fp32_weights(qwen05_dir, task_dir):
    # rollout.dtype auto: a LoRA actor computing in bf16 samples from an fp32 engine (rollout_checks.engine_dtype).
    vllm = (f"data.train_files={task_dir / 'train.parquet'}", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16", "actor_rollout_ref.rollout.kv_cache_memory_bytes=1024")
    full = _plan(qwen05_dir, task_dir, *vllm)
    lora = _plan(qwen05_dir, task_dir, *vllm, "actor_rollout_ref.model.lora_rank=16")
    assert _item(full, "gen", "vLLM engine weights") == P05 * 2
    assert _item(lora, "gen", "vLLM engine weights") == lora.settings.model("actor").parameters * 4


@pytest.mark.parametrize("rollout", ["offline", "hf"])
def test_a_static_cache_holds_the_generation_copy_and_its_cache_through_every_phase(qwen05_dir, task_dir, rollout):
    """With a static KV cache generation keeps its copy and its cache from one generation to the next
    (``trainer.responses.keeps_generation_model``): held beside the models in every phase after setup,
    the update's peak included; not with the dynamic cache, nor for an offloaded actor."""
    bf16, generating = "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16", "kl_probe" if rollout == "offline" else "gen"
    changes = (bf16, f"actor_rollout_ref.rollout.name={rollout}", "actor_rollout_ref.rollout.response_length=256")
    kept = _plan(qwen05_dir, task_dir, *changes, device="cuda")  # auto: compiled on CUDA
    assert kept.settings.generation_kept
    copy, cache = _item(kept, generating, "generation copy"), _item(kept, generating, "KV cache")
    assert copy == 2 * P05 and cache > 0
    for phase in kept.phases:
        held = phase.phase != "setup"
        assert _item(kept, phase.phase, "generation copy") == (copy if held else 0), phase.phase
        assert _item(kept, phase.phase, "KV cache") == (cache if held else 0), phase.phase
    for freed in ("actor_rollout_ref.rollout.hf_decoding=dynamic", "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                  "actor_rollout_ref.actor.fsdp_config.offload_policy=true"):
        e = _plan(qwen05_dir, task_dir, *changes, freed, device="cuda")
        assert not e.settings.generation_kept
        assert _item(e, "update_actor", "generation copy") == _item(e, "update_actor", "KV cache") == 0, freed
    dynamic = _plan(qwen05_dir, task_dir, *changes, "actor_rollout_ref.rollout.hf_decoding=dynamic", device="cuda")
    assert _phase(kept, "update_actor").total - _phase(dynamic, "update_actor").total == copy + cache



VLLM = ("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.response_length=256")


def test_a_cpu_vllm_engine_is_held_through_every_phase(qwen05_dir, task_dir):
    """A CPU engine has no sleep mode: its weights and KV cache stay beside the models through the
    update (the usual peak), and its KV cache is the engine's own default (at least 64 MiB), not 0."""
    e = _plan(qwen05_dir, task_dir, *VLLM)
    kv = _item(e, "gen", "vLLM KV cache")
    # 16 prompts x n 4 rows at max_model_len 64 + 256 (+ a 128-token block), 24 layers x 2 x 2 heads x 64 x fp32
    assert kv == 64 * (320 + 128) * 24 * 2 * 2 * 64 * 4
    for phase in e.phases:
        assert _item(e, phase.phase, "vLLM engine weights") == 4 * P05, phase.phase
        assert _item(e, phase.phase, "vLLM KV cache") == kv, phase.phase
        assert _item(e, phase.phase, "vLLM libraries and buffers") == memory.VLLM_CPU_RUNTIME_BYTES, phase.phase
    offline = _plan(qwen05_dir, task_dir)
    assert _phase(e, "update_actor").total - _phase(offline, "update_actor").total == (
        4 * P05 + kv + memory.VLLM_CPU_RUNTIME_BYTES)


def test_a_gpu_engine_is_held_outside_generation_only_without_free_cache_engine(qwen05_dir, task_dir):
    device = 80 * 2**30
    kept = _plan(qwen05_dir, task_dir, *VLLM, "actor_rollout_ref.rollout.free_cache_engine=false", device="cuda")
    asleep = _plan(qwen05_dir, task_dir, *VLLM, device="cuda")
    share = int(0.5 * device)
    assert _item(kept, "update_actor", "vLLM engine (gpu_memory_utilization)") == share
    assert _item(asleep, "update_actor", "vLLM engine (gpu_memory_utilization)") == 0
    for e in (kept, asleep):  # built in setup (before it first sleeps), woken to generate
        assert _item(e, "setup", "vLLM engine (gpu_memory_utilization)") == share
        assert _item(e, "gen", "vLLM engine (gpu_memory_utilization)") == share


def test_the_plans_cpu_kv_cache_is_the_engines_default(qwen05_dir, task_dir):
    from types import SimpleNamespace

    from klppo.plan import inputs
    from klppo.plan.inputs import engine_kv_bytes
    from klppo.rollout import vllm
    from klppo.run.settings import engine_settings

    assert (inputs.MIN_CPU_KV_BYTES, inputs.CPU_BLOCK_TOKENS) == (vllm.MIN_CPU_KV_BYTES, vllm.CPU_BLOCK_TOKENS)
    config = SimpleNamespace(**QWEN05, head_dim=64)
    for changes, world, free in (((), 1, 80 * 2**30), (("data.max_prompt_length=8",), 2, 80 * 2**30),
                                 (("actor_rollout_ref.rollout.response_length=4",), 1, 80 * 2**30),
                                 ((), 1, 2**30)):
        cfg = _cfg(qwen05_dir, task_dir, *VLLM, *changes)
        shape = read_shapes(cfg)["actor"]
        assert engine_kv_bytes(cfg, shape, world, "cpu", free, 4) == vllm.cpu_kv_cache_bytes(
            config, engine_settings(cfg, world), free), changes


def _saved(folder, dtype):
    config = Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    Qwen2ForCausalLM(config).to(dtype).save_pretrained(folder)
    return folder


def test_one_process_maps_an_fp32_checkpoint_and_reads_nothing_at_setup(tmp_path, task_dir):
    """from_pretrained keeps the tensors of a file in the dtype the model trains in mapped from the
    file, paged in on first use: an acceptance run (4 layers, hidden 512, vocabulary 32,000, fp32
    file, online GRPO) measured setup at 0.43 GiB against a plan of 1.02 that held the actor, the
    reference and the file. A bf16 file is converted: the fp32 weights and the file's pages."""
    fp32, bf16 = _saved(tmp_path / "fp32", torch.float32), _saved(tmp_path / "bf16", torch.bfloat16)
    mapped, converted = _plan(fp32, task_dir), _plan(bf16, task_dir)
    shape = mapped.settings.model("actor").shape
    assert _phase(mapped, "setup").items == (("interpreter and libraries", memory.cpu_baseline_bytes(mapped.settings)),)
    assert _item(mapped, "old_log_prob", "actor weights") == _item(mapped, "ref", "ref weights") == \
        4 * shape.parameters  # paged in once used
    assert _item(converted, "setup", "actor weights") == _item(converted, "setup", "ref weights") == 4 * shape.parameters
    assert _item(converted, "setup", "weights file being read") == 2 * shape.parameters
    grouped = _plan(fp32, task_dir, "actor_rollout_ref.actor.fsdp_config.param_offload=true")  # a group of one
    assert _item(grouped, "setup", "actor weights") == 4 * shape.parameters
    assert _item(grouped, "setup", "largest tensor being filled") == 4 * shape.embedding_parameters
    on_gpu = _plan(fp32, task_dir, device="cuda")  # copied to the device; the file is host memory
    assert _item(on_gpu, "setup", "actor weights") == 4 * shape.parameters
    assert _item(on_gpu, "setup", "weights file being read") == 0


def test_in_the_first_step_mapped_weights_come_in_with_the_phase_that_first_reads_them(tmp_path, task_dir):
    """A long-response run of an fp32 file (plan_accuracy's long-1) measured its offline generation
    phase at the baseline, 0.44 GiB, against a plan of 0.82 that held the actor and the reference."""
    fp32 = _saved(tmp_path / "fp32", torch.float32)
    cfg = _cfg(fp32, task_dir, "actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false")
    first = {p.phase: dict(p.items) for p in estimate(cfg, read_shapes(cfg), LENGTHS, world_size=1, device="cpu",
                                                      device_bytes=80 * 2**30, first_step=True).phases}
    assert "actor weights" not in first["setup"] and "actor weights" not in first["gen"]  # offline: reads none
    assert "actor weights" in first["old_log_prob"] and "actor weights" in first["update_actor"]
    steady = _plan(fp32, task_dir)
    assert _item(steady, "gen", "actor weights") > 0 and _item(steady, "setup", "actor weights") == 0
    online = _cfg(fp32, task_dir, "actor_rollout_ref.rollout.name=vllm")  # the weight sync reads the actor first
    first = {p.phase: dict(p.items) for p in estimate(online, read_shapes(online), LENGTHS, world_size=1, device="cpu",
                                                      device_bytes=80 * 2**30, first_step=True).phases}
    assert "actor weights" not in first["setup"] and "actor weights" in first["weight_sync"]


def test_the_cpu_baseline_grows_with_the_tokenizer(qwen05_dir, tmp_path, task_dir):
    """Measured: 0.41 GiB with 32,000 entries, 0.49 with 151,936 (benchmarks/README.md)."""
    small, large = _plan(_saved(tmp_path / "w", torch.float32), task_dir), _plan(qwen05_dir, task_dir)
    assert memory.cpu_baseline_bytes(large.settings) - memory.cpu_baseline_bytes(small.settings) == \
        memory.CPU_TOKENIZER_ENTRY_BYTES * (151936 - 300)


def test_a_no_grad_forward_holds_the_blocks_or_the_head_not_both(qwen05_dir, task_dir):
    """The blocks' intermediates are freed before the LM head runs: long-1's scoring forward (16,269
    tokens, hidden 512, MLP 1536) measured 0.35 GiB over what stayed, against 0.50 for the sum."""
    e = _plan(qwen05_dir, task_dir)
    tokens = e.settings.passes.forward_tokens  # 4,096: the token budget
    blocks = tokens * (3 * 896 + 3 * 4864) * 4  # 283 MB, above the head's 2 fused slices of 64 MiB
    assert _item(e, "old_log_prob", "activations") == blocks
    assert _item(e, "old_log_prob", "LM head logits") == 0
    naive = _plan(qwen05_dir, task_dir, "actor_rollout_ref.model.use_fused_kernels=false")
    response = e.settings.passes.forward_response_tokens
    assert _item(naive, "ref", "LM head logits") == 3 * response * 151936 * 4 + tokens * 896 * 4
    assert _item(naive, "ref", "activations") == 0


def test_a_run_whose_update_gives_pi_old_plans_no_old_log_prob_phase(qwen05_dir, task_dir):
    online = ("actor_rollout_ref.rollout.name=hf", f"data.train_files={task_dir / 'train.parquet'}")
    one_step = _plan(qwen05_dir, task_dir, *online, "actor_rollout_ref.actor.ppo_mini_batch_size=16")
    assert "old_log_prob" not in [p.phase for p in one_step.phases]  # update_gives_old_log_prob: no forward
    two_steps = _plan(qwen05_dir, task_dir, *online)  # two mini-batches: the second's pi_old is not its forward
    assert "old_log_prob" in [p.phase for p in two_steps.phases]


def test_a_run_whose_updates_run_their_forwards_first_plans_the_actor_graph_through_the_critic_update(
        qwen05_dir, task_dir):
    """``update_forwards_first``: no old_log_prob or values forward; the critic's update holds the
    actor's saved activations, which wait for the actor's update."""
    gae = ("algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.use_kl_loss=false",
           "actor_rollout_ref.actor.ppo_mini_batch_size=16", "critic.use_dynamic_bsz=true")
    longest = 16 * 4 * (64 + 256)  # a step's samples on one rank, each at its longest

    def budgets(tokens: int) -> list[str]:
        return [f"{key}={tokens}" for key in ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                                              "critic.ppo_max_token_len_per_gpu")]

    first = _plan(qwen05_dir, task_dir, *gae, *budgets(longest))
    assert {"old_log_prob", "values"}.isdisjoint(p.phase for p in first.phases)
    actor = first.settings.model("actor")
    held = memory.training_activation_bytes(actor, first.settings.passes.update_tokens)
    assert held > 0 and _item(first, "update_critic", "actor activations awaiting its update") == held
    # one token less: two micro-batches may be needed, so the scoring forwards run and nothing waits
    scored = _plan(qwen05_dir, task_dir, *gae, *budgets(longest - 1))
    assert {"old_log_prob", "values"} <= {p.phase for p in scored.phases}
    assert _item(scored, "update_critic", "actor activations awaiting its update") == 0
    assert _phase(first, "update_critic").total - _phase(scored, "update_critic").total == held


def test_a_vllm_weight_sync_holds_the_engine_and_one_streamed_tensor_at_a_time(qwen05_dir, task_dir):
    """Before each generation the actor's whole tensors stream into the engine: the embedding, the
    largest (151,936 x 896), cast to the engine's dtype; gathered in fp32 first where the actor is
    sharded; a sleeping engine (a GPU's free_cache_engine) wakes its weights, not its KV cache."""
    embedding = 151936 * 896
    cpu = _plan(qwen05_dir, task_dir, *VLLM)
    assert [p.phase for p in cpu.phases][:3] == ["setup", "weight_sync", "gen"]
    assert _item(cpu, "weight_sync", "vLLM weights being streamed") == embedding * 4  # one process: its own, cast
    # both hold the models and the engine (a CPU engine never sleeps); generation's batch is small here
    assert _phase(cpu, "weight_sync").total - _phase(cpu, "gen").total == embedding * 4
    sharded = _plan(qwen05_dir, task_dir, *VLLM, world=2)
    assert _item(sharded, "weight_sync", "vLLM weights being streamed") == embedding * (4 + 4)
    bf16 = ("actor_rollout_ref.actor.fsdp_config.dtype=bfloat16",)
    asleep = _plan(qwen05_dir, task_dir, *VLLM, *bf16, device="cuda")
    kept = _plan(qwen05_dir, task_dir, *VLLM, *bf16, "actor_rollout_ref.rollout.free_cache_engine=false", device="cuda")
    assert _item(asleep, "weight_sync", "vLLM engine weights") == 2 * P05  # woken: the weights alone
    assert _item(asleep, "weight_sync", "vLLM engine (gpu_memory_utilization)") == 0
    assert _item(kept, "weight_sync", "vLLM engine (gpu_memory_utilization)") == int(0.5 * 80 * 2**30)
    assert _item(kept, "weight_sync", "vLLM engine weights") == 0  # in its share
    for e in (asleep, kept):
        assert _item(e, "weight_sync", "vLLM weights being streamed") == embedding * 2
    assert "weight_sync" not in [p.phase for p in _plan(qwen05_dir, task_dir).phases]  # offline: no engine


def test_a_cpu_run_holds_the_heap_glibc_keeps_from_its_first_forward_on(qwen05_dir, task_dir):
    # the first step: none before the first phase with transients, half the pad in it, the whole pad in
    # each later forward and the reward phase, and an update's transients carved from it; CUDA: none
    from klppo.monitoring.memory import HEAP_TOP_PAD

    def kept(phases):
        return {p.phase: sum(b for k, b in p.items if k == "freed heap glibc keeps") for p in phases}

    e = _plan(qwen05_dir, task_dir, "actor_rollout_ref.actor.use_kl_loss=false")
    first = kept(memory.phase_estimates(e.settings, first_step=True))
    assert first["setup"] == first["gen"] == 0  # offline: nothing generated
    assert first["old_log_prob"] == HEAP_TOP_PAD // 2 and first["reward"] == HEAP_TOP_PAD
    assert first["update_actor"] == 0  # its transients exceed the pad
    steady = kept(memory.phase_estimates(e.settings))
    assert steady["gen"] == steady["old_log_prob"] == HEAP_TOP_PAD and steady["setup"] == 0
    cuda = _plan(qwen05_dir, task_dir, "actor_rollout_ref.actor.use_kl_loss=false", device="cuda")
    assert set(kept(memory.phase_estimates(cuda.settings, first_step=True)).values()) == {0}


def test_the_unfused_heads_update_holds_fewer_logits_without_the_entropy_in_the_loss(qwen05_dir, task_dir):
    # entropy_coeff 0 (the default): the entropy is measured without a gradient, and backward skips it
    naive = "actor_rollout_ref.model.use_fused_kernels=false"
    without = _item(_plan(qwen05_dir, task_dir, naive), "update_actor", "LM head logits")
    with_bonus = _item(_plan(qwen05_dir, task_dir, naive, "actor_rollout_ref.actor.entropy_coeff=0.01"),
                       "update_actor", "LM head logits")
    assert with_bonus / without == pytest.approx(memory.NAIVE_TRAIN_LOGITS / memory.NAIVE_TRAIN_LOGITS_NO_ENTROPY)


@pytest.mark.parametrize("changes, floats", [
    ((), 2), (("actor_rollout_ref.actor.optim.optimizer=SGD",), 0),
    (("actor_rollout_ref.actor.optim.optimizer=SGD", "actor_rollout_ref.actor.optim.override_optimizer_config={momentum: 0.9}"), 1),
    (("actor_rollout_ref.actor.optim.optimizer=Adam", "actor_rollout_ref.actor.optim.override_optimizer_config={amsgrad: true}"), 3),
])
def test_the_optimisers_state_is_what_optim_optimizer_keeps(qwen05_dir, task_dir, changes, floats):
    """AdamW keeps two fp32 tensors per parameter, SGD none (one with momentum), Adam with AMSGrad three."""
    assert _item(_plan(qwen05_dir, task_dir, *changes), "update_actor", "actor optimiser") == floats * 4 * P05
