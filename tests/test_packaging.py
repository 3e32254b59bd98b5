"""What pyproject.toml lets pip install."""

from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"


def _requirement(name: str) -> Requirement:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, dependencies) if r.name == name)


def test_pyarrow_below_14_0_1_is_refused_for_its_parquet_code_execution():
    # CVE-2023-47248: pyarrow 0.14.0 to 14.0.0 deserialise untrusted data reading a crafted Parquet
    # file, and klppo reads users' Parquet files.
    pyarrow = _requirement("pyarrow")
    assert not pyarrow.specifier.contains("14.0.0")
    assert pyarrow.specifier.contains("14.0.1") and pyarrow.specifier.contains("17.0.0")
