"""fla's own KDA op tests through kda-cute's backend (bench/fla_suite.py): flash-linear-attention's
tests/ops/test_kda.py is not shipped here, so this runs where KDA_FLA_TESTS names that file
(with fla's tests/conftest.py beside it) and skips otherwise, as it does without a Hopper GPU
or fla. The forward-only selection must pass, kda-cute must take calls (fla's FlashKDA tests'
prefills), and every call it declines must name an argument of fla's entry."""

import inspect
import json
import os
import subprocess
import sys
from inspect import unwrap
from pathlib import Path

import pytest

# fla's Triton kernels compile cold on a fresh machine, for minutes
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
pytest.importorskip("fla.backends")
TESTS = os.environ.get("KDA_FLA_TESTS")
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not TESTS or not Path(TESTS).is_file(),
                    reason="KDA_FLA_TESTS does not name fla's tests/ops/test_kda.py")
def test_fla_kda_op_tests_through_the_backend(tmp_path):
    out = tmp_path / "fla-suite"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "fla_suite.py"), "--tests", TESTS,
                          "--out", str(out)], capture_output=True, text=True, timeout=900,
                         cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads(Path(f"{out}.json").read_text())
    tests = res["tests"]
    assert tests and res["exit_code"] == 0, res["exit_code"]
    assert all(t["outcome"] == "passed" for t in tests.values()), {
        n: t["outcome"] for n, t in tests.items() if t["outcome"] != "passed"}
    assert sum(t["taken"]["chunk_kda"] for t in tests.values()) > 0
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    names = (set(inspect.signature(unwrap(chunk_kda)).parameters)
             | set(inspect.signature(unwrap(fused_recurrent_kda_fwd)).parameters)
             | {"A_log", "dt_bias", "transpose_state_layout"})
    for t in tests.values():
        for reason in t["declined"]:
            said = reason.split(": ", 1)[1].split(": ")[0]
            assert said in names, reason
