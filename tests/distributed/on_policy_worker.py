"""One rank of a PPO run with pi_old recomputed by the scoring forward even where the actor's
update gives it; run by ``torchrun`` from test_on_policy_ranks.py as ``on_policy_worker.py
key=value ...`` (the run itself is ``main_ppo``'s)."""

import sys

from klppo.commands.main_ppo import main
from klppo.run import settings

if __name__ == "__main__":
    settings.on_policy_update = lambda cfg: False
    sys.exit(main(sys.argv[1:]))
