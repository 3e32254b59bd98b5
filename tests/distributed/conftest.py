"""Fixtures of the distributed tests run in one process."""

import pytest

from klppo.distributed import build_mesh, close, init_distributed


@pytest.fixture
def group_of_one(monkeypatch):
    """A process group of one (gloo, CPU) and its 1-rank device mesh, for FSDP2 in one process."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    env = init_distributed("cpu", group_of_one=True)
    yield build_mesh(1)
    close(env)
