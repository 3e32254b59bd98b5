"""The process group a run joins, read without a GPU: on CUDA it holds NCCL for CUDA tensors and
gloo for CPU ones (FSDP2's offload_policy reduces CPU gradients), a CPU run keeps gloo alone,
the timeout comes from the config, and LOCAL_RANK picks a visible device."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from klppo.config import load_ppo_config
from klppo.distributed import env as env_module
from klppo.errors import UserError
from klppo.run import build, setup


@pytest.fixture
def joined(monkeypatch):
    """init_distributed with torchrun's variables and a stand-in for init_process_group -> its kwargs."""
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)

    def join(device: str, *, visible: int = 8, local_rank: int = 1, local_world_size: int | None = None, **kwargs):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
        for key, value in {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": str(local_rank),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
            monkeypatch.setenv(key, value)
        if local_world_size is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))
        env = env_module.init_distributed(device, **kwargs)
        return env, calls[-1]

    return join


def test_a_cuda_run_joins_one_group_with_gloo_for_cpu_tensors_and_nccl_for_cuda_ones(joined):
    env, kwargs = joined("cuda", timeout_s=1234)
    assert kwargs["backend"] == "cpu:gloo,cuda:nccl"
    assert kwargs["timeout"] == timedelta(seconds=1234)
    assert kwargs["device_id"] == torch.device("cuda", 1) == env.device
    assert (kwargs["rank"], kwargs["world_size"]) == (1, 4)


def test_a_cpu_run_keeps_a_gloo_only_group_with_the_default_timeout(joined):
    env, kwargs = joined("cpu")
    assert (kwargs["backend"], kwargs["device_id"], env.device) == ("gloo", None, torch.device("cpu"))
    assert kwargs["timeout"] == timedelta(seconds=600)


@pytest.mark.parametrize("local_rank, visible, index", [(3, 8, 3), (3, 1, 0)])
def test_local_rank_picks_a_visible_device_when_each_process_sees_one_gpu(joined, local_rank, visible, index):
    env, _ = joined("cuda", visible=visible, local_rank=local_rank)
    assert env.device == torch.device("cuda", index) and env.local_rank == local_rank


@pytest.mark.parametrize("local_rank, local_world_size", [(5, None), (0, 6)], ids=["its_own_rank", "torchruns_count"])
def test_more_ranks_on_a_node_than_the_gpus_they_see_is_refused(joined, local_rank, local_world_size):
    # 6 processes and 4 GPUs: ranks 4 and 5 would share GPUs 0 and 1 (out of memory, or a stalled NCCL).
    with pytest.raises(UserError, match=r"LOCAL_RANK=\d with 6 processes on this node, but this process sees 4 CUDA "
                                        r"devices.*launch at most 4 processes per node \(torchrun --nproc_per_node 4 "
                                        r"and trainer.n_gpus_per_node=4\), or give each process its own GPU"):
        joined("cuda", visible=4, local_rank=local_rank, local_world_size=local_world_size)


def test_klppos_own_collectives_run_on_cuda_when_the_group_has_nccl(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(dist, "get_backend", lambda: "cpu:gloo,cuda:nccl")
    assert env_module._comm_device() == torch.device("cuda", 2)
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    assert env_module._comm_device() == torch.device("cpu")


def test_ppo_joins_with_actor_rollout_ref_nccl_timeout(monkeypatch):
    seen = []
    monkeypatch.setattr(setup, "init_distributed", lambda device, **kwargs: seen.append(kwargs) or env_module.SINGLE_PROCESS)
    cfg = load_ppo_config(None, ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m",
                                 "actor_rollout_ref.nccl_timeout=1800", "trainer.device=cpu"])
    build.start_processes(cfg)
    assert seen == [{"group_of_one": False, "timeout_s": 1800}]


def test_verls_critic_timeout_is_noted_as_covered_by_the_one_group():
    notes: list[str] = []
    load_ppo_config(None, ["data.train_files=t.parquet", "actor_rollout_ref.model.path=m", "critic.nccl_timeout=1800"],
                    notes=notes)
    assert any("critic.nccl_timeout=1800" in n for n in notes)
    assert any("timeout is actor_rollout_ref.nccl_timeout" in n for n in notes)


@pytest.fixture
def group_calls(monkeypatch):
    """A stand-in two-rank process group -> the calls that leave it, in order."""
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **k: calls.append("destroy"))
    return calls


TWO_RANKS = env_module.DistEnv(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"), is_distributed=True)


def test_an_error_another_rank_raised_is_raised_here_and_every_rank_leaves_the_group_in_step(group_calls, monkeypatch):
    # Rank 1's reward function failed; this rank's part succeeded. Leaving at once could cut rank 1
    # off while it still reads this rank's half of the gather that agreed the error.
    monkeypatch.setattr(env_module, "all_gather_objects", lambda obj: [obj, "rank 1's reward function raised"])
    with pytest.raises(UserError, match="rank 1's reward function raised") as raised:
        env_module.run_on_ranks(TWO_RANKS, lambda log: env_module.same_on_every_rank(lambda: 0.5))
    assert raised.value.raised_on_every_rank
    assert group_calls == ["barrier", "destroy"]


def test_an_error_this_rank_agreed_on_keeps_its_own_type_and_leaves_in_step(group_calls, monkeypatch):
    from klppo.checkpoint.verify import IncompatibleCheckpoint

    monkeypatch.setattr(env_module, "all_gather_objects", lambda obj: [obj, None])

    def refuse():
        raise IncompatibleCheckpoint("rank_0.pt was written by 4 ranks")

    with pytest.raises(IncompatibleCheckpoint, match="written by 4 ranks"):
        env_module.run_on_ranks(TWO_RANKS, lambda log: env_module.same_on_every_rank(refuse))
    assert group_calls == ["barrier", "destroy"]


@pytest.mark.parametrize("error", [RuntimeError("CUDA out of memory"), UserError("a bad row on this rank alone")])
def test_an_error_on_this_rank_alone_leaves_the_group_at_once_without_waiting(group_calls, error):
    def fail(log):
        raise error

    with pytest.raises(type(error)):
        env_module.run_on_ranks(TWO_RANKS, fail)
    assert group_calls == ["destroy"]  # a barrier would hang: the other ranks are not coming


def test_a_run_that_succeeds_leaves_the_group_after_every_rank_is_done(group_calls):
    assert env_module.run_on_ranks(TWO_RANKS, lambda log: "done") == "done"
    assert group_calls == ["barrier", "destroy"]


def test_agreeing_when_no_rank_refused_returns_this_ranks_result(monkeypatch):
    monkeypatch.setattr(env_module, "all_gather_objects", lambda obj: [obj, None])
    assert env_module.same_on_every_rank(lambda: 7) == 7
