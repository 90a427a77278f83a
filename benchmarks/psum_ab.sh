#!/usr/bin/env bash
# mono at k = 0.9 on the per-compile (full-graph) runner: the partials' sum as a launch of its own
# (COUNTDOWN_PSUM=auto) against the sparse kernel summing its own partials (tail), two processes each, alternating.
# Usage on the device: OUT=... bash benchmarks/psum_ab.sh   (session 21: +0.3 %, results/decode_runs/H200-run-BL/)
set -u
OUT=${OUT:-/tmp/out}
for i in 1 2; do for r in auto tail; do
  t0=$SECONDS
  COUNTDOWN_PSUM=$r PYTHONPATH=src timeout 140 python benchmarks/decode.py --runner per-compile --methods mono --ks 0.9 \
    --skip-checks --no-breakdown --dense-samples 2 --samples 2 --budget-s 120 --out "$OUT/$r$i" > "/tmp/$r$i.log" 2>&1
  echo "== $r$i rc=$? $((SECONDS - t0)) s"
  grep -E "^(dense|mono) " "/tmp/$r$i.log" | cut -c1-120
  grep -iE "error|Traceback" "/tmp/$r$i.log" | head -3
done; done
