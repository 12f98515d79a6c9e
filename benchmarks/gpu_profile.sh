#!/usr/bin/env bash
# One command that profiles ferrotron's training step on a CUDA GPU and writes one report
# (issue: GPU speed by design). Sized for a short lease: every step has a time limit, the
# whole run a deadline (BUDGET_S), and the most telling steps come first.
#
#   benchmarks/gpu_profile.sh BIN_DIR REPORT_DIR [PYTHON]
#
# BIN_DIR holds CUDA builds (see docs/gpu.md, "Building on one machine, running on another"):
#   pretrain            cargo build --release --features cuda --bin pretrain
#   pretrain-baseline   another CUDA build to compare with, e.g. the commit before a change
#                       (optional; its bf16 step and host floor run right after the new build's).
#                       With BASELINE_FLAGS (e.g. BASELINE_FLAGS="--cuda-matmul cubecl") and no
#                       such build, the baseline is `pretrain` itself with those flags added.
#   matmul_shapes       cargo build --release --features cuda --example matmul_shapes
#                       (target/release/examples/matmul_shapes; optional)
#   step_graph          cargo build --release --features cuda --example step_graph
#                       (optional: the forward + backward replayed from a captured graph)
# each possibly xz-compressed (NAME.xz), or together in BIN_DIR/bins.tar.xz. PYTHON: a Python with CUDA PyTorch (default python3).
# REPORT_DIR receives report.md (the numbers) and logs.tar.xz (every run's log).
#
# Steps, the acceptance's first: probe (nvidia-smi, driver, profilers); the model in bf16 with
# dropout, the default attention (--attention-backend auto: on CUDA in bf16 the composed core
# on cuBLAS keeping only q, k, v; then the baseline build's), PyTorch eager bf16 + SDPA beside,
# the step captured and replayed (--cuda-graph-impl local), --attention-backend unfused (the
# core keeping its probabilities), and bf16 without dropout; CubeCL's per-kernel profile of the
# default bf16 step summed by class (iterations 3-5 of a 5-iteration run, an iteration ending at its
# Adam launches; set PROFILE_FLAGS=--use-flash-attn for the fused attention); the forward +
# backward captured as a CUDA graph and replayed, against eager; --use-flash-attn;
# the host floor (24 layers at hidden 64, seq 64: launch overhead) of both builds; the GPT's
# matmul shapes, CubeCL default vs autotune vs cuBLAS; flash without dropout; fp32;
# torch.compile.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN_DIR=$1 REPORT=$2 PY=${3:-python3}
BUDGET_S=${BUDGET_S:-520}
ITERS=${ITERS:-12}
# LAYERS, HIDDEN, HEADS, SEQ, MBS, DATA, DEVICE: the model (gpu_common.sh: GPT-2 345M at
# micro-batch 4; DEVICE=cpu with small sizes dry-runs the script on a CPU). DROPOUT: 0.1 by
# default. PEAK_TFLOPS: the card's dense bf16 peak for MFU (default 989, an H100/H200).
source benchmarks/gpu_common.sh
DROPOUT=${DROPOUT:-0.1} PEAK_TFLOPS=${PEAK_TFLOPS:-989}
MODEL="$LAYERS layers, hidden $HIDDEN, $HEADS heads, seq $SEQ, micro-batch $MBS"
START=$(date +%s)
WORK=$(mktemp -d)
export WORK
mkdir -p "$REPORT" "$WORK/logs" "$WORK/bin"
R="$REPORT/report.md"
: > "$R"
say() { echo "$*" | tee -a "$R"; }
finish() {
  tar -C "$WORK" -cJf "$REPORT/logs.tar.xz" logs 2>/dev/null
  say "total wall time: $(( $(date +%s) - START )) s"
}
trap finish EXIT

# Binaries: unpack what is there.
benchmarks/unpack_bins.sh "$BIN_DIR" "$WORK/bin"
P="$WORK/bin/pretrain"
export P
if [ ! -f "$WORK/bin/pretrain-baseline" ] && [ -n "${BASELINE_FLAGS:-}" ]; then
  printf '#!/bin/sh\nexec "%s" "$@" %s\n' "$P" "$BASELINE_FLAGS" > "$WORK/bin/pretrain-baseline"
  chmod +x "$WORK/bin/pretrain-baseline"
fi
cuda_libraries "$PY"

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
# ratio A B: the tokens/s of run A over run B's ("1.234x"), nothing unless both ran.
ratio() {
  [ -s "$WORK/tps_$1" ] && [ -s "$WORK/tps_$2" ] &&
    awk -v a="$(cat "$WORK/tps_$1")" -v b="$(cat "$WORK/tps_$2")" 'BEGIN{printf "%.3fx", a/b}'
}
# say_losses RUN...: a line per run that has a log, its lm loss at each logged iteration.
say_losses() {
  local run
  for run in "$@"; do
    [ -f "$WORK/logs/$run.log" ] && say "- $run: $(lm_losses "$WORK/logs/$run.log")"
  done
  return 0
}
# step NAME MAX_SECONDS MIN_SECONDS command...: runs the command with its output in
# logs/NAME.log, under min(MAX, time left); skipped when less than MIN is left.
step() {
  local name=$1 max=$2 min=$3; shift 3
  local l; l=$(left)
  if [ "$l" -lt "$min" ]; then say "- $name: skipped ($l s left of the budget)"; return 1; fi
  [ "$l" -lt "$max" ] && max=$l
  local t0; t0=$(date +%s)
  # Shell functions run under `timeout` through a child bash (they are exported below).
  timeout "$max" bash -c '"$@"' step "$@" > "$WORK/logs/$name.log" 2>&1
  local rc=$?
  echo "[$name: exit $rc after $(( $(date +%s) - t0 )) s]" >> "$WORK/logs/$name.log"
  [ $rc -eq 0 ] || say "- $name: exit $rc after $(( $(date +%s) - t0 )) s (limit $max s); last lines: $(tail -3 "$WORK/logs/$name.log" | tr '\n' ' ' | cut -c1-400)"
  return $rc
}

# ferrotron's log: the last interval's tokens/s and ms per iteration (warm-up excluded).
train_line() {
  local name=$1 log="$WORK/logs/$1.log"
  local tps ms tflops
  tps=$(grep -o 'tokens/s: [0-9.]*' "$log" | tail -1 | awk '{print $2}')
  ms=$(grep -o 'elapsed time per iteration (ms): [0-9.]*' "$log" | tail -1 | awk '{print $NF}')
  tflops=$(grep -o 'throughput per GPU (TFLOP/s/GPU): [0-9.]*' "$log" | tail -1 | awk '{print $NF}')
  say "| ferrotron $name | ${tps:-?} | ${ms:-?} | $(awk -v t="${tflops:-0}" -v p="$PEAK_TFLOPS" 'BEGIN{printf "%.1f %%", 100*t/p}') | $(peak_gib "$WORK/logs/$name.mem") |"
  echo "${tps:-0}" > "$WORK/tps_$name"
}

say "# ferrotron GPU profile, $(date -u +%Y-%m-%dT%H:%MZ)"
say ""
say '## Machine'
say '```'
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv | tee -a "$R"
say "nvcc: $(nvcc --version 2>/dev/null | tail -2 | head -1)"
say "profilers: $(for t in ncu nsys compute-sanitizer; do command -v $t >/dev/null && printf '%s ' $t; done)"
say "torch: $("$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())' 2>&1 | tail -1)"
say "binaries: $(ls "$WORK/bin" | tr '\n' ' ')"
say '```'
say ""
say "## Training step: $MODEL, bf16, dropout $DROPOUT ($ITERS iterations, the last 4 timed)"
say ""
say "| run | tokens/s | ms/iteration | MFU | peak GPU memory GiB |"
say "|---|---|---|---|---|"
D="--hidden-dropout $DROPOUT --attention-dropout $DROPOUT"
B="--bf16 $D"
# PyTorch's arguments: the same model, 20 steps.
T="$LAYERS $HIDDEN $HEADS $SEQ $MBS 20"
# shellcheck disable=SC2086
step bf16 150 60 pretrain_model "$P" bf16 "$ITERS" $B && train_line bf16
BASE="$WORK/bin/pretrain-baseline"
if [ -x "$BASE" ]; then
  # shellcheck disable=SC2086
  step bf16-baseline 150 60 pretrain_model "$BASE" bf16-baseline "$ITERS" $B && train_line bf16-baseline
fi
if step torch-bf16-sdpa 90 40 with_memory "$WORK/logs/torch-bf16-sdpa.mem" "$PY" benchmarks/torch_gpu_gpt.py $T bf16-sdpa "$DROPOUT"; then
  say "| PyTorch eager bf16 + SDPA | $(tail -2 "$WORK/logs/torch-bf16-sdpa.log" | head -1) (allocator), $(peak_gib "$WORK/logs/torch-bf16-sdpa.mem") GiB (nvidia-smi, as ferrotron's) |"
  grep -o 'tokens/s: [0-9.]*' "$WORK/logs/torch-bf16-sdpa.log" | awk '{print $2}' > "$WORK/tps_torch"
fi
# The same step captured once and replayed (--cuda-graph-impl local --cuda-graph-scope
# full_iteration, after 3 eager warm-up steps; the last 4 iterations timed are replays), the
# cuBLAS products queued after each replay (docs/gpu.md, "Captured steps"). GRAPH=0 leaves
# the captured runs out (gpu_session.sh sets it when the smoke check's capture failed).
G="--cuda-graph-impl local --cuda-graph-scope full_iteration"
GRAPH=${GRAPH:-1}
# shellcheck disable=SC2086
[ "$GRAPH" = 1 ] && step bf16-graph 150 60 pretrain_model "$P" bf16-graph "$ITERS" $G $B && train_line bf16-graph
# The default on CUDA in bf16 (--attention-backend auto) is the composed attention core keeping
# only q, k, v and forming its probabilities again in its backward (Megatron's selective
# recomputation), as SDPA keeps none; `unfused` keeps them: more memory for GPT-2 345M, for the
# speed of not forming them twice (measured: benchmarks/results/2026-11-30-h200-gpu-history.md;
# after PyTorch's run, which every ratio needs).
# shellcheck disable=SC2086
step bf16-unfused 150 60 pretrain_model "$P" bf16-unfused "$ITERS" --attention-backend unfused $B && train_line bf16-unfused
# The acceptance's dropout check: the composed bf16 step without dropout, against bf16 above.
step bf16-no-dropout 100 50 pretrain_model "$P" bf16-no-dropout "$ITERS" --bf16 --hidden-dropout 0 --attention-dropout 0 &&
  train_line bf16-no-dropout
r=$(ratio bf16 bf16-no-dropout) && say "ferrotron bf16, dropout $DROPOUT / no dropout: $r (the target: at least 0.9x)"
for run in bf16 bf16-baseline bf16-graph bf16-unfused; do
  r=$(ratio "$run" torch) && say "ferrotron $run / PyTorch eager bf16+SDPA: $r"
done
r=$(ratio bf16-graph bf16) && say "ferrotron bf16, captured step / eager: $r"
r=$(ratio bf16 bf16-baseline) && say "ferrotron bf16 / baseline build bf16: $r"
r=$(ratio bf16 bf16-unfused) && say "ferrotron bf16 (auto: probabilities formed again) / unfused (kept): $r"
say ""
say "lm loss by logged iteration (the same seed and data: a change of kernels shows as a change of losses; recomputation must change none):"
say_losses bf16 bf16-baseline bf16-graph bf16-unfused
say ""

# The step captured as a graph and replayed (one launch for the host, then the recorded
# cuBLAS products) against the same step eager, in one process (benchmarks/step_graph.rs,
# optional: pretrain's bf16-graph and floor-graph runs measure the same through the training
# loop). First at the host floor's sizes, where the step is launch overhead (short); the
# model's sizes after the profile.
SG="$WORK/bin/step_graph"
# CUBE_DEVICE: a CubeCL device for the runs that need one (these captured steps, the
# per-kernel profile) where DEVICE is not one (a dry run: DEVICE=cpu, CUBE_DEVICE=wgpu-cpu).
GD=${CUBE_DEVICE:-$DEVICE}
graph_section() {
  [ -x "$SG" ] || return 0
  say "## Captured step ($1): the training step (forward, backward, AdamW) replayed from a CUDA graph against eager (bf16, dropout 0.1)"
  say '```'
  shift
  "$@"
  say '```'
  say ""
}
graph_floor() {
  step graph-floor 90 30 "$SG" "$GD" 24 64 4 64 4 10 &&
    tee -a "$R" < "$WORK/logs/graph-floor.log" > /dev/null
}
graph_model() {
  step graph-model 150 60 "$SG" "$GD" "$LAYERS" "$HIDDEN" "$HEADS" "$SEQ" "$MBS" 5 &&
    tee -a "$R" < "$WORK/logs/graph-model.log" > /dev/null
}
graph_section "host floor: 24 layers, hidden 64, 4 heads, seq 64, micro-batch 4" graph_floor

PROFILE_FLAGS=${PROFILE_FLAGS:-}
# PROFILE_PRECISION: a precision the dry run's CUBE_DEVICE takes (lavapipe refuses bf16:
# --fp16), so the profile's summary and watch table run before a lease depends on them.
PP=${PROFILE_PRECISION:---bf16}
# One 5-iteration run, read by iteration: the launches after iteration 2's Adam step up to the
# last one (an autotuning build logs its tuning and CubeCL's device probes in amounts that vary
# from run to run, so subtracting a shorter run's log does not cancel them).
say "## Per-kernel GPU time (CubeCL profile on $GD, ${PP#--} with dropout, ${PROFILE_FLAGS:-default attention}; iterations 3-5 of a 5-iteration run)"
say '```'
# shellcheck disable=SC2086
if DEVICE=$GD CUBECL_DEBUG_OPTION=profile CUBECL_DEBUG_LOG="$WORK/logs/prof5.txt" step profile-5 90 40 pretrain_model "$P" profile-5 5 $PROFILE_FLAGS $PP $D; then
  "$PY" benchmarks/kernel_profile_summary.py "$WORK/logs/prof5.txt" --after AdamStep 2 \
    --watch benchmarks/watched_kernels.tsv 2>&1 | tee -a "$R"
fi
say '```'
say ""

graph_section "$MODEL" graph_model

# The fused attention (FLASH=0 leaves out its runs): after the acceptance's runs and the
# profile. Its kernels run on tensor cores (cmma) where the device has them for bf16 (the
# CUDA-core kernels' figures: benchmarks/results/2026-11-30-h200-gpu-history.md).
FLASH=${FLASH:-1}
if [ "$FLASH" = 1 ]; then
  say "## Fused attention (--use-flash-attn): $MODEL, bf16, dropout $DROPOUT"
  say ""
  say "| run | tokens/s | ms/iteration | MFU | peak GPU memory GiB |"
  say "|---|---|---|---|---|"
  # shellcheck disable=SC2086
  step bf16-flash 120 50 pretrain_model "$P" bf16-flash "$ITERS" --use-flash-attn $B && train_line bf16-flash
  r=$(ratio bf16-flash torch) && say "ferrotron bf16-flash / PyTorch eager bf16+SDPA: $r"
  r=$(ratio bf16-flash bf16) && say "ferrotron bf16-flash / bf16 (composed attention on cuBLAS): $r"
  say ""
  say "lm loss by logged iteration (tensor cores round the probabilities to bf16 before p·v; expect the first digits to agree):"
  say_losses bf16 bf16-flash
  say ""
fi

say "## Host floor: 24 layers, hidden 64, 4 heads, seq 64, micro-batch 4 (the step is launch overhead)"
floor() {
  local bin=$1; shift
  "$bin" --device "$DEVICE" --num-layers 24 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
    --max-position-embeddings 64 --micro-batch-size 4 --global-batch-size 4 --train-iters 20 --bf16 \
    --lr 1e-4 --split 100,0,0 --log-interval 5 --eval-iters 0 --eval-interval 0 \
    --data-path "$DATA" --data-cache-path "$WORK/cache" --use-flash-attn "$@"
}
export -f floor
step floor 60 20 floor "$P" --hidden-dropout 0.1 --attention-dropout 0.1 &&
  say "ms/iteration (last 5): $(grep -o 'elapsed time per iteration (ms): [0-9.]*' "$WORK/logs/floor.log" | tail -1 | awk '{print $NF}')"
# shellcheck disable=SC2086
[ "$GRAPH" = 1 ] && step floor-graph 60 20 floor "$P" --hidden-dropout 0.1 --attention-dropout 0.1 $G &&
  say "the step captured and replayed ($G), ms/iteration (last 5): $(grep -o 'elapsed time per iteration (ms): [0-9.]*' "$WORK/logs/floor-graph.log" | tail -1 | awk '{print $NF}')"
[ -x "$BASE" ] && step floor-baseline 60 20 floor "$BASE" --hidden-dropout 0.1 --attention-dropout 0.1 &&
  say "baseline build, ms/iteration (last 5): $(grep -o 'elapsed time per iteration (ms): [0-9.]*' "$WORK/logs/floor-baseline.log" | tail -1 | awk '{print $NF}')"
say ""

say "## Matmuls of the GPT's shapes (bf16; T = $(( MBS * SEQ )) tokens): CubeCL default, CubeCL autotune, cuBLAS"
say '```'
if [ -x "$WORK/bin/matmul_shapes" ]; then
  step matmul-cubecl 150 40 "$WORK/bin/matmul_shapes" $(( MBS * SEQ )) "$HIDDEN" && tee -a "$R" < "$WORK/logs/matmul-cubecl.log" > /dev/null
fi
step matmul-torch 60 15 "$PY" benchmarks/torch_matmul_shapes.py $(( MBS * SEQ )) "$HIDDEN" && tee -a "$R" < "$WORK/logs/matmul-torch.log" > /dev/null
say '```'
say ""

say "## More training runs"
say ""
say "| run | tokens/s | ms/iteration | MFU | peak GPU memory GiB |"
say "|---|---|---|---|---|"
[ "$FLASH" = 1 ] && step bf16-flash-no-dropout 100 50 pretrain_model "$P" bf16-flash-no-dropout "$ITERS" --use-flash-attn --bf16 --hidden-dropout 0 --attention-dropout 0 &&
  train_line bf16-flash-no-dropout
# shellcheck disable=SC2086
step fp32 100 50 pretrain_model "$P" fp32 "$ITERS" $D && train_line fp32
# shellcheck disable=SC2086
[ -x "$BASE" ] && step fp32-baseline 100 50 pretrain_model "$BASE" fp32-baseline "$ITERS" $D && train_line fp32-baseline
for run in fp32 fp32-baseline; do
  [ -f "$WORK/logs/$run.log" ] && say "- lm loss, $run: $(lm_losses "$WORK/logs/$run.log")"
done
if step torch-bf16-compile 150 90 with_memory "$WORK/logs/torch-bf16-compile.mem" "$PY" benchmarks/torch_gpu_gpt.py $T bf16-compile "$DROPOUT"; then
  say "| PyTorch bf16 + SDPA + torch.compile | $(tail -2 "$WORK/logs/torch-bf16-compile.log" | head -1) (allocator), $(peak_gib "$WORK/logs/torch-bf16-compile.mem") GiB (nvidia-smi) |"
fi
say ""
