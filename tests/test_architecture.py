"""ARCHITECTURE.md's rules hold: each package imports only the klppo packages its row lists, no
package's modules import one another in a circle, no module is over 600 lines and the PPO loop's
file is under 300 (STYLE.md, rules 2 and 6)."""

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
    "rollout": {"data", "models", "rewards", "errors"},
    "rewards": {"algo", "data", "errors"},
    "checkpoint": {"distributed", "errors"},
    "monitoring": {"algo", "rollout", "errors", "cli_support"},
    "cli_support": {"errors"},
    "cli": {"cli_support", "config"},
    "plan": {"config", "data", "monitoring", "errors", "cli_support"},
    "safety": {"errors"},
    "run": {"algo", "checkpoint", "config", "data", "distributed", "errors", "models", "monitoring", "plan", "rewards",
            "rollout", "safety"},
    "trainer": {"algo", "checkpoint", "cli_support", "config", "data", "distributed", "errors", "models", "monitoring",
                "rewards", "rollout", "run", "safety"},
    "commands": {"algo", "checkpoint", "cli_support", "config", "data", "distributed", "errors", "models", "monitoring",
                 "plan", "rewards", "rollout", "run", "safety", "trainer"},
}
# verl's module path (``python -m klppo.trainer.main_ppo``) is kept by a shim that runs the command.
SHIMS = {"trainer/main_ppo.py": {"commands.main_ppo"}, "trainer/fsdp_sft_trainer.py": {"commands.main_sft"}}
MAX_MODULE_LINES = 600
PPO_LOOP, MAX_LOOP_LINES = PACKAGE / "trainer" / "ppo_trainer.py", 300


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
    allowed = ALLOWED[own] | SHIMS.get(str(path.relative_to(PACKAGE)), set())
    bad = [name for name in _klppo_imports(path)
           if name.split(".")[0] != own and name not in allowed and name.split(".")[0] not in allowed]
    assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}; ARCHITECTURE.md allows {sorted(allowed) or 'none'}"


def test_every_package_has_a_row_in_the_table():
    packages = {_package(p) for p in PACKAGE.rglob("*.py")} - {"__init__"}
    assert packages == set(ALLOWED)


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


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")


def _same_package_imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``path``'s own package that it imports, at module level or inside functions."""
    own = _module_name(path).split(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("klppo."):
            base = node.module.removeprefix("klppo.")
            found.update(m for m in [base] + [f"{base}.{a.name}" for a in node.names] if m in modules)
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("klppo.") for a in node.names if a.name.removeprefix("klppo.") in modules)
    return {m for m in found if m.split(".")[0] == own and "." in m and m != _module_name(path)}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle of ``graph``, as the path that closes it (depth-first search)."""
    circles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return circles


def test_no_package_has_an_import_circle_among_its_modules():
    """A circle is hidden today by an import inside a function and breaks the day it moves up; none at all."""
    paths = list(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    graph = {_module_name(p): _same_package_imports(p, modules) for p in paths}
    assert not _circles(graph), _circles(graph)


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": set()}) == [["a.x", "a.y", "a.z", "a.x"]]
    assert _circles({"a.x": {"a.y"}, "a.y": set()}) == []


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_longer_than_600_lines(path):
    lines = path.read_text().count("\n")
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines; split it where a concept has no name yet"


def test_the_ppo_loop_reads_in_under_300_lines():
    lines = PPO_LOOP.read_text().count("\n")
    assert lines < MAX_LOOP_LINES, f"trainer/ppo_trainer.py has {lines} lines; move a phase out (STYLE.md rule 2)"
