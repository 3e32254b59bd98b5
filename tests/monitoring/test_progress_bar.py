"""The progress bar: ETA over steps, the current phase in its postfix, silent under CI."""

import io

from klppo.monitoring.progress import Progress, is_quiet


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def run_two_steps(progress: Progress) -> None:
    for _ in range(2):
        with progress.phase("gen", total=3) as bar:
            for _ in range(3):
                bar.update()
        with progress.phase("update_actor"):
            pass
        progress.advance(postfix={"score": 0.5})
    progress.close()


def test_quiet_under_ci_or_klppo_quiet_or_without_a_terminal():
    assert is_quiet({"CI": "true"}, FakeTerminal())
    assert is_quiet({"KLPPO_QUIET": "1"}, FakeTerminal())
    assert is_quiet({}, io.StringIO())
    assert not is_quiet({}, FakeTerminal())


def test_progress_prints_nothing_at_all_under_ci(monkeypatch, capsys):
    monkeypatch.setenv("CI", "true")
    terminal = FakeTerminal()
    run_two_steps(Progress(total=2, file=terminal))
    assert terminal.getvalue() == ""
    assert capsys.readouterr() == ("", "")


def test_progress_shows_steps_eta_and_the_running_phase_on_a_terminal(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("KLPPO_QUIET", raising=False)
    terminal = FakeTerminal()
    progress = Progress(total=4, initial=2, desc="ppo", file=terminal)
    with progress.phase("gen"):
        assert "phase=gen" in terminal.getvalue()
    run_two_steps(progress)
    shown = terminal.getvalue()
    assert "ppo" in shown and "4/4" in shown and "score=0.5" in shown and "<" in shown  # elapsed<remaining
