"""Host time of an eager call, the public functions (which bypass the torch.library dispatcher
eagerly) against the same call through torch.ops.kda_cute (the dispatcher's path), on the H200.

Each figure: the median over 9 rounds of the mean wall time of 500 back-to-back calls on
tensors of fixed metadata (the checks and plans cached, as in a serving loop), the GPU idle
enough that the host is the bottleneck (tiny shapes). It times the kda_cute on PYTHONPATH: run
it once more with an older tree there for the before/after of a change (its torch.ops rows are
absent where it has no ops).

    PYTHONPATH=$PWD python3 bench/library_overhead.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import kda_cute  # the tree on PYTHONPATH
from kda_cute import testing


def host_us(fn, calls=500, rounds=9) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    means = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(means)


def cases():
    inp = testing.make_inputs(B=1, T=1, H=4, K=128, seed=1)
    pool = torch.randn(8, 4, 128, 128, device="cuda")
    idx = torch.tensor([3], dtype=torch.int32, device="cuda")
    out = torch.empty_like(inp["v"])
    q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
    A, dt = inp["A_log"], inp["dt_bias"]
    yield "decode N1 H4 (kda_cute.decode)", lambda: kda_cute.decode(
        q, k, v, g, beta, pool, idx, out=out, A_log=A, dt_bias=dt, lower_bound=-5.0)
    ops = getattr(torch.ops, "kda_cute", None)
    if ops is not None and hasattr(ops, "decode"):
        op = ops.decode.default
        yield "decode N1 H4 (torch.ops.kda_cute.decode)", lambda: op(
            q, k, v, g, beta, pool, idx, out, None, None, A, dt, None, -5.0, "bounded", True,
            True, None)
    pre = testing.make_inputs(B=1, T=64, H=4, K=128, seed=2)
    o2 = torch.empty_like(pre["v"])
    s1 = torch.empty_like(pre["initial_state"])
    args = (pre["q"], pre["k"], pre["v"], pre["g"], pre["beta"], pre["scale"], o2,
            pre["A_log"], pre["dt_bias"], -5.0, pre["initial_state"], s1)
    yield "prefill B1 T64 H4 (kda_cute.fwd)", lambda: kda_cute.fwd(*args)
    if ops is not None and hasattr(ops, "fwd"):
        op2 = ops.fwd.default
        yield "prefill B1 T64 H4 (torch.ops.kda_cute.fwd)", lambda: op2(
            *args, None, None, "bounded", True, True, False, None, "fast", None, None, None,
            None, None, None, None, None, None)
    yield "torch.compiler.is_compiling()", torch.compiler.is_compiling


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    rows = []
    for name, fn in cases():
        us = host_us(fn)
        rows.append({"case": name, "host_us": us})
        print(f"{a.label:10s} {name:48s} {us:8.2f} us", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({
            "label": a.label, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "kda_cute": str(Path(kda_cute.__file__).parent), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
