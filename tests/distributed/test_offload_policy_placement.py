"""Where ``fsdp_config.offload_policy`` puts a sharded model's parameters on a CUDA run, shown on CPU.

The run's device is made to look like CUDA (``DistEnv.device``) while the mesh stays a CPU one
(this machine has no GPU): whatever ``load_model`` puts on the run's device would fail here,
and on a GPU it would be the parameters FSDP2's offload policy refuses at the first forward
("FSDP parameters should be materialized on CPU").
"""

import pytest
import torch
from torch.distributed.tensor import DTensor

import klppo.run.setup as setup
from klppo.config.schema import FSDPConfig
from klppo.distributed import DistEnv, build_mesh, parameter_device
from klppo.models.lora import LoraSpec

LOOKS_LIKE_CUDA = torch.device("cuda", 0)


def test_parameters_live_on_cpu_under_the_offload_policy_and_on_the_device_otherwise():
    assert parameter_device(LOOKS_LIKE_CUDA, cpu_offload=True) == torch.device("cpu")
    assert parameter_device(LOOKS_LIKE_CUDA, cpu_offload=False) == LOOKS_LIKE_CUDA


@pytest.fixture
def cuda_looking_env(group_of_one, monkeypatch):
    """A group of one whose run device says CUDA; its meshes are built on CPU."""
    monkeypatch.setattr(setup, "build_mesh", lambda world, size, device_type: build_mesh(world, size, "cpu"))
    return DistEnv(rank=0, world_size=1, local_rank=0, device=LOOKS_LIKE_CUDA, is_distributed=True)


@pytest.mark.parametrize("lora", [None, LoraSpec("actor_rollout_ref.model", rank=4, alpha=8,
                                                 target_modules="all-linear")], ids=["full", "lora"])
def test_a_cuda_run_under_the_offload_policy_materialises_on_cpu_and_steps_a_fused_cpu_optimiser(
        cuda_looking_env, tiny_model_dir, lora):
    fsdp = FSDPConfig(offload_policy=True)
    model = setup.load_model("causal_lm", str(tiny_model_dir), key="actor_rollout_ref.model.path",
                             env=cuda_looking_env, sharder=setup.Sharder(cuda_looking_env), fsdp=fsdp, lora=lora)
    params = dict(model.named_parameters())
    assert {p.device.type for p in params.values()} == {"cpu"}
    # FSDP2 brings only the parameters it manages to the device: none may be left out (a LoRA
    # model's frozen root is otherwise kept whole and unmanaged).
    assert all(isinstance(p, DTensor) for p in params.values()), [n for n, p in params.items()
                                                                   if not isinstance(p, DTensor)]
    optimizer = setup.build_optimizer(model, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999))
    assert all(group.get("fused") for group in optimizer.param_groups)  # torch's fused AdamW runs on CPU too
    ids = torch.tensor([[5, 6, 7, 8]])
    model(ids).logits.float().mean().backward()  # FSDP2's lazy init checks where the parameters live
    optimizer.step()
