#!/usr/bin/env bash
# Set up (if needed) and run the test suite; extra arguments go to pytest.
# --vllm: the vLLM tests instead (pytest -m vllm), in .venv-vllm (scripts/setup.sh --vllm).
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
exec python -m pytest -q ${args[@]+"${args[@]}"}
