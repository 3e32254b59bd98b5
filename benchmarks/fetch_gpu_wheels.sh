#!/usr/bin/env bash
# Download (here, with a network) the wheels that benchmarks/vs_trl.py needs to run TRL on the GPU
# machine, which has no network: TRL itself (1.16 for GRPO, 1.12 for PPO) and what TRL needs that
# its image lacks (/work/.library/device/KINDS.md: torch 2.11, transformers 5.17, accelerate,
# huggingface_hub 1.33, pandas, pyarrow, psutil, pyyaml, jinja2, xxhash, fsspec are there;
# datasets and its dill and multiprocess are not). Python 3.12, x86_64, pure-Python wheels: about 2.5 MB.
#
#   bash benchmarks/fetch_gpu_wheels.sh            # into .whl/ (ignored by git)
#
# There, vs_trl.py installs them itself into its work folder, one TRL release per folder:
#   python3 benchmarks/vs_trl.py --mode gpu --trl-wheels .whl
# which runs, for each release,
#   python3 -m pip install --no-index --no-deps --target WORK/trl-site-grpo .whl/trl-1.16.0-*.whl .whl/datasets-*.whl ...
# and starts TRL's workers with PYTHONPATH=WORK/trl-site-grpo (the image's torch and transformers).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEST=${1:-.whl}
PYTHON=${PYTHON:-python3}
# datasets 5.2.0 takes huggingface_hub 1.31-2.x (the image has 1.33); dill and multiprocess at the
# newest versions it allows
WHEELS=(trl==1.16.0 trl==1.12.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)

mkdir -p "$DEST"
for spec in "${WHEELS[@]}"; do  # one at a time: two TRL releases in one call would conflict
    if ! log=$("$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$DEST" "$spec" 2>&1); then
        echo "$log" | grep -v "is ignored: it is neither a file nor a directory" >&2
        echo "fetch_gpu_wheels: could not download $spec" >&2
        exit 1
    fi
done
ls -l "$DEST"/*.whl
du -ch "$DEST"/*.whl | tail -1
