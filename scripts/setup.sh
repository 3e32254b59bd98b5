#!/usr/bin/env bash
# Create .venv (if missing) and install klppo into it, with PyTorch's CPU build where no GPU is
# present. Safe to run again: it installs only what is missing. Sourced by demo.sh and test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${KLPPO_TORCH_VERSION:-2.13.0}

if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate

if ! python -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "[setup] GPU found: installing torch==$TORCH_VERSION (CUDA build)"
        python -m pip install -q "torch==$TORCH_VERSION"
    else
        # No GPU: the CPU build. Where the default index serves only CUDA builds, point
        # KLPPO_TORCH_INDEX_URL at PyTorch's CPU wheel index.
        echo "[setup] no GPU: installing torch==$TORCH_VERSION (CPU build)"
        python -m pip install -q "torch==$TORCH_VERSION" ${KLPPO_TORCH_INDEX_URL:+--index-url "$KLPPO_TORCH_INDEX_URL"}
    fi
fi

if ! python -c "import klppo, pytest, transformers, pyarrow" >/dev/null 2>&1 || [ pyproject.toml -nt .venv/.klppo-installed ]; then
    echo "[setup] installing klppo and its dependencies into .venv"
    python -m pip install -q -e ".[test]"
    touch .venv/.klppo-installed
fi
