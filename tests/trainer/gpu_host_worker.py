"""``python gpu_host_worker.py key=value ...``: ``klppo.commands.main_ppo`` in a process that looks like
one on a GPU host (``tests/gpu_host.py``); run by test_cpu_run_on_a_gpu_host.py."""

import sys

from tests.gpu_host import pretend_gpu_host

if __name__ == "__main__":
    pretend_gpu_host()
    from klppo.commands.main_ppo import main

    sys.exit(main(sys.argv[1:]))
