"""One rank of a PPO run whose ranks see different free memory; run by ``torchrun`` from
test_plan_check_ranks.py as ``plan_check_worker.py <out_dir> key=value ...``.

Rank 0 sees 1 TiB free, rank 1 1 MiB (``available_bytes`` replaced). Each rank writes its exit
status, what it printed and its error to ``<out_dir>/rank<R>.json``.
"""

import contextlib
import io
import json
import os
import sys
from pathlib import Path

from klppo.commands.main_ppo import main
from klppo.monitoring import memory

RANK = int(os.environ["RANK"])
memory.available_bytes = lambda device: 2**40 if RANK == 0 else 2**20

out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = main(sys.argv[2:])
Path(sys.argv[1], f"rank{RANK}.json").write_text(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue()}))
sys.exit(code)
