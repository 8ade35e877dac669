#!/usr/bin/env bash
# The GPU comparison, run from a bundle (`cargo xtask bundle`) with no Rust and no network:
# our trainer (the bundle's lora-train) against PEFT + transformers on the same random-init
# checkpoints (make_models.py), each part skipped cleanly when its prerequisite is missing.
#
#   benches/gpu/run.sh <bundle-dir> <out-dir> [--cpu]
#
# <bundle-dir>  a folder written by `cargo xtask bundle` (holds lora-train and bundle.json);
#               from inside a bundle: benches/gpu/run.sh . out/
# <out-dir>     results.json and results.md (rewritten after every part), the generated models
#               (models/) and each run's files (work/)
# --cpu         small shapes on the CPU (the tiny Llama, 2 x 64 tokens, 4 steps): the whole chain
#               in a few minutes on any machine
#
# Needs a python3 with torch of the bundle's PyTorch release (LORA_PYTHON picks another
# interpreter; it is also how the bundle's launcher finds libtorch unless LIBTORCH is set);
# transformers + peft for the PEFT side; safetensors + tokenizers for make_models.py. The parts
# and what each measures: the top of run_parts.py.
set -euo pipefail

usage() {
    sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}
[ $# -ge 2 ] || usage
bundle=$1
out=$2
shift 2
extra=()
for arg in "$@"; do
    case $arg in
        --cpu) extra+=(--cpu) ;;
        -h | --help) usage ;;
        *) echo "run.sh: unknown argument $arg" >&2; usage ;;
    esac
done
here=$(cd "$(dirname "$0")" && pwd -P)
if [ ! -x "$bundle/lora-train" ] || [ ! -f "$bundle/bundle.json" ]; then
    echo "run.sh: $bundle is not a bundle (no lora-train launcher or bundle.json); build one with cargo xtask bundle --libtorch <path>" >&2
    exit 2
fi
py=${LORA_PYTHON:-python3}
if ! command -v "$py" >/dev/null 2>&1; then
    echo "run.sh: $py not found; set LORA_PYTHON to a python with torch" >&2
    exit 2
fi
if ! "$py" -c 'import torch' >/dev/null 2>&1; then
    echo "run.sh: $py has no torch; every part needs it (pip install torch==<the bundle's release>)" >&2
    exit 2
fi
mkdir -p "$out"
# CPU threads only feed the GPU there; on --cpu both sides get the same count.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$py" "$here/run_parts.py" --bundle "$bundle" --out "$out" "${extra[@]}"
