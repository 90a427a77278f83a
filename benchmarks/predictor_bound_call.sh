#!/usr/bin/env bash
# One device call for session 25's bound (benchmarks/predictor_bound.py): dual[lowrank] in the one-compile decode
# benchmark as it is ("real"), then with its predictor's launches gone from the MLP's chain ("norm": the norm
# kernel, the sparse kernel and its partials' sum left).
# Usage on the device: OUT=... [METHODS=...] bash benchmarks/predictor_bound_call.sh
set -u
OUT=${OUT:-/tmp/out}
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
common=(--methods "${METHODS:-dual[lowrank],dual[lowrank16]}" --ks 0.9 --no-breakdown --dense-compiles 1
        --kernel-layers 2 --budget-s "${BUDGET:-150}")
for B in real norm; do
  if [ "$B" = real ]; then
    timeout "${DECODE_TIMEOUT:-200}" python benchmarks/decode.py "${common[@]}" --skip-checks --out "$OUT/$B" \
      > "/tmp/bound_$B.log" 2>&1
  else
    timeout "${DECODE_TIMEOUT:-200}" python benchmarks/predictor_bound.py "${common[@]}" \
      --out "$OUT/$B" > "/tmp/bound_$B.log" 2>&1
  fi
  echo "== $B rc=$? $((SECONDS - t0)) s"
  grep -E "floor \(|^(dense|dual)|predictor_bound:" "/tmp/bound_$B.log" | cut -c1-130 | tail -6
  grep -iE "error|Traceback" "/tmp/bound_$B.log" | head -5
  cp "/tmp/bound_$B.log" "$OUT/$B/" 2>/dev/null
  rm -f "$OUT/$B/dynamo.log" "$OUT/$B/decode.png"  # the device tool brings back only so many files
done
