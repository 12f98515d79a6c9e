#!/usr/bin/env bash
# A minute's check before a GPU profile spends its device time: a 2-layer GPT trained for 6
# iterations twice, the run under test (the caller's environment and RUN_FLAGS, plus
# TEST_FLAGS) and a reference run (RUN_FLAGS plus REFERENCE_FLAGS, default `--cuda-matmul
# cubecl`: CubeCL's products instead of cuBLAS's); their losses must agree within TOLERANCE
# (relative, default 2 %: the two kinds of product agree within 1e-5 when both are right).
# The run under test is under `timeout 70`, so an ordering bug that hangs the device (see
# docs/gpu.md, "Matrix products on cuBLAS") costs a minute, not the lease; the reference under
# `timeout 200` (CubeCL's matmuls autotune on a machine's first run, which outlasted the run
# under test's limit on a GPU; measured: benchmarks/results/2026-11-27-h200-device-order.md).
#
#   benchmarks/gpu_smoke.sh PRETRAIN_BINARY [PYTHON]      PRECISIONS="fp32 bf16" by default
#
# Exit 0: the losses agree; 1: they do not, or the run under test failed; 2: the reference run
# failed too (then the fault is in what both runs share, not in what the check varies).
#
# Run from the repository root (it trains on the bundled WikiText-2 validation set; DEVICE=cpu
# dry-runs it on a CPU). gpu_session.sh checks device ordering against host ordering
# (REFERENCE_FLAGS="--cublas-ordering host") and the captured step against the eager one
# (TEST_FLAGS="--cuda-graph-impl local --cuda-graph-scope full_iteration", REFERENCE_FLAGS=).
set -uo pipefail
BIN=$1 PY=${2:-python3}
source "$(dirname "$0")/gpu_common.sh"
cuda_libraries "$PY"
W=$(mktemp -d)
run() {
  # shellcheck disable=SC2086
  timeout "${T:-70}" "$BIN" --device "$DEVICE" --num-layers 2 --hidden-size 128 --num-attention-heads 4 \
    --seq-length 128 --max-position-embeddings 128 --micro-batch-size 2 --global-batch-size 2 \
    --train-iters 6 --lr 1e-3 --lr-warmup-iters 1 --split 100,0,0 --log-interval 1 \
    --eval-iters 0 --eval-interval 0 --data-path tests/fixtures/golden/wikitext2_valid_text_document \
    --data-cache-path "$W/cache" ${RUN_FLAGS:-} "$@" 2>&1
}
ok=1 reference_failed=0
REFERENCE_FLAGS=${REFERENCE_FLAGS---cuda-matmul cubecl}
for p in ${PRECISIONS:-fp32 bf16}; do
  flags=""; [ "$p" = bf16 ] && flags=--bf16
  # shellcheck disable=SC2086
  T=70 run $flags ${TEST_FLAGS:-} > "$W/test-$p.log"; rc_a=$?
  # shellcheck disable=SC2086
  T=200 run $flags $REFERENCE_FLAGS > "$W/reference-$p.log"; rc_b=$?
  [ $rc_b -eq 0 ] || reference_failed=1
  a=$(lm_losses "$W/test-$p.log") b=$(lm_losses "$W/reference-$p.log")
  echo "$p tested${TEST_FLAGS:+ ($TEST_FLAGS)} (exit $rc_a): $a"
  echo "$p reference${REFERENCE_FLAGS:+ ($REFERENCE_FLAGS)} (exit $rc_b): $b"
  worst=$(awk -v a="$a" -v b="$b" 'BEGIN{n=split(a,x," ");m=split(b,y," ");if(n==0||n!=m){print "inf";exit}
    w=0;for(i=1;i<=n;i++){d=(x[i]-y[i])/y[i];if(d<0)d=-d;if(d>w)w=d} print w}')
  echo "$p: worst relative loss difference $worst"
  if ! awk -v w="$worst" -v t="${TOLERANCE:-0.02}" 'BEGIN{exit !(w!="inf" && w<t)}'; then
    ok=0
    tail -5 "$W/test-$p.log"
    tail -3 "$W/reference-$p.log"
  fi
done
if [ $ok != 1 ] && [ $reference_failed = 1 ]; then
  echo "gpu_smoke: FAILED, the reference run too"
  exit 2
fi
[ $ok = 1 ] || { echo "gpu_smoke: FAILED"; exit 1; }
echo "gpu_smoke: the tested and the reference runs give the same losses"
