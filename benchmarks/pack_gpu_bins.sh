#!/usr/bin/env bash
# Packs the release binaries for a GPU machine into .gpubin/ (git-ignored) and checks that
# what a device call carries fits its limit.
#
#   benchmarks/pack_gpu_bins.sh [BINARY...]    default: target/release/pretrain and
#                                              target/release/examples/step_graph
#
# Why: a device call carries the working tree (tracked and untracked-not-ignored files) and
# the carried paths, 64 MiB in all. The repository and the two stripped binaries, in one xz
# archive whose dictionary spans both, fit just inside (measured:
# benchmarks/results/2026-11-29-2core-gpu-session-builds-and-dry-runs.md), so a grown
# binary or fixture can make the lease's one call fail. This says so here, before the lease.
# Writes .gpubin/bins.tar.xz and .gpubin/BUILD (the commit, named in gpu_session.sh's report).
set -euo pipefail
cd "$(dirname "$0")/.."
LIMIT=$((64 * 1024 * 1024))
bins=("$@")
[ ${#bins[@]} -eq 0 ] && bins=(target/release/pretrain target/release/examples/step_graph)
for b in "${bins[@]}"; do
  [ -x "$b" ] || { echo "pack_gpu_bins: no binary $b (cargo build --release --features cuda --bin pretrain --example step_graph)" >&2; exit 1; }
done
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cp "${bins[@]}" "$stage/"
strip "$stage"/*
mkdir -p .gpubin
# One archive, one dictionary over all binaries: they share most of their code.
tar -cf - -C "$stage" . | xz -T1 --lzma2=preset=6,dict=320MiB > .gpubin/bins.tar.xz.tmp
mv .gpubin/bins.tar.xz.tmp .gpubin/bins.tar.xz
{ git rev-parse HEAD; git status --short | head -5; } > .gpubin/BUILD
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
packed=$(du -cb .gpubin | tail -1 | cut -f1)
total=$((tree + packed))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "pack_gpu_bins: stripped $(du -cb "$stage" | tail -1 | cut -f1) bytes of binaries into $(mib "$packed") (.gpubin)"
echo "pack_gpu_bins: a call carries the working tree $(mib "$tree") + .gpubin $(mib "$packed") = $(mib "$total") of $(mib "$LIMIT")"
if [ "$total" -gt "$LIMIT" ]; then
  echo "pack_gpu_bins: OVER the limit by $(mib $((total - LIMIT))). Leave the Megatron checkpoint fixtures (14 MiB)" >&2
  echo "  out of the working tree for the call (mv tests/fixtures/megatron_ckpt ..; mv it back after;" >&2
  echo "  the GPU scripts read only tests/fixtures/golden), or pack one binary." >&2
  exit 3
fi
