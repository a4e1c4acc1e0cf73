"""The prefill against its peers in one process: kda_cute, FlashKDA and cuDNN-frontend's fused sm90
kernel on the same inputs, K = V = 128, the bounded gate (lower_bound -5), fp32 states in and out.

    python3 bench/peers.py [--table tp|ten|all] [--gates random,slow,mixed] [--out PREFIX]

Tables: `tp`, cuDNN's ten tensor-parallel shapes (T tokens in all, H heads, N equal sequences);
`ten`, bench.py's ten cases. Gates: random (g ~ N(0, 1)), slow (every channel decays slowly: g
shifted by SLOW_SHIFT, a decay per token of ~1e-3), mixed (one channel in ten slow). Method as
bench.py's: each runner captured in a CUDA graph per input set, the sets cycled so the inputs
come from HBM, median ms of `--iters` replays; the roofline is the compulsory bytes (bf16 q, k,
v, g, beta and out, the fp32 states) over the copy bandwidth measured in the same run. Every
runner's output is checked against the float64 reference on the first heads (a peer as a clock:
its error is reported, not required). FlashKDA comes from FLASHKDA_DIR (its `flash_kda_C`
built in place), cuDNN's kernel from the `cudnn` package; either missing is reported as absent.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import (  # noqa: E402
    CASES,
    REF_HEADS,
    compulsory_bytes,
    copy_bandwidth,
    gpu_kernel_ms,
    graph_runner,
    head_slice,
    input_sets,
    kda_runner,
    kernel_split,
    pyplot,
    time_fn,
    versions,
)
from kda_cute.reference import rel_err  # noqa: E402
from kda_cute.testing import reference  # noqa: E402

# cuDNN's published shapes: (T in all, H, N)
TP = [(2048, 12, 1), (2048, 16, 1), (4096, 8, 1), (4096, 12, 1), (8192, 12, 4), (8192, 16, 1),
      (1024, 4, 1), (3072, 10, 1), (8192, 24, 1), (16384, 16, 8)]
GATES = ("random", "slow", "mixed")
SLOW_SHIFT = -6.0  # sigmoid(e^A_log (g + dt_bias)) ~ 1e-4: lower_bound times it per token


def shaped(sets, gate: str) -> None:
    """The gate form asked for, in place on every set's g (bf16 [B, T, H, K])."""
    for x in sets:
        if gate == "slow":
            x["g"].add_(SLOW_SHIFT)
        elif gate == "mixed":
            x["g"][..., ::10].add_(SLOW_SHIFT)


def flashkda():
    """FlashKDA's runner (flash_kda_C from FLASHKDA_DIR), or None."""
    d = os.environ.get("FLASHKDA_DIR")
    if d:
        sys.path.insert(0, d)
    try:
        import flash_kda_C as fk
    except ImportError as e:
        print(f"FlashKDA unavailable: {e}", file=sys.stderr)
        return None

    def run(x):
        B, T, H, _ = x["q"].shape
        N = x["N"]
        w = x.get("flashkda_workspace")  # kept in the set: an id() outlives a case's sets
        if w is None:
            w = x["flashkda_workspace"] = torch.empty(fk.get_workspace_size(B * T, H, N),
                                                      dtype=torch.uint8, device=x["q"].device)
        fk.fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], float(x["scale"]), x["out"], w,
               x["A_log"], x["dt_bias"], float(x["lower_bound"]),
               initial_state=x["initial_state"], final_state=x["final_state"],
               cu_seqlens=x["cu_seqlens"])
    return run


def cudnn_fused():
    """cuDNN-frontend's fused sm90 kernel (packed tokens, fp32 g and beta, int32 cu_seqlens: made
    once per set, outside the timing), or None."""
    try:
        from cudnn.linear_attention.hopper import cuda_host as ch
    except Exception as e:  # noqa: BLE001 (a missing or broken wheel: reported, not fatal)
        print(f"cuDNN fused kernel unavailable: {e!r}", file=sys.stderr)
        return None
    flags = ch.FLAG_L2NORM | ch.FLAG_SAFE_GATE | ch.FLAG_BETA_SIGMOID

    def run(x):
        B, T, H, _ = x["q"].shape
        m = x.get("cudnn_inputs")  # kept in the set: an id() outlives a case's sets
        if m is None:
            cu = x["cu_seqlens"]
            if cu is None:
                cu = torch.arange(0, B * T + 1, T, device=x["q"].device)
            m = x["cudnn_inputs"] = (x["g"].float(), x["beta"].float(), cu.to(torch.int32))
        g32, b32, cu32 = m
        ch.launch(device=x["q"].device.index or 0, stream=torch.cuda.current_stream().cuda_stream,
                  q=x["q"].data_ptr(), k=x["k"].data_ptr(), v=x["v"].data_ptr(),
                  g=g32.data_ptr(), beta=b32.data_ptr(), cu_seqlens=cu32.data_ptr(),
                  initial_state=x["initial_state"].data_ptr(), o=x["out"].data_ptr(),
                  final_state=x["final_state"].data_ptr(), total_tokens=B * T, n_seqs=x["N"],
                  n_heads=H, a_log=x["A_log"].data_ptr(), dt_bias=x["dt_bias"].data_ptr(),
                  gate_lower_bound=float(x["lower_bound"]), flags=flags,
                  q_scale=float(x["scale"]))
    run.pieces = ch.pieces_per_sequence  # (total tokens, sequences, heads): its own split
    return run


def out_error(run, x, ref_o, nh) -> float:
    x["out"].fill_(float("nan"))
    run(x)
    torch.cuda.synchronize()
    return rel_err(x["out"][:, :, :nh], ref_o)


def bench_case(name, spec, gate, runners, iters, ceiling) -> dict:
    sets = input_sets(spec, 128, seed=len(name) + GATES.index(gate))
    shaped(sets, gate)
    base = sets[0]
    nh = min(REF_HEADS, base["q"].shape[2])
    ref_o, _ = reference(head_slice(base, nh))
    nbytes = compulsory_bytes(base)
    row = {"case": name, "gate": gate, "bytes": nbytes, "roofline_ms": nbytes / ceiling * 1e3}
    for peer, run in runners.items():
        if run is None:
            continue
        print(f"{name}, {gate} gates: {peer}", file=sys.stderr, flush=True)  # a crash's place
        row[f"{peer}_err"] = out_error(run, base, ref_o, nh)
        row[f"{peer}_ms"] = time_fn(graph_runner(run, sets), sets, iters)
        if peer == "kda":
            k1, k2, other = kernel_split(gpu_kernel_ms(run, sets))
            row.update(kda_k1_ms=k1, kda_k2_ms=k2, kda_other_ms=other)
    row["kda_pct_roofline"] = 100 * row["roofline_ms"] / row["kda_ms"]
    if "cudnn_ms" in row:  # its pieces, and its time per chunk a piece walks (warm-up included)
        T, H, N = base["q"].shape[1] * base["q"].shape[0], base["q"].shape[2], base["N"]
        chunks = math.ceil(math.ceil(T / N) / 16)
        pieces = runners["cudnn"].pieces(T, N, H)
        row.update(cudnn_pieces=pieces, cudnn_us_per_chunk=row["cudnn_ms"] * 1e3
                   / math.ceil(chunks / pieces))
    for peer in ("cudnn", "flashkda"):
        if f"{peer}_ms" in row:
            row[f"kda_vs_{peer}"] = row[f"{peer}_ms"] / row["kda_ms"]
    print(json.dumps(row), flush=True)
    return row


def geomean(xs):
    xs = [x for x in xs if x]
    return math.exp(statistics.fmean(map(math.log, xs))) if xs else None


def summary(rows) -> dict:
    out = {}
    for gate in GATES:
        rs = [r for r in rows if r["gate"] == gate]
        if not rs:
            continue
        s = {f"{k}_geomean_ms": geomean([r.get(f"{k}_ms") for r in rs])
             for k in ("kda", "cudnn", "flashkda", "roofline")}
        for peer in ("cudnn", "flashkda"):
            s[f"kda_vs_{peer}_geomean"] = geomean([r.get(f"kda_vs_{peer}") for r in rs])
            s[f"kda_vs_{peer}_min"] = min((r[f"kda_vs_{peer}"] for r in rs
                                           if f"kda_vs_{peer}" in r), default=None)
        out[gate] = s
    return out


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def markdown(rows, summ) -> str:
    lines = []
    for gate in GATES:
        rs = [r for r in rows if r["gate"] == gate]
        if not rs:
            continue
        lines += [f"\n### {gate} gates\n",
                  "| case | roofline us | kda_cute us | K1 / K2 us | % roofline | cuDNN fused us | "
                  "vs cuDNN | FlashKDA us | vs FlashKDA | out err kda / cuDNN / FlashKDA |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in rs:
            errs = " / ".join(_f(r.get(f"{p}_err"), ".1e") for p in ("kda", "cudnn", "flashkda"))
            lines.append(
                f"| {r['case']} | {r['roofline_ms'] * 1e3:.1f} | {r['kda_ms'] * 1e3:.1f} | "
                f"{r['kda_k1_ms'] * 1e3:.0f} / {r['kda_k2_ms'] * 1e3:.0f} | "
                f"{r['kda_pct_roofline']:.1f} | "
                f"{_f(r.get('cudnn_ms') and r['cudnn_ms'] * 1e3, '.1f')} | "
                f"{_f(r.get('kda_vs_cudnn'), '.2f')}x | "
                f"{_f(r.get('flashkda_ms') and r['flashkda_ms'] * 1e3, '.1f')} | "
                f"{_f(r.get('kda_vs_flashkda'), '.2f')}x | {errs} |")
        s = summ[gate]
        lines.append(f"| geomean | {_f(s['roofline_geomean_ms'] * 1e3, '.1f')} | "
                     f"{_f(s['kda_geomean_ms'] * 1e3, '.1f')} | | | "
                     f"{_f(s['cudnn_geomean_ms'] and s['cudnn_geomean_ms'] * 1e3, '.1f')} | "
                     f"{_f(s['kda_vs_cudnn_geomean'], '.2f')}x | "
                     f"{_f(s['flashkda_geomean_ms'] and s['flashkda_geomean_ms'] * 1e3, '.1f')} | "
                     f"{_f(s['kda_vs_flashkda_geomean'], '.2f')}x | |")
    return "\n".join(lines) + "\n"


def plot(rows, path):
    plt = pyplot()
    gates = [g for g in GATES if any(r["gate"] == g for r in rows)]
    if plt is None or not gates:
        return
    tall = 0.5 * len(rows) / len(gates) + 2
    fig, axes = plt.subplots(1, len(gates), figsize=(6 * len(gates), tall), squeeze=False)
    for ax, gate in zip(axes[0], gates, strict=True):
        rs = [r for r in rows if r["gate"] == gate]
        y = range(len(rs))
        for i, (peer, label) in enumerate((("kda", "kda_cute"), ("cudnn", "cuDNN fused"),
                                           ("flashkda", "FlashKDA"), ("roofline", "roofline"))):
            ax.barh([j + 0.2 * (1.5 - i) for j in y], [r.get(f"{peer}_ms", 0) * 1e3 for r in rs],
                    0.2, label=label)
        ax.set_yticks(list(y), [r["case"] for r in rs] if gate == gates[0] else [""] * len(rs))
        ax.set_xscale("log")
        ax.set_xlabel("us (median, CUDA graphs)")
        ax.set_title(f"{gate} gates")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", choices=("tp", "ten", "all"), default="tp")
    ap.add_argument("--gates", default="random,slow,mixed")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--out", type=Path, default=Path("bench/results/peers"))
    a = ap.parse_args(argv)
    gates = [g for g in a.gates.split(",") if g]
    unknown = sorted(set(gates) - set(GATES))
    if unknown:
        raise SystemExit(f"--gates: expected names from {GATES}, got {unknown}")
    cases = []
    if a.table in ("tp", "all"):
        cases += [(f"{T}/{H}/{N}", ("varlen", [T // N] * N, H)) for T, H, N in TP]
    if a.table in ("ten", "all"):
        cases += list(CASES.items())
    runners = {"kda": kda_runner(), "cudnn": cudnn_fused(), "flashkda": flashkda()}
    ceiling = copy_bandwidth()
    rows = []
    for gate in gates:
        for name, spec in cases:
            rows.append(bench_case(name, spec, gate, runners, a.iters, ceiling))
            write(rows, a, ceiling, final=False)  # a run cut short keeps its rows
    write(rows, a, ceiling, final=True)


def write(rows, a, ceiling, final: bool) -> None:
    summ = summary(rows)
    doc = {"versions": versions(), "method": __doc__.strip(), "copy_TBps": ceiling / 1e12,
           "complete": final, "summary": summ, "rows": rows}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    md = (f"# The prefill against its peers ({doc['versions']['device']}, commit "
          f"{doc['versions']['commit']})\n\nK = V = 128, bounded gate, fp32 states; CUDA "
          f"graphs, cold L2, median of {a.iters}; copy ceiling {ceiling / 1e12:.2f} TB/s.\n"
          + markdown(rows, summ))
    a.out.with_suffix(".md").write_text(md)
    if final:
        plot(rows, a.out.with_suffix(".png"))
        print(md)
        print(json.dumps(summ))

if __name__ == "__main__":
    main()
