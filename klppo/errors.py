"""The one error type for mistakes a user can make and fix (config, data, model folders).

The CLI prints a ``UserError`` as one line, without a traceback, and exits with status 2.
The message says what was wrong, where (file, row, column or config key) and how to fix it.
``reading`` turns whatever a loading library raises while reading a user's file into one.
"""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class UserError(ValueError):
    """A problem in the user's config, data or files, with a message that names the fix.

    ``raised_on_every_rank``: every rank of the run stops with this error at the same point
    (``klppo.distributed.same_on_every_rank`` agreed on it), so the ranks may leave their
    process group in step, as after a success.
    """

    raised_on_every_rank: bool = False


def reason(exc: BaseException) -> str:
    """A short, user-facing account of why reading a file failed (one line, no library advice)."""
    if isinstance(exc, pickle.UnpicklingError):
        # torch's weights_only message advises loading with weights_only=False "if you trust the
        # source"; that is exactly what must not be done with a file of unknown origin.
        return "it holds something other than plain data"
    if isinstance(exc, EOFError):
        return "the file ends early"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    text = str(exc).strip().splitlines()
    line = text[0] if text else type(exc).__name__
    return line if len(line) <= 160 else line[:157] + "..."


@contextmanager
def reading(path: str | Path, what: str, fix: str) -> Iterator[None]:
    """Inside this block, any error becomes ``UserError("<what> '<path>' cannot be read (...); <fix>")``.

    Loading libraries raise almost anything for a damaged file (safetensors' own error type,
    torch's RuntimeError for a torn zip, pickle's UnpicklingError, OSError, EOFError, KeyError),
    so the block catches ``Exception``; keep it around the read alone, so that only the read's
    errors are reported as the user's file.
    """
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":  # the machine's, not the file's
            raise
        raise UserError(f"{what} '{path}' cannot be read ({reason(exc)}); {fix}") from exc
