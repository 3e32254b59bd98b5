#!/usr/bin/env bash
# Build the environments that benchmarks/vs_trl.py runs TRL in; klppo itself never needs TRL.
#
#   bash benchmarks/setup_trl.sh          # both: .venv-trl (TRL 1.16, GRPOTrainer) and .venv-trl-ppo (TRL 1.12)
#   bash benchmarks/setup_trl.sh grpo     # only .venv-trl
#   bash benchmarks/setup_trl.sh ppo      # only .venv-trl-ppo
#
# Two environments because one cannot hold two TRL releases: 1.16 is the one compared for
# GRPO, and 1.12 is the last release with a PPOTrainer (trl.experimental.ppo; 1.16 has none).
# Both get the same torch and transformers as klppo's .venv, so HF generate and the model code
# are the same on both sides of the comparison. Safe to run again: it installs what is missing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${KLPPO_TORCH_VERSION:-2.13.0}
# klppo's transformers where its .venv has one, so both sides run the same model code.
TRANSFORMERS_VERSION=${TRL_TRANSFORMERS_VERSION:-$(.venv/bin/python -c 'import transformers; print(transformers.__version__)' 2>/dev/null || echo 5.25.0)}
TRL_GRPO_VERSION=1.16.0
TRL_PPO_VERSION=1.12.0

build() {  # build VENV TRL_VERSION
    local venv=$1 trl=$2
    [ -x "$venv/bin/python" ] || { echo "[setup_trl] creating $venv with $($PYTHON --version)"; "$PYTHON" -m venv "$venv"; }
    if "$venv/bin/python" -c "import trl, sys; sys.exit(trl.__version__ != '$trl')" >/dev/null 2>&1; then
        echo "[setup_trl] $venv: trl $trl already installed"
        return
    fi
    echo "[setup_trl] $venv: torch==$TORCH_VERSION, transformers==$TRANSFORMERS_VERSION, trl==$trl"
    "$venv/bin/python" -m pip install -q "torch==$TORCH_VERSION" ${KLPPO_TORCH_INDEX_URL:+--index-url "$KLPPO_TORCH_INDEX_URL"}
    # pyarrow for the prompts Parquet; tokenizers/safetensors come with transformers
    "$venv/bin/python" -m pip install -q "transformers==$TRANSFORMERS_VERSION" "trl==$trl" pyarrow
    "$venv/bin/python" -c "import trl, transformers, torch; print('[setup_trl] $venv: trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
}

which=${1:-all}
case "$which" in
    all) build .venv-trl "$TRL_GRPO_VERSION"; build .venv-trl-ppo "$TRL_PPO_VERSION" ;;
    grpo) build .venv-trl "$TRL_GRPO_VERSION" ;;
    ppo) build .venv-trl-ppo "$TRL_PPO_VERSION" ;;
    *) echo "usage: bash benchmarks/setup_trl.sh [all|grpo|ppo]" >&2; exit 2 ;;
esac
