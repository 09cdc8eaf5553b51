#!/usr/bin/env bash
# One-shot GPU checks of issue 7 (test/gpu/gpu_checks.py): CUDA kernels vs their torch fallbacks,
# the ring buffer's CUDA IPC backend across processes, and full-size pi0.5 (random weights, bf16,
# 1/2/3 cameras) per-phase latency dense vs cached with peak memory, and the same for the bundled
# trained checkpoint (checkpoints/pi05-mw-metaworld). Writes gpu_checks.json into
# --out DIR, else $OUT, else out/gpu_checks. Sized for a few minutes on one H100/H200-class GPU; the
# Python side stops starting new work after --budget-s (420 s) and this wrapper kills it at 470 s,
# so the whole run stays under 8 minutes.
#
#   bash test/gpu/run_gpu_checks.sh                 # on a machine with one NVIDIA GPU
#   bash test/gpu/run_gpu_checks.sh --cpu-dry-run   # anywhere: tiny sizes on CPU, lists what needs a GPU
#
# Python: $PYTHON if set. Otherwise, on a GPU machine, the first interpreter whose torch sees CUDA:
# the machine's python3 (the device image this project is lent ships torch with CUDA, CuPy, numpy
# and safetensors, and has no network, so nothing is installed there); failing that, a virtualenv
# in .venv-gpu is created with torch (CUDA build), cupy-cuda12x and requirements.txt from PyPI,
# which needs network. For --cpu-dry-run: the repository's .venv (make setup), else python3.
# The package is used from this checkout through PYTHONPATH; nothing is installed into it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DRY=0
for arg in "$@"; do
    [[ "$arg" == "--cpu-dry-run" ]] && DRY=1
done

has_cuda_torch() {
    "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1
}

make_gpu_venv() {
    local venv="$ROOT/.venv-gpu"
    echo "[gpu-checks] no python3 with CUDA torch here: creating $venv (needs network)" >&2
    {
        python3 -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip
        "$venv/bin/python" -m pip install -q torch cupy-cuda12x -r "$ROOT/requirements.txt"
    } >&2  # stdout carries only the interpreter's path
    echo "$venv/bin/python"
}

pick_python() {
    if [[ -n "${PYTHON:-}" ]]; then
        echo "$PYTHON"
    elif [[ $DRY == 1 ]]; then
        if [[ -x "$ROOT/.venv/bin/python" ]]; then echo "$ROOT/.venv/bin/python"; else echo python3; fi
    elif has_cuda_torch python3; then
        echo python3
    elif [[ -x "$ROOT/.venv-gpu/bin/python" ]] && has_cuda_torch "$ROOT/.venv-gpu/bin/python"; then
        echo "$ROOT/.venv-gpu/bin/python"
    else
        make_gpu_venv
    fi
}

PY="$(pick_python)"
OUT_DIR="${OUT:-$ROOT/out/gpu_checks}"
echo "[gpu-checks] python: $(command -v "$PY") ($("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'))" >&2
if [[ $DRY == 0 ]] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 || true
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec timeout --signal=TERM --kill-after=10 470 "$PY" "$ROOT/test/gpu/gpu_checks.py" --out "$OUT_DIR" "$@"
