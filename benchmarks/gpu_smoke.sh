#!/usr/bin/env bash
# klppo's GPU smoke test: one online PPO run through the paths a CPU run cannot show (bf16,
# packing with the attention a run chooses (torch's varlen kernel on CUDA), offload_policy, a reward model scoring
# validation on the device, save and exact resume, peak memory, MFU, host syncs); one line
# per check, PASS / FAIL / SKIP with its figure and seconds. See benchmarks/gpu_smoke.py.
#
#   bash benchmarks/gpu_smoke.sh                 # one CUDA GPU, about 100 s on an H200
#   bash benchmarks/gpu_smoke.sh --budget-s 150  # and check that it kept to 150 s (gpu_all.sh does)
#   bash benchmarks/gpu_smoke.sh --cpu           # tiny shape on CPU, under a minute
#   bash benchmarks/gpu_smoke.sh --keep DIR      # keep the model, data and runs in DIR
#
# Exit status: 0 all checks passed (or were skipped), 1 a check failed, 2 no GPU without --cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
# The exact-resume check runs the same steps twice under torch.use_deterministic_algorithms: cuBLAS
# must pick the same kernels both times (its workspace config, set before CUDA starts), and the packed
# attention is then the math backend's (klppo.models.attention.PACKED_DETERMINISTIC); flash-attn's own
# kernels, where installed, read FLASH_ATTENTION_DETERMINISTIC.
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
export FLASH_ATTENTION_DETERMINISTIC="${FLASH_ATTENTION_DETERMINISTIC:-1}"
export TOKENIZERS_PARALLELISM=false KLPPO_QUIET=1 TQDM_DISABLE=1
unset RANK WORLD_SIZE LOCAL_RANK  # one process: FSDP2 over a group of one
exec "${PYTHON:-python3}" benchmarks/gpu_smoke.py "$@"
