"""The machinery of the bad-input corpus (``cases_*.py``, run by ``test_bad_input_corpus.py``).

A case writes its inputs into a fresh ``Workspace`` (a YAML config file, Parquet files of
eight rows with the bad value away from row 0, model folders, an earlier run's folder) and
returns the command line after ``klppo``. ``check_refused`` is the rule every case must pass:
exit status 2, at most 3 lines on stderr, the first ``error: ...``, no traceback, the texts
that name the place and the fix, and every byte of the workspace (and the shared tiny model)
as it was.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROWS = 8
DROP = object()  # a row change that removes the key (the column is null in that row)


@dataclass(frozen=True)
class Case:
    command: str  # ppo, sft, rm, validate-config or report
    build: Callable[["Workspace"], list[str]]  # writes the inputs; returns argv after `klppo`
    expect: tuple[str, ...]  # texts the error must hold: the place (file, row, column, key) and the fix


def register(registry: dict[str, Case], command: str, *expect: str):
    """Decorator: ``@register(CASES, "ppo", "row 5", ...)`` over ``def name(ws) -> argv`` adds case ``name``."""

    def add(build: Callable[["Workspace"], list[str]]) -> Callable:
        assert build.__name__ not in registry, f"case {build.__name__} is defined twice"
        assert expect, f"case {build.__name__} names no place or fix"
        registry[build.__name__] = Case(command, build, expect)
        return build

    return add


# ---- rows ----

def ppo_row(i: int) -> dict:
    return {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + 3?"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + 3)},
            "extra_info": {"index": i}, "responses": [f"{i} + 3 = {i + 3} #### {i + 3}", f"{i} + 3 = 1 #### 1"]}


def sft_row(i: int) -> dict:
    return {"prompt": [{"role": "user", "content": f"What is {i} + 3?"}], "response": f"{i} + 3 = {i + 3}"}


def ranked_row(i: int) -> dict:
    return {"prompt": [{"role": "user", "content": f"Rate {i} and 3."}],
            "responses": [f"{i} is great", f"{i} is fine", f"{i} is bad"], "ranking": [0, 1, 2]}


def rows(make: Callable[[int], dict], bad_at: int | None = None, **changes: Any) -> list[dict]:
    """``ROWS`` rows from ``make``; row ``bad_at`` gets ``changes`` (``DROP`` removes a key)."""
    out = []
    for i in range(ROWS):
        row = make(i)
        if i == bad_at:
            row.update(changes)
            row = {k: v for k, v in row.items() if v is not DROP}
        out.append(row)
    return out


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    if value is DROP:
        tree.pop(leaf, None)
    else:
        tree[leaf] = value


# ---- the workspace ----

class Workspace:
    """A folder of inputs for one case, and the tiny model folder every case shares (read-only)."""

    def __init__(self, root: Path, model: Path, trained_runs: Callable[[], Path] | None = None) -> None:
        self.root, self.model, self._trained_runs = root, model, trained_runs
        self.run = root / "run"  # an earlier run's folder: a refused command must leave it as it was
        self.run.mkdir(parents=True)
        (self.run / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.0}\n{"step": 2, "train/loss": 1.5}\n')
        (self.run / "config.yaml").write_text("trainer:\n  total_training_steps: 2\n")

    def write(self, name: str, content: str | bytes) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return path

    def parquet(self, table_rows: list[dict], name: str = "train.parquet") -> Path:
        """Every key of any row is a column (null where a row lacks it; from_pylist reads row 0's keys only)."""
        path = self.root / name
        columns = list(dict.fromkeys(k for row in table_rows for k in row))
        pq.write_table(pa.Table.from_pylist([{k: row.get(k) for k in columns} for row in table_rows]), path)
        return path

    def model_copy(self, name: str = "model") -> Path:
        return Path(shutil.copytree(self.model, self.root / name))

    def model_with_new_special_tokens(self, **tokens: str) -> Path:
        """A copy of the model whose tokenizer got ``tokens`` (e.g. ``eos_token="<|end|>"``) as new special
        tokens, so their ids lie past the model's embedding rows (no resize)."""
        from transformers import AutoTokenizer

        model = self.model_copy()
        tokenizer = AutoTokenizer.from_pretrained(model)
        tokenizer.add_special_tokens(tokens)
        tokenizer.save_pretrained(model)
        return model

    def trained(self, kind: str, into: str | None = None) -> Path:
        """A copy of a finished 1-step ``kind`` run ("sft", "rm" or "ppo") with its checkpoint at step 1;
        ``into="run"`` makes it the earlier run this case's command continues."""
        assert self._trained_runs is not None, "this workspace has no trained runs"
        target = self.root / (into or f"trained_{kind}")
        if target.exists():
            shutil.rmtree(target)
        return Path(shutil.copytree(self._trained_runs() / kind, target))

    def shift_data_position(self, checkpoint: Path, position: int) -> None:
        """Make ``checkpoint`` stop at batch ``position`` of its epoch, as a run over more data would
        (its state is otherwise whole and sound)."""
        import torch

        path = checkpoint / "trainer_state.pt"
        state = torch.load(path, weights_only=True)
        state["data"]["position"] = position
        torch.save(state, path)

    def config(self, tree: dict, changes: dict | None = None, name: str = "config.yaml") -> Path:
        """Write ``tree`` with dotted ``changes`` (``DROP`` removes a key) as a YAML file."""
        for dotted, value in (changes or {}).items():
            set_dotted(tree, dotted, value)
        return self.write(name, yaml.safe_dump(tree, sort_keys=False))

    # -- the three training commands, each from a YAML file --

    def ppo(self, train: Path | list[dict] | None = None, changes: dict | None = None, *overrides: str) -> list[str]:
        train = self._data(train, ppo_row)
        tree = {"data": {"train_files": str(train), "train_batch_size": 4, "max_prompt_length": 64,
                         "max_response_length": 16},
                "actor_rollout_ref": {"model": {"path": str(self.model)}, "rollout": {"name": "offline", "n": 2},
                                      "actor": {"ppo_mini_batch_size": 2}},
                "trainer": self._trainer()}
        return ["ppo", "--config", str(self.config(tree, changes)), *overrides]

    def sft(self, train: Path | list[dict] | None = None, changes: dict | None = None, *overrides: str) -> list[str]:
        train = self._data(train, sft_row)
        tree = {"data": {"train_files": str(train), "train_batch_size": 4, "micro_batch_size_per_gpu": 2,
                         "max_length": 96},
                "model": {"partial_pretrain": str(self.model)}, "trainer": self._trainer()}
        return ["sft", "--config", str(self.config(tree, changes)), *overrides]

    def rm(self, train: Path | list[dict] | None = None, changes: dict | None = None, *overrides: str) -> list[str]:
        train = self._data(train, ranked_row)
        tree = {"data": {"train_files": str(train), "train_batch_size": 4, "micro_batch_size_per_gpu": 2,
                         "max_prompt_length": 64, "max_response_length": 16},
                "model": {"partial_pretrain": str(self.model)}, "trainer": self._trainer()}
        return ["rm", "--config", str(self.config(tree, changes)), *overrides]

    def _data(self, train: Path | list[dict] | None, make: Callable[[int], dict]) -> Path:
        if isinstance(train, Path):
            return train
        return self.parquet(train if train is not None else rows(make))

    def _trainer(self) -> dict:
        return {"default_local_dir": str(self.run), "device": "cpu", "logger": [], "total_training_steps": 1}


# ---- the rule ----

def snapshot(*folders: Path) -> dict[str, str]:
    """Every file's bytes (as a hash) and every folder under ``folders``: what "nothing changed" compares."""
    seen = {}
    for folder in folders:
        if not folder.exists():
            continue
        for path in sorted(folder.rglob("*")):
            key = str(path)
            if path.is_dir():
                seen[key] = "folder"
            elif path.is_file():
                seen[key] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                seen[key] = "other"
    return seen


def check_refused(code: int, err: str, expect: tuple[str, ...] | list[str], before: dict, after: dict) -> None:
    assert "Traceback" not in err, err[-3000:]
    assert code == 2, (code, err[-3000:])
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[0].startswith("error: ") and len(lines) <= 3, err[-3000:]
    for text in expect:
        assert text in err, f"{text!r} not in {err!r}"
    changed = sorted(set(before.items()) ^ set(after.items()))
    assert not changed, f"files changed: {changed[:5]}"
