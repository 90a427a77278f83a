#!/usr/bin/env bash
# The batched decode step with the few-token kernel, in one device call (2026-11-24):
#   1. benchmarks/few.py (check, sweep, parts, table at T = 2 / 4 / 8)
#   2. the 8B decode at batch 4 with it (default) and without it (COUNTDOWN_FEW=0, the control)
# usage: OUT=DIR bash benchmarks/few_run.sh
set -uo pipefail
cd "$(dirname "$0")"
mkdir -p "$OUT/few" "$OUT/b4" "$OUT/b4-chain"
PYTHONPATH=../src:. python few.py --out "$OUT/few" --budget 150 2>&1 | grep -v Warning > "$OUT/few/run.log"
tail -30 "$OUT/few/run.log"
cd ..
common=(--runner per-compile --batches 4 --skip-checks --no-breakdown --dense-samples 3 --new-tokens 256)
PYTHONPATH=src python benchmarks/decode.py "${common[@]}" --methods "dual[lowrank],mono" --ks 0.8,0.9 \
  --budget-s 270 --out "$OUT/b4" 2>&1 | grep -v Warning > "$OUT/b4/run.log"
grep -E "^\| (dense|dual|mono)" "$OUT/b4/decode.md" | cut -d'|' -f2-10
COUNTDOWN_FEW=0 PYTHONPATH=src python benchmarks/decode.py "${common[@]}" --methods "dual[lowrank]" --ks 0.9 \
  --budget-s 130 --out "$OUT/b4-chain" 2>&1 | grep -v Warning > "$OUT/b4-chain/run.log"
grep -E "^\| (dense|dual|mono)" "$OUT/b4-chain/decode.md" | cut -d'|' -f2-10
rm -f "$OUT"/*/dynamo.log "$OUT"/b4*/decode.png "$OUT"/b4*/decode_meta.json  # what comes back is counted
