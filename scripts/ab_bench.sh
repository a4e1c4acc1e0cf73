#!/usr/bin/env bash
# On the device machine: time every revision that scripts/ab_build.sh put in build/ab (carry
# "build/ab"), each with its own launcher and cubins, without fla, and print one line per case.
# Usage: bash scripts/ab_bench.sh [CASES] [HEAD_DIM]   (cases as bench.py --cases takes them)
set -uo pipefail
CASES=${1:-B1_T8192_H64,B1_T32768_H32,B32_T256_H32}
HD=${2:-128}
for d in build/ab/*/; do
  d=${d%/}
  echo "== $(basename "$d")"
  KDA_CUTE_CUBIN_DIR=$d python3 "$d/src/bench/bench.py" --no-fla --head-dims "$HD" \
    --cases "$CASES" --out "/tmp/ab_$(basename "$d").json" 2>&1 | grep " K$HD "
done
