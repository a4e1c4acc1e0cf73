#!/usr/bin/env bash
# The wheel in a fresh virtual environment holding only torch and cuda-python (and what they
# need), no CuTe DSL and no repository on the path: `python -m kda_cute.demo`, `kda-cute check`
# and `kda-cute bench` from another folder. On a machine without a package index (the H200
# here) the venv gets the already installed distributions of torch and cuda-python by links
# (scripts/linked_site.py), nothing else.
#   bash scripts/fresh_venv_check.sh dist/kda_cute-*.whl [OUT_DIR]
set -uo pipefail
WHEEL=$(readlink -f "$1")
OUT=$(readlink -f "${2:-./venv_check}")
mkdir -p "$OUT"
ENV=$(mktemp -d)/venv
HERE=$(cd "$(dirname "$0")" && pwd)
python3 -m venv "$ENV" || exit 1
SITE=$("$ENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if ! "$ENV/bin/python" -m pip install -q torch cuda-python 2>/dev/null; then
  python3 "$HERE/linked_site.py" "$SITE/linked" torch cuda-bindings || exit 1
  echo "$SITE/linked" > "$SITE/linked.pth"
fi
"$ENV/bin/python" -m pip install -q --no-index --no-deps "$WHEEL" || exit 1
cd "$(mktemp -d)"
unset PYTHONPATH
rc=0
"$ENV/bin/python" - <<'PY' || rc=1
import importlib.util, sys
import kda_cute
assert importlib.util.find_spec("cutlass") is None, "the CuTe DSL is importable here"
print("kda_cute", kda_cute.__version__, "from", kda_cute.__file__)
print("sys.path", sys.path)
PY
"$ENV/bin/python" -m pip list 2>/dev/null > "$OUT/pip_list.txt"
"$ENV/bin/python" -m kda_cute.demo || rc=1
"$ENV/bin/kda-cute" check --json "$OUT/check.json" || rc=1
"$ENV/bin/kda-cute" bench --json "$OUT/bench.json" || rc=1
echo "fresh venv check rc=$rc"
exit $rc
