#!/usr/bin/env bash
# A GPU lease in one call: the smoke checks, then the profile, whatever the checks find.
#
#   benchmarks/gpu_session.sh BIN_DIR REPORT_DIR [PYTHON]          SESSION_S=570 by default
#
# Why: a lease is about fifteen minutes of device time, of which one call of at most ten is
# the measuring (the machine's start takes the rest). Chaining `gpu_smoke.sh && gpu_profile.sh`
# by hand measured nothing when the smoke failed. Here, first, the cuBLAS products ordered on
# the device (the default: faster than host ordering; measured:
# benchmarks/results/2026-11-27-h200-device-order.md and
# benchmarks/results/2026-11-30-h200-device-thread.md) are checked against host ordering
# (`--cublas-ordering host`); if they pass, the step captured into a graph with its cuBLAS
# products queued after each replay is checked against the eager step. The fused attention
# (on tensor cores where the card has them for bf16) is checked against the composed core.
# Where device ordering passed, the memory check comes next (the windows' buffers let go at
# their wait, then gpu_runahead.sh; RUNAHEAD=0 leaves it out). The profile then runs the
# ordering that passed (every run of the lease takes `--cublas-ordering host` through
# RUN_FLAGS where device ordering failed) and leaves out the captured runs where the capture
# failed (GRAPH=0); the report says why. Where host ordering failed too (gpu_smoke.sh's exit
# 2), the report says that the step itself failed, not the ordering: kernels new since the
# last lease run on that path and have never been compiled for a GPU. A kernel changed since
# the last lease is measured against that lease's report (benchmarks/results/), or against a
# `pretrain-baseline` build of the older commit in BIN_DIR (gpu_profile.sh).
# Each check's run is under a 70 s timeout, so a hang costs a minute.
#
# BIN_DIR as gpu_profile.sh takes it (bins.tar.xz, or the binaries). REPORT_DIR receives
# report.md (the profile's report with the smoke's results and the memory check's table at its
# end), smoke-*.txt, runahead/ (gpu_runahead.sh's logs) and the profile's logs.tar.xz. The
# profile gets what is left of SESSION_S as its BUDGET_S. Other variables (DEVICE, LAYERS,
# ...) reach every script: DEVICE=cpu with small sizes dry-runs it
# on a CPU (see docs/gpu.md).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN_DIR=$1 REPORT=$2 PY=${3:-python3}
SESSION_S=${SESSION_S:-570}
START=$(date +%s)
mkdir -p "$REPORT"
BIN=$(mktemp -d)
benchmarks/unpack_bins.sh "$BIN_DIR" "$BIN" || exit 1
[ -x "$BIN/pretrain" ] || { echo "gpu_session: no pretrain binary in $BIN_DIR"; exit 1; }

# bf16 only: the half-precision products are the ones cuBLAS takes by default.
GRAPH=0
# against_host REPORT_FILE: the bf16 smoke check of device ordering against host ordering.
against_host() {
  REFERENCE_FLAGS="--cublas-ordering host" PRECISIONS=bf16 \
    benchmarks/gpu_smoke.sh "$BIN/pretrain" "$PY" > "$REPORT/$1" 2>&1
}
against_host smoke-device.txt
smoke=$?
if [ $smoke -eq 0 ]; then
  ORDER=device
  VERDICT="device ordering passed the smoke check (the losses of host ordering); the profile runs it"
  # The same kernels in the same order: the replayed losses equal the eager ones (bit for bit
  # on lavapipe); 1e-5 leaves room for cuBLAS choosing another algorithm, not for a race.
  if TEST_FLAGS="--cuda-graph-impl local --cuda-graph-scope full_iteration" REFERENCE_FLAGS= TOLERANCE=1e-5 PRECISIONS=bf16 \
    benchmarks/gpu_smoke.sh "$BIN/pretrain" "$PY" > "$REPORT/smoke-graph.txt" 2>&1; then
    GRAPH=1
    VERDICT="$VERDICT; the captured step passed too (the eager step's losses), so the profile runs it"
  else
    VERDICT="$VERDICT; the captured step FAILED its check (smoke-graph.txt): the profile leaves its runs out"
  fi
elif [ $smoke -eq 2 ]; then
  # Host ordering ran on GPUs before (benchmarks/results/2026-11-30-h200-gpu-history.md); a
  # failure there too is the step's own (a kernel new since, say), which the default runs below
  # will meet again: the report must say so.
  ORDER=host
  VERDICT="the default bf16 step FAILED under host ordering as well as device ordering (smoke-device.txt): a fault of the step itself, not of the ordering; the profile runs with host ordering and no captured step, and its runs that take the same path will fail the same way"
else
  ORDER=host
  VERDICT="device ordering FAILED the smoke check (smoke-device.txt); the profile runs with host ordering (measured on H200s before) and no captured step"
fi
if [ "$ORDER" = host ]; then
  RUN_FLAGS="${RUN_FLAGS:-} --cublas-ordering host"
  export RUN_FLAGS
fi
# The fused attention (on tensor cores where the card has them) against the composed core:
# the two differ by rounding only (the probabilities and score gradients rounded to bf16 before
# their products), so the losses agree to well under 0.5 %. Informational: the profile runs
# --use-flash-attn whatever this finds.
if TEST_FLAGS=--use-flash-attn REFERENCE_FLAGS="--attention-backend unfused" \
  TOLERANCE=5e-3 PRECISIONS=bf16 benchmarks/gpu_smoke.sh "$BIN/pretrain" "$PY" > "$REPORT/smoke-flash.txt" 2>&1; then
  VERDICT="$VERDICT; the fused attention gave the composed core's losses (smoke-flash.txt)"
else
  VERDICT="$VERDICT; the fused attention FAILED its check against the composed core (smoke-flash.txt)"
fi
# The memory check (peak at most PyTorch's: the acceptance's one target not met, see
# benchmarks/results/2026-11-30-h200-gpu-history.md), before the profile takes what is left:
# the cuBLAS windows' buffers let go once their wait is queued (FERROTRON_CUBLAS_RELEASE=wait,
# never run on a GPU) against host ordering at 2 layers, then gpu_runahead.sh's peaks at 345M
# (short enough to leave the profile most of the call; measured:
# benchmarks/results/2026-11-29-2core-gpu-session-builds-and-dry-runs.md). RUNAHEAD=0
# leaves them out.
if [ "${RUNAHEAD:-1}" = 1 ] && [ "$ORDER" != host ]; then
  if FERROTRON_CUBLAS_RELEASE=wait against_host smoke-release-at-wait.txt; then
    VERDICT="$VERDICT; the windows' buffers let go at their wait gave host ordering's losses (smoke-release-at-wait.txt)"
  else
    VERDICT="$VERDICT; the windows' buffers let go at their wait FAILED the smoke check (smoke-release-at-wait.txt)"
  fi
  timeout 240 benchmarks/gpu_runahead.sh "$BIN_DIR" "$REPORT/runahead" "$PY" \
    > "$REPORT/runahead.txt" 2>&1
fi
echo "gpu_session: $VERDICT"

BUDGET_S=$((SESSION_S - ($(date +%s) - START))) GRAPH=$GRAPH \
  benchmarks/gpu_profile.sh "$BIN" "$REPORT" "$PY"
{
  echo
  echo "### Smoke check before the profile (benchmarks/gpu_session.sh)"
  echo
  echo "$VERDICT."
  for f in "$REPORT"/smoke-*.txt; do
    echo
    echo "\`$(basename "$f")\`:"
    echo '```'
    grep -v '^$' "$f" | tail -12
    echo '```'
  done
  if [ -f "$REPORT/runahead/runahead.md" ]; then
    echo
    echo "### Peak memory against how long the cuBLAS windows' buffers are held (benchmarks/gpu_runahead.sh)"
    echo
    cat "$REPORT/runahead/runahead.md"
  fi
  echo
  # The build's commit, where the packing step wrote it (docs/gpu.md).
  [ -f "$BIN_DIR/BUILD" ] && echo "binaries built from: $(head -3 "$BIN_DIR/BUILD" | tr '\n' ' ')"
  echo "session wall time: $(($(date +%s) - START)) s of SESSION_S=$SESSION_S"
} >> "$REPORT/report.md"
