"""read_parquet_rows: up-front checks of the files, and row locations for errors; row counts from the
footers and a sample of the first rows, for sizing estimates."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from klppo.data.parquet import RowSample, parquet_num_rows, read_parquet_rows, read_parquet_sample, row_error
from klppo.errors import UserError


def test_rows_carry_their_file_and_row_index(write_parquet):
    a = write_parquet([{"x": 1}, {"x": 2}], "a.parquet")
    b = write_parquet([{"x": 3}], "b.parquet")
    rows = read_parquet_rows([a, b], ["x"])
    assert [(r["x"], r["_file"], r["_row"]) for r in rows] == [(1, a, 0), (2, a, 1), (3, b, 0)]


def test_a_row_cap_reads_the_first_rows_or_a_seeded_draw_across_files_keeping_where_each_row_is(write_parquet):
    a = write_parquet([{"x": i} for i in range(6)], "a.parquet")
    b = write_parquet([{"x": 6 + i} for i in range(6)], "b.parquet")
    first = read_parquet_rows([a, b], ["x"], RowSample(8))
    assert [r["x"] for r in first] == list(range(8)) and (first[-1]["_file"], first[-1]["_row"]) == (b, 1)
    drawn = read_parquet_rows([a, b], ["x"], RowSample(5, seed=3))
    xs = [r["x"] for r in drawn]
    assert len(set(xs)) == 5 and xs == sorted(xs) and xs != list(range(5))  # in file order, not the first five
    assert all(r["_row"] == r["x"] - (6 if r["_file"] == b else 0) for r in drawn)
    assert [r["x"] for r in read_parquet_rows([a, b], ["x"], RowSample(5, seed=3))] == xs  # the same draw again
    assert [r["x"] for r in read_parquet_rows([a, b], ["x"], RowSample(5, seed=4))] != xs
    for everything in (RowSample(-1), RowSample(0), RowSample(12, seed=3), RowSample(99)):  # verl: <= 0 is every row
        assert len(read_parquet_rows([a, b], ["x"], everything)) == 12


def test_missing_file_is_a_user_error_naming_the_file_and_the_key(tmp_path):
    with pytest.raises(UserError, match=r"data file '.*nope.parquet' not found; check data.train_files"):
        read_parquet_rows(str(tmp_path / "nope.parquet"), ["x"])


def test_missing_second_file_fails_before_reading_rows(write_parquet, tmp_path):
    good = write_parquet([{"x": 1}])
    with pytest.raises(UserError, match="missing.parquet"):
        read_parquet_rows([good, str(tmp_path / "missing.parquet")], ["x"])


def test_garbage_bytes_are_reported_as_not_parquet(tmp_path):
    path = tmp_path / "garbage.parquet"
    path.write_bytes(b"this is not parquet at all" * 10)
    with pytest.raises(UserError, match=r"'.*garbage.parquet' is not a readable Parquet file"):
        read_parquet_rows(str(path), ["x"])


def test_file_with_no_rows_is_a_user_error(tmp_path):
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"x": pa.array([], type=pa.int64())}), path)
    with pytest.raises(UserError, match="empty.parquet' has no rows"):
        read_parquet_rows(str(path), ["x"])


def test_missing_column_error_lists_the_columns_present(write_parquet):
    path = write_parquet([{"question": "q", "data_source": "d"}])
    with pytest.raises(UserError) as err:
        read_parquet_rows(path, ["data_source", "prompt"])
    msg = str(err.value)
    assert "no column 'prompt'" in msg and "question, data_source" in msg and "data.prompt_key" in msg


def test_empty_file_list_is_a_user_error():
    with pytest.raises(UserError, match="data.train_files"):
        read_parquet_rows([], ["x"])


def test_row_error_says_file_row_column_problem_and_fix():
    err = row_error({"_file": "x.parquet", "_row": 3}, "prompt", "bad value", "fix it")
    assert isinstance(err, UserError) and isinstance(err, ValueError)
    assert str(err) == "x.parquet row 3, column 'prompt': bad value; fix it"


def test_map_columns_come_back_as_dicts(tmp_path):
    path = tmp_path / "map.parquet"
    table = pa.table({"extra_info": pa.array([[("a", 1), ("b", 2)]], type=pa.map_(pa.string(), pa.int64()))})
    pq.write_table(table, path)
    assert read_parquet_rows(str(path), ["extra_info"])[0]["extra_info"] == {"a": 1, "b": 2}


def test_a_sample_shares_its_rows_over_the_files_and_holds_only_the_asked_columns(write_parquet):
    a = write_parquet([{"x": i, "y": "a"} for i in range(5)], "a.parquet")
    b = write_parquet([{"x": 10 + i, "y": "b"} for i in range(3)], "b.parquet")
    rows = read_parquet_sample([a, b], ["x", "absent"], 4)  # 2 per file, each file's first rows
    assert rows == [{"x": 0, "_file": a, "_row": 0}, {"x": 1, "_file": a, "_row": 1},
                    {"x": 10, "_file": b, "_row": 0}, {"x": 11, "_file": b, "_row": 1}]
    assert parquet_num_rows([a, b]) == 8


def test_row_counts_of_a_missing_file_name_it(tmp_path):
    with pytest.raises(UserError, match=r"data file '.*nope.parquet' not found"):
        parquet_num_rows(str(tmp_path / "nope.parquet"))
