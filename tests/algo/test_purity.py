"""klppo/algo stays pure: torch and the standard library only, no host syncs, ASCII."""

import ast
from pathlib import Path

import pytest

ALGO_DIR = Path(__file__).resolve().parents[2] / "klppo" / "algo"
ALGO_FILES = sorted(ALGO_DIR.glob("*.py"))
ALLOWED_TOP_LEVEL = {"torch", "math", "typing", "dataclasses", "__future__", "collections", "functools"}


def _imported_modules(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level > 0:  # relative import: inside klppo.algo
                yield "klppo.algo"
            else:
                yield node.module


def test_algo_package_has_its_modules():
    names = {p.name for p in ALGO_FILES}
    assert {"__init__.py", "stats.py", "kl.py", "advantages.py", "losses.py"} <= names


@pytest.mark.parametrize("path", ALGO_FILES, ids=lambda p: p.name)
def test_algo_module_imports_only_torch_and_the_standard_library(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for module in _imported_modules(tree):
        top = module.split(".")[0]
        inside_algo = module == "klppo.algo" or module.startswith("klppo.algo.")
        assert top in ALLOWED_TOP_LEVEL or inside_algo, f"{path.name} imports {module}"
        assert not module.startswith("torch.distributed"), f"{path.name} imports {module}"


@pytest.mark.parametrize("path", ALGO_FILES, ids=lambda p: p.name)
def test_algo_module_never_syncs_with_the_host_or_touches_distributed(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            assert node.attr not in ("item", "tolist", "distributed"), f"{path.name}:{node.lineno} uses .{node.attr}"


@pytest.mark.parametrize("path", ALGO_FILES, ids=lambda p: p.name)
def test_algo_module_is_ascii(path):
    path.read_bytes().decode("ascii")
