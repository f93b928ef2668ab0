#!/usr/bin/env bash
# GPU readiness check: parity with transformers on the GPU (fp32, bf16), 30 bf16 steps of a
# t5-v1.1-base-shaped model with CUDA's sync debug mode set to "error" after warm-up, fp16 loss scaling,
# checkpoint save + resume, HF export, the communication recorder on NCCL; writes OUTPUT/gpu_check.json
# (samples/s, MFU, peak memory) and OUTPUT/bench/named.* (t5forge vs transformers at t5-v1.1-base, bf16).
#
#   scripts/gpu_check.sh [--output DIR] [--steps N]   # on a machine with CUDA PyTorch (no network needed)
#   scripts/gpu_check.sh --cpu [--output DIR]         # dry run, tiny shapes, on the CPU (the test suite runs it)
#
# Runs from the source tree (PYTHONPATH=src), so t5forge need not be installed. It needs torch,
# transformers, safetensors, sentencepiece, tokenizers, numpy, rich, omegaconf (+ antlr4-python3-runtime
# 4.9.*); where omegaconf is missing, bring the two wheels (see docs/guides/gpu-check.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import omegaconf" 2>/dev/null; then
    echo "gpu_check: omegaconf is missing; install the wheels brought along: $PYTHON -m pip install --no-index --no-deps omegaconf-*.whl antlr4_python3_runtime-*.whl" >&2
    exit 2
fi
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" scripts/gpu_check.py "$@"
