"""``rollout.hf_decoding``: a static KV cache, eager or compiled, samples exactly what transformers'
dynamic cache samples (left-padded prompts, rows ending at EOS, greedy and sampled from one seed)."""

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo.utils
from transformers import AutoModelForCausalLM, CompileConfig, GenerationConfig

import klppo.rollout.hf as hf
from klppo.data.rl_dataset import load_rl_dataset
from klppo.distributed import plain_copy
from klppo.models.load import load_tokenizer
from klppo.rollout.hf import Decoding, SamplingParams, hf_rollout

CACHE = 64 + 12  # the run's longest prompt + response


@pytest.fixture(scope="module")
def model_and_records(tiny_model_dir, task_dir):
    """The tiny model (no grad, as a generation copy is) with weights drawn wider than its
    initialisation (which decodes one token forever, greedily), 6 prompts of different lengths, and
    for sampled and greedy decoding a tokenizer whose EOS is a token some rows pick and others do
    not, so that rows end at different steps."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    records = load_rl_dataset(task_dir / "train.parquet", tokenizer, max_prompt_length=64, log=lambda *_: None)[:6]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().requires_grad_(False)
    torch.manual_seed(0)
    for param in model.parameters():
        param.normal_(0.0, 0.3)
    never = SimpleNamespace(pad_token_id=tokenizer.pad_token_id, eos_token_id=len(tokenizer))
    tokenizers = {}
    for do_sample in (True, False):
        ids = sample(model, records, never, "dynamic", do_sample).response_ids[:, :-1]
        eos = next(t for t in range(len(tokenizer)) if 0 < (ids == t).any(-1).sum() < len(ids))
        tokenizers[do_sample] = SimpleNamespace(pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
    return model, records, tokenizers


def sample(model, records, tokenizer, mode: str, do_sample: bool):
    torch.manual_seed(3)
    return hf_rollout(model, records, tokenizer, SamplingParams(n=2, max_new_tokens=12, do_sample=do_sample),
                      decoding=Decoding(mode, CACHE))


@pytest.mark.parametrize("do_sample", [True, False], ids=["sampled", "greedy"])
def test_a_static_cache_samples_what_the_dynamic_cache_samples(model_and_records, do_sample):
    model, records, tokenizers = model_and_records
    tokenizer = tokenizers[do_sample]
    dynamic = sample(model, records, tokenizer, "dynamic", do_sample)
    static = sample(model, records, tokenizer, "static", do_sample)
    assert torch.equal(static.response_ids, dynamic.response_ids)
    assert torch.equal(static.response_mask, dynamic.response_mask)
    ended = (~dynamic.response_mask).any(-1)  # rows that stopped at EOS before the last token
    assert ended.any() and not ended.all()


def test_compiled_decoding_samples_what_eager_decoding_samples_and_goes_through_torch_compile(
        model_and_records, monkeypatch):
    """torch.compile with its eager backend (inductor's C++ compilation takes a minute here: the slow
    test below runs it); the graph captured is the one inductor would compile."""
    monkeypatch.setattr(hf, "CompileConfig", lambda: CompileConfig(backend="eager"))
    model, records, tokenizers = model_and_records
    tokenizer = tokenizers[True]
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = sample(model, records, tokenizer, "compiled", True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before
    assert torch.equal(compiled.response_ids, sample(model, records, tokenizer, "dynamic", True).response_ids)


@pytest.mark.slow
def test_inductor_compiled_decoding_samples_what_eager_decoding_samples_and_a_new_copy_reuses_it(
        model_and_records):
    model, records, tokenizers = model_and_records
    torch._dynamo.reset()
    for do_sample, tokenizer in tokenizers.items():
        compiled = sample(model, records, tokenizer, "compiled", do_sample)
        assert torch.equal(compiled.response_ids, sample(model, records, tokenizer, "dynamic", do_sample).response_ids)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    copy = plain_copy(model, {n: p.detach().clone() for n, p in model.named_parameters()})  # each step's new copy
    sample(copy, records, tokenizers[True], "compiled", True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # nothing compiled again
    caches = hf.StaticCaches()  # a kept model's caches, emptied in place between calls
    for _ in range(2):
        torch.manual_seed(3)
        kept = hf_rollout(model, records, tokenizers[True], SamplingParams(n=2, max_new_tokens=12),
                          decoding=Decoding("compiled", CACHE, caches=caches))
        assert torch.equal(kept.response_ids, sample(model, records, tokenizers[True], "dynamic", True).response_ids)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs and len(caches) == 1


def test_auto_decoding_is_compiled_on_cuda_and_dynamic_on_cpu():
    auto = Decoding("auto", CACHE)
    assert auto.on(torch.device("cuda", 0)) == Decoding("compiled", CACHE)
    assert auto.on(torch.device("cpu")) == Decoding("dynamic", CACHE)
    assert Decoding("static", CACHE).on(torch.device("cuda", 0)).mode == "static"


def test_each_mode_means_the_same_on_any_device():
    """transformers compiles a static cache's step by itself on CUDA, and never on CPU unless told."""
    static = hf.with_decoding(GenerationConfig(), Decoding("static", CACHE))
    assert static.disable_compile and static.compile_config is None
    compiled = hf.with_decoding(GenerationConfig(), Decoding("compiled", CACHE))
    assert not compiled.disable_compile and compiled.compile_config._compile_all_devices
    # the cache is klppo's to give (transformers refuses a cache_implementation beside a given cache)
    assert {c.cache_implementation for c in (static, compiled)} == {None}
    assert hf.with_decoding(GenerationConfig(), Decoding("dynamic", CACHE)).cache_implementation is None


def test_a_static_cache_holds_the_runs_longest_prompt_and_response_and_kept_ones_come_back_empty(model_and_records):
    model, records, tokenizers = model_and_records
    config = GenerationConfig(max_new_tokens=12)
    assert hf.static_cache(model, torch.Size([4, 30]), config, Decoding("dynamic", CACHE)) is None
    own = hf.static_cache(model, torch.Size([4, 30]), config, Decoding("static"))
    assert own.layers[0].max_cache_len == 30 + 12  # without the run's length: this call's prompt and response
    caches = hf.StaticCaches()
    kept = Decoding("static", CACHE, caches=caches)
    first = hf.static_cache(model, torch.Size([4, 30]), config, kept)
    assert first.layers[0].max_cache_len == CACHE and hf.static_cache(model, torch.Size([4, 50]), config, kept) is first
    assert hf.static_cache(model, torch.Size([2, 30]), config, kept) is not first and len(caches) == 2
    longer = hf.static_cache(model, torch.Size([4, 30]), config, Decoding("static", CACHE + 8, caches=caches))
    assert longer is not first and len(caches) == 2  # one cache per row count: another length replaces it
    response = sample(model, records, tokenizers[True], "static", True)
    torch.manual_seed(3)
    params = SamplingParams(n=2, max_new_tokens=12)
    for _ in range(2):  # decoding into a kept cache, twice: what a new cache samples
        torch.manual_seed(3)
        again = hf_rollout(model, records, tokenizers[True], params, decoding=Decoding("static", CACHE, caches=caches))
        assert torch.equal(again.response_ids, response.response_ids)
    assert Decoding("static", CACHE, caches=caches) == Decoding("static", CACHE)  # the caches are state, not config


def test_a_model_whose_compiled_decoding_fails_decodes_with_the_dynamic_cache_after_one_warning(
        model_and_records, monkeypatch):
    """torch.compile cannot compile every model everywhere; the run goes on, from the same RNG state."""
    def refuse(*args, **kwargs):
        raise RuntimeError("backend failed\nlong traceback")

    monkeypatch.setattr(hf, "CompileConfig", lambda: CompileConfig(backend=refuse))
    monkeypatch.setattr(hf, "_COMPILE_FAILED", set())
    model, records, tokenizers = model_and_records
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="compiled decoding failed for Qwen2ForCausalLM .*backend failed"):
        fell_back = sample(model, records, tokenizers[True], "compiled", True)
    assert torch.equal(fell_back.response_ids, sample(model, records, tokenizers[True], "dynamic", True).response_ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: later calls decode dynamically without trying again
        again = sample(model, records, tokenizers[True], "compiled", True)
    assert torch.equal(again.response_ids, fell_back.response_ids)


def test_generate_on_the_device_of_a_model_whose_parameters_stay_on_cpu_prints_no_device_warning(
        model_and_records, monkeypatch):
    """FSDP2's offload_policy keeps a sharded actor's parameters on CPU while it computes on the GPU;
    transformers' warning about inputs on another device than the model's is filtered, others are not."""
    import inspect

    from transformers.generation.utils import GenerationMixin

    model, records, tokenizers = model_and_records
    generate = model.generate
    text = ("You are calling .generate() with the `input_ids` being on a device type different than your model's "
            "device. `input_ids` is on cuda, whereas the model is on cpu.")
    assert "being on a device type different" in inspect.getsource(GenerationMixin.generate)  # the text still there

    def warning_generate(*args, **kwargs):
        warnings.warn(text, UserWarning)
        warnings.warn("something else", UserWarning)
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", warning_generate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sample(model, records, tokenizers[True], "dynamic", True)
    assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == ["something else"]
