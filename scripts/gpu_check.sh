#!/usr/bin/env bash
# GPU readiness check, in one call on a lent GPU machine (no network): parity with transformers on the GPU,
# bf16 training of a t5-v1.1-base-shaped model under CUDA's sync debug mode, fp16 loss scaling, checkpoint
# resume, HF export, the communication recorder on NCCL, generation, fine-tuning evaluation, activation
# checkpointing, the fake process group at world size 8, two ranks sharing the GPU over gloo, torch.compile,
# and the named benchmark against transformers. Each check runs in its own process with its own timeout, and
# OUTPUT/gpu_check.json is rewritten after each (see scripts/gpu_check.py and docs/guides/gpu-check.md).
#
#   scripts/gpu_check.sh [--output DIR] [--steps N] [--only a,b]   # on a machine with CUDA PyTorch, ~6 minutes
#   scripts/gpu_check.sh --cpu [--output DIR] [--sync-debug]       # dry run, tiny shapes, on the CPU (the suite)
#
# Runs from the source tree (PYTHONPATH=src), so t5forge need not be installed. What the GPU image lacks
# (omegaconf, sentencepiece, protobuf, rouge-score, sacrebleu; optionally matplotlib) comes from the folder
# scripts/gpu_deps.sh fills on a machine with the package index: .gpu-deps, or T5FORGE_GPU_DEPS=DIR. A
# missing package stops the run at once, with one line naming all of them (scripts/gpu_preflight.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
DEPS="${T5FORGE_GPU_DEPS:-$PWD/.gpu-deps}"
if [ -d "$DEPS" ]; then
    # Binary wheels (sentencepiece, protobuf, lxml) load only on the Python they were fetched for.
    built_for="$(cat "$DEPS/T5FORGE_GPU_DEPS_PYTHON" 2>/dev/null || echo unknown)"
    running="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    if [ "$built_for" = "$running" ]; then
        export PYTHONPATH="$DEPS${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "gpu_check: not using $DEPS: it was built for Python $built_for, this is $running" >&2
    fi
fi
export T5FORGE_GPU_DEPS="$DEPS"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"  # the GPU machine has no network: never wait for the hub
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" scripts/gpu_preflight.py  # exits 2 with one line when a package is missing
exec "$PYTHON" scripts/gpu_check.py "$@"
