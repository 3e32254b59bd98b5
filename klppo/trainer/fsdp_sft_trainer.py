"""verl's module path: ``torchrun ... -m klppo.trainer.fsdp_sft_trainer [key=value ...]``, as verl
users type ``-m verl.trainer.fsdp_sft_trainer``, runs ``klppo sft`` (``klppo.commands.main_sft``),
which reads verl's SFT keys (``klppo.config.verl_sft``).

Like ``main_ppo`` beside it, a module of ``trainer/`` that imports a command (``tests/test_architecture.py``
allows it by name).
"""

import sys

from klppo.commands.main_sft import main, run_sft

__all__ = ["main", "run_sft"]

if __name__ == "__main__":
    sys.exit(main())
