#!/usr/bin/env bash
# Everything a GPU lease needs from this machine, in one command, in the order that makes a
# usable archive soonest: the system packages and the LLVM stand-in, the CUDA build of
# `pretrain` packed alone into .gpubin/ (a lease can start on it), then `step_graph` built and
# the two packed together.
#
#   benchmarks/gpu_prepare.sh            then, on the GPU machine: benchmarks/gpu_session.sh .gpubin $OUT
#
# Why: whether a session is lent a GPU is known only at its start, a fresh checkout holds no
# build, and the loan can be paused while the build runs (once from the session's start until
# the build and packing of both binaries ended; measured:
# benchmarks/results/2026-11-29-2core-gpu-session-builds-and-dry-runs.md). `pretrain`
# alone has both cores for its code generation and leaves out the dev-dependencies that the
# example links; `step_graph` (the captured-step benchmark) is optional to gpu_session.sh.
# An archive that is still valid (the reuse check of docs/gpu.md: nothing built into the
# binaries changed since its commit) is kept and not rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
elapsed() { echo "gpu_prepare: $1 after $((SECONDS - START)) s"; }

# The sources built into the binaries: a change to any of them makes the archive stale.
BUILT_FROM=(src assets kernels/src kernels/build.rs kernels/Cargo.toml benchmarks/step_graph.rs Cargo.toml Cargo.lock)
# archive_holds NAME: the archive is valid and holds NAME. (Not `grep -q`: it stops reading at
# the first match, and under pipefail tar's broken pipe then reads as "not in the archive".)
archive_holds() {
  [ -f .gpubin/BUILD ] && [ -f .gpubin/bins.tar.xz ] &&
    git diff --quiet "$(head -1 .gpubin/BUILD)" -- "${BUILT_FROM[@]}" 2>/dev/null &&
    tar -tJf .gpubin/bins.tar.xz | grep -x "\./$1" > /dev/null
}
if archive_holds step_graph; then
  echo "gpu_prepare: .gpubin (built from $(head -1 .gpubin/BUILD | cut -c1-7)) is still valid"
  exit 0
fi

.ci/packages
.ci/llvm-bundle
if ! archive_holds pretrain; then
  cargo build --release --locked --features cuda --bin pretrain
  elapsed "pretrain built"
  benchmarks/pack_gpu_bins.sh target/release/pretrain
  elapsed "the archive of pretrain alone can travel (carry .gpubin)"
fi
cargo build --release --locked --features cuda --example step_graph
elapsed "step_graph built"
benchmarks/pack_gpu_bins.sh
elapsed "the archive of pretrain and step_graph can travel"
