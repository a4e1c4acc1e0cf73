#!/usr/bin/env bash
# The whole GPU check in one call (run on the H200 from the repo root, cubins carried):
# GPU tests against the float64 reference, then a short benchmark. Logs and a JSON summary go
# to $OUT (default ./gpu_out). Exit status: non-zero if any test failed.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/device.txt" 2>&1
python3 -m pytest -q -m gpu -p no:cacheprovider --timeout=120 --timeout-method=thread --junitxml="$OUT/gpu_tests.xml" \
  ${GPU_TESTS:-tests} 2>&1 | tee "$OUT/gpu_tests.log"
rc=${PIPESTATUS[0]}
if [ -z "${SKIP_BENCH:-}" ]; then
  [ -n "${SKIP_ACC:-}" ] || python3 bench/accuracy.py ${ACC_ARGS:-} --out "$OUT/accuracy.json"
  python3 bench/bench.py ${BENCH_ARGS:---quick} --out "$OUT/bench.json"
fi
python3 scripts/gpu_summary.py "$OUT" | tee "$OUT/summary.json"
exit "$rc"
