"""ARCHITECTURE.md's layer table holds: each package imports only the klppo packages it lists."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "klppo"

# package -> the klppo packages it may import (ARCHITECTURE.md, "Layers").
ALLOWED = {
    "algo": set(),
    "errors": set(),
    "config": {"errors", "monitoring.backends"},
    "data": {"errors"},
    "distributed": {"errors"},
    "models": {"algo", "data", "errors"},
    "rollout": {"data", "models", "errors"},
    "rewards": {"algo", "data", "errors"},
    "checkpoint": {"distributed", "errors"},
    "monitoring": {"algo", "rollout", "errors", "cli_support"},
    "cli_support": {"errors"},
    "cli": {"cli_support", "config"},
    "plan": {"config", "data", "monitoring", "errors", "cli_support"},
}


def _package(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _klppo_imports(path: Path) -> set[str]:
    """The klppo modules a file imports, as 'package' or 'package.module'."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        modules = []
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        names.update(".".join(m.split(".")[1:3]) for m in modules if m.startswith("klppo."))
    return names


FILES = sorted(p for p in PACKAGE.rglob("*.py") if _package(p) in ALLOWED)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_package_imports_only_the_layers_below_it(path):
    own = _package(path)
    allowed = ALLOWED[own]
    bad = [name for name in _klppo_imports(path)
           if name.split(".")[0] != own and name not in allowed and name.split(".")[0] not in allowed]
    assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}; ARCHITECTURE.md allows {sorted(allowed) or 'none'}"


def test_every_package_has_a_row_in_the_table():
    packages = {_package(p) for p in PACKAGE.rglob("*.py")} - {"__init__"}
    assert packages - {"trainer"} == set(ALLOWED)


def test_the_config_layer_loads_without_torch():
    """``klppo validate-config`` answers in a fraction of a second: no torch import on its path."""
    import subprocess
    import sys

    code = "import sys, klppo.config, klppo.cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr


def test_vllm_is_imported_by_rollout_vllm_alone_and_only_inside_functions():
    """klppo runs without vLLM: nothing imports it at module level, and only ``rollout/vllm.py`` at all."""
    importers = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            modules = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if any(m == "vllm" or m.startswith("vllm.") for m in modules):
                importers.setdefault(str(path.relative_to(PACKAGE)), []).append(node in tree.body)
    assert set(importers) == {"rollout/vllm.py"} and not any(importers["rollout/vllm.py"])
