"""Reading Parquet files into rows, with errors that name the file, row and column.

This is the one place klppo opens data files. Every reader checks up front that each file
exists, is Parquet, has rows and has the columns it needs, so a typo in
``data.train_files`` or a missing column fails before any model loads.

Rows are plain Python dicts (``pyarrow.Table.to_pylist``); each carries two extra keys,
``"_file"`` (the path as given) and ``"_row"`` (0-based row index within that file, as
pandas and pyarrow count), so that later validation can say exactly where a bad value is.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from klppo.errors import UserError


def as_file_list(files: str | Sequence[str]) -> list[str]:
    """``"a.parquet"`` or ``["a.parquet", "b.parquet"]`` -> a non-empty list of paths."""
    paths = [files] if isinstance(files, (str, Path)) else list(files)
    paths = [str(p) for p in paths]
    if not paths or any(not p for p in paths):
        raise UserError(
            f"no data file given (got {files!r}); set data.train_files to a Parquet file or a list of them"
        )
    return paths


def _require_file(path: str) -> None:
    if not Path(path).is_file():
        raise UserError(f"data file '{path}' not found; check data.train_files (and data.val_files)")


def _not_parquet(path: str, e: Exception) -> UserError:
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return UserError(
        f"data file '{path}' is not a readable Parquet file ({first_line}); "
        "write it with pyarrow.parquet.write_table or pandas.DataFrame.to_parquet"
    )


def _read_table(path: str, required: Sequence[str]) -> pa.Table:
    """Open one file and check it exists, is Parquet, has rows and has ``required`` columns."""
    _require_file(path)
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:  # ArrowInvalid, ArrowIOError, ArrowNotImplementedError, ...
        raise _not_parquet(path, e) from e
    if table.num_rows == 0:
        raise UserError(f"data file '{path}' has no rows; point data.train_files at a file with data")
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise UserError(
            f"data file '{path}' has no column '{missing[0]}' (its columns: {', '.join(table.column_names)}); "
            "add that column, or point the key option (data.prompt_key, data.response_key) at one of these"
        )
    return table


def parquet_columns(files: str | Sequence[str]) -> set[str]:
    """The column names of the files that exist and are Parquet (the readers report the rest)."""
    names: set[str] = set()
    for path in as_file_list(files):
        try:
            names.update(pq.read_schema(path).names)
        except (pa.ArrowException, OSError):
            continue
    return names


def _plain(value: Any) -> Any:
    """Turn Arrow map columns (read back as lists of (key, value) pairs) into dicts, recursively."""
    if isinstance(value, list) and value and all(isinstance(v, tuple) and len(v) == 2 for v in value):
        return {k: _plain(v) for k, v in value}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class RowSample:
    """Read at most ``max_samples`` rows of the files (verl's ``data.train_max_samples`` /
    ``val_max_samples``; -1, 0 or more than the files hold: every row): a draw without replacement
    seeded by ``seed`` (verl draws at random when ``data.shuffle`` is on), or the first rows when
    ``seed`` is None. The rows keep the files' order; the draw comes before any check or filter."""

    max_samples: int = -1
    seed: int | None = None

    @classmethod
    def drawn(cls, max_samples: int, shuffle: bool, seed: int) -> RowSample:
        """verl's rule for its data configs: a draw seeded by ``seed`` where ``shuffle`` is on, else the first rows."""
        return cls(max_samples, seed if shuffle else None)

    def rows(self, total: int) -> list[int] | None:
        """The global indices read, in order; None for every row."""
        if self.max_samples <= 0 or self.max_samples >= total:
            return None
        if self.seed is None:
            return list(range(self.max_samples))
        return sorted(random.Random(self.seed).sample(range(total), self.max_samples))


EVERY_ROW = RowSample()


def read_parquet_rows(files: str | Sequence[str], required: Sequence[str], sample: RowSample = EVERY_ROW) -> list[dict]:
    """Read one or several Parquet files into a list of row dicts (``sample``'s rows of them).

    Every file is checked (exists, Parquet, non-empty, has ``required``) before any rows are
    converted. Each row gets ``"_file"`` (path) and ``"_row"`` (0-based index in its file).
    """
    paths = as_file_list(files)
    tables = [(path, _read_table(path, required)) for path in paths]
    picked = sample.rows(sum(table.num_rows for _, table in tables))
    rows: list[dict] = []
    start = 0
    for path, table in tables:
        mine = range(table.num_rows) if picked is None else [i - start for i in picked
                                                              if start <= i < start + table.num_rows]
        start += table.num_rows
        taken = table if picked is None else table.take(list(mine))
        for i, row in zip(mine, taken.to_pylist()):
            row = {k: _plain(v) for k, v in row.items()}
            row["_file"], row["_row"] = path, i
            rows.append(row)
    return rows


def _parquet_file(path: str) -> pq.ParquetFile:
    _require_file(path)
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise _not_parquet(path, e) from e


def parquet_num_rows(files: str | Sequence[str]) -> int:
    """Rows in all the files, from their Parquet footers: no row is read."""
    return sum(_parquet_file(path).metadata.num_rows for path in as_file_list(files))


def read_parquet_sample(files: str | Sequence[str], columns: Sequence[str], rows: int) -> list[dict]:
    """Up to ``rows`` rows, shared evenly over the files (each file's first rows), as ``read_parquet_rows``
    gives them (with ``"_file"`` and ``"_row"``) but holding only those of ``columns`` the files have.

    Only the first record batch of each file is decoded, so a sample of a large file costs what
    its first rows cost (sizing estimates, ``klppo plan``), never the whole file.
    """
    paths = as_file_list(files)
    per_file = max(1, -(-rows // len(paths)))  # ceil: every file contributes
    sample: list[dict] = []
    for path in paths:
        handle = _parquet_file(path)
        wanted = [c for c in columns if c in handle.schema_arrow.names]
        batch = next(handle.iter_batches(batch_size=per_file, columns=wanted), None)
        for i, row in enumerate(batch.to_pylist() if batch is not None else []):
            row = {k: _plain(v) for k, v in row.items()}
            row["_file"], row["_row"] = path, i
            sample.append(row)
    return sample[:rows]


def describe_files(files: str | Sequence[str]) -> str:
    """``"x.parquet"`` for one file, ``"2 files (a.parquet, b.parquet)"`` for several (log lines)."""
    paths = as_file_list(files)
    if len(paths) == 1:
        return paths[0]
    return f"{len(paths)} files ({', '.join(paths)})"


def row_place(row: dict) -> str:
    """``"x.parquet row 3"``: where a row from ``read_parquet_rows`` is (its file, 0-based row)."""
    return f"{row.get('_file', '<data>')} row {row.get('_row', '?')}"


def row_error(row: dict, column: str, problem: str, fix: str) -> UserError:
    """``"x.parquet row 3, column 'prompt': <problem>; <fix>"`` for a row from ``read_parquet_rows``."""
    return UserError(f"{row_place(row)}, column '{column}': {problem}; {fix}")


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr`` cut to ``limit`` characters, for quoting a bad value in a one-line error."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
