#!/usr/bin/env bash
# mono at k = 0.9 on the per-compile (full-graph) runner: the post-attention norm, the sparse MLP and the residual add
# in two launches (COUNTDOWN_FOLD_MLP=1, kernels/_block.py) against four or five (=0), alternating processes.
# Usage on the device: OUT=... ROUNDS=2 [METHODS="dual[lowrank],dual[shadow4]" BUDGET=200 TIMEOUT=240] bash benchmarks/fold_mlp_ab.sh
# (results: benchmarks/results/decode_runs/H200-run-BM/)
set -u
OUT=${OUT:-/tmp/out}
for i in $(seq 1 "${ROUNDS:-2}"); do for r in 0 1; do
  t0=$SECONDS
  COUNTDOWN_FOLD_MLP=$r PYTHONPATH=src timeout ${TIMEOUT:-175} python benchmarks/decode.py --runner per-compile --methods "${METHODS:-mono}" \
    --ks 0.9 --skip-checks --no-breakdown --dense-samples 2 --samples 2 --budget-s ${BUDGET:-140} --out "$OUT/fold$r-$i" \
    > "/tmp/fold$r-$i.log" 2>&1
  echo "== FOLD_MLP=$r round $i rc=$? $((SECONDS - t0)) s"
  grep -E "^(dense|mono|dual|cats|teal)" "/tmp/fold$r-$i.log" | cut -c1-120
  grep -iE "error|Traceback" "/tmp/fold$r-$i.log" | head -3
done; done
