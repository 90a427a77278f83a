#!/bin/bash
# make_bundle.sh MODEL FILE... : the files that are too big for one device call (weights pack, big SP-Prac
# artifacts) as one tar, split into ${CHUNK_MIB:-56} MiB chunks, with a manifest of sizes and sha256 for dev.sh.
# CARRY (default .device_carry/gpueval, under the repository that the device tool sends) holds the result:
#   $CARRY/chunks/MODEL.NN and $CARRY/run/MODEL.manifest
set -e
CARRY=${CARRY:-.device_carry/gpueval}
M=$1; shift
mkdir -p "$CARRY/bundles" "$CARRY/chunks" "$CARRY/run"
tar -cf "$CARRY/bundles/$M.tar" --transform 's,.*/,,' "$@"
rm -f "$CARRY/chunks/$M".*
split -b $((${CHUNK_MIB:-56} * 1024 * 1024)) -d -a 2 "$CARRY/bundles/$M.tar" "$CARRY/chunks/$M."
{ echo "total $(stat -c%s "$CARRY/bundles/$M.tar") $(sha256sum "$CARRY/bundles/$M.tar" | cut -d' ' -f1)"
  off=0
  for c in "$CARRY/chunks/$M".*; do
    s=$(stat -c%s "$c"); echo "chunk ${c##*.} $off $s $(sha256sum "$c" | cut -d' ' -f1)"; off=$((off + s))
  done; } > "$CARRY/run/$M.manifest"
cat "$CARRY/run/$M.manifest"
