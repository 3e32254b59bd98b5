"""One process whose actor FSDP2 wraps (a group of one: bf16 mixed precision, offload_policy) generates
from a plain model of the actor's weights: FSDP2's hooks run a bounded number of times per
``generate``, whatever the number of tokens, and the samples are the FSDP2 actor's own.

Before: the actor itself decoded, and every generated token ran every unit's pre-forward hook
(the tiny model's 3 units: 12 hooks for 4 new tokens, 48 for 16; the first H200 run: 8,942 in one
step's generation).
"""

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from klppo.config.schema import FSDPConfig
from klppo.data.rl_dataset import load_rl_dataset
from klppo.distributed import DistEnv, inference_copy_bytes
from klppo.models.load import load_tokenizer
from klppo.rollout.hf import Decoding, SamplingParams, StaticCaches, hf_rollout
from klppo.trainer import responses
from klppo.trainer.responses import generation_decoding, generation_model
from klppo.run.setup import Sharder, load_model

ONE_PROCESS = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), is_distributed=True)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture
def actor_parts(group_of_one, tiny_model_dir, task_dir):
    """parts(dtype, weights) -> what ``generation_model`` reads: the tiny actor wrapped by FSDP2 in
    one process (``fsdp_config.dtype``), and 6 prompts of different lengths (left-padded)."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    records = load_rl_dataset(task_dir / "train.parquet", tokenizer, max_prompt_length=64, log=lambda *_: None)[:6]

    def parts(dtype: str, weights: str = "auto") -> SimpleNamespace:
        actor = load_model("causal_lm", str(tiny_model_dir), key="k", env=ONE_PROCESS, sharder=Sharder(ONE_PROCESS),
                           fsdp=FSDPConfig(dtype=dtype))
        settings = SimpleNamespace(generation_weights=weights, actor_lora=False, hf_decoding=Decoding("dynamic"),
                                   actor=SimpleNamespace(compute_dtype=DTYPES[dtype]), actor_offloaded=False)
        return SimpleNamespace(actor=actor, env=ONE_PROCESS, settings=settings, tokenizer=tokenizer, records=records,
                               kept_generation_model=None, kv_caches=StaticCaches())

    return parts


def generate(parts, params: SamplingParams, seed: int = 5) -> torch.Tensor:
    """(B, T) response ids sampled as a PPO step does (``generation_model``), from seed ``seed``."""
    torch.manual_seed(seed)
    with generation_model(parts) as (model, sharded):
        batch = hf_rollout(model, parts.records, parts.tokenizer, params, synced_gpus=sharded, device=parts.env.device,
                           decoding=generation_decoding(parts, sharded))
    return batch.response_ids


def pre_forward_hooks(monkeypatch, parts, new_tokens: int) -> int:
    """FSDP2 pre-forward hooks (one per unit per forward) that one generation of ``new_tokens`` runs."""
    calls = []
    original = FSDPParamGroup.pre_forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FSDPParamGroup, "pre_forward", counted)
    generate(parts, SamplingParams(n=2, max_new_tokens=new_tokens))
    monkeypatch.setattr(FSDPParamGroup, "pre_forward", original)
    return len(calls)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_process_generation_runs_fsdp2_hooks_a_bounded_number_of_times_whatever_the_tokens(
        actor_parts, monkeypatch, dtype):
    parts = actor_parts(dtype)
    hooks = {n: pre_forward_hooks(monkeypatch, parts, n) for n in (4, 16)}
    assert hooks[4] == hooks[16] == 0  # the plain model has no hook; gathering a group of one runs no forward
    sharded = actor_parts(dtype, weights="sharded")  # the opt-in: the actor itself, hooks per layer per token
    per_token = {n: pre_forward_hooks(monkeypatch, sharded, n) for n in (4, 16)}
    assert per_token[16] == 4 * per_token[4] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("do_sample", [True, False], ids=["sampled", "greedy"])
def test_one_process_generation_samples_what_the_fsdp2_actor_samples(actor_parts, dtype, do_sample):
    params = SamplingParams(n=2, max_new_tokens=12, do_sample=do_sample)
    plain = generate(actor_parts(dtype), params)
    assert torch.equal(plain, generate(actor_parts(dtype, weights="sharded"), params))


def test_one_process_fp32_generation_shares_the_actors_parameters_and_bf16_adds_a_cast_copy(actor_parts):
    fp32, bf16 = actor_parts("float32"), actor_parts("bfloat16")
    cpu = torch.device("cpu")
    assert inference_copy_bytes(fp32.actor, torch.float32, cpu) == 0
    numel = sum(p.numel() for p in bf16.actor.parameters())
    assert inference_copy_bytes(bf16.actor, torch.bfloat16, cpu) == 2 * numel
    with generation_model(fp32) as (model, sharded):
        assert not sharded and model is not fp32.actor
        shared = {p.data_ptr() for p in model.parameters()}
        assert shared == {p.to_local().data_ptr() for p in fp32.actor.parameters()}
    with generation_model(bf16) as (model, _):
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_with_no_memory_free_auto_still_shares_fp32_parameters_but_warns_and_decodes_sharded_in_bf16(
        actor_parts, monkeypatch):
    monkeypatch.setattr(responses, "available_bytes", lambda device: 0)
    assert responses.uses_gathered_copy(actor_parts("float32"))  # adds nothing
    with pytest.warns(UserWarning, match="does not fit in half the free memory"):
        assert not responses.uses_gathered_copy(actor_parts("bfloat16"))
    assert responses.uses_gathered_copy(actor_parts("bfloat16", weights="gathered"))  # asked for: no check
