"""What every entry point shares: user errors as one line, quiet third-party logging."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from klppo.errors import UserError


def quiet_libraries() -> None:
    """Silence transformers' progress bars and advisory warnings; klppo prints its own progress."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def run_cli(action: Callable[[], object]) -> int:
    """Run ``action``; a ``UserError`` becomes ``error: <message>`` on stderr and exit status 2."""
    try:
        action()
    except UserError as exc:
        # One write: ranks that stop on the same error share torchrun's stderr, and print's
        # separate write of the newline would let their lines run together.
        sys.stderr.write(f"error: {exc}\n")
        sys.stderr.flush()
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def parse_config_args(argv: list[str] | None, prog: str, description: str) -> argparse.Namespace:
    """``--config x.yaml`` and ``key.path=value`` overrides, as every training command takes them."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", "-c", help="YAML config (verl key names)")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. trainer.total_training_steps=10")
    return parser.parse_args(argv)
