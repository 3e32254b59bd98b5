#!/usr/bin/env bash
# Every GPU measurement of klppo in one call of under 8 minutes (benchmarks/gpu_all.py says what and
# why): the smoke test, the actor update's MFU (with and without gradient checkpointing), klppo vs
# TRL where benchmarks/vs_trl.py exists, the packed attentions, HF decoding; each under a time cap,
# its log and figures in $OUT (default ./gpu_out): summary.txt, logs.txt, figures.json.
#
#   bash benchmarks/gpu_all.sh              # on the GPU machine, from the repository root
#   bash benchmarks/gpu_all.sh --cpu        # every step on tiny shapes on CPU
#   bash benchmarks/gpu_all.sh --dry-run    # the steps, their caps and the deadline
#
# Through the device tool: run(command="bash benchmarks/gpu_all.sh", carry=[".whl"] where .whl/ holds
# wheels, timeout_s=540). Exit status: 0 every step ran to its end, 1 one failed or hit its cap,
# 2 no GPU without --cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHON="${PYTHON:-python3}"
export OUT="${OUT:-$PWD/gpu_out}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # klppo from this tree, no install
export TOKENIZERS_PARALLELISM=false KLPPO_QUIET=1 TQDM_DISABLE=1 PYTHONUNBUFFERED=1
unset RANK WORLD_SIZE LOCAL_RANK  # one process per step: FSDP2 over a group of one
# Wheels carried in .whl/ (the GPU machine reaches no registry): installed into /tmp/site, all but
# TRL's, which benchmarks/vs_trl.py installs itself, one release per folder (two trl wheels in one
# pip call would stop the whole install).
if [[ " $* " != *" --dry-run "* ]] && compgen -G ".whl/*.whl" >/dev/null; then
    mapfile -t wheels < <(ls .whl/*.whl | grep -v '/trl-' || true)
    if (( ${#wheels[@]} )); then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "${wheels[@]}"
        export PYTHONPATH="/tmp/site:$PYTHONPATH"
    fi
fi
exec "$PYTHON" benchmarks/gpu_all.py "$@"
