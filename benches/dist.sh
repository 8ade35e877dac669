#!/usr/bin/env bash
# Data parallelism on one machine: the SmolLM2-135M demo job (examples/configs/smollm2-shakespeare.yaml,
# 16 steps of 4 × 128 tokens) trained by 1 process with 2 threads against 2 data-parallel ranks
# (`lora-train train --nproc-per-node 2`, Gloo on loopback) with 1 thread each and a micro-batch of
# 2 (the same global batch of 4); then the time of one gradient sync of the demo adapter (921,600
# fp32 values, `benches/src/bin/bench-allreduce.rs`).
#
# What it shows: whether two processes with one thread each train faster than one process with two
# threads on the same cores (parallel work split by batch rows instead of inside each GEMM), and
# what the all-reduce adds to a step. What it does not: scaling across machines or GPUs (loopback
# here; NCCL is not built), and speed on an idle machine when run on a shared one — the load
# average is printed beside the numbers.
#
#   benches/dist.sh [--release] [--repeats N] [--steps N]
#
# (--steps: optimizer steps per run, default the demo's 16; fewer for a quick look on a busy
# machine.)
#
# Prints tokens/s of each side per repeat, the median ratio (2 ranks / 1 process, higher is better
# for the ranks) and the all-reduce times (median / min / max ms). Results in target/bench-dist/.
set -euo pipefail
cd "$(dirname "$0")/.."

PROFILE=debug
CARGO_PROFILE=()
REPEATS=2
STEPS=16
while [ $# -gt 0 ]; do
    case "$1" in
        --release) PROFILE=release; CARGO_PROFILE=(--release) ;;
        --repeats) REPEATS="$2"; shift ;;
        --steps) STEPS="$2"; shift ;;
        *) echo "usage: benches/dist.sh [--release] [--repeats N] [--steps N]" >&2; exit 2 ;;
    esac
    shift
done

cargo build "${CARGO_PROFILE[@]}" --workspace --bin lora-train --bin bench-allreduce
BIN="target/$PROFILE"
export LD_LIBRARY_PATH="$PWD/.venv/libtorch/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OUT=target/bench-dist
rm -rf "$OUT"
mkdir -p "$OUT"

# the demo config with its own output folder, a micro-batch and a thread count per side
config() { # name batch_size num_threads
    sed -e "s|output_dir: .*|output_dir: $OUT/$1|" \
        -e "s|batch_size: .*|batch_size: $2|" \
        -e "s|num_threads: .*|num_threads: $3|" \
        -e "s|max_steps: .*|max_steps: $STEPS|" \
        -e "s|save_every_n_steps: .*|save_every_n_steps: $STEPS|" \
        -e "s|tensorboard: .*|tensorboard: false|" \
        examples/configs/smollm2-shakespeare.yaml > "$OUT/$1.yaml"
}
config one 4 2
config ranks 2 1

tokens_per_s() { # run folder
    .venv/bin/python -c 'import json,sys; s=json.load(open(sys.argv[1])); print("%.1f" % (s["tokens"] / s["train_seconds"]))' "$1/summary.json"
}
load() { cut -d' ' -f1 /proc/loadavg; }

ratios=()
for r in $(seq 1 "$REPEATS"); do
    rm -rf "$OUT/one" "$OUT/ranks"
    before=$(load)
    OMP_NUM_THREADS=2 "$BIN/lora-train" train --config "$OUT/one.yaml" > "$OUT/one-$r.log" 2>&1
    one=$(tokens_per_s "$OUT/one")
    mid=$(load)
    OMP_NUM_THREADS=1 "$BIN/lora-train" train --nproc-per-node 2 --config "$OUT/ranks.yaml" > "$OUT/ranks-$r.log" 2>&1
    ranks=$(tokens_per_s "$OUT/ranks")
    ratio=$(.venv/bin/python -c "print(f'{$ranks / $one:.3f}')")
    ratios+=("$ratio")
    echo "repeat $r: 1 process × 2 threads $one tokens/s (load $before); 2 ranks × 1 thread $ranks tokens/s (load $mid); ratio $ratio"
done
echo "median ratio (2 ranks / 1 process): $(printf '%s\n' "${ratios[@]}" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')"

echo "gradient all-reduce of the SmolLM2 demo adapter, 2 ranks (load $(load)):"
"$BIN/bench-allreduce" --elements 921600 --world 2 --iters 50 | tee "$OUT/allreduce.json"
