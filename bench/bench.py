"""Benchmark: kda_cute vs fla's Triton chunk_kda on the H200, side by side in one run.

    python bench/bench.py [--quick] [--cases NAME,...] [--head-dims 128] [--out results.json]

Method: CUDA events around each launch, warm-up, median of >= 100 timed iterations; every case
rotates through enough input sets that their bytes exceed 3x the 60 MB L2, so the inputs are read
from HBM. The roofline is the compulsory bytes (q, k, v, g, beta read, out written, fp32 states
read and written) over the device-to-device copy bandwidth measured in the same run. Each case's
kda_cute output is checked against the float64 reference (and fla's too, when fla is present).
Writes JSON (device, versions, commit, every figure), a Markdown table and a PNG plot.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kda_cute import fwd  # noqa: E402
from kda_cute.reference import rel_err  # noqa: E402
from kda_cute.testing import make_inputs, reference  # noqa: E402

L2_BYTES = 60 * 2**20
REF_HEADS = 4
MIX = [1300, 547, 2048, 963, 271, 3063]
# name -> (B, T, H) or ("varlen", seqlens, H); the table at K = V = 128
CASES = {
    "B1 T8192 H96": (1, 8192, 96),
    "B1 T8192 H64": (1, 8192, 64),
    "B1 T8192 H32": (1, 8192, 32),
    "B1 T8192 H16": (1, 8192, 16),
    "varlen mix H96": ("varlen", MIX, 96),
    "varlen mix H64": ("varlen", MIX, 64),
    "varlen 8x1024 H64": ("varlen", [1024] * 8, 64),
    "B8 T1024 H32": (8, 1024, 32),
    "B1 T32768 H32": (1, 32768, 32),
    "B32 T256 H32": (32, 256, 32),
}
QUICK = ["B1 T8192 H64", "B1 T8192 H16", "varlen mix H64", "B8 T1024 H32"]


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    n = 2 * 2**30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ts = []
    for _ in range(25):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return 2 * n / statistics.median(ts[5:])


def flusher(nbytes: int = 256 * 2**20):
    """A function that evicts the L2 (a write of `nbytes`), for timings of a cold cache."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return lambda: buf.fill_(1)


def time_flushed(fn, iters, flush, warmup=5) -> float:
    """Median ms of `fn` by CUDA events, the L2 flushed (`flush`) before every launch."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        flush()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def graphed(fn):
    """`fn` captured in a CUDA graph (after a warm run on a side stream): its replay, which
    holds `fn` (and so the tensors its closure owns: the captured kernels address them)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()

    def replay():
        g.replay()
    replay.holds = (fn, g)
    return replay


def head_slice(inp, nh):
    """The same problem restricted to the first `nh` heads."""
    d = dict(inp)
    for n in ("q", "k", "v", "g", "beta"):
        d[n] = inp[n][:, :, :nh]
    for n in ("A_log", "dt_bias"):
        d[n] = inp[n][:nh]
    if inp["initial_state"] is not None:
        d["initial_state"] = inp["initial_state"][:, :nh]
    return d


def case_inputs(spec, K, seed):
    if spec[0] == "varlen":
        return make_inputs(seqlens=spec[1], H=spec[2], K=K, seed=seed)
    B, T, H = spec
    return make_inputs(B=B, T=T, H=H, K=K, seed=seed)


def parse_case(name: str):
    """(label, spec) of a case for the probes: a CASES name ('_' for ' '), "B<b>_T<t>_H<h>" (a
    fixed-length batch) or "V<len>x<n>_H<h>" (n sequences of len tokens as one varlen batch)."""
    label = name.replace("_", " ")
    if label in CASES:
        return label, CASES[label]
    m = re.fullmatch(r"B(\d+)_T(\d+)_H(\d+)", name.replace(" ", "_"))
    if m:
        return label, tuple(int(x) for x in m.groups())
    m = re.fullmatch(r"V(\d+)x(\d+)_H(\d+)", name.replace(" ", "_"))
    if m:
        n_tok, n_seq, h = (int(x) for x in m.groups())
        return label, ("varlen", [n_tok] * n_seq, h)
    raise SystemExit(f"unknown case {name!r}: a bench.py case, B<b>_T<t>_H<h> or V<len>x<n>_H<h>")


def compulsory_bytes(inp) -> int:
    q, v = inp["q"], inp["v"]
    B, T, H, K = q.shape
    V = v.shape[3]
    return (3 * B * T * H * K + 2 * B * T * H * V + B * T * H) * 2 + 2 * inp["N"] * H * V * K * 4


def problem_of(x, check_seqlens=True, **kw):
    """kda_cute's validated problem for a dict of inputs (make_inputs' keys plus out and
    final_state), the bounded gate, `kw` more of fwd's arguments (checkpoints). CPU inputs (the
    CPU tests) get every check but the CUDA requirement; CUDA ones the checks as fwd makes
    them."""
    from kda_cute import api

    cpu = {} if x["q"].is_cuda else {"cuda": False}
    return api.validate(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["out"],
                        x["A_log"], x["dt_bias"], x["lower_bound"], x["initial_state"],
                        x["final_state"], x["cu_seqlens"], "bounded",
                        check_seqlens=check_seqlens, **cpu, **kw)


def call_of(x):
    """kda_cute's Call of a dict of inputs (make_inputs' keys plus out and final_state): what
    kda_cute.launch.run and kda_cute.bind take with a plan."""
    from kda_cute import Call

    return Call(x["q"], x["k"], x["v"], x["g"], x["beta"], x["out"], x["A_log"], x["dt_bias"],
                x["initial_state"], x["final_state"], x["cu_seqlens"], x["scale"],
                x["lower_bound"])


def input_sets(spec, K, seed: int = 1, *, later_seed: int | None = None, configs=(None,),
               workspace: bool = True) -> list[dict]:
    """Inputs for timing a case: enough sets (at least two) that cycling through them keeps the
    L2 cold (3x its size). Set 0 has seed `seed`, set i > 0 seed `later_seed` (default `seed`)
    + i. Each has NaN-poisoned `out` and `final_state` and, with `workspace`, its own workspace
    large enough for every config in `configs` (None: the ladder's); else None (the launcher
    allocates one per call)."""
    from kda_cute import api

    base = case_inputs(spec, K, seed=seed)
    later = seed if later_seed is None else later_seed
    sets = []
    for i in range(max(2, math.ceil(3 * L2_BYTES / compulsory_bytes(base)))):
        x = base if i == 0 else case_inputs(spec, K, seed=later + i)
        x["out"] = torch.full_like(x["v"], float("nan"))
        x["final_state"] = torch.full_like(x["initial_state"], float("nan"))
        x["workspace"] = None
        if workspace:
            p = problem_of(x)
            x["workspace"] = torch.empty(max(api.workspace_bytes(p, api.config_for(p, c, PRECISION))
                                             for c in configs),
                                         dtype=torch.uint8, device=x["v"].device)
        sets.append(x)
    return sets


def time_fn(fn, sets, iters, warmup=10) -> float:
    """Median ms over `iters` launches, cycling through the input sets."""
    for i in range(warmup):
        fn(sets[i % len(sets)])
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        x = sets[i % len(sets)]
        starts[i].record()
        fn(x)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def gpu_kernel_ms(fn, sets, iters=30) -> dict[str, float]:
    """Each kernel's own GPU time per call of `fn` (ms; name -> the median of its launches
    times its launches per call), from the profiler's kernel records of `iters` calls (cycling
    through the input sets, after three of warm-up): no launch gaps, no host."""
    for i in range(3):
        fn(sets[i % len(sets)])
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            fn(sets[i % len(sets)])
        torch.cuda.synchronize()
    per = collections.defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name].append(ev.device_time_total / 1e3)
    return {name: statistics.median(ts) * len(ts) / iters for name, ts in per.items()}


def kernel_split(times: dict[str, float]) -> tuple[float, float, float]:
    """(K1, K2, other) GPU ms of a forward from gpu_kernel_ms: K2 counts every recurrence
    launch and the segments' combine; other is the small torch kernels (offsets, copies)."""
    k1 = sum(t for n, t in times.items() if "KdaPrep" in n)
    k2 = sum(t for n, t in times.items() if "KdaRecur" in n or "KdaCombine" in n)
    return k1, k2, sum(times.values()) - k1 - k2


def graph_runner(fn, sets):
    """`fn` captured once per input set in a CUDA graph; replaying it times the GPU work alone,
    without the host's launch path (what a serving engine that captures its forward sees)."""
    graphs = {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x in sets:
            fn(x)  # warm (loads the kernels) outside the capture
        torch.cuda.synchronize()
        for x in sets:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                fn(x)
            graphs[id(x)] = g
    torch.cuda.current_stream().wait_stream(stream)
    return lambda x: graphs[id(x)].replay()


SEGMENTS = None  # --segments: K2's segments per sequence (None: the launcher's choice)
PRECISION = "fast"  # --precision: the ladder's "fast" (fp16 products) or "precise" (bf16 hi/lo)


def kda_runner(config=None, **kw):
    """fwd on a set of inputs (its workspace), `kw` more of fwd's arguments (checkpoints)."""
    def run(x):
        fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["out"], x["A_log"],
            x["dt_bias"], x["lower_bound"], x["initial_state"], x["final_state"],
            x["cu_seqlens"], x["workspace"], check_seqlens=False, config=config,
            segments=SEGMENTS, precision=PRECISION, **kw)
    return run


def k1_plan(p, device, config=None):
    """The plan of K1 alone: a serial forward's plan (K1 as it runs there: its own build, grid
    and shared memory, not programmatic; a varlen batch's offsets before it) restricted to K1
    (Plan.only), on `device` (a torch device or index)."""
    from kda_cute import Options, plan
    from kda_cute.plans import device_info

    opts = Options(precision=PRECISION, config=config, segments=1, alongside=False)
    return plan(p, opts, device_info(device)).only("offsets", "K1")


def k1_runner(config=None):
    """K1 alone (k1_plan, run with kda_cute.launch.run on each set's workspace)."""
    from kda_cute import launch

    made = {}

    def run(x):
        p = problem_of(x, check_seqlens=False)
        key = (p, x["q"].device)
        pl = made.get(key)
        if pl is None:
            pl = made[key] = k1_plan(p, x["q"].device, config)
        launch.run(pl, call_of(x), x["workspace"])
    return run


def fla_chunk_kda(x):
    """fla's chunk_kda (its Triton path) on inputs from kda_cute.testing.make_inputs, in their
    gate form and activations: (out, final state [N, H, V, K])."""
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
    from fla.ops.kda import chunk_kda
    gate = {"bounded": dict(use_gate_in_kernel=True, safe_gate=True,
                            lower_bound=x["lower_bound"]),
            "unbounded": dict(use_gate_in_kernel=True),
            "none": dict(use_gate_in_kernel=False)}[x["gate"]]
    g = x["g"] if x["gate"] != "none" else x["g"].float()
    return chunk_kda(x["q"], x["k"], x["v"], g, x["beta"], scale=x["scale"],
                     initial_state=x["initial_state"], output_final_state=True,
                     use_qk_l2norm_in_kernel=x["qk_l2norm"],
                     use_beta_sigmoid_in_kernel=x["beta_sigmoid"], A_log=x["A_log"],
                     dt_bias=x["dt_bias"], state_v_first=True, cu_seqlens=x["cu_seqlens"],
                     **gate)


def fla_recurrent():
    """fla's Triton `fused_recurrent_kda_fwd` (the serving tables' peer), or None without fla
    (the tables say so)."""
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    except Exception as e:  # fla is optional
        print(f"fla unavailable: {e!r}", file=sys.stderr)
        return None
    return fused_recurrent_kda_fwd


def fla_runner():
    os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
    try:
        import fla.ops.kda  # noqa: F401
    except Exception as e:  # fla is optional: the table says so when it is absent
        print(f"fla unavailable: {e!r}", file=sys.stderr)
        return None
    return fla_chunk_kda


def checked(run, x, nh, ref_o, ref_s) -> tuple[float, float]:
    """(output, final state) errors of `run` on input set `x`, its outputs poisoned first: the
    first `nh` heads against their float64 reference."""
    x["out"].fill_(float("nan"))
    x["final_state"].fill_(float("nan"))
    run(x)
    torch.cuda.synchronize()
    return rel_err(x["out"][:, :, :nh], ref_o), rel_err(x["final_state"][:, :nh], ref_s)


def bench_case(name, spec, K, iters, fla, ceiling, simt=False, sweep=False):
    from kda_cute import api
    from kda_cute.ladder import EXPERIMENTAL, SHIPPED, SIMT
    simt_cfg = next((c for c in SIMT if c.prep.head_dim_k == K), None) if simt else None
    # --sweep: every tensor-core config for this head dim, shipped and experimental
    sweep_cfgs = [c for c in SHIPPED + EXPERIMENTAL if c.prep.head_dim_k == K
                  and c.recur.mma == "wgmma"] if sweep else []
    sets = input_sets(spec, K, zlib.crc32(name.encode()) % 1000, later_seed=0,
                      configs=[None, simt_cfg, *sweep_cfgs])
    base = sets[0]
    nbytes = compulsory_bytes(base)
    n_sets = len(sets)
    p = problem_of(base)
    run = kda_runner()
    t_kda = time_fn(run, sets, iters)
    t_graph = time_fn(graph_runner(run, sets), sets, iters)
    k1_gpu, k2_gpu, other_gpu = kernel_split(gpu_kernel_ms(run, sets))
    # heads are independent: the float64 check covers the first few, which keeps it fast
    nh = min(REF_HEADS, base["q"].shape[2])
    ref_o, ref_s = reference(head_slice(base, nh))
    # correctness of the timed configuration, on the first set
    out_err, state_err = checked(run, base, nh, ref_o, ref_s)
    ladder = api.config_for(p, None, PRECISION)  # every input set has the same problem shape
    row = {"case": name, "K": K, "config": [ladder.prep.name, ladder.recur.name],
           "precision": PRECISION,
           # alongside: K1's and K2's GPU times overlap (each kernel's span covers the other's)
           "schedule": api.schedule(p, ladder, torch.cuda.current_device(), SEGMENTS),
           "bytes": nbytes, "roofline_ms": nbytes / ceiling * 1e3,
           "kda_ms": t_kda, "kda_graph_ms": t_graph,
           "kda_k1_gpu_ms": k1_gpu, "kda_k2_gpu_ms": k2_gpu, "kda_other_gpu_ms": other_gpu,
           "kda_out_err": out_err, "kda_state_err": state_err,
           "input_sets": n_sets, "checked_heads": nh}
    if simt_cfg is not None:
        run_tc = kda_runner(simt_cfg)
        row["simt_ms"] = time_fn(run_tc, sets, iters)
        row["simt_k1_ms"] = time_fn(k1_runner(simt_cfg), sets, iters)
        row["simt_out_err"], row["simt_state_err"] = checked(run_tc, base, nh, ref_o, ref_s)
    if sweep_cfgs:
        row["sweep"] = {}
        for cfg in sweep_cfgs:
            run_c = kda_runner(cfg)
            ms = time_fn(run_c, sets, iters)
            out_e, state_e = checked(run_c, base, nh, ref_o, ref_s)
            # K1's and K2's thread counts both: two configs may differ in one only
            row["sweep"][f"c{cfg.chunk}_s{cfg.recur.stages}_t{cfg.prep.threads}"
                         f"_k2t{cfg.recur.threads}{'_f16' if cfg.recur.f16 else ''}"] = {
                "ms": ms, "k1_ms": time_fn(k1_runner(cfg), sets, iters),
                "out_err": out_e, "state_err": state_e}
    row["kda_GBps"] = nbytes / t_kda / 1e6
    row["kda_pct_roofline"] = 100 * row["roofline_ms"] / t_kda
    if fla is not None:
        row["fla_ms"] = time_fn(fla, sets, iters)
        o, s = fla(sets[0])
        torch.cuda.synchronize()
        row["fla_out_err"] = rel_err(o[:, :, :nh], ref_o)
        row["fla_state_err"] = rel_err(s[:, :nh], ref_s)
        row["speedup_vs_fla"] = row["fla_ms"] / t_kda
    del sets
    torch.cuda.empty_cache()
    return row


def versions() -> dict:
    v = {"torch": torch.__version__, "cuda": torch.version.cuda,
         "device": torch.cuda.get_device_name(), "python": sys.version.split()[0]}
    try:
        from importlib.metadata import version
        v["fla-core"] = version("fla-core")
        v["triton"] = version("triton")
    except Exception:
        pass
    v["commit"] = os.environ.get("KDA_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=ROOT).stdout.strip() or None
    return v


# FlashKDA and fla on an H200, 2026-11-29, K = V = 128 (ms; the speed issue's table). FlashKDA
# does not run here, so a row's FlashKDA estimate is its figure scaled by (fla here / fla there).
FLASHKDA_REF = {
    "B1 T8192 H96": (1.399, 2.628), "B1 T8192 H64": (1.189, 1.738),
    "B1 T8192 H32": (0.979, 0.960), "B1 T8192 H16": (0.870, 0.832),
    "varlen mix H96": (1.389, 2.657), "varlen mix H64": (1.022, 1.799),
    "varlen 8x1024 H64": (0.811, 1.794), "B8 T1024 H32": (0.422, 1.595),
    "B1 T32768 H32": (3.815, 3.691), "B32 T256 H32": (0.462, 1.041),
}


def _flashkda_ref(r) -> tuple[float, float] | None:
    """(FlashKDA ms, fla ms) of the issue's table for this row's case (K = 128 only)."""
    return FLASHKDA_REF.get(r["case"]) if r["K"] == 128 else None


def flashkda_estimate(r) -> float | None:
    ref = _flashkda_ref(r)
    if ref is None or "fla_ms" not in r:
        return None
    return ref[0] * r["fla_ms"] / ref[1]


def flashkda_table_ratio(r) -> float | None:
    """kda_cute's speed-up over the issue's FlashKDA figure as measured (not scaled by fla)."""
    ref = _flashkda_ref(r)
    return ref[0] / r["kda_ms"] if ref else None


def markdown(rows) -> str:
    head = ("| case | K | roofline ms | kda_cute ms | K1 / K2 ms | graph ms | % roofline | "
            "fla ms | vs fla | FlashKDA est. ms | vs FlashKDA est. | vs FlashKDA figure | "
            "out err | state err | fla out/state err |"
            "\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in rows:
        fla = f"{r['fla_ms']:.3f}" if "fla_ms" in r else "-"
        sp = f"{r['speedup_vs_fla']:.2f}x" if "speedup_vs_fla" in r else "-"
        fk = flashkda_estimate(r)
        fks, fkr = (f"{fk:.3f}", f"{fk / r['kda_ms']:.2f}x") if fk else ("-", "-")
        ft = flashkda_table_ratio(r)
        fkt = f"{ft:.2f}x" if ft else "-"
        fe = (f"{r['fla_out_err']:.1e} / {r['fla_state_err']:.1e}" if "fla_out_err" in r
              else "-")
        # each kernel's own GPU time; results from before it was recorded: K1 alone, eager
        split = (f"{r['kda_k1_gpu_ms']:.3f} / {r['kda_k2_gpu_ms']:.3f}" if "kda_k1_gpu_ms" in r
                 else f"{r['kda_k1_ms']:.3f} (eager) / -")
        if r.get("schedule", "serial") != "serial":
            split += f" ({r['schedule']})"
        lines.append(f"| {r['case']} | {r['K']} | {r['roofline_ms']:.3f} | {r['kda_ms']:.3f} | "
                     f"{split} | {r.get('kda_graph_ms', float('nan')):.3f} | "
                     f"{r['kda_pct_roofline']:.1f} | {fla} | {sp} | {fks} | {fkr} | {fkt} | "
                     f"{r['kda_out_err']:.2e} | {r['kda_state_err']:.2e} | {fe} |")
    return head + "\n".join(lines) + "\n"


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is not installed (the
    plots are skipped then)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    names = [f"{r['case']} K{r['K']}" for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(14, 0.45 * len(rows) + 2))
    y = range(len(rows))
    a1.barh([i + 0.2 for i in y], [r["kda_ms"] for r in rows], 0.4, label="kda_cute")
    if all("fla_ms" in r for r in rows):
        a1.barh([i - 0.2 for i in y], [r["fla_ms"] for r in rows], 0.4, label="fla chunk_kda")
    a1.set_yticks(list(y), names)
    a1.set_xlabel("ms (median)")
    a1.legend()
    a2.barh(list(y), [r["kda_pct_roofline"] for r in rows])
    a2.set_yticks(list(y), [""] * len(rows))
    a2.set_xlabel("% of HBM roofline (kda_cute)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="four cases, 100 iterations")
    ap.add_argument("--cases", default="",
                    help="comma-separated case names ('_' for ' ', e.g. B1_T8192_H64)")
    ap.add_argument("--head-dims", default="128")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--sweep", action="store_true",
                    help="also time every tensor-core tile config (shipped and experimental)")
    ap.add_argument("--simt", action="store_true",
                    help="also time the fp32 CUDA-core baseline forward (ladder.SIMT)")
    ap.add_argument("--segments", type=int, default=0,
                    help="K2's segments per sequence (0: the launcher's choice; 1: none)")
    ap.add_argument("--precision", choices=("fast", "precise"), default="fast",
                    help="the ladder kda_cute is timed with (fwd's precision)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                    help="no timing: merge these result files (one commit and device; a table "
                         "measured in several calls to fit a time limit) into --out")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "latest.json"))
    a = ap.parse_args(argv)
    if a.merge:
        merge_results([Path(p) for p in a.merge], Path(a.out))
        return
    global SEGMENTS, PRECISION
    SEGMENTS = a.segments or None
    PRECISION = a.precision
    # '_' may stand for ' ' in case names, so a shell variable can carry them unquoted
    names = ([n.replace("_", " ") for n in a.cases.split(",")] if a.cases
             else (QUICK if a.quick else list(CASES)))
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; known: {list(CASES)}")
    fla = None if a.no_fla else fla_runner()
    ceiling = copy_bandwidth()
    print(f"copy ceiling {ceiling / 1e12:.2f} TB/s", flush=True)
    rows = []
    for K in (int(k) for k in a.head_dims.split(",")):
        for name in names:
            t0 = time.time()
            rows.append(bench_case(name, CASES[name], K, max(100, a.iters), fla, ceiling,
                                   a.simt, a.sweep))
            r = rows[-1]
            print(f"{name:<22} K{K:<4} kda {r['kda_ms']:.3f} ms (GPU K1 {r['kda_k1_gpu_ms']:.3f} "
                  f"K2 {r['kda_k2_gpu_ms']:.3f} other {r['kda_other_gpu_ms']:.3f}, "
                  f"{r['schedule']}; "
                  f"graph {r['kda_graph_ms']:.3f}; "
                  f"{r['kda_pct_roofline']:.1f}% "
                  f"roofline) fla {r.get('fla_ms', float('nan')):.3f} ms "
                  f"err {r['kda_out_err']:.2e}/{r['kda_state_err']:.2e} "
                  f"simt {r.get('simt_ms', float('nan')):.3f} ms "
                  f"(K1 {r.get('simt_k1_ms', float('nan')):.3f}) "
                  f"err {r.get('simt_out_err', float('nan')):.2e}/"
                  f"{r.get('simt_state_err', float('nan')):.2e} [{time.time() - t0:.0f}s]",
                  flush=True)
            for tag, sw in r.get("sweep", {}).items():
                print(f"    sweep {tag}: {sw['ms']:.3f} ms (K1 {sw['k1_ms']:.3f}) "
                      f"err {sw['out_err']:.2e}/{sw['state_err']:.2e}", flush=True)
            write_results(rows, ceiling, Path(a.out), final=False)
    write_results(rows, ceiling, Path(a.out), final=True)


def merge_results(paths: list[Path], out: Path) -> None:
    """One table from several runs of the same commit on the same device: their rows (in the
    case order of CASES, head dim by head dim), each run's copy ceiling and versions kept."""
    docs = [json.loads(p.read_text()) for p in paths]
    for key in ("commit", "device"):
        seen = {d["versions"].get(key) for d in docs}
        if len(seen) != 1:
            raise SystemExit(f"--merge: the runs differ in {key}: {sorted(map(str, seen))}")
    rows = [r for d in docs for r in d["rows"]]
    counts = collections.Counter((r["case"], r["K"]) for r in rows)
    dup = {key for key, n in counts.items() if n > 1}
    if dup:
        raise SystemExit(f"--merge: cases measured twice: {sorted(dup)}")
    order = list(CASES)
    rows.sort(key=lambda r: (r["K"], order.index(r["case"]) if r["case"] in order else 99))
    ceilings = [d["summary"]["copy_TBps"] for d in docs]
    extra = {"merged_from": [p.name for p in paths], "copy_TBps_runs": ceilings,
             "complete_runs": [d["summary"].get("complete") for d in docs]}
    write_results(rows, statistics.median(ceilings) * 1e12, out, final=True,
                  run_versions=docs[0]["versions"], extra=extra)


def write_results(rows, ceiling, out: Path, final: bool, run_versions=None, extra=None):
    """Rewritten after every case, so a run cut short still leaves its figures."""
    sp = [r["speedup_vs_fla"] for r in rows if "speedup_vs_fla" in r]
    fk = [flashkda_estimate(r) / r["kda_ms"] for r in rows if flashkda_estimate(r)]
    # against the FlashKDA figures as measured (not scaled by this run's fla time)
    fkt = [flashkda_table_ratio(r) for r in rows if flashkda_table_ratio(r)]
    for r in rows:
        if flashkda_estimate(r):
            r["flashkda_est_ms"] = flashkda_estimate(r)
    summary = {"cases": len(rows), "copy_TBps": ceiling / 1e12,
               "geomean_speedup_vs_fla": math.exp(statistics.fmean(map(math.log, sp)))
               if sp else None,
               "geomean_speedup_vs_flashkda_est": math.exp(statistics.fmean(map(math.log, fk)))
               if fk else None,
               "geomean_speedup_vs_flashkda_table": math.exp(
                   statistics.fmean(map(math.log, fkt))) if fkt else None,
               "max_out_err": max(r["kda_out_err"] for r in rows),
               "max_state_err": max(r["kda_state_err"] for r in rows)}
    summary["complete"] = final
    summary.update(extra or {})
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"versions": run_versions or versions(), "method": __doc__.strip(),
           "summary": summary, "rows": rows}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rows))
    if final:
        plot(rows, out.with_suffix(".png"))
        print(markdown(rows))
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
