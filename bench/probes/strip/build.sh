#!/usr/bin/env bash
# The token step's cubins with parts of its math stripped, for timing only (their outputs are
# wrong by design): nodots.patch (no row dot products, no reduction), notok.patch (no token
# math: norms, gate, sigmoid, k . q), bare (both). Each is built from HEAD with its patches
# into build/ab/strip-<name> (carry "build/ab"); on the device, against the shipped cubins:
#   python3 bench/probes/ab_decode_probe.py --old kda_cute/_cubins --new build/ab/strip-bare \
#     --shapes bfloat16:64:32,bfloat16:64:32:2
# (bench/results/step-strip-h200-2026-12-04.md)
# Usage: bash bench/probes/strip/build.sh [nodots notok bare]
set -euo pipefail
ARCH=${ARCH:-sm_90a}
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
HERE="$ROOT/bench/probes/strip"
TMP=$(mktemp -d)
trap 'git -C "$ROOT" worktree remove --force "$TMP/tree" >/dev/null 2>&1; rm -rf "$TMP"' EXIT
for name in "${@:-nodots notok bare}"; do
  for n in $name; do
    case $n in
      nodots|notok) patches=("$HERE/$n.patch") ;;
      bare) patches=("$HERE/nodots.patch" "$HERE/notok.patch") ;;
      *) echo "build.sh: expected nodots, notok or bare, got $n" >&2; exit 2 ;;
    esac
    git -C "$ROOT" worktree remove --force "$TMP/tree" >/dev/null 2>&1 || true
    git -C "$ROOT" worktree add -q --detach "$TMP/tree" HEAD
    git -C "$TMP/tree" apply "${patches[@]}"
    rm -rf "$ROOT/build/ab/strip-$n"
    (cd "$TMP/tree" && "$PY" -m kernels.build --arch "$ARCH" --out "$ROOT/build/ab/strip-$n" | tail -1)
  done
done
