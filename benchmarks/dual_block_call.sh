#!/usr/bin/env bash
# One device call for kernels/dual.py's dual_block (session 23): the MLP-half A/B against the norm on its own kernel
# (benchmarks/block_ab.py, each route checked against float64 at the real shape first), then dual[lowrank] at k = 0.9
# on the per-compile runner with dual_block on (DUAL_BLOCK=0: off, the default since this call found it slower).
# (tests/test_block.py's dual_block cases run with `make gpu-test`.)
# Usage on the device: OUT=... bash benchmarks/dual_block_call.sh   (results: benchmarks/results/dual_block/)
set -u
OUT=${OUT:-/tmp/out}
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
COUNTDOWN_PDL=1 timeout 90 python benchmarks/block_ab.py --out "$OUT/block" --ks 0.8,0.9 --rounds 3 2>&1 | tail -9
echo "== block_ab $((SECONDS - t0)) s"
COUNTDOWN_DUAL_BLOCK=${DUAL_BLOCK:-1} timeout ${DECODE_TIMEOUT:-175} python benchmarks/decode.py --runner per-compile \
  --methods "dual[lowrank]" --ks 0.9 --skip-checks --no-breakdown --dense-samples 2 --samples 2 --budget-s ${BUDGET:-140} --out /tmp/run > /tmp/decode.log 2>&1
echo "== decode rc=$? $((SECONDS - t0)) s"
grep -E "^(dense|dual)|tokens/s" /tmp/decode.log | cut -c1-160 | tail -12
grep -iE "error|Traceback" /tmp/decode.log | head -5
mkdir -p "$OUT/run"; cp /tmp/run/decode.md /tmp/run/decode.csv /tmp/decode.log "$OUT/run/" 2>/dev/null
