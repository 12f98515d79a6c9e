#!/usr/bin/env bash
# GPU training speed of ferrotron against PyTorch on the same GPT and batch (issue: GPU
# training at PyTorch speed). Run on a machine with a CUDA GPU:
#
#   benchmarks/gpu_train.sh [PRETRAIN_BINARY] [PYTHON]
#
# PRETRAIN_BINARY: ferrotron's `pretrain` built with `--features cuda` (default
#   target/release/pretrain; build it here or on another machine, see docs/gpu.md).
# PYTHON: a Python with torch (CUDA) for the reference (default python3; skipped if absent).
# Environment: LAYERS HIDDEN HEADS SEQ MBS ITERS DROPOUT (default GPT-2 345M: 24 1024 16
#   1024 4 30 0.1), DATA (a Megatron .bin/.idx prefix; default the bundled wikitext-2).
#
# Prints for each run: tokens/s, TFLOP/s, MFU (of 989 TFLOP/s dense bf16 on an H100/H200),
# peak GPU memory, and the ratio to PyTorch eager bf16 + SDPA.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/release/pretrain}
PY=${2:-python3}
LAYERS=${LAYERS:-24} HIDDEN=${HIDDEN:-1024} HEADS=${HEADS:-16} SEQ=${SEQ:-1024}
MBS=${MBS:-4} ITERS=${ITERS:-30} DROPOUT=${DROPOUT:-0.1}
DATA=${DATA:-tests/fixtures/golden/wikitext2_valid_text_document}
PEAK_TFLOPS=${PEAK_TFLOPS:-989}
out=$(mktemp -d)
trap 'rm -rf "$out"; kill "${smi:-0}" 2>/dev/null || true' EXIT

# Megatron's FLOPs per token (6 × matmul parameters + attention), as the log's TFLOP/s.
flops=$(( 6 * (LAYERS * 12 * HIDDEN * HIDDEN + 50304 * HIDDEN) + 12 * LAYERS * HIDDEN * SEQ ))

# Peak GPU memory of a process tree while it runs (nvidia-smi samples every 200 ms).
sample_memory() {
  local file=$1
  while true; do
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1 >> "$file"
    sleep 0.2
  done
}

ferrotron() {
  local name=$1; shift
  : > "$out/mem"
  sample_memory "$out/mem" & smi=$!
  "$BIN" --device cuda --num-layers "$LAYERS" --hidden-size "$HIDDEN" \
    --num-attention-heads "$HEADS" --seq-length "$SEQ" --max-position-embeddings "$SEQ" \
    --micro-batch-size "$MBS" --global-batch-size "$MBS" --train-iters "$ITERS" \
    --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 1 --lr-decay-style cosine --split 100,0,0 \
    --log-interval 10 --eval-iters 0 --eval-interval 0 --data-path "$DATA" \
    --data-cache-path "$out/cache" "$@" > "$out/log" 2>&1 || { cat "$out/log"; exit 1; }
  kill $smi; wait $smi 2>/dev/null || true
  # The last logged interval (after warm-up): Megatron's tokens/s field.
  local tps
  tps=$(grep -o 'tokens/s: [0-9.]*' "$out/log" | tail -1 | awk '{print $2}')
  local mem
  mem=$(sort -n "$out/mem" | tail -1)
  awk -v n="$name" -v t="$tps" -v f="$flops" -v p="$PEAK_TFLOPS" -v m="$mem" 'BEGIN {
    printf "ferrotron %-28s tokens/s: %.0f | TFLOP/s: %.1f | MFU: %.1f %% | peak memory GiB: %.1f\n",
      n, t, t * f / 1e12, 100 * t * f / 1e12 / p, m / 1024 }'
  echo "$tps" > "$out/tps_$name"
}

echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
echo "model: $LAYERS layers, hidden $HIDDEN, $HEADS heads, seq $SEQ, micro-batch $MBS, dropout $DROPOUT"
ferrotron fp32 --hidden-dropout "$DROPOUT" --attention-dropout "$DROPOUT"
ferrotron bf16 --bf16 --hidden-dropout "$DROPOUT" --attention-dropout "$DROPOUT"
ferrotron bf16-no-dropout --bf16 --hidden-dropout 0 --attention-dropout 0
# The fused (FlashAttention-style) attention kernel: no [s, s] scores stored.
ferrotron bf16-flash --bf16 --use-flash-attn --hidden-dropout "$DROPOUT" --attention-dropout "$DROPOUT"
ferrotron bf16-flash-no-dropout --bf16 --use-flash-attn --hidden-dropout 0 --attention-dropout 0

if command -v "$PY" >/dev/null && "$PY" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  for mode in fp32 bf16-sdpa bf16-compile; do
    line=$("$PY" benchmarks/torch_gpu_gpt.py "$LAYERS" "$HIDDEN" "$HEADS" "$SEQ" "$MBS" "$ITERS" "$mode" "$DROPOUT")
    printf "PyTorch   %-28s %s\n" "$mode" "$line"
    echo "$line" | grep -o 'tokens/s: [0-9.]*' | awk '{print $2}' > "$out/torch_$mode"
  done
  for run in bf16 bf16-flash; do
    awk -v n="$run" -v a="$(cat "$out/tps_$run")" -v b="$(cat "$out/torch_bf16-sdpa")" -v c="$(cat "$out/torch_bf16-compile")" 'BEGIN {
      printf "ferrotron %s vs PyTorch eager bf16+SDPA: %.2fx; vs torch.compile: %.2fx\n", n, a / b, a / c }'
  done
else
  echo "no CUDA PyTorch at $PY: PyTorch reference skipped"
fi
for run in bf16 bf16-flash; do
  awk -v n="$run" -v a="$(cat "$out/tps_$run")" -v b="$(cat "$out/tps_$run-no-dropout")" 'BEGIN {
    printf "ferrotron %s: dropout on / off time per iteration: %.2f\n", n, b / a }'
done
