"""What the tests of examples/smollm2 share: importing its scripts (examples/ is not a package)."""

import importlib.util
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2"


@pytest.fixture(scope="session")
def smollm2_script():
    """``smollm2_script(name)``: examples/smollm2/<name>.py imported as a module."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"smollm2_{name}", EXAMPLE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
