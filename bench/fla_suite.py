"""fla's own KDA op tests (flash-linear-attention's tests/ops/test_kda.py, not shipped here: pass
its path) run with kda-cute's fla backend registered: per test, its outcome, the calls kda-cute
took and those it declined with fla's reason. fla's FlashKDA tests (test_flash_kda_*), which
skip without the flash_kda package, run too: kda-cute's backend goes ahead of FlashKDA's, so
their calls are kda-cute's to take.

    python bench/fla_suite.py --tests PATH/test_kda.py [-k EXPR] --out bench/results/<prefix>

(tests/test_gpu_fla_suite.py runs it where KDA_FLA_TESTS names the file.)

writes <prefix>.json and <prefix>.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ENTRIES = ("chunk_kda", "fused_recurrent_kda_fwd")
# fla's forward-only KDA tests (its others take gradients, which kda-cute declines), a few
# minutes on a bare machine with Triton's compiles
SELECTION = ("flash_kda or vllm_decode or fused_recurrent_gate_in_kernel or "
             "fused_recurrent_state_v_first or fused_recurrent_use_beta")


class Recorder:
    """A pytest plugin: every verdict of kda-cute's verifiers and every outcome, by test."""

    def __init__(self):
        self.current = None
        self.verdicts = defaultdict(Counter)  # test -> (entry, taken, reason) -> n
        self.outcomes = {}
        self.lifted = []

    def install(self):
        from kda_cute.integrations import fla as kda_fla
        kda_fla.register()
        cls = kda_fla.KdaCuteBackend
        for entry in ENTRIES:
            name = f"{entry}_verifier"
            real = getattr(cls, name)

            def verifier(backend, *a, _real=real, _entry=entry, **kw):
                ok, why = _real(backend, *a, **kw)
                self.verdicts[self.current][(_entry, ok, why)] += 1
                return ok, why

            setattr(cls, name, verifier)

    def pytest_collection_modifyitems(self, items):
        for item in items:
            if item.originalname.startswith("test_flash_kda"):
                item.own_markers = [m for m in item.own_markers if m.name != "skipif"]
                self.lifted.append(item.nodeid)

    def pytest_runtest_setup(self, item):
        self.current = item.nodeid

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.outcomes.setdefault(report.nodeid, (report.outcome, report.duration,
                                                     _short(report)))


def _short(report) -> str:
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])[:200]
    if report.outcome == "failed":
        return str(report.longrepr).strip().splitlines()[-1][:300]
    return ""


def run(tests: str, keyword: str | None, timeout: int) -> dict:
    import pytest
    rec = Recorder()
    rec.install()
    args = [tests, "-q", "-p", "no:cacheprovider", "-rN"]
    if keyword:
        args += ["-k", keyword]
    try:
        import pytest_timeout  # noqa: F401
        args += [f"--timeout={timeout}"]
    except ImportError:
        pass
    t0 = time.time()
    code = pytest.main(args, plugins=[rec])
    tests_out = {}
    for nodeid in sorted(set(rec.outcomes) | set(rec.verdicts)):
        outcome, dur, why = rec.outcomes.get(nodeid, ("?", 0.0, ""))
        v = rec.verdicts.get(nodeid, Counter())
        tests_out[nodeid] = {
            "outcome": outcome, "seconds": round(dur, 2), "note": why,
            "taken": {e: sum(n for (e2, ok, _), n in v.items() if e2 == e and ok)
                      for e in ENTRIES},
            "declined": {f"{e}: {r}": n for (e, ok, r), n in v.items() if not ok}}
    return {"exit_code": int(code), "seconds": round(time.time() - t0, 1), "keyword": keyword,
            "flash_kda_skips_lifted": rec.lifted, "tests": tests_out}


def _md(res: dict, meta: dict) -> str:
    tests = res["tests"]
    taken = sum(sum(t["taken"].values()) for t in tests.values())
    declined = sum(sum(t["declined"].values()) for t in tests.values())
    outcomes = Counter(t["outcome"] for t in tests.values())
    lines = [f"# fla's KDA op tests through kda-cute's backend ({meta['device']}, "
             f"{meta['commit']})", "",
             f"fla {meta['fla']}, torch {meta['torch']}; tests/ops/test_kda.py"
             + (f" -k '{res['keyword']}'" if res["keyword"] else "")
             + f"; {res['seconds']} s. Outcomes: "
             + ", ".join(f"{n} {o}" for o, n in sorted(outcomes.items()))
             + f". Calls kda-cute took: {taken}; declined: {declined}.", "",
             "| test | outcome | taken (chunk / step) | declined: fla's reason (calls) |",
             "|---|---|---|---|"]
    for nodeid, t in tests.items():
        name = nodeid.split("::", 1)[-1]
        dec = "; ".join(f"{r} ({n})" for r, n in t["declined"].items()) or "-"
        note = f" ({t['note']})" if t["note"] and t["outcome"] != "passed" else ""
        lines.append(f"| {name} | {t['outcome']}{note} | {t['taken']['chunk_kda']} / "
                     f"{t['taken']['fused_recurrent_kda_fwd']} | {dec} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tests", required=True, help="fla's tests/ops/test_kda.py")
    ap.add_argument("-k", dest="keyword", default=SELECTION,
                    help="pytest -k selection (default: the forward-only tests; '' for all)")
    ap.add_argument("--timeout", type=int, default=300, help="per test (pytest-timeout)")
    ap.add_argument("--out", required=True, help="path prefix: writes .json and .md")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    res = run(a.tests, a.keyword, a.timeout)
    import fla
    import torch
    commit = os.environ.get("KDA_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "commit": commit, "fla": getattr(fla, "__version__", "?"),
            "torch": torch.__version__}
    Path(a.out + ".json").write_text(json.dumps({**meta, **res}, indent=1) + "\n")
    Path(a.out + ".md").write_text(_md(res, meta))
    print(_md(res, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
