"""The bad-input corpus, through ``klppo.cli.main`` (the entry point the ``klppo`` executable calls).

Each case (``cases_*.py``) writes a YAML config, data files with the bad value away from row 0,
model folders or a run folder, runs one of ``klppo ppo | sft | rm | validate-config | report``,
and must be refused by the rule users rely on (``bad_input_kit.check_refused``): exit status 2,
at most 3 lines on stderr naming the place and the fix, no traceback, nothing on disk changed.
"""

from __future__ import annotations

import pytest

from bad_input_corpus import CORPUS, SOURCES
from bad_input_kit import Workspace, check_refused, snapshot
from klppo.cli import main


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_a_bad_input_is_refused_with_a_short_error_and_nothing_changed(name, capsys, tmp_path, tiny_model_dir,
                                                                      request):
    case = CORPUS[name]
    ws = Workspace(tmp_path / "ws", tiny_model_dir, lambda: request.getfixturevalue("trained_runs"))
    argv = case.build(ws)
    assert argv[0] == case.command
    before = snapshot(ws.root, tiny_model_dir)
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    check_refused(code, err, case.expect, before, snapshot(ws.root, tiny_model_dir))


def test_the_corpus_holds_at_least_80_distinct_cases_over_every_command():
    """Counted from the registries: each case is its own function, with its own expected texts."""
    assert len(CORPUS) == sum(len(cases) for cases in SOURCES)  # no name twice
    assert len({case.build for case in CORPUS.values()}) == len(CORPUS)
    assert len(CORPUS) >= 80, len(CORPUS)
    per_command = {c: sum(case.command == c for case in CORPUS.values()) for c in ("ppo", "sft", "rm",
                                                                                   "validate-config", "report")}
    assert min(per_command.values()) >= 10, per_command
