#!/usr/bin/env bash
# Set up (if needed) and run the test suite; extra arguments go to pytest.
# --vllm: the vLLM tests instead (pytest -m vllm), in .venv-vllm (scripts/setup.sh --vllm).
# The default suite runs in KLPPO_TEST_WORKERS processes (default 2; 0 = one process), a test
# file per process (pytest-xdist, --dist loadfile: a file's shared runs are made once): most tests
# spend their time in single-threaded work (imports, subprocesses, small kernels), so two files
# side by side take about 20% less time on 2 cores than one after the other. The vLLM tests run in
# one process: one engine per process, and an engine takes gigabytes.
set -euo pipefail
args=()
vllm=0
for arg in "$@"; do
    if [ "$arg" = "--vllm" ]; then vllm=1; else args+=("$arg"); fi
done
if [ "$vllm" = "1" ]; then
    KLPPO_VLLM=1 . "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
    exec python -m pytest -q -m vllm ${args[@]+"${args[@]}"}
fi
. "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
workers=${KLPPO_TEST_WORKERS:-2}
parallel=()
if [ "$workers" != "0" ]; then
    parallel=(-n "$workers" --dist loadfile)
    # One compute thread per worker: two workers of two threads each on two cores made the suite ~20%
    # slower (measured: 139 s against 110 s for four of its training-run files).
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
exec python -m pytest -q ${parallel[@]+"${parallel[@]}"} ${args[@]+"${args[@]}"}
