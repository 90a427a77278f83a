#!/usr/bin/env bash
# The in-kernel indicator (kernels/_onepass.py, IND "kernel") against the default route, in one device call:
# benchmarks/ind_kernel.py's candidates for mono's MLP alone, then the decode step (benchmarks/decode.py, one
# process per configuration: it is read at import) for mono's fastest candidate, between two runs of the
# default. Usage on the device: OUT=... bash benchmarks/fused_ab.sh
set -u
OUT=${OUT:-/tmp/out}
(cd benchmarks && COUNTDOWN_PDL=1 PYTHONPATH=../src:. timeout 200 python ind_kernel.py --out "$OUT/ind_kernel" \
  --ks 0.9 > /tmp/ind_kernel.log 2>&1; echo "== ind_kernel rc=$?"; grep -E "^\|" "$OUT/ind_kernel/ind_kernel.md")
BEST=$(cat "$OUT/ind_kernel/best.json" 2>/dev/null || echo '{}')
run() {  # name, methods, config JSON
  local t0=$SECONDS
  COUNTDOWN_ONEPASS_CONFIGS="$3" PYTHONPATH=src timeout 150 python benchmarks/decode.py --out "$OUT/$1" \
    --methods "$2" --ks 0.9 --checks quick --no-breakdown --dense-samples 2 --samples 2 --dense-compiles 0 \
    --new-tokens 512 --budget-s 100 > "/tmp/$1.log" 2>&1
  echo "== $1 rc=$? $((SECONDS - t0)) s  $3"
  grep -E "^\| (dense|mono) \||^- floor|checks" "$OUT/$1/decode.md" | cut -c1-150
  grep -iE "error|mismatch|failed" "/tmp/$1.log" | head -3
}
run mono-default mono '{}'
run mono-best mono "$BEST"
run mono-default2 mono '{}'
