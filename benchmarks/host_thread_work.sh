#!/usr/bin/env bash
# How long the thread that builds a training step works per iteration, apart from waiting for
# CubeCL's device thread: burn's autodiff, ferrotron's ops and CubeCL's client (issue: GPU speed
# by design). On a GPU an eager step is bound by the slower of that thread and the device
# thread (the one launching the kernels), or by their sum where one waits for the other; this
# measures the first on any machine, with perf, on lavapipe (where the device thread also
# executes the kernels, so it is the slower one here and the building thread's own work shows
# apart from it).
#
#   benchmarks/host_thread_work.sh [PRETRAIN] [ITERS] [-- more pretrain flags]
#
# PRETRAIN: a build with wgpu (default target/release/pretrain); the model: 24 layers at hidden
# 64, seq 64, micro-batch 4, fp16 (lavapipe has no bf16), dropout 0.1: the host floor of
# gpu_profile.sh, whose step on a GPU is launch overhead. ITERS (default 16): the last
# ITERS - 5 iterations are measured. Needs perf (linux-perf) and permission to sample.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release/pretrain}
ITERS=${2:-16}
shift $(( $# < 2 ? $# : 2 )); [ "${1:-}" = "--" ] && shift
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp} perf record -q -g -e task-clock -c 250000 -o "$work/perf.data" -- "$BIN" \
  --device wgpu-cpu --num-layers 24 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
  --max-position-embeddings 64 --micro-batch-size 4 --global-batch-size 4 --train-iters "$ITERS" \
  --lr 1e-4 --split 100,0,0 --eval-iters 0 --eval-interval 0 --log-interval 1 \
  --hidden-dropout 0.1 --attention-dropout 0.1 --fp16 --initial-loss-scale 4096 \
  --data-path tests/fixtures/golden/wikitext2_valid_text_document \
  --data-cache-path "$work/cache" "$@" > "$work/run.log" 2>&1 || { cat "$work/run.log"; exit 1; }
perf script -i "$work/perf.data" -F comm,tid,time,ip,sym 2>/dev/null > "$work/samples.txt"
# The kernel names a thread after the binary's file name, cut to 15 bytes.
python3 - "$work/samples.txt" "$work/run.log" "$ITERS" "$(basename "$BIN" | cut -c1-15)" <<'PY'
import re, sys
samples_path, log_path, iters, comm = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
# Iteration times from the log (ms), to find the measured stretch: the last iters - 5.
ms = [float(m) for m in re.findall(r'elapsed time per iteration \(ms\): ([0-9.]+)', open(log_path).read())]
measured = ms[5:]
span = sum(measured) / 1000.0
# Each sample: a header line (comm, tid, time) and its call chain, one frame per line.
samples = []
for line in open(samples_path):
    parts = line.split()
    if len(parts) >= 3 and parts[2].endswith(':') and not line.startswith(('\t', ' ' * 8)):
        samples.append([parts[0], int(parts[1]), float(parts[2][:-1]), ''])
    elif samples and parts:
        samples[-1][3] += ' ' + ' '.join(parts[1:])
end = max(s[2] for s in samples)
start = end - span
window = [s for s in samples if s[2] >= start]
tids = [s[1] for s in samples if s[0] == comm]
if not tids:
    sys.exit(f"host_thread_work: no samples of a thread named {comm!r} (perf's comm names: "
             f"{sorted({s[0] for s in samples})[:8]})")
main_tid = min(tids)
# Waiting for the device thread: spinning, yielding or sleeping in CubeCL's queue (anywhere
# in the call chain: a yield's samples are in the kernel).
waiting = lambda s: any(w in s[3] for w in ('DeviceClient::enqueue', 'sched_yield', 'nanosleep'))
main = [s for s in window if s[1] == main_tid]
work = [s for s in main if not waiting(s)]
# One sample per 0.25 ms of a thread's CPU time (task-clock, -c 250000 ns).
period = 0.25e-3
device = [s for s in window if s[0].startswith('DS')]
per_iter = len(work) * period / len(measured) * 1000
print(f"{len(measured)} iterations measured, {span:.1f} s; ms/iteration {span / len(measured) * 1000:.0f}")
print(f"CPU time per iteration: the building thread {len(main) * period / len(measured) * 1000:.1f} ms, of which {(len(main) - len(work)) * period / len(measured) * 1000:.1f} waiting for the device thread; CubeCL's device threads {len(device) * period / len(measured) * 1000:.1f} ms")
print(f"the building thread's own work: {per_iter:.1f} ms per iteration")
PY
