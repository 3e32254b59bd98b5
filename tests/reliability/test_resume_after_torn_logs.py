"""A run killed while appending to metrics.jsonl leaves a last line without its newline; resuming
drops that line (it was logged after the checkpoint) instead of failing on it after the run
folder's config.yaml was already written. A damaged line elsewhere is kept as it was."""

import json
import shutil

from bad_input_kit import Workspace
from klppo.cli import main
from klppo.monitoring.jsonl import truncate_jsonl


def test_resuming_after_a_torn_metrics_line_continues_from_the_checkpoint(trained_runs, tiny_model_dir, tmp_path,
                                                                          capsys):
    ws = Workspace(tmp_path / "ws", tiny_model_dir)
    shutil.rmtree(ws.run)
    shutil.copytree(trained_runs / "sft", ws.run)
    with (ws.run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "train/lo')  # killed mid-write at step 2, before its checkpoint
    assert main(ws.sft(None, {"trainer.total_training_steps": 2, "trainer.save_freq": 1})) == 0
    assert "resumed from" in capsys.readouterr().out
    lines = (ws.run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_truncating_keeps_records_up_to_the_step_and_unreadable_middle_lines_as_they_were(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "a": 1.0}\nnot json \xff\n{"step": 2, "a": 2.0}\n{"step": 3, "a": 3.0}\n{"step": 4')
    truncate_jsonl(path, 2)
    assert path.read_bytes() == b'{"step": 1, "a": 1.0}\nnot json \xff\n{"step": 2, "a": 2.0}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
