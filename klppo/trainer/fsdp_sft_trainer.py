"""verl's module path: ``torchrun ... -m klppo.trainer.fsdp_sft_trainer [key=value ...]``, as verl
users type ``-m verl.trainer.fsdp_sft_trainer``, runs ``klppo sft`` (``klppo.commands.main_sft``),
which reads verl's SFT keys (``klppo.config.verl_sft``). As verl's, it starts from verl's
``sft_trainer`` config where the command line names no other: verl's SFT defaults (betas
0.9/0.95, 10% warm-up, cosine, four epochs, ...), not ``klppo sft``'s own.

Like ``main_ppo`` beside it, a module of ``trainer/`` that imports a command (``tests/test_architecture.py``
allows it by name).
"""

import sys

import klppo.commands.main_sft as main_sft
from klppo.commands.main_sft import run_sft

__all__ = ["main", "run_sft"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not any(arg in ("--config", "-c") or arg.startswith(("--config=", "-c=", "--config-name")) for arg in argv):
        argv = ["--config-name", "sft_trainer", *argv]  # verl's fsdp_sft_trainer: config_name="sft_trainer"
    return main_sft.main(argv)


if __name__ == "__main__":
    sys.exit(main())
