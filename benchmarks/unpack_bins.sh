#!/usr/bin/env bash
# The CUDA builds a GPU run takes, unpacked from BIN_DIR into DEST: BIN_DIR/bins.tar.xz (all of
# them in one archive, which compresses two pretrain builds against each other), or each as
# NAME.xz or NAME. Shared by gpu_profile.sh and gpu_session.sh (docs/gpu.md).
#
#   benchmarks/unpack_bins.sh BIN_DIR DEST
set -uo pipefail
BIN_DIR=$1 DEST=$2
mkdir -p "$DEST"
if [ -f "$BIN_DIR/bins.tar.xz" ]; then
  tar -C "$DEST" -xJf "$BIN_DIR/bins.tar.xz" || { echo "unpack_bins: cannot unpack $BIN_DIR/bins.tar.xz"; exit 1; }
fi
for name in pretrain pretrain-baseline matmul_shapes step_graph; do
  if [ -f "$DEST/$name" ]; then :
  elif [ -f "$BIN_DIR/$name.xz" ]; then xz -dc "$BIN_DIR/$name.xz" > "$DEST/$name"
  elif [ -f "$BIN_DIR/$name" ]; then cp "$BIN_DIR/$name" "$DEST/$name"
  else continue; fi
  chmod +x "$DEST/$name"
done
