#!/usr/bin/env bash
# The whole GPU check in one call (run on the H200 from the repo root, cubins carried):
# GPU tests against the float64 reference, then a short benchmark. Logs and a JSON summary go
# to $OUT (default ./gpu_out). Exit status: non-zero if any test failed.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
# the results record KDA_COMMIT; set it to the commit under test (a copied tree's git metadata
# can be stale: a run on a copy once reported an older commit)
[ -n "${KDA_COMMIT:-}" ] || echo "warning: KDA_COMMIT unset; results take the commit from git here" >&2
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# fla's Triton kernels autotune per shape (~80 s a case on a bare machine): keep Triton's cache
# (kernels and autotuning results) in the repo (git-ignored), carry it, send it back as one archive
export TRITON_CACHE_DIR="$PWD/.triton_cache" TRITON_CACHE_AUTOTUNING=1
mkdir -p "$TRITON_CACHE_DIR"
# the cache travels packed (.triton_cache.tgz, ~15 MB; unpacked it is ~100 MB)
[ -f .triton_cache.tgz ] && tar xzf .triton_cache.tgz -C "$TRITON_CACHE_DIR"
# at most 8 files come back from $OUT: the device line goes into the summary instead
export KDA_DEVICE_TXT=/tmp/kda_device.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$KDA_DEVICE_TXT" 2>&1
# a hung kernel must cost one test, not the whole call
TIMEOUT_ARGS=""
python3 -c "import pytest_timeout" 2>/dev/null && TIMEOUT_ARGS="--timeout=120 --timeout-method=thread"
python3 -m pytest -q -m gpu -p no:cacheprovider $TIMEOUT_ARGS \
  --junitxml="$OUT/gpu_tests.xml" ${GPU_TESTS:-tests} 2>&1 | tee "$OUT/gpu_tests.log"
rc=${PIPESTATUS[0]}
if [ -z "${SKIP_BENCH:-}" ]; then
  [ -n "${SKIP_ACC:-}" ] || python3 bench/accuracy.py ${ACC_ARGS:-} --out "$OUT/accuracy.json"
  # BENCH_TIMEOUT (seconds): stop the benchmark there and keep what it wrote (0: no limit)
  timeout "${BENCH_TIMEOUT:-0}" python3 bench/bench.py ${BENCH_ARGS:---quick} --out "$OUT/bench.json"
fi
python3 scripts/gpu_summary.py "$OUT" | tee "$OUT/summary.json"
# at most 8 files of 16 MB come back: the test XML is in the summary, and Triton's cache returns in
# 15 MB parts (locally: cat triton_cache.tgz.part-* > .triton_cache.tgz)
rm -f "$OUT/gpu_tests.xml"
# only the compiled kernels, launchers and autotune results are needed to skip a compile
find "$TRITON_CACHE_DIR" -type f \( -name '*.llir' -o -name '*.ptx' -o -name '*.ttir' \
  -o -name '*.ttgir' -o -name '*.source' \) -delete 2>/dev/null
tar czf - -C "$TRITON_CACHE_DIR" . 2>/dev/null | split -b 15M - "$OUT/triton_cache.tgz.part-" || true
exit "$rc"
