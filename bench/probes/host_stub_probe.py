"""The launcher's own host time per call, on a CPU: the CUDA driver faked (tests/launch_record.py's
FakeDriver, its launches made no-ops) and torch.cuda's answers stubbed (fake_device), so what is
timed is kda_cute's Python from the call to the driver call, nothing of torch.cuda's wrappers
or of cuda-python's launch. For comparing two trees of the launcher on one machine: run it from
each (the same file copied into the other), then --merge the two JSONs into one table.

    python3 bench/probes/host_stub_probe.py --out A.json [--calls 5000] [--rounds 5]
    python3 bench/probes/host_stub_probe.py --merge OLD.json NEW.json --out TABLE.md  (+ .png)

Calls (repeated on the same tensors, as a serving loop or a benchmark makes them): an eager and
a bound decode (N 1, H 12, K 128, fp32 pool), a verify (style a, N 4, T 3), a commit, a dense
recurrent, and fwd without a workspace on B1 T8192 H16 / H64 and 5 varlen rows H64 (K 128). Each
figure: the median over rounds of the mean microseconds a call.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _calls():
    """name -> a function making one call (the tensors made once)."""
    import kda_cute
    from kda_cute import serving
    from tests.launch_record import PROBLEMS, make_call

    bf = torch.bfloat16
    H, K = 12, 128

    def tok(*lead):
        return torch.randn(*lead, H, K).to(bf)

    d = dict(q=tok(1, 1), k=tok(1, 1), v=tok(1, 1), g=tok(1, 1), beta=torch.randn(1, 1, H).to(bf),
             state=torch.randn(4, H, K, K), idx=torch.zeros(1, dtype=torch.int32), out=tok(1, 1),
             A_log=torch.randn(H), dt_bias=torch.randn(H * K))
    args = (d["q"], d["k"], d["v"], d["g"], d["beta"], d["state"], d["idx"])
    gates = dict(A_log=d["A_log"], dt_bias=d["dt_bias"], lower_bound=-5.0)
    kw = dict(out=d["out"], **gates)
    bound = kda_cute.decode(*args, bind=True, **kw)
    N, T = 4, 3
    rows = [tok(N, T) for _ in range(4)]
    vbeta = torch.randn(N, T, H).to(bf)
    pool = torch.randn(16, H, K, K)
    sidx = torch.arange(N * T, dtype=torch.int32).view(N, T)
    acc = torch.ones(N, dtype=torch.int32)
    vout = tok(N, T)
    scratch = torch.randn(N, T, H, K, K)
    slots = torch.arange(N, dtype=torch.int32)
    dense = torch.randn(N, H, K, K)
    fwds = {"fwd B1 T8192 H16": make_call(dict(B=1, T=8192, H=16, K=128)),
            "fwd B1 T8192 H64": make_call(dict(B=1, T=8192, H=64, K=128)),
            "fwd varlen 5 rows H64": make_call(PROBLEMS["k128-varlen-mix-h64"])}
    calls = {
        "decode, eager": lambda: kda_cute.decode(*args, **kw),
        "decode, bound": bound,
        "verify (a), eager": lambda: kda_cute.verify(*rows, vbeta, pool, ssm_state_indices=sidx,
                                                     num_accepted_tokens=acc, out=vout, **gates),
        "commit, eager": lambda: kda_cute.commit(pool, scratch, slots, acc),
        "recurrent, eager": lambda: serving.recurrent(*rows, vbeta, dense, dense, out=vout,
                                                      **gates),
    }
    for name, x in fwds.items():
        calls[name] = functools.partial(kda_cute.fwd, **x)
    return calls


def measure(calls: int, rounds: int) -> dict:
    from _pytest.monkeypatch import MonkeyPatch

    from kda_cute import api, checks, plans, serving
    from kda_cute.launch import driver
    from kda_cute.plans.step import step_plan
    from tests.launch_record import FakeDriver, fake_device

    mp = MonkeyPatch()
    # plans for an H200 from CPU tensors (the device checks skipped), the launches no-ops
    mp.setattr(serving, "_planned", lambda p, opts, dev, what="q", dry=False:
               (serving._config(p, opts), step_plan(p, opts))[1])
    real_forward = checks.forward
    mp.setattr(checks, "forward", lambda c, opts, cs=False, cuda=True, **kw:
               real_forward(c, opts, cs, cuda=False, **kw))
    mp.setattr(api, "device_info", lambda dev: plans.H200)
    out = {}
    try:
        with fake_device(mp), driver.substitute(FakeDriver()):
            mp.setattr(driver.Kernel, "launch", lambda self, *a, **k: None)
            mp.setattr(driver, "memset_d32", lambda *a: None)
            mp.setattr(driver, "record_event", lambda *a: None)
            mp.setattr(driver, "wait_event", lambda *a: None)
            for name, fn in _calls().items():
                n = calls if not name.startswith("fwd") else max(1, calls // 10)
                for _ in range(20):
                    fn()
                per = []
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    for _ in range(n):
                        fn()
                    per.append((time.perf_counter() - t0) / n * 1e6)
                out[name] = {"us": statistics.median(per), "rounds": per}
                print(f"{name:24s} {out[name]['us']:8.2f} us", flush=True)
    finally:
        mp.undo()
    return out


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def merge(old: dict, new: dict) -> str:
    lines = [f"Host time per call of the launcher's own Python, CPU, driver and torch.cuda stubbed "
             f"(bench/probes/host_stub_probe.py; {new['machine']}, torch {new['torch']}): "
             f"{old['commit']} against {new['commit']}.", "",
             f"| call | {old['commit']} us | {new['commit']} us | new / old |",
             "|---|---:|---:|---:|"]
    for name, r in new["calls"].items():
        o = old["calls"].get(name)
        if o is None:
            lines.append(f"| {name} | - | {r['us']:.2f} | - |")
        else:
            lines.append(f"| {name} | {o['us']:.2f} | {r['us']:.2f} | {r['us'] / o['us']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(old: dict, new: dict, path: Path) -> None:
    """Both trees' microseconds a call, a pair of bars a call (skipped without matplotlib)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench import pyplot
    plt = pyplot()
    if plt is None:
        return
    names = [n for n in new["calls"] if n in old["calls"]]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.2))
    y = range(len(names))
    ax.barh([i + 0.2 for i in y], [old["calls"][n]["us"] for n in names], 0.4,
            label=old["commit"])
    ax.barh([i - 0.2 for i in y], [new["calls"][n]["us"] for n in names], 0.4,
            label=new["commit"])
    ax.set_yticks(list(y), names)
    ax.invert_yaxis()
    ax.set_xlabel("us a call, the launcher's Python (CPU, driver and torch.cuda stubbed)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--merge", nargs=2, type=Path, metavar=("OLD", "NEW"))
    a = ap.parse_args(argv)
    if a.merge:
        old, new = (json.loads(p.read_text()) for p in a.merge)
        a.out.write_text(merge(old, new))
        plot(old, new, a.out.with_suffix(".png"))
        print(a.out.read_text())
        return 0
    res = {"commit": _commit(), "machine": f"{platform.machine()} {platform.processor() or ''}"
           .strip(), "python": platform.python_version(), "torch": torch.__version__,
           "calls": measure(a.calls, a.rounds)}
    a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
