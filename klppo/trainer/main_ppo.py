"""verl's module path: ``python -m klppo.trainer.main_ppo --config x.yaml [key=value ...]``, as verl
users type ``python -m verl.trainer.main_ppo``, runs ``klppo ppo`` (``klppo.commands.main_ppo``).

The one module of ``trainer/`` that imports a command (``tests/test_architecture.py`` allows it by
name): the command lives with the others, this path stays for the people who know verl's.
"""

import sys

from klppo.commands.main_ppo import main, run_ppo

__all__ = ["main", "run_ppo"]

if __name__ == "__main__":
    sys.exit(main())
