#!/usr/bin/env bash
# Fills .gpu-deps (git-ignored) with the packages scripts/gpu_check.sh needs and the lent GPU machine's image
# lacks (omegaconf, sentencepiece, protobuf, rouge-score, sacrebleu and their dependencies; matplotlib with
# --matplotlib), built for that image's Python (3.12, x86-64 Linux), on a machine that reaches the package
# index. The list comes from scripts/gpu_preflight.py. Bring the folder along (the device tool carries it:
# carry [".gpu-deps"]); gpu_check.sh puts it on PYTHONPATH when it matches the running Python.
#
#   scripts/gpu_deps.sh [--matplotlib] [--python-version 3.12] [--output DIR]   # DIR: default .gpu-deps
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TARGET_PY=3.12
OUT="${T5FORGE_GPU_DEPS:-.gpu-deps}"
LIMIT_MIB=60  # the device tool carries 64 MiB of ignored files in all
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --matplotlib) EXTRA=(--matplotlib) ;;
        --python-version) TARGET_PY="$2"; shift ;;
        --output) OUT="$2"; shift ;;
        *) echo "usage: scripts/gpu_deps.sh [--matplotlib] [--python-version X.Y] [--output DIR]" >&2; exit 2 ;;
    esac
    shift
done
ABI="cp${TARGET_PY/./}"
# torch >= 2.8 wheels need glibc 2.28, so every image that runs them accepts these tags.
PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_28_x86_64)
TARGET=(--python-version "$TARGET_PY" --implementation cp --abi "$ABI" "${PLATFORMS[@]}" --only-binary=:all:)

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mapfile -t binary < <("$PYTHON" scripts/gpu_preflight.py --requirements "${EXTRA[@]}")
mapfile -t source < <("$PYTHON" scripts/gpu_preflight.py --requirements --source-only "${EXTRA[@]}")
echo "gpu_deps: ${#binary[@]} wheels for Python $TARGET_PY (x86-64 Linux) and ${#source[@]} built here: ${binary[*]} ${source[*]}"
# --no-deps: the lists are complete; a resolver would also bring numpy, PyYAML and others the image has.
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps "${TARGET[@]}" -d "$work/wheels" "${binary[@]}"
if [ ${#source[@]} -gt 0 ]; then
    # Published as source only, and pure Python: the wheel built here runs on any Python 3.
    "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-binary=:all: -w "$work/built" "${source[@]}"
    for wheel in "$work"/built/*.whl; do
        case "$wheel" in
            *-none-any.whl) mv "$wheel" "$work/wheels/" ;;
            *) echo "gpu_deps: $wheel is not pure Python; it cannot be built here for Python $TARGET_PY" >&2; exit 1 ;;
        esac
    done
fi
# pip checks Requires-Python of local wheels against the running interpreter, not --python-version; the
# download above already chose them for $TARGET_PY.
# --no-compile: bytecode compiled here would be for this Python, not the image's.
"$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --no-index --ignore-requires-python --no-compile \
    "${TARGET[@]}" --target "$work/deps" "$work"/wheels/*.whl
rm -rf "$work/deps/bin"  # console scripts written for this machine's interpreter
echo "$TARGET_PY" > "$work/deps/T5FORGE_GPU_DEPS_PYTHON"  # gpu_check.sh uses the folder only on this Python
size_mib=$(du -sm "$work/deps" | cut -f1)
if [ "$size_mib" -gt "$LIMIT_MIB" ]; then
    if [ ${#EXTRA[@]} -eq 0 ]; then
        echo "gpu_deps: the folder would be $size_mib MiB, over the $LIMIT_MIB MiB the device tool carries" >&2
        exit 1
    fi
    echo "gpu_deps: with matplotlib the folder is $size_mib MiB, over the $LIMIT_MIB MiB the device tool carries:" \
         "bring it another way (without --matplotlib the plots are skipped, nothing else)" >&2
fi
rm -rf "$OUT"
mv "$work/deps" "$OUT"
echo "gpu_deps: wrote $OUT ($size_mib MiB, Python $TARGET_PY); gpu_check.sh puts it on PYTHONPATH"
