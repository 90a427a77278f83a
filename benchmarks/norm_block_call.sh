#!/usr/bin/env bash
# One device call for session 24's MLP halves with no norm kernel (kernels/_shadow_block.py for dual[shadow4],
# kernels/dual.py X_FROM_PREDICTOR for dual[lowrank]): their GPU tests, the MLP-half A/B against the norm on its own
# kernel (benchmarks/block_ab.py --shadow), then the one-compile decode benchmark with both routes on (ROUTES=1;
# dual[lowrank]'s is the default, shadow_block opt-in) or off (ROUTES=0); METHODS overrides the specs timed.
# Usage on the device: OUT=... [ROUTES=0|1] [TESTS=0] [BLOCK=0] bash benchmarks/norm_block_call.sh
set -u
OUT=${OUT:-/tmp/out}
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_block_norm.py tests/test_block.py 2>&1 | tail -3
  echo "== tests $((SECONDS - t0)) s"
fi
if [ "${BLOCK:-1}" = 1 ]; then
  COUNTDOWN_PDL=1 timeout 120 python benchmarks/block_ab.py --shadow --out "$OUT/block" --ks 0.8,0.9 --rounds 3 2>&1 \
    | grep -E "^\|" | tail -12
  echo "== block_ab $((SECONDS - t0)) s"
fi
R=${ROUTES:-1}
COUNTDOWN_DUAL_XN=$R COUNTDOWN_SHADOW_BLOCK=$R timeout ${DECODE_TIMEOUT:-260} python benchmarks/decode.py \
  --methods "${METHODS:-mono,dual[lowrank],dual[shadow4]}" --ks 0.9 --skip-checks --no-breakdown --dense-compiles 1 \
  --kernel-layers 2 --budget-s ${BUDGET:-220} --out "$OUT/run$R" > /tmp/decode$R.log 2>&1
echo "== decode routes=$R rc=$? $((SECONDS - t0)) s"
grep -E "floor|^(method|dense|mono|dual)" /tmp/decode$R.log | cut -c1-150 | tail -9
grep -iE "error|Traceback" /tmp/decode$R.log | head -5
cp /tmp/decode$R.log "$OUT/run$R/" 2>/dev/null
