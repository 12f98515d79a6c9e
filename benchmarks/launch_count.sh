#!/usr/bin/env bash
# Kernel launches per training iteration, by class and by kernel, on a CubeCL device that
# every machine has (lavapipe, Mesa's CPU Vulkan driver): the launch count of each change is
# visible without a GPU (issue: GPU speed by design, item 6). On a GPU each launch costs host
# time, so the count bounds the step from below (measured:
# benchmarks/results/2026-11-26-h200-gpu-profile.md).
#
#   benchmarks/launch_count.sh [PRETRAIN] [DEVICE] [-- extra pretrain flags]
#
# PRETRAIN: a build with wgpu (default target/release/pretrain); DEVICE: wgpu-cpu (default),
# wgpu or cuda. A 2-layer GPT (hidden 64, 4 heads, seq 64, micro-batch 2, dropout 0.1) runs 3
# and 1 iterations under CubeCL's profiler; the difference, halved, is one steady iteration.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release/pretrain}
DEVICE=${2:-wgpu-cpu}
shift $(( $# < 2 ? $# : 2 )); [ "${1:-}" = "--" ] && shift
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
run() {
  local n=$1; shift
  CUBECL_DEBUG_OPTION=profile CUBECL_DEBUG_LOG="$work/profile-$n.log" "$BIN" --device "$DEVICE" \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
    --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 2 --train-iters "$n" \
    --lr 1e-4 --split 100,0,0 --eval-iters 0 --eval-interval 0 --log-interval 1 \
    --hidden-dropout 0.1 --attention-dropout 0.1 \
    --data-path tests/fixtures/golden/wikitext2_valid_text_document \
    --data-cache-path "$work/cache" "$@" > "$work/run-$n.log" 2>&1 || { cat "$work/run-$n.log"; exit 1; }
}
run 3 "$@"
run 1 "$@"
python3 benchmarks/kernel_profile_summary.py "$work/profile-3.log" 3 "$work/profile-1.log" 1
