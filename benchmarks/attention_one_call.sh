#!/usr/bin/env bash
# One device call for session 24's one-launch attention (kernels/_rope_attention.py ONE_LAUNCH): its GPU tests (the
# kernel against float64 with the ticket merge racing for real; a fused model's tokens with it on), then the
# one-compile decode benchmark with it off and on, in ORDER (default "0 1").
# Usage on the device: OUT=... [ORDER="1 0"] [TESTS=0] bash benchmarks/attention_one_call.sh
set -u
OUT=${OUT:-/tmp/out}
export PYTHONPATH=src PYTHONUNBUFFERED=1
t0=$SECONDS
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  timeout 100 python -m pytest -q -p no:cacheprovider tests/test_rope_attention.py 2>&1 | tail -2
  COUNTDOWN_ATTENTION_CONFIG='{"ONE_LAUNCH": true}' timeout 120 python -m pytest -q -p no:cacheprovider \
    tests/test_fused_attention.py 2>&1 | tail -2
  echo "== tests $((SECONDS - t0)) s"
fi
for R in ${ORDER:-0 1}; do
  CFG='{}'; [ "$R" = 1 ] && CFG='{"ONE_LAUNCH": true}'
  COUNTDOWN_ATTENTION_CONFIG="$CFG" timeout ${DECODE_TIMEOUT:-220} python benchmarks/decode.py \
    --methods "${METHODS:-mono,dual[lowrank],dual[shadow4]}" --ks 0.9 --skip-checks --no-breakdown --dense-compiles 1 \
    --kernel-layers 2 --budget-s ${BUDGET:-180} --out "$OUT/one$R" > /tmp/decode$R.log 2>&1
  echo "== decode one_launch=$R rc=$? $((SECONDS - t0)) s"
  grep -E "floor \(|^(dense|mono|dual)" /tmp/decode$R.log | cut -c1-120 | tail -7
  grep -iE "error|Traceback" /tmp/decode$R.log | head -5
  cp /tmp/decode$R.log "$OUT/one$R/" 2>/dev/null
done
