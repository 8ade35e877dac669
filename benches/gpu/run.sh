#!/usr/bin/env bash
# The side-by-side comparison on CUDA: the same job as the CPU comparison (one code path,
# `cargo xtask bench-compare`), on GPU 0 with bf16 autocast on both sides, larger batches, and the
# allocator peaks compared (ours: lora_core::sys::cuda_mem_stats, i.e. the CUDA caching allocator's
# allocated_bytes.all.peak; PEFT: torch.cuda.max_memory_allocated), each reset before the first step.
#
# Needs: an NVIDIA driver, this checkout, Rust, and `cargo xtask setup` (run below; idempotent).
# PyPI's torch==2.13.0 wheel is a CUDA 13 build and serves as libtorch for both sides.
# Takes a few minutes (most of it the first build); results in target/bench-compare-cuda/.
#
#   benches/gpu/run.sh [extra bench-compare flags, e.g. --steps 30 --batch 16]
set -euo pipefail
cd "$(dirname "$0")/../.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "benches/gpu/run.sh: no NVIDIA GPU visible (nvidia-smi -L failed); use cargo xtask bench-compare for the CPU comparison" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

cargo xtask setup

# CPU threads only feed the GPU here; keep both sides equal.
THREADS="${THREADS:-4}"
export OMP_NUM_THREADS="$THREADS" MKL_NUM_THREADS="$THREADS"

# The CUDA build of libtorch must be usable from a tch binary (libtorch_cuda.so linked, not
# dropped by --as-needed): check before spending minutes on the comparison.
.venv/bin/python - <<'PY'
import torch, sys
if not torch.cuda.is_available():
    sys.exit("the venv's torch sees no CUDA device; check the driver (torch %s, CUDA %s)" % (torch.__version__, torch.version.cuda))
print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.get_device_name(0))
PY

cargo xtask bench-compare \
    --device cuda --precision bf16 \
    --threads "$THREADS" \
    --steps 12 --repeats 2 --batch 8 --seq-len 512 \
    --no-loader --phases \
    --out target/bench-compare-cuda "$@"

echo
echo "results: target/bench-compare-cuda/bench.md, bench.json, bench.png"
