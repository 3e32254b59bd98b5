"""What every entry point shares: user errors as one line, quiet third-party logging."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, TypeVar

from klppo.errors import UserError

T = TypeVar("T")


def quiet_libraries() -> None:
    """Silence transformers' progress bars and advisory warnings; klppo prints its own progress."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def show_notes(notes: list[str], print_fn: Callable = print) -> None:
    """A config's warnings, printed once: by the process torchrun made rank 0 (or the only one),
    before any process group exists."""
    if int(os.environ.get("RANK", "0")) == 0:
        for note in notes:
            print_fn(note)


def loaded_with_notes(load: Callable[[list[str]], T], print_fn: Callable = print) -> T:
    """``load(notes)``'s config, its warnings (what it appended to ``notes``) shown first (``show_notes``)."""
    notes: list[str] = []
    cfg = load(notes)
    show_notes(notes, print_fn)
    return cfg


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
    add_hydra_config_args(parser)
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. trainer.total_training_steps=10")
    return parser.parse_intermixed_args(argv)  # options anywhere among the overrides


def add_hydra_config_args(parser: argparse.ArgumentParser) -> None:
    """verl's (Hydra's) way to name the config: ``--config-path DIR --config-name NAME``
    (``klppo.config.command_line_config`` turns them into the file)."""
    parser.add_argument("--config-path", help="folder of --config-name (Hydra's form, as verl's scripts pass it)")
    parser.add_argument("--config-name", help="YAML file in --config-path, without .yaml, or verl's ppo_trainer / "
                        "ppo_megatron_trainer")
