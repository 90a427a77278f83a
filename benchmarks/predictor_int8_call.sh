#!/usr/bin/env bash
# One device call for session 24's int8 predictor probe (kernels/_linear.py int8 rows + scales; kernels/dual.py
# dual_block_int8; COUNTDOWN_PREDICTOR_INT8=1): the MLP half's A/B (benchmarks/block_ab.py --int8), then dual[lowrank]
# in the one-compile decode benchmark with the int8 factors off and on, in ORDER (default "0 1").
# Usage on the device: OUT=... [ORDER="1 0"] [BLOCK=0] bash benchmarks/predictor_int8_call.sh
set -u
OUT=${OUT:-/tmp/out}
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_block_norm.py -k int8 2>&1 | tail -1
if [ "${BLOCK:-1}" = 1 ]; then
  COUNTDOWN_PDL=1 timeout 120 python benchmarks/block_ab.py --int8 --out "$OUT/block" --ks 0.8,0.9 --rounds 3 2>&1 \
    | grep -E "^\|" | tail -10
  echo "== block_ab $((SECONDS - t0)) s"
fi
for R in ${ORDER:-0 1}; do
  COUNTDOWN_PREDICTOR_INT8=$R timeout ${DECODE_TIMEOUT:-200} python benchmarks/decode.py --methods "${METHODS:-dual[lowrank]}" \
    --ks 0.9 --skip-checks --no-breakdown --dense-compiles 1 --kernel-layers 2 --budget-s ${BUDGET:-160} \
    --out "$OUT/int8_$R" > /tmp/decode$R.log 2>&1
  echo "== decode int8=$R rc=$? $((SECONDS - t0)) s"
  grep -E "floor \(|^(dense|mono|dual)" /tmp/decode$R.log | cut -c1-120 | tail -5
  grep -iE "error|Traceback" /tmp/decode$R.log | head -5
  cp /tmp/decode$R.log "$OUT/int8_$R/" 2>/dev/null
done
