#!/usr/bin/env bash
# The peers eval/bench_kernels.py times beside ours, as wheels for the device machine (Python 3.12,
# x86_64), into the ignored .whl-peers/ (carry it with .whl; device_check.sh installs both):
#   comfy-kitchen 0.2.40 without its HIP backend (the wheel is 68 MB with it, over a call's carry),
#   nvidia-cudnn-frontend (cuDNN's FP8 attention graph).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY="${PYTHON:-python3}"
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
dl() { "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$TMP" "$@"; }
dl comfy-kitchen==0.2.40 nvidia-cudnn-frontend
mkdir -p .whl-peers && rm -f .whl-peers/*.whl
mv "$TMP"/nvidia_cudnn_frontend-*.whl .whl-peers/
mkdir "$TMP/ck" && (cd "$TMP/ck" && unzip -q "$TMP"/comfy_kitchen-*.whl \
  && rm comfy_kitchen/backends/hip/_C.abi3.so \
  && sed -i '/backends\/hip\/_C.abi3.so/d' comfy_kitchen-*.dist-info/RECORD \
  && zip -q -r -9 "$OLDPWD/.whl-peers/comfy_kitchen-0.2.40-cp312-abi3-manylinux_2_28_x86_64.whl" .)
du -sh .whl-peers/*.whl
