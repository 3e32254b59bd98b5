"""Config files a user can get wrong, through the real `klppo validate-config`: each is one short
error naming the file and the fix, exit status 2, no traceback (and the usable ones validate)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REQUIRED = ["data.train_files=train.parquet", "actor_rollout_ref.model.path=models/tiny"]


def validate(path: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "klppo.cli", "validate-config", str(path), *REQUIRED, *overrides],
                          capture_output=True, text=True, timeout=120)


def assert_one_line_error(result: subprocess.CompletedProcess, *parts: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: config file "), lines
    for part in parts:
        assert part in lines[0], lines[0]


BAD_FILES = {
    # name: (bytes of the file, texts the error must contain)
    "latin1_comment": ("data:\n  # r\xe9sum\xe9 of the run\n  train_batch_size: 8\n".encode("latin-1"),
                       ["is not UTF-8 text (byte 0xe9 at line 2, column 6)", "save it as UTF-8", "iconv"]),
    "latin1_value": ("trainer:\n  experiment_name: caf\xe9\n".encode("latin-1"), ["is not UTF-8 text", "line 2"]),
    "utf16": ("data:\n  train_batch_size: 8\n".encode("utf-16"), ["is UTF-16 text; save it as UTF-8"]),
    "binary_junk": (bytes(range(256)) * 4, ["is a binary file", "give the YAML file"]),
    "junk_without_nul": (b"\x89PNG\r\n\x1a\n\xff\xd8\xff", ["is not UTF-8 text"]),
    "tab_indent": (b"data:\n\ttrain_batch_size: 8\n", ["not valid YAML at line 2", "indent with spaces, not tabs"]),
    "duplicate_key": (b"actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1e-6\n      lr: 2e-6\n",
                      ["at line 5", "key 'lr' is given twice (first at line 4); keep one of them"]),
    "duplicate_section": (b"data:\n  train_batch_size: 8\ntrainer:\n  nnodes: 1\ndata:\n  seed: 2\n",
                          ["key 'data' is given twice (first at line 1)"]),
    "unclosed_list": (b"trainer:\n  logger: [console, jsonl\n", ["not valid YAML at line", "close the [list] or {mapping}"]),
    "python_tag": (b"data: !!python/object/apply:os.system ['echo hi']\n", ["remove the !tag"]),
    "top_level_list": (b"- data\n- trainer\n", ["holds a list; it must hold a mapping of sections"]),
    "top_level_string": (b"just some words\n", ["holds a single string"]),
    "unhashable_key": (b"? [a, b]\n: 1\n", ["not valid YAML", "unhashable"]),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_unusable_config_file_is_one_line_naming_file_and_fix(name, tmp_path):
    content, parts = BAD_FILES[name]
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(content)
    assert_one_line_error(validate(path), str(path), *parts)


def test_missing_config_file_and_folder_are_one_line_errors(tmp_path):
    assert_one_line_error(validate(tmp_path / "nope.yaml"), "does not exist; check the path")
    assert_one_line_error(validate(tmp_path), "is a folder; give the path of a YAML file in it")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_config_file_is_a_one_line_error(tmp_path):
    path = tmp_path / "locked.yaml"
    path.write_text("data:\n  seed: 1\n")
    path.chmod(0)
    assert_one_line_error(validate(path), "cannot be read (permission denied)")


@pytest.mark.parametrize("content", [b"", b"# only a comment\n", b"\xef\xbb\xbfdata:\n  seed: 3\n", b"data:\n"],
                         ids=["empty", "comment_only", "utf8_bom", "empty_section"])
def test_empty_commented_or_bom_config_file_validates_as_defaults(content, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_bytes(content)
    result = validate(path)
    assert result.returncode == 0, result.stderr
    assert "seed: 3" in result.stdout if b"seed: 3" in content else "seed: 1" in result.stdout


def test_unpaired_interpolation_braces_are_one_problem_naming_the_key(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("trainer:\n  experiment_name: run_${data.seed\n")
    result = validate(path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "trainer.experiment_name: cannot resolve" in result.stderr and "do not pair up" in result.stderr
