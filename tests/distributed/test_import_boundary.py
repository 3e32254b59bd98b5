"""House rule 2: ``torch.distributed`` is imported only in klppo/distributed/."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "klppo"
OUTSIDE_DIST = sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "distributed")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


@pytest.mark.parametrize("path", OUTSIDE_DIST, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_klppo_distributed_imports_torch_distributed(path):
    bad = [n for n in _imports(path) if n.startswith("torch.distributed")]
    assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}; call a function of klppo.distributed instead"


def test_the_boundary_covers_the_whole_package():
    assert (PACKAGE / "distributed" / "fsdp.py").is_file()
    assert len(OUTSIDE_DIST) > 40 and not any("distributed" == p.relative_to(PACKAGE).parts[0] for p in OUTSIDE_DIST)
