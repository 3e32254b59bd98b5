"""A run's folder is first written once the run is under way, by PPO, SFT and reward-model runs alike.

Everything that can refuse a run happens before its first write: the config's checks, loading
the data and the models, the resume target's check, restoring the checkpoint's state (a data
position that no longer fits the data is found only there), and the first step itself (the
user's reward function first runs while it is scored; validation before training runs first).
Only when that step's metrics are logged does rank 0 write ``config.yaml`` and set the earlier
run's logs aside (a fresh run) or cut them back to the checkpoint's step (a resumed one). So a
run refused at any point before leaves its folder exactly as it was, and a run that fails at a
later step has neither logged nor saved that step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from klppo.distributed import DistEnv, barrier
from klppo.monitoring.jsonl import set_aside, truncate_jsonl


@dataclass
class RunFolder:
    path: Path
    logs: tuple[str, ...]  # the JSON-lines logs this kind of run appends to (metrics.jsonl, ...)
    config_text: Optional[str]  # what config.yaml gets; None (a run built in code) writes none
    env: DistEnv
    resumed_at: Optional[int] = None  # the step of the checkpoint the run restored; None: a fresh run
    opened: bool = False

    def open(self, print_fn: Callable = print) -> None:
        """The run's first writes, once (every rank calls it at the same point; rank 0 writes)."""
        if self.opened:
            return
        self.opened = True
        if self.env.rank == 0:
            self.path.mkdir(parents=True, exist_ok=True)
            if self.config_text is not None:
                (self.path / "config.yaml").write_text(self.config_text)
            if self.resumed_at is None:  # a fresh run never appends to an earlier run's logs
                set_aside(self.path, self.logs, print_fn)
            else:  # steps logged after the checkpoint will be run (and logged) again
                for name in self.logs:
                    truncate_jsonl(self.path / name, self.resumed_at)
        barrier()
