#!/usr/bin/env bash
# A GPU lease in one call: the smoke check, then the profile, whatever the smoke finds.
#
#   benchmarks/gpu_session.sh BIN_DIR REPORT_DIR [PYTHON]          SESSION_S=570 by default
#
# Why: a lease is about fifteen minutes of device time, of which one call of at most ten is
# the measuring (the machine's start takes the rest). Chaining `gpu_smoke.sh && gpu_profile.sh`
# by hand measured nothing when the smoke failed. Here the cuBLAS products are first checked
# with the device ordering their two streams (FERROTRON_CUBLAS_ORDER=device, never yet run on a
# GPU in its committed form, see docs/gpu.md); if that check passes the profile runs with it
# and with host ordering as its baseline, the ratio between them being the measurement. If it
# fails (wrong losses, or a hang caught by the smoke's 70 s timeouts) the profile runs with host
# ordering, measured before on an H200 (with one product per ordering window if the windows of
# two fail the check), and the report says why.
#
# BIN_DIR as gpu_profile.sh takes it (bins.tar.xz, or the binaries). REPORT_DIR receives
# report.md (the profile's report with the smoke's results at its end), smoke-*.txt and the
# profile's logs.tar.xz. The profile gets what is left of SESSION_S as its BUDGET_S. Other
# variables (DEVICE, LAYERS, ...) reach both scripts: DEVICE=cpu with small sizes dry-runs it
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
if FERROTRON_CUBLAS_ORDER=device PRECISIONS=bf16 benchmarks/gpu_smoke.sh "$BIN/pretrain" "$PY" \
  > "$REPORT/smoke-device.txt" 2>&1; then
  ORDER=device BASELINE=FERROTRON_CUBLAS_ORDER=host
  VERDICT="device ordering passed the smoke check (losses as CubeCL's products give); the profile runs with it, host ordering as the baseline"
else
  ORDER=host BASELINE=
  VERDICT="device ordering FAILED the smoke check (smoke-device.txt); the profile runs with host ordering and no baseline"
  if ! PRECISIONS=bf16 benchmarks/gpu_smoke.sh "$BIN/pretrain" "$PY" > "$REPORT/smoke-host.txt" 2>&1; then
    # The windows of two products (new, FERROTRON_CUBLAS_PAIRS) are what host ordering has
    # not run on a GPU before.
    if FERROTRON_CUBLAS_PAIRS=0 PRECISIONS=bf16 benchmarks/gpu_smoke.sh "$BIN/pretrain" "$PY" \
      > "$REPORT/smoke-host-no-pairs.txt" 2>&1; then
      export FERROTRON_CUBLAS_PAIRS=0
      VERDICT="$VERDICT; host ordering failed it too (smoke-host.txt) but passed with one product per window (FERROTRON_CUBLAS_PAIRS=0), which the profile uses"
    else
      VERDICT="$VERDICT; host ordering failed it too, with and without windows of two products (smoke-host*.txt): the losses below are suspect"
    fi
  fi
fi
echo "gpu_session: $VERDICT"

BUDGET_S=$((SESSION_S - ($(date +%s) - START))) FERROTRON_CUBLAS_ORDER=$ORDER BASELINE_ENV=$BASELINE \
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
  echo
  # The build's commit, where the packing step wrote it (docs/gpu.md).
  [ -f "$BIN_DIR/BUILD" ] && echo "binaries built from: $(head -3 "$BIN_DIR/BUILD" | tr '\n' ' ')"
  echo "session wall time: $(($(date +%s) - START)) s of SESSION_S=$SESSION_S"
} >> "$REPORT/report.md"
