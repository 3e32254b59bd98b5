"""The attention for packed rows: which one a run chooses, that the CUDA choice runs one kernel per
layer (counted on CPU through a stand-in for torch's varlen kernel), that every candidate scores
and differentiates packed rows as the padded path does, and that every model of a run gets it."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2ForCausalLM, Qwen2ForTokenClassification
from transformers.masking_utils import sdpa_mask

from klppo.models import attention
from klppo.models.attention import (
    PACKED_DETERMINISTIC, PACKED_MASKED, PACKED_SDPA, PACKED_VARLEN, block_causal_mask, choose_packed_attention,
    packed_attention_for, set_packed_attention, torch_varlen_runs,
)
from klppo.models.forward import response_logprobs, response_values
from klppo.models.load import enable_activation_checkpointing
from klppo.models.tiny import tiny_model_config

LAYERS = 3
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


# ---- (a) the choice ----


@pytest.mark.parametrize("device, dtypes, varlen, flash, expected", [
    ("cuda", [BF16], True, True, PACKED_VARLEN),  # torch's own kernel first: no extra package
    ("cuda", [FP16, BF16], True, False, PACKED_VARLEN),
    ("cuda", [BF16], False, True, "flash_attention_2"),  # torch < 2.10 (or no flash in its build)
    ("cuda", [BF16], False, False, PACKED_MASKED),  # one masked sdpa call per layer
    ("cuda", [BF16, None], True, True, PACKED_MASKED),  # one model in fp32: varlen kernels take bf16/fp16 only
    ("cuda", [FP32], True, True, PACKED_MASKED),
    ("cpu", [BF16], True, True, PACKED_SDPA),  # measured fastest on CPU (benchmarks/README.md)
    ("cpu", [None], False, False, PACKED_SDPA),
])
def test_a_run_chooses_varlen_then_flash_then_the_masked_sdpa_on_cuda(device, dtypes, varlen, flash, expected):
    assert packed_attention_for(device, dtypes, torch_varlen=varlen, flash_installed=flash) == expected


def _cuda_host(monkeypatch, *, capability=(9, 0), flash_kernels=True, flash_attn=False):
    """This process as a CUDA host of the given card, torch build and packages."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: flash_kernels)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flash_attn" and flash_attn else find_spec(name, *a))


@pytest.mark.parametrize("host, has_varlen, expected", [
    (dict(), True, PACKED_VARLEN),
    (dict(), False, PACKED_MASKED),  # torch < 2.10
    (dict(flash_attn=True), False, "flash_attention_2"),
    (dict(flash_kernels=False, flash_attn=True), True, "flash_attention_2"),  # torch built without flash
    (dict(capability=(7, 5)), True, PACKED_MASKED),  # flash kernels need compute capability 8.0+
])
def test_on_a_cuda_host_the_choice_follows_torch_and_the_installed_packages(monkeypatch, host, has_varlen, expected):
    _cuda_host(monkeypatch, **host)
    if not has_varlen:
        monkeypatch.setattr(attention, "_varlen_api", lambda: None)
    assert choose_packed_attention("cuda", [BF16]) == expected


@pytest.mark.parametrize("varlen, flash, dtypes", [(True, True, [BF16]), (False, True, [BF16]), (False, False, [FP32])])
def test_under_deterministic_algorithms_cuda_gets_the_math_backend_loop_whatever_is_installed(varlen, flash, dtypes):
    chosen = packed_attention_for("cuda", dtypes, torch_varlen=varlen, flash_installed=flash, deterministic=True)
    assert chosen == PACKED_DETERMINISTIC
    # CPU's choice is deterministic as it is
    assert packed_attention_for("cpu", dtypes, torch_varlen=varlen, flash_installed=flash, deterministic=True) == PACKED_SDPA


@pytest.mark.parametrize("warn_only", [True, False])
def test_a_cuda_host_reads_torch_use_deterministic_algorithms_when_it_chooses(monkeypatch, warn_only):
    _cuda_host(monkeypatch)
    assert choose_packed_attention("cuda", [BF16]) == PACKED_VARLEN
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    monkeypatch.setattr(torch, "is_deterministic_algorithms_warn_only_enabled", lambda: warn_only)
    assert choose_packed_attention("cuda", [BF16]) == PACKED_DETERMINISTIC


def test_the_deterministic_attention_holds_every_sdpa_call_to_the_math_backend(monkeypatch):
    seen = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append((torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled(),
                     torch.backends.cuda.mem_efficient_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    actor, _ = _models(PACKED_DETERMINISTIC)
    ids, mask, width = _batch()
    response_logprobs(actor, ids, mask, width, packed=True)  # packed rows: one call per sequence
    response_logprobs(actor, ids, mask, width)  # padded rows
    prompts = torch.randint(2, 64, (2, 4), generator=torch.Generator().manual_seed(2))
    actor.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=2, do_sample=False,
                   pad_token_id=0, use_cache=True)
    assert len(seen) > 5 * LAYERS and set(seen) == {(True, False, False, False)}
    assert torch.backends.cuda.flash_sdp_enabled()  # restored after each call


def test_this_torch_has_varlen_attn_but_not_on_cpu():
    assert attention._varlen_api() is not None, "torch >= 2.10 has torch.nn.attention.varlen"
    assert not torch_varlen_runs("cpu")
    assert choose_packed_attention("cpu", [BF16]) == PACKED_SDPA


# ---- (b) one kernel per layer on the CUDA path ----


class FakeVarlen:
    """A CPU stand-in for torch's ``varlen_attn`` with the parameters of one torch version: causal
    sdpa per sequence (the reference), differentiable; it counts its calls and checks its arguments."""

    def __init__(self, params: frozenset[str]):
        self.params, self.calls, self.windows = params, 0, []

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=None, is_causal=None,
                 enable_gqa=False):
        self.calls += 1
        left = -1
        if "window_size" in self.params:  # 2.11+: a tuple, which varlen_attn compares to (-1, 0)
            # (-1, 0): causal; (left, 0): causal within the left tokens before each query (flash's window)
            assert isinstance(window_size, tuple) and window_size[1] == 0 and window_size[0] >= -1 and is_causal is None
            left = window_size[0]
            self.windows.append(left)
        else:  # 2.10
            assert is_causal is True and window_size is None
        assert enable_gqa == (k.shape[1] != q.shape[1]) and (enable_gqa is False or "enable_gqa" in self.params)
        assert cu_q is cu_k and cu_q.dtype == torch.int32 and isinstance(max_q, int) and max_q == max_k
        bounds = cu_q.tolist()
        assert max_q == max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        out = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                back = torch.arange(b - a)[:, None] - torch.arange(b - a)[None, :]  # query - key position
                mask = (back >= 0) & ((back <= left) if left >= 0 else True)
                out.append(F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), mask, scale=scale,
                                                          enable_gqa=enable_gqa).transpose(0, 1))
        return torch.cat(out)  # (N, H, D)


TORCH_VERSIONS = {  # the parameters varlen_attn has in each (found in pytorch's history)
    "2.10": frozenset({"is_causal", "scale"}),
    "2.11": frozenset({"window_size", "scale"}),
    "2.12+": frozenset({"window_size", "enable_gqa", "scale"}),
}


def _install_fake_varlen(monkeypatch, version: str) -> FakeVarlen:
    """torch's varlen kernel replaced by ``FakeVarlen``, and fp32 let through to it (CPU tests run fp32)."""
    fake = FakeVarlen(TORCH_VERSIONS[version])
    monkeypatch.setattr(attention, "_varlen_api", lambda: (fake, fake.params))
    monkeypatch.setattr(attention, "VARLEN_DTYPES", (BF16, FP16, FP32))
    return fake


@pytest.fixture(params=list(TORCH_VERSIONS))
def fake_varlen(request, monkeypatch) -> FakeVarlen:
    return _install_fake_varlen(monkeypatch, request.param)


def _models(implementation: str):
    """A tiny actor and critic (4 query heads over 2 key/value heads), large random weights."""
    config = tiny_model_config(64, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
                               num_key_value_heads=2)
    config.initializer_range, config.num_labels = 0.5, 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        # eval: the critic's head has dropout (gradients flow all the same)
        actor, critic = Qwen2ForCausalLM(config).eval(), Qwen2ForTokenClassification(config).eval()
    for model in (actor, critic):
        model.config.use_cache = False
        set_packed_attention(model, implementation)
    return actor, critic


def _batch():
    """Left-padded prompts + right-padded responses, one response empty."""
    prompt_lens, response_lens, width, response_width = (6, 3, 1, 4, 2), (7, 1, 4, 0, 3), 6, 8
    ids = torch.randint(2, 64, (5, width + response_width), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(5, width + response_width, dtype=torch.bool)
    for row, (p, t) in enumerate(zip(prompt_lens, response_lens)):
        mask[row, width - p : width + t] = True
    return torch.where(mask, ids, 0), mask, response_width


def test_the_varlen_path_runs_one_kernel_per_layer_forward_and_backward(fake_varlen):
    actor, critic = _models(PACKED_VARLEN)
    ids, mask, width = _batch()
    log_probs, entropy = response_logprobs(actor, ids, mask, width, packed=True, with_entropy=True)
    assert fake_varlen.calls == LAYERS  # 5 sequences, one call per layer
    (log_probs.sum() + entropy.sum()).backward()
    assert fake_varlen.calls == LAYERS  # backward runs through autograd, calls nothing again
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in actor.model.layers.parameters())
    response_values(critic, ids, mask, width, packed=True)
    assert fake_varlen.calls == 2 * LAYERS


def test_with_gradient_checkpointing_backward_recomputes_one_kernel_per_layer(fake_varlen):
    actor, _ = _models(PACKED_VARLEN)
    enable_activation_checkpointing(actor)
    actor.train()  # transformers checkpoints only in training mode (the tiny model has no dropout)
    ids, mask, width = _batch()
    response_logprobs(actor, ids, mask, width, packed=True)[0].sum().backward()
    assert fake_varlen.calls == 2 * LAYERS  # the recomputation gets the row's bounds too


def test_padded_rows_and_generation_never_reach_the_varlen_kernel(fake_varlen):
    actor, _ = _models(PACKED_VARLEN)
    ids, mask, width = _batch()
    response_logprobs(actor, ids, mask, width)  # the padded path
    prompts = torch.randint(2, 64, (2, 4), generator=torch.Generator().manual_seed(2))
    actor.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=3, do_sample=False,
                   pad_token_id=0, use_cache=True)
    assert fake_varlen.calls == 0


# ---- (c) every candidate equals the padded path ----


def _scores_and_grads(implementation: str, packed: bool):
    actor, critic = _models(implementation)
    ids, mask, width = _batch()
    log_probs, entropy = response_logprobs(actor, ids, mask, width, packed=packed, with_entropy=True, temperature=0.7)
    values = response_values(critic, ids, mask, width, packed=packed)
    (log_probs.sum() + entropy.sum() + values.sum()).backward()
    grads = [p.grad for model in (actor, critic) for p in model.parameters()]
    return (log_probs.detach(), entropy.detach(), values.detach()), grads


def _assert_close_grads(grads, expected):
    """Equal to fp32 rounding: each is a sum over every token, up to ~50 with these weights."""
    scale = max(g.abs().max() for g in expected)
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, atol=2e-5 * scale, rtol=1e-4)


@pytest.mark.parametrize("implementation", ["sdpa", PACKED_SDPA, PACKED_VARLEN, PACKED_DETERMINISTIC, PACKED_MASKED])
def test_packed_rows_score_and_differentiate_as_the_padded_path(implementation, fake_varlen):
    # PACKED_VARLEN through the fake kernel; "sdpa" is transformers' block-diagonal mask, one call a layer
    padded, padded_grads = _scores_and_grads("sdpa", packed=False)
    packed, packed_grads = _scores_and_grads(implementation, packed=True)
    for a, b in zip(packed, padded):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    _assert_close_grads(packed_grads, padded_grads)
    assert fake_varlen.calls == (2 * LAYERS if implementation == PACKED_VARLEN else 0)


def test_fp32_rows_on_the_varlen_path_use_one_masked_sdpa_call_and_match(monkeypatch):
    calls = []
    sdpa = attention.sdpa_attention_forward
    monkeypatch.setattr(attention, "sdpa_attention_forward",
                        lambda *a, **k: calls.append(a[4] is not None) or sdpa(*a, **k))  # a[4]: the mask
    packed, packed_grads = _scores_and_grads(PACKED_VARLEN, packed=True)
    # actor and critic, one masked call per layer, no loop over the 5 sequences (the calls without a
    # mask are fused_head's one unpacked forward that measures the actor's logit scale)
    assert sum(calls) == 2 * LAYERS
    padded, padded_grads = _scores_and_grads("sdpa", packed=False)
    for a, b in zip(packed, padded):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    _assert_close_grads(packed_grads, padded_grads)


@pytest.mark.parametrize("bounds, window, last_row", [
    ([0, 2, 2, 5], None, [0, 0, 1, 1, 1]),  # lengths 2, 0, 3: each sequence to itself
    ([0, 2, 5], 2, [0, 0, 0, 1, 1]),  # lengths 2, 3, a window of 2: the last token sees itself and one before
])
def test_the_block_causal_mask_keeps_each_token_to_its_sequence_and_window(bounds, window, last_row):
    mask = block_causal_mask(torch.tensor(bounds, dtype=torch.int32), 5, window)
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [0, 0, 1, 0, 0],
                             [0, 0, 1, 1, 0],
                             last_row], dtype=torch.bool)
    assert torch.equal(mask, expected)


# ---- (d) sliding-window layers ----

WINDOW = 3  # shorter than most sequences of _batch (up to 13 tokens)
SLIDING_MODELS = {  # model type -> its config's sliding-window keys; each hands its layers the window its own way
    "mistral": dict(sliding_window=WINDOW),  # every layer, and the window as a keyword argument
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),  # 1 full layer, 2 sliding
    "gemma3_text": dict(sliding_window=WINDOW, query_pre_attn_scalar=8),
    "phi3": dict(sliding_window=WINDOW),
    # its attention never sees the window: only the mask carries it
    "qwen2_moe": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, num_experts=2,
                      num_experts_per_tok=1, moe_intermediate_size=16, shared_expert_intermediate_size=16),
}


def _sliding_model(kind: str, implementation: str, window: int = WINDOW):
    from transformers import AutoConfig, AutoModelForCausalLM

    keys = {**SLIDING_MODELS[kind], "sliding_window": window}
    config = AutoConfig.for_model(kind, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.5,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0, use_cache=False, **keys)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    set_packed_attention(model, implementation)
    return model


def _sliding_layers(model) -> list[bool]:
    types = getattr(model.config, "layer_types", None) or ["sliding_attention"] * LAYERS
    return [t == "sliding_attention" for t in types]


def _logprobs_and_grads(model, packed: bool):
    ids, mask, width = _batch()
    log_probs, entropy = response_logprobs(model, ids, mask, width, packed=packed, with_entropy=True)
    (log_probs.sum() + entropy.sum()).backward()
    return (log_probs.detach(), entropy.detach()), [p.grad for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("implementation", [PACKED_SDPA, PACKED_VARLEN, PACKED_DETERMINISTIC, PACKED_MASKED])
@pytest.mark.parametrize("kind", list(SLIDING_MODELS))
def test_sliding_window_layers_score_and_differentiate_packed_rows_as_the_padded_path_without_a_row_mask(
        kind, implementation, monkeypatch):
    fake = _install_fake_varlen(monkeypatch, "2.12+")
    padded, padded_grads = _logprobs_and_grads(_sliding_model(kind, "sdpa"), packed=False)
    far, _ = _logprobs_and_grads(_sliding_model(kind, "sdpa", window=64), packed=False)
    assert (far[0] - padded[0]).abs().max() > 0.1  # the window changes what these rows score
    masks = []
    monkeypatch.setattr(attention, "sdpa_mask", lambda *a, **k: masks.append(k) or sdpa_mask(*a, **k))
    model = _sliding_model(kind, implementation)
    packed, packed_grads = _logprobs_and_grads(model, packed=True)
    for a, b in zip(packed, padded):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    _assert_close_grads(packed_grads, padded_grads)
    assert masks == []  # no (N, N) mask built for the packed row, sliding layers included
    if implementation == PACKED_VARLEN:  # one kernel per layer, each with its layer's window
        assert fake.windows == [WINDOW - 1 if sliding else -1 for sliding in _sliding_layers(model)]


def test_on_torch_2_10_sliding_layers_of_a_packed_row_take_one_masked_sdpa_call_each(monkeypatch):
    fake = _install_fake_varlen(monkeypatch, "2.10")  # varlen_attn without a window
    calls = []
    sdpa = attention.sdpa_attention_forward
    monkeypatch.setattr(attention, "sdpa_attention_forward",
                        lambda *a, **k: calls.append(a[4] is not None) or sdpa(*a, **k))  # a[4]: the mask
    padded, _ = _logprobs_and_grads(_sliding_model("qwen2", "sdpa"), packed=False)
    calls.clear()
    model = _sliding_model("qwen2", PACKED_VARLEN)
    packed, _ = _logprobs_and_grads(model, packed=True)
    for a, b in zip(packed, padded):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    sliding = sum(_sliding_layers(model))
    assert fake.calls == LAYERS - sliding and sum(calls) == sliding == 2


def test_generation_and_padded_rows_of_a_sliding_window_model_keep_transformers_masks():
    prompts = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(2))  # longer than the window
    attention_mask = torch.ones_like(prompts)
    attention_mask[1, :2] = 0  # left padding
    scores = {}
    for implementation in ("sdpa", PACKED_SDPA, PACKED_VARLEN):
        model = _sliding_model("qwen2", implementation)
        for cache in ("dynamic", "static"):
            out = model.generate(input_ids=prompts, attention_mask=attention_mask, max_new_tokens=4, do_sample=False,
                                 use_cache=True, cache_implementation=cache, output_scores=True,
                                 return_dict_in_generate=True)
            scores[implementation, cache] = torch.stack(out.scores)
    for key, value in scores.items():
        torch.testing.assert_close(value, scores["sdpa", "dynamic"], atol=1e-5, rtol=1e-5, msg=str(key))


def test_the_mask_function_hands_over_only_plain_sliding_windows():
    from types import SimpleNamespace

    from transformers.masking_utils import causal_mask_function

    def mask(config, **changes):
        kwargs = dict(batch_size=1, q_length=6, kv_length=6, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
                      attention_mask=None, local_size=None, allow_is_causal_skip=False, config=config, use_vmap=False,
                      device=torch.device("cpu"))
        return attention._packed_sdpa_mask(**{**kwargs, **changes})

    sliding, chunked = SimpleNamespace(sliding_window=3), SimpleNamespace(sliding_window=None, attention_chunk_size=3)
    assert mask(sliding) is None  # a causal layer: the attention reads the sequences from the positions
    assert mask(sliding, local_size=3) == attention.SlidingWindow(3)
    assert isinstance(mask(chunked, local_size=3), torch.Tensor)  # chunked attention keeps its mask
    assert isinstance(mask(sliding, local_size=3, use_vmap=True), torch.Tensor)  # a mask with overlays too
    assert isinstance(mask(sliding, use_vmap=True), torch.Tensor)
    assert isinstance(mask(sliding, local_size=3, attention_mask=torch.ones(1, 6, dtype=torch.bool)), torch.Tensor)
    assert isinstance(mask(sliding, local_size=3, q_length=1, kv_offset=5), torch.Tensor)  # a cache


# ---- (e) every model of a run ----


def test_every_model_a_run_builds_gets_the_one_attention_chosen_for_the_run(
        ppo_overrides, task_dir, tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForSequenceClassification

    from klppo.config import load_ppo_config
    from klppo.distributed import close
    from klppo.run import build
    from klppo.trainer.responses import generation_copy

    torch.manual_seed(0)
    rm = tmp_path / "rm"
    AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1).save_pretrained(rm)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (rm / name).write_bytes((tiny_model_dir / name).read_bytes())
    chosen = []
    monkeypatch.setattr(attention, "CPU_PACKED_ATTENTION", PACKED_VARLEN)  # not what CPU runs get: it must travel
    monkeypatch.setattr(build, "choose_packed_attention",
                        lambda *a: chosen.append(a) or choose_packed_attention(*a))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    cfg = load_ppo_config(None, ppo_overrides(**{
        "actor_rollout_ref.model.use_remove_padding": "true", "critic.model.use_remove_padding": "true",
        "reward_model.enable": "true", "reward_model.model.path": rm, "trainer.gold_reward.model_path": rm,
        "data.val_files": task_dir / "val.parquet", "actor_rollout_ref.ref.fsdp_config.reshard_after_forward": "false",
    }))  # a group of one (FSDP2), so that generation gathers a copy; the reward models run padded rows
    env = build.start_processes(cfg)
    try:
        parts = build.build_ppo(cfg, log=lambda *a, **k: None, env=env)
        models = {"actor": parts.actor, "ref": parts.ref, "critic": parts.critic, "gold": parts.gold_reward_model,
                  "reward_model": parts.reward_models[0], "generation copy": generation_copy(parts.actor, FP32, env.device)}
        assert {name: m.config._attn_implementation for name, m in models.items()} == dict.fromkeys(models, PACKED_VARLEN)
        assert len(chosen) == 1  # chosen once per run
    finally:
        close(env)


# ---- (e) layers that hand their attention the position ids only ----


def _row(lengths: tuple[int, ...], heads: int = 4, kv_heads: int = 2, dim: int = 8):
    """A packed row's query (1, H, N, D), keys and values (1, Hkv, N, D) and position ids (1, N)."""
    g = torch.Generator().manual_seed(sum(lengths))
    n = sum(lengths)
    q, k, v = (torch.randn(1, h, n, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    positions = torch.cat([torch.arange(length) for length in lengths])[None]
    return q, k, v, positions


def _each_sequence_alone(q, k, v, lengths) -> torch.Tensor:
    """(1, N, H, D): causal attention over each sequence by itself, key/value heads repeated."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    out, start = [], 0
    for length in lengths:
        piece = (t[:, :, start : start + length] for t in (q, k, v))
        out.append(F.scaled_dot_product_attention(*piece, is_causal=True, scale=0.5).transpose(1, 2))
        start += length
    return torch.cat(out, dim=1)


class _Attention(torch.nn.Module):
    """What transformers' sdpa reads from an attention module."""

    is_causal, num_key_value_groups = True, 2


@pytest.mark.parametrize("lengths", [(5, 3), (4, 6, 2), (1, 7, 3, 5)])
@pytest.mark.parametrize("implementation", [PACKED_SDPA, PACKED_VARLEN, PACKED_DETERMINISTIC, PACKED_MASKED])
def test_a_packed_row_whose_layers_pass_only_position_ids_keeps_each_sequence_to_itself(
        implementation, lengths, monkeypatch):
    """StableLM's and Falcon's decoder layers drop the keyword arguments that carry the sequences'
    bounds (``cu_seq_lens_q``, klppo's row bounds) and hand on the position ids only: the
    sequences are read from them. Two sequences once ran as one, attending across their border."""
    fake = _install_fake_varlen(monkeypatch, "2.12+")
    q, k, v, positions = _row(lengths)
    function = {PACKED_SDPA: attention.packed_sdpa_attention, PACKED_VARLEN: attention.packed_varlen_attention,
                PACKED_DETERMINISTIC: attention.deterministic_sdpa_attention,
                PACKED_MASKED: attention.packed_masked_attention}[implementation]
    out, _ = function(_Attention(), q, k, v, None, scaling=0.5, position_ids=positions)
    torch.testing.assert_close(out, _each_sequence_alone(q, k, v, lengths), atol=1e-5, rtol=1e-5)
    assert fake.calls == (1 if implementation == PACKED_VARLEN else 0)  # one kernel call for the row
    monkeypatch.setattr(attention, "VARLEN_DTYPES", (BF16, FP16))  # fp32 on the varlen path: one masked call
    out, _ = function(_Attention(), q, k, v, None, scaling=0.5, position_ids=positions)
    torch.testing.assert_close(out, _each_sequence_alone(q, k, v, lengths), atol=1e-5, rtol=1e-5)


def test_a_packed_rows_mask_is_built_once_per_forward_and_freed_with_the_row(monkeypatch):
    """PACKED_MASKED (and fp32 rows on the varlen path): every layer gets the row's bounds as the
    same tensor, so its (N, N) mask is built once per forward, as transformers builds its own."""
    import gc

    built = []
    real = attention.block_causal_mask
    monkeypatch.setattr(attention, "block_causal_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    actor, critic = _models(PACKED_MASKED)
    ids, mask, width = _batch()
    response_logprobs(actor, ids, mask, width, packed=True)[0].sum().backward()
    response_values(critic, ids, mask, width, packed=True)
    assert len(built) == 2  # one per model forward, not one per layer (LAYERS = 3)
    gc.collect()
    assert len(attention._ROW_MASKS) == 0  # nothing held once the rows are gone
