#!/usr/bin/env bash
# Build the cubins of several revisions side by side, for timing them in one device call.
# Each REV's kernels go to build/ab/<name>/<arch> and its launcher and benchmark (kda_cute/,
# bench/) to build/ab/<name>/src (git-ignored; carry "build/ab"), so revisions with different
# kernel arguments compare too. On the device: bash scripts/ab_bench.sh [CASES] [HEAD_DIM]
# Usage: bash scripts/ab_build.sh REV [REV ...]   (name: REV with '/' as '-')
set -euo pipefail
ARCH=${ARCH:-sm_90a}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
TMP=$(mktemp -d)
trap 'for t in "$TMP"/tree-*; do git -C "$ROOT" worktree remove --force "$t" >/dev/null 2>&1; done; rm -rf "$TMP"' EXIT
for REV in "$@"; do
  name=${REV//\//-}
  tree="$TMP/tree-$name"
  git -C "$ROOT" worktree add -q --detach "$tree" "$REV"
  rm -rf "$ROOT/build/ab/$name"
  (cd "$tree" && "$PY" -m kernels.build --arch "$ARCH" --out "$ROOT/build/ab/$name" | tail -1)
  mkdir -p "$ROOT/build/ab/$name/src"
  git -C "$ROOT" archive "$REV" kda_cute bench ":(exclude)bench/results" | tar x -C "$ROOT/build/ab/$name/src"
done
