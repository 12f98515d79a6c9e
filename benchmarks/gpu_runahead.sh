#!/usr/bin/env bash
# Peak GPU memory of the bf16 GPT-2 345M step against how long the cuBLAS products' buffers
# stay held while the host runs ahead of the GPU.
#
#   benchmarks/gpu_runahead.sh BIN_DIR REPORT_DIR [PYTHON]
#
# Why: the eager bf16 step peaked far above PyTorch's by nvidia-smi, where the same step under
# CubeCL's profiling (a synchronisation after every kernel) peaked below PyTorch's (measured:
# benchmarks/results/2026-11-30-h200-device-thread.md). What each run separates:
# - `--log-interval 1` reads the loss every iteration (a synchronisation per step, as
#   Megatron's per-step reads of the grad norm are): steps queued ahead (measured once to
#   change nothing, the same report);
# - host ordering of the cuBLAS products synchronises at every window (its peak: the same
#   report);
# - FERROTRON_CUBLAS_RELEASE=wait lets a window's buffers go once its wait is queued on
#   CubeCL's stream, not once the GPU has run it (the latter's peak, still over PyTorch's:
#   benchmarks/results/2026-11-30-h200-gpu-history.md): its losses must equal the default
#   run's, bit for bit;
# - FERROTRON_CUBLAS_HELD=32 and 8 (default 256) wait for the oldest window held once that many
#   hold buffers: how far cuBLAS's products are queued ahead of the GPU (its losses too must
#   equal the default run's).
# PyTorch runs beside them. DEVICE=cpu with small sizes (gpu_common.sh) dry-runs it on a CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN_DIR=$1 REPORT=$2 PY=${3:-python3}
source benchmarks/gpu_common.sh
mkdir -p "$REPORT"
WORK=$(mktemp -d)
export WORK
mkdir -p "$WORK/logs"
benchmarks/unpack_bins.sh "$BIN_DIR" "$WORK" || exit 1
cuda_libraries "$PY"
ROWS="$REPORT/runahead.md"
# measured NAME command...: the command under a time limit with its output in REPORT/NAME.log
# (a pretrain_model command samples the memory itself), its row of the table.
measured() {
  local name=$1; shift
  timeout 90 bash -c '"$@"' measured "$@" > "$REPORT/$name.log" 2>&1
  echo "[exit $?]" >> "$REPORT/$name.log"
  local tps
  tps=$(grep -o 'tokens/s: [0-9.]*' "$REPORT/$name.log" | tail -1 | awk '{print $2}')
  echo "| $name | ${tps:-?} | $(peak_gib "$WORK/logs/$name.mem") |" | tee -a "$ROWS"
}
# step345m NAME FLAGS...: the model for 12 iterations in bf16 with dropout 0.1.
step345m() {
  local name=$1; shift
  measured "$name" pretrain_model "$WORK/pretrain" "$name" 12 --bf16 --hidden-dropout 0.1 \
    --attention-dropout 0.1 "$@"
}
echo "| run (bf16, dropout 0.1, 12 iterations) | tokens/s (last logged) | peak GiB (nvidia-smi) |" | tee "$ROWS"
echo "|---|---|---|" | tee -a "$ROWS"
# Most telling first: a lease that runs out of time loses the last rows.
step345m log-interval-4
FERROTRON_CUBLAS_RELEASE=wait step345m release-at-wait
measured torch-bf16-sdpa with_memory "$WORK/logs/torch-bf16-sdpa.mem" "$PY" benchmarks/torch_gpu_gpt.py \
  "$LAYERS" "$HIDDEN" "$HEADS" "$SEQ" "$MBS" 20 bf16-sdpa 0.1
FERROTRON_CUBLAS_HELD=32 step345m held-32
step345m host-ordering --cublas-ordering host
FERROTRON_CUBLAS_HELD=8 step345m held-8
step345m log-interval-4-again
step345m log-interval-1 --log-interval 1
echo | tee -a "$ROWS"
for run in log-interval-4 host-ordering release-at-wait held-32 held-8; do
  echo "- lm loss, $run: $(lm_losses "$REPORT/$run.log")" | tee -a "$ROWS"
done
default=$(lm_losses "$REPORT/log-interval-4.log")
for run in release-at-wait held-32 held-8; do
  if [ -n "$default" ] && [ "$default" = "$(lm_losses "$REPORT/$run.log")" ]; then
    echo "- $run's losses equal the default's" | tee -a "$ROWS"
  else
    echo "- $run's losses DIFFER from the default's" | tee -a "$ROWS"
  fi
done
