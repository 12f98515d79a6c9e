#!/usr/bin/env bash
# Peak GPU memory of the bf16 GPT-2 345M step against how far the host may run ahead of the GPU.
#
#   benchmarks/gpu_runahead.sh BIN_DIR REPORT_DIR [PYTHON]
#
# Why: on 2026-11-30 the eager bf16 step peaked at 29.7 GiB by nvidia-smi (PyTorch: 13.1), where
# the same step under CubeCL's profiling (a synchronisation after every kernel) peaked at
# 12.8 GiB. The host queues work ahead of the GPU; these runs tell steps queued ahead from work
# queued ahead within a step: `--log-interval 1` reads the loss every iteration (a
# synchronisation per step, as Megatron's per-step reads of the grad norm are; on 2026-11-30 it
# changed nothing), host ordering of the cuBLAS products synchronises at every window (12.6
# GiB). PyTorch runs beside them.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN_DIR=$1 REPORT=$2 PY=${3:-python3}
mkdir -p "$REPORT"
W=$(mktemp -d)
benchmarks/unpack_bins.sh "$BIN_DIR" "$W" || exit 1
NV=$("$PY" -c "import nvidia; print(nvidia.__path__[0])" 2>/dev/null || true)
[ -n "$NV" ] && export LD_LIBRARY_PATH=$(ls -d "$NV"/*/lib 2>/dev/null | tr '\n' ':')/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
# measured NAME command...: the command's output in REPORT/NAME.log, its peak nvidia-smi memory.
measured() {
  local name=$1; shift
  : > "$W/$name.mem"
  ( while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1; sleep 0.2; done ) > "$W/$name.mem" &
  local sampler=$!
  timeout 90 bash -c '"$@"' measured "$@" > "$REPORT/$name.log" 2>&1
  echo "[exit $?]" >> "$REPORT/$name.log"
  kill $sampler; wait $sampler 2>/dev/null
  local tps peak
  tps=$(grep -o 'tokens/s: [0-9.]*' "$REPORT/$name.log" | tail -1 | awk '{print $2}')
  peak=$(sort -n "$W/$name.mem" | tail -1 | awk '{printf "%.1f", $1 / 1024}')
  echo "| $name | ${tps:-?} | ${peak:-?} |" | tee -a "$REPORT/runahead.md"
}
step345m() {
  "$W/pretrain" --device "${DEVICE:-cuda}" --num-layers "${LAYERS:-24}" --hidden-size "${HIDDEN:-1024}" \
    --num-attention-heads "${HEADS:-16}" --seq-length "${SEQ:-1024}" --max-position-embeddings "${SEQ:-1024}" \
    --micro-batch-size "${MBS:-4}" --global-batch-size "${MBS:-4}" --train-iters 12 --lr 1e-4 --min-lr 1e-5 \
    --lr-warmup-iters 1 --lr-decay-style cosine --split 100,0,0 --eval-iters 0 --eval-interval 0 \
    --data-path tests/fixtures/golden/wikitext2_valid_text_document --data-cache-path "$W/cache" \
    --bf16 --hidden-dropout 0.1 --attention-dropout 0.1 "$@"
}
export W
export -f step345m
echo "| run (bf16, dropout 0.1, 12 iterations) | tokens/s (last logged) | peak GiB (nvidia-smi) |" | tee "$REPORT/runahead.md"
echo "|---|---|---|" | tee -a "$REPORT/runahead.md"
measured log-interval-4 step345m --log-interval 4
measured log-interval-1 step345m --log-interval 1
FERROTRON_CUBLAS_ORDER=host measured host-ordering step345m --log-interval 4
measured torch-bf16-sdpa "$PY" benchmarks/torch_gpu_gpt.py "${LAYERS:-24}" "${HIDDEN:-1024}" "${HEADS:-16}" "${SEQ:-1024}" "${MBS:-4}" 20 bf16-sdpa 0.1
measured log-interval-4-again step345m --log-interval 4
