"""Which models may pack rows (``use_remove_padding``): every model type klppo packs scores a packed
row as the padded rows, and every type it counts out (stateful layers, attention of its own) would
have mixed the sequences of a packed row; a run asked to pack one runs padded rows with a warning."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from klppo.commands.main_ppo import run_ppo
from klppo.models.attention import PACKED_MASKED, PACKED_SDPA, packing_problem, set_packed_attention
from klppo.models.forward import response_logprobs

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=1, initializer_range=0.5)
PACKS = {  # model type -> its config's own keys
    "llama": {}, "qwen3": {}, "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2), "gemma2": dict(query_pre_attn_scalar=8),
    "gemma3_text": dict(sliding_window=4, query_pre_attn_scalar=8), "phi3": {}, "phi": {}, "gpt2": {},
    "gpt_neox": {}, "opt": dict(ffn_dim=64, word_embed_proj_dim=32), "olmo2": {}, "granite": {},
    "mistral": dict(sliding_window=4), "starcoder2": {}, "cohere": {}, "glm": {}, "smollm3": {},
    "lfm2": dict(layer_types=["full_attention", "full_attention"]),
}
COUNTED_OUT = {  # model type -> its config's own keys, and what keeps it from packing
    "bloom": ({}, "does not declare transformers' attention interface"),
    "mpt": (dict(d_model=32, n_heads=4, n_layers=2), "does not declare"),
    "xglm": (dict(d_model=32, ffn_dim=64, num_layers=2, attention_heads=4), "does not declare"),
    "lfm2": (dict(layer_types=["conv", "full_attention"]), "its conv layers carry a state"),
    "jamba": (dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                   num_experts=2, mamba_d_state=8, mamba_dt_rank=4), "its linear_attention layers carry a state"),
}


def _model(kind: str, keys: dict, implementation: str = PACKED_SDPA):
    config = AutoConfig.for_model(kind, **{**SIZES, **keys})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
    return config, set_packed_attention(model, implementation) and model


def _batch():
    """Left-padded prompts and right-padded responses of three lengths: a packed row of 3 sequences."""
    ids = torch.randint(3, 64, (3, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :5], mask[1, :9], mask[2, -3:] = False, False, False
    return torch.where(mask, ids, 0), mask, 8


def _packed_against_padded(model) -> float:
    ids, mask, width = _batch()
    with torch.no_grad():
        padded = response_logprobs(model, ids, mask, width)[0]
        packed = response_logprobs(model, ids, mask, width, packed=True)[0]
    return (packed - padded).abs().max().item()


@pytest.mark.parametrize("implementation", [PACKED_SDPA, PACKED_MASKED])  # CPU's choice, and CUDA's last resort
@pytest.mark.parametrize("kind", list(PACKS))
def test_every_type_klppo_packs_scores_a_packed_row_as_its_padded_rows(kind, implementation):
    config, model = _model(kind, PACKS[kind], implementation)
    assert packing_problem(config) is None
    assert _packed_against_padded(model) < 1e-4  # fp32 rounding of log-probs up to ~20 (large weights)


def test_transformers_own_sdpa_mask_lets_opts_packed_tokens_attend_across_sequences():
    """Why CUDA's last resort builds its mask itself (PACKED_MASKED): transformers' sdpa finds the
    sequences in the position ids its mask function gets, and OPT's model does not hand them on."""
    assert _packed_against_padded(_model("opt", PACKS["opt"], "sdpa")[1]) > 1e-2
    assert _packed_against_padded(_model("opt", PACKS["opt"], PACKED_MASKED)[1]) < 1e-4


@pytest.mark.parametrize("kind", list(COUNTED_OUT))
def test_a_type_counted_out_would_mix_the_sequences_of_a_packed_row(kind):
    keys, why = COUNTED_OUT[kind]
    config, model = _model(kind, keys)
    assert why in packing_problem(config)
    assert _packed_against_padded(model) > 1e-2  # packed, its tokens would see the sequences before theirs


@pytest.mark.parametrize("kind, keys", [
    ("qwen3_5_text", dict(layer_types=["linear_attention", "full_attention"])), ("falcon_h1", {}),
    ("bamba", dict(attn_layer_indices=[1])), ("falcon", {}), ("stablelm", {}),
])
def test_stateful_layers_and_unmarked_attention_are_counted_out_from_the_config_alone(kind, keys):
    assert packing_problem(AutoConfig.for_model(kind, num_hidden_layers=2, **keys)) is not None


def test_a_run_asked_to_pack_a_model_that_cannot_runs_padded_rows_with_a_warning(tiny_model_dir, ppo_overrides,
                                                                                  tmp_path):
    import shutil

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    folder = tmp_path / "bloom"
    config = AutoConfig.for_model("bloom", **{**SIZES, "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                                              "eos_token_id": tokenizer.eos_token_id})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model_dir / name, folder / name)
    runs = {}
    for packed in ("true", "false"):
        printed = []
        overrides = ppo_overrides(tmp_path / packed, **{
            "actor_rollout_ref.model.path": folder, "algorithm.adv_estimator": "gae", "trainer.total_training_steps": 1,
            "actor_rollout_ref.model.use_remove_padding": packed, "critic.model.use_remove_padding": packed})
        runs[packed] = run_ppo(None, overrides, print_fn=lambda *a, **k: printed.append(" ".join(map(str, a))))
        warnings = [line.split(" = ")[0] for line in printed if "use_remove_padding has no effect" in line]
        assert warnings == ([] if packed == "false" else [  # each section once
            "warning: actor_rollout_ref.model.use_remove_padding has no effect with actor_rollout_ref.model.path",
            "warning: critic.model.use_remove_padding has no effect with critic.model.path"])
    timings = ("timing_s/", "perf/", "timing_per_token_ms/")
    same = [{k: v for k, v in r.items() if not k.startswith(timings)} for r in runs["true"]]
    assert same == [{k: v for k, v in r.items() if not k.startswith(timings)} for r in runs["false"]]
