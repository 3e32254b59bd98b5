"""A PPO run with ``rollout.name: vllm`` against a stand-in engine that records its calls
(``tests/fake_vllm.py``), as on a GPU with ``free_cache_engine`` (the default): every generation,
validation's several and the KL probe's included, has the actor's weights loaded since the last
level-2 sleep, and PyTorch's cache is emptied before every wake. The weights the engine gets carry
the tied head's name only where its model has one."""

import pytest

from klppo.commands.main_ppo import run_ppo
from klppo.rollout.vllm import VLLMEngine
from tests import fake_vllm
from tests.rollout.test_vllm_engine_calls import generations_from_released_weights


def quiet(*args, **kwargs) -> None:
    """A print_fn that prints nothing."""


@pytest.fixture
def fake_gpu_engine(monkeypatch):
    """install(**fake options) -> the log of a fake engine that believes it runs on a GPU."""
    monkeypatch.setattr(VLLMEngine, "on_gpu", True)
    return lambda **options: fake_vllm.install(monkeypatch, **options)


def test_validation_and_the_kl_probe_never_generate_from_weights_a_sleep_released(
        fake_gpu_engine, ppo_overrides, task_dir):
    log = fake_gpu_engine()
    records = run_ppo(None, ppo_overrides(**{
        "data.train_files": task_dir / "train.parquet", "data.val_files": task_dir / "val.parquet",
        "data.val_batch_size": 4,  # 8 prompts: two validation batches, then the KL probe's two
        "actor_rollout_ref.rollout.name": "vllm", "trainer.test_freq": 1,
    }), print_fn=quiet)
    assert [r["step"] for r in records] == [0, 1, 2] and "val-aux/kl_to_ref" in records[0]
    names = log.names()
    assert names.count("generate") == 2 + 3 * 4  # one per step; four per validation (before training, 1, 2)
    assert generations_from_released_weights(log) == 0
    assert names.count("sleep") == names.count("generate") + 1  # asleep after building and after every generation
    wakes = [i for i, name in enumerate(names) if name == "wake_up"]
    assert wakes and all(names[i - 1] == "empty_cache" for i in wakes)


@pytest.mark.parametrize("head", [True, False])
def test_the_tied_heads_name_is_sent_only_to_an_engine_whose_model_has_it(fake_gpu_engine, ppo_overrides, task_dir,
                                                                          head):
    log = fake_gpu_engine(head=head)  # Qwen2's layout (head tied to the embeddings), or Gemma2's (no lm_head)
    run_ppo(None, ppo_overrides(**{"data.train_files": task_dir / "train.parquet",
                                   "actor_rollout_ref.rollout.name": "vllm", "trainer.total_training_steps": 1}),
            print_fn=quiet)
    loads = [call[1] for call in log if call[0] == "load"]
    assert loads and all("model.embed_tokens.weight" in names for names in loads)
    assert all(("lm_head.weight" in names) is head for names in loads)


def test_remax_decodes_its_greedy_baseline_with_the_engine_from_loaded_weights(fake_gpu_engine, ppo_overrides,
                                                                               task_dir):
    log = fake_gpu_engine()
    records = run_ppo(None, ppo_overrides(**{"data.train_files": task_dir / "train.parquet",
                                             "actor_rollout_ref.rollout.name": "vllm",
                                             "algorithm.adv_estimator": "remax"}), print_fn=quiet)
    assert all("critic/reward_baseline/mean" in r for r in records)
    generations = [call[1] for call in log if call[0] == "generate"]
    assert len(generations) == 2 * len(records)  # the samples, then one greedy response per prompt
    for sampled, greedy in zip(generations[::2], generations[1::2]):
        assert {p.temperature for p in sampled} == {1.0} and {p.temperature for p in greedy} == {0.0}
        assert len(greedy) * 2 == len(sampled)  # rollout.n = 2
    assert generations_from_released_weights(log) == 0  # a sleep between them loads the weights again
