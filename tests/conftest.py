"""Fixtures shared by the end-to-end tests: a tiny model folder and the arithmetic task on disk."""

import random
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from klppo.data.arithmetic import (
    arithmetic_corpus,
    write_arithmetic_offline_parquet,
    write_arithmetic_parquet,
    write_arithmetic_sft_parquet,
)
from klppo.models.tiny import CHAT_TEMPLATE, build_tiny_model_folder

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
# Qwen3's switch, in the tiny tokenizer's special tokens: with enable_thinking=false the opened
# assistant turn gets an empty "thought" (two special tokens, whatever text comes before).
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ '<|im_start|>assistant\n' }}",
    "{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<|im_start|><|im_end|>' }}{% endif %}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random-init tiny Qwen2 model and its locally trained tokenizer, as a HF folder."""
    return build_tiny_model_folder(tmp_path_factory.mktemp("tiny_model"), arithmetic_corpus(200, 0), seed=0, **TINY)


@pytest.fixture(scope="session")
def task_dir(tmp_path_factory) -> Path:
    """train.parquet (prompts), offline.parquet (prompts + 2 recorded responses), val, sft."""
    out = tmp_path_factory.mktemp("task")
    write_arithmetic_parquet(out / "train.parquet", 32, seed=1)
    write_arithmetic_offline_parquet(out / "offline.parquet", 32, seed=2, n_responses=2)
    write_arithmetic_parquet(out / "val.parquet", 8, seed=3, split="test")
    write_arithmetic_sft_parquet(out / "sft.parquet", 64, seed=4, wrong_fraction=0.5)
    return out


@pytest.fixture
def ppo_overrides(tiny_model_dir, task_dir, tmp_path):
    """base(**changes) -> overrides for a 2-step offline PPO run of the tiny model in tmp_path."""

    def base(run_dir: Path | None = None, **changes) -> list[str]:
        settings = {
            "data.train_files": task_dir / "offline.parquet",
            "data.max_prompt_length": 64,
            "data.max_response_length": 16,
            "data.train_batch_size": 8,
            "actor_rollout_ref.model.path": tiny_model_dir,
            "actor_rollout_ref.rollout.name": "offline",
            "actor_rollout_ref.rollout.n": 2,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
            "actor_rollout_ref.actor.optim.lr": 1e-3,
            "critic.optim.lr": 1e-3,
            "algorithm.use_kl_in_reward": "true",
            "trainer.total_training_steps": 2,
            "trainer.logger": "[]",
            "trainer.device": "cpu",
            "trainer.default_local_dir": run_dir or tmp_path / "run",
        }
        settings.update(changes)
        return [f"{k}={v}" for k, v in settings.items()]

    return base


WORDS = ["great", "good", "fine", "bad"]  # best first: the preference a reward model must learn


def _write_word_ranking(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(20), rng.randrange(20)
        order = list(range(4))
        rng.shuffle(order)
        rows.append({"prompt": [{"role": "user", "content": f"Rate {a} and {b}."}],
                     "responses": [f"{a} + {b} is {WORDS[k]}" for k in order],
                     "ranking": sorted(range(4), key=lambda j: order[j])})
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="session")
def word_ranking_file():
    """write(path, n, seed) -> path: ranked Parquet of 4 responses per prompt, great > good > fine > bad."""
    return _write_word_ranking


@pytest.fixture(scope="session")
def answer_batch(tiny_model_dir):
    """make(rows) -> a RolloutBatch for update tests: arithmetic prompts (left-padded), answers cut
    to growing lengths (right-padded), random advantages and returns; a fresh batch per call."""
    import torch
    from transformers import AutoTokenizer

    from klppo.data.arithmetic import make_problems
    from klppo.data.chat_template import encode_chats
    from klppo.rollout.batch import RolloutBatch, right_pad

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def make(rows: int = 6) -> RolloutBatch:
        problems = make_problems(rows, seed=5)
        prompts = encode_chats(tokenizer, [[{"role": "user", "content": p.question}] for p in problems])
        prompt_ids, prompt_mask = right_pad([list(reversed(p)) for p in prompts], tokenizer.pad_token_id)
        prompt_ids, prompt_mask = prompt_ids.flip(1), prompt_mask.flip(1)  # left-padded
        answers = [tokenizer(p.solution()[: 4 + 3 * i])["input_ids"] + [tokenizer.eos_token_id]
                   for i, p in enumerate(problems)]
        response_ids, response_mask = right_pad(answers, tokenizer.pad_token_id)
        g = torch.Generator().manual_seed(0)
        batch = RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
            group_index=torch.arange(rows) // 2, data_sources=["x"] * rows, ground_truths=[None] * rows,
            extra_infos=[{}] * rows,
        )
        batch.advantages = torch.randn(response_ids.shape, generator=g) * response_mask
        batch.returns = torch.randn(response_ids.shape, generator=g) * response_mask
        return batch

    return make


# vLLM's CPU attention takes head sizes of 32 and more: the vLLM tests' tiny model has 2 heads of 32.
VLLM_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    """A random-init tiny Qwen2 (tied embeddings) that vLLM's CPU backend runs."""
    return build_tiny_model_folder(tmp_path_factory.mktemp("vllm_model"), arithmetic_corpus(200, 0), seed=0, **VLLM_TINY)


@pytest.fixture(scope="session")
def vllm_untied_model_dir(vllm_model_dir, tmp_path_factory) -> Path:
    """The same model with an LM head of its own (untied from the embeddings, its own random values)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir)
    model.config.tie_word_embeddings = False
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(5)) * 0.05)
    model.lm_head = head
    out = tmp_path_factory.mktemp("vllm_untied_model")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(vllm_model_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def vllm_olmo2_model_dir(vllm_model_dir, tmp_path_factory) -> Path:
    """A random-init tiny OLMo 2, a type vLLM runs through its Transformers backend (transformers' own
    classes, which vLLM changes to compile them), with the vLLM tiny model's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_model_dir)
    config = AutoConfig.for_model("olmo2", vocab_size=len(tokenizer), intermediate_size=128, head_dim=32,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                  bos_token_id=tokenizer.eos_token_id, initializer_range=0.2, **VLLM_TINY)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("vllm_olmo2_model")
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture
def gpu_host(monkeypatch):
    """This process looks like one on a GPU host (``torch.cuda.is_available()`` is True), and any
    call that would create a CUDA context there, pinning host memory included, fails the test
    (``tests/gpu_host.py``). Torch caches some of what it sees then, so whole runs under it go in
    a process of their own (``tests/trainer/gpu_host_worker.py``)."""
    from tests.gpu_host import pretend_gpu_host

    pretend_gpu_host(monkeypatch.setattr)


@pytest.fixture
def crash_after_logging(monkeypatch):
    """``with crash_after_logging(step): run(...)``: the run stops with a KeyboardInterrupt right
    after ``step`` is logged and before it is saved, as a killed process would (the block expects it)."""
    from klppo.monitoring.logger import MetricsLogger

    real_log = MetricsLogger.log

    @contextmanager
    def crashing(step: int):
        def log_then_crash(self, logged, metrics, total=None):
            record = real_log(self, logged, metrics, total)
            if logged == step:
                raise KeyboardInterrupt
            return record

        monkeypatch.setattr(MetricsLogger, "log", log_then_crash)
        try:
            with pytest.raises(KeyboardInterrupt):
                yield
        finally:
            monkeypatch.setattr(MetricsLogger, "log", real_log)

    return crashing


@pytest.fixture
def crashed_and_resumed(tmp_path, crash_after_logging):
    """``crashed_and_resumed(overrides, changes, at=3)`` -> (the uninterrupted run's records, the resumed run's,
    both without their timings): a run of ``overrides(run_dir, **changes)`` in-process, and the same run
    crashed right after logging step ``at`` (before saving it), then started again in its folder."""
    from klppo.commands.main_ppo import run_ppo

    def quiet(*args, **kwargs) -> None:
        pass

    def same(record: dict) -> dict:
        return {k: v for k, v in record.items() if not k.startswith(("timing_s/", "perf/"))}

    def run(overrides, changes: dict, at: int = 3) -> tuple[list[dict], list[dict]]:
        full = run_ppo(None, overrides(tmp_path / "full", **changes), print_fn=quiet)
        with crash_after_logging(at):
            run_ppo(None, overrides(tmp_path / "crashed", **changes), print_fn=quiet)
        resumed = run_ppo(None, overrides(tmp_path / "crashed", **changes), print_fn=quiet)
        return [same(r) for r in full], [same(r) for r in resumed]

    return run
