# What the GPU scripts share (gpu_profile.sh, gpu_runahead.sh, gpu_smoke.sh): sourced, not run.
# One copy, so that a fix to how CUDA's libraries are found or how memory is sampled reaches
# every script that measures with them.

# The model the GPU scripts train: GPT-2 345M at micro-batch 4 unless the caller sets it
# (DEVICE=cpu with small sizes dry-runs a script on a CPU).
DEVICE=${DEVICE:-cuda} LAYERS=${LAYERS:-24} HIDDEN=${HIDDEN:-1024} HEADS=${HEADS:-16}
SEQ=${SEQ:-1024} MBS=${MBS:-4}
DATA=${DATA:-tests/fixtures/golden/wikitext2_valid_text_document}
export DEVICE LAYERS HIDDEN HEADS SEQ MBS DATA

# cuda_libraries PYTHON: CUDA's libraries from PYTHON's NVIDIA wheels (cuBLAS above all, NCCL)
# put on LD_LIBRARY_PATH; libcuda comes with the driver. Nothing where PYTHON has no wheels.
cuda_libraries() {
  local nv
  nv=$("$1" -c "import nvidia; print(nvidia.__path__[0])" 2>/dev/null || true)
  if [ -n "$nv" ]; then
    LD_LIBRARY_PATH=$(ls -d "$nv"/*/lib 2>/dev/null | tr '\n' ':')/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
    export LD_LIBRARY_PATH
  fi
}

# with_memory FILE command...: runs the command while sampling the card's used memory
# (nvidia-smi, every 200 ms, in MiB) into FILE; returns the command's status.
with_memory() {
  local mem=$1; shift
  ( while true; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1 >> "$mem"; sleep 0.2; done ) &
  local sampler=$!
  "$@"; local rc=$?
  kill $sampler 2>/dev/null; wait $sampler 2>/dev/null
  return $rc
}

# peak_gib FILE: the largest of with_memory's samples in GiB ("?" where there are none). It
# counts what the process holds on the card (PyTorch's own figure counts its allocator's).
peak_gib() {
  awk '$1 > m { m = $1 } END { if (NR) printf "%.1f", m / 1024; else printf "?" }' "$1" 2>/dev/null || printf '?'
}

# pretrain_model BINARY NAME ITERATIONS [FLAGS...]: the model above trained for ITERATIONS on
# DATA (logging every 4 iterations, with throughput) under with_memory into WORK/logs/NAME.mem.
# RUN_FLAGS (the caller's: flags every run of a lease takes, e.g. `--cublas-ordering host`)
# and FLAGS come last, so they may override these (a repeated flag's last value wins, as in
# Megatron).
pretrain_model() {
  local bin=$1 name=$2 iters=$3; shift 3
  # shellcheck disable=SC2086
  with_memory "$WORK/logs/$name.mem" "$bin" --device "$DEVICE" --num-layers "$LAYERS" \
    --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" --seq-length "$SEQ" \
    --max-position-embeddings "$SEQ" \
    --micro-batch-size "$MBS" --global-batch-size "$MBS" --train-iters "$iters" \
    --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 1 --lr-decay-style cosine --split 100,0,0 \
    --log-interval 4 --eval-iters 0 --eval-interval 0 --log-throughput \
    --data-path "$DATA" --data-cache-path "$WORK/cache" ${RUN_FLAGS:-} "$@"
}

# lm_losses LOG: the lm loss of each logged iteration, on one line.
lm_losses() {
  grep -o 'lm loss: [0-9.E+-]*' "$1" | awk '{print $3}' | tr '\n' ' '
}

# Functions a script runs under `timeout` (through a child bash).
export -f with_memory pretrain_model
