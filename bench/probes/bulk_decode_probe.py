"""Does moving the state tiles by the bulk copy engine take a decode to the serving bar
(88% of the copy ceiling at N x H = 2048-3072)? A decode step written in CUDA C++ with that
memory structure (bench/probes/bulk_decode/probe.cu: a persistent grid, a producer warp moving
each tile global -> shared -> global with cp.async.bulk, STAGES tiles in flight a CTA, consumer
warps updating the rows in place in shared memory) beside kda_cute.decode on the same inputs:
bench/serving.py's decode case (fp32 and bf16 pools, gate="bounded", qk_l2norm, beta logits,
K = V = 128, a pool four times the touched slots, random slots), CUDA graph, cold L2, median; %
of the same compulsory bytes (bench/serving.py's step_bytes).

Each variant is first checked against kda_cute.decode from the same pool: outputs and touched
states close (the same fp32 math in another order), every other slot bit-identical.

    python3 bench/probes/bulk_decode_probe.py [--shapes 64:32,256:12] [--out FILE.json]
        [--cubin FILE]   (built with nvcc -arch=sm_90a where the file does not exist)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "probes"))

from gather_stream_probe import Probe, parse_shapes, plot  # noqa: E402
from serving import K, V, _flusher, graphed, inputs, step_bytes, time_ms  # noqa: E402

import kda_cute  # noqa: E402
from bench import copy_bandwidth, versions  # noqa: E402

SRC = Path(__file__).resolve().parent / "bulk_decode" / "probe.cu"
KERNELS = [(32, 4, 4), (32, 6, 4), (32, 6, 8), (32, 8, 4), (64, 3, 4), (64, 3, 8), (64, 6, 4),
           (16, 8, 4), (16, 12, 4)]  # (rows, stages, consumer warps): probe.cu's DECODE list
LOWER = -5.0


class Dec(ctypes.Structure):
    """probe.cu's kernel parameter (its field order and types)."""
    _fields_ = [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("g", ctypes.c_void_p),
                ("v", ctypes.c_void_p), ("beta", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("a_log", ctypes.c_void_p), ("dt_bias", ctypes.c_void_p),
                ("idx", ctypes.c_void_p), ("pool", ctypes.c_void_p),
                ("slot_stride", ctypes.c_longlong), ("heads", ctypes.c_int),
                ("parts", ctypes.c_int), ("tiles", ctypes.c_int), ("scale", ctypes.c_float),
                ("lower_bound", ctypes.c_float)]


def variants(sms: int, esz: int):
    """(name, kernel, rows, grid, threads, dynamic shared memory) for every CTA count an SM
    that fits (1-4), for a pool of `esz`-byte elements."""
    out = []
    pre = "decode_bulk_" if esz == 4 else "decode_bulk_bf16_"
    for rows, stages, warps in KERNELS:
        smem = stages * rows * K * esz
        for per_sm in (1, 2, 3, 4):
            if per_sm * (smem + 1024) <= 227 * 1024 and per_sm * 32 * (warps + 1) <= 2048:
                out.append((f"bulk {rows} rows x {stages} stages, {warps}+1 warps, {per_sm}/SM",
                            f"{pre}{rows}_{stages}_{warps}", rows, per_sm * sms,
                            32 * (warps + 1), smem))
    return out


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def one_shape(probe: Probe, N, H, dtype, sms, bw, flush, iters) -> dict:
    x = inputs(N, 1, H, dtype, seed=N * 7 + H)
    esz = x["pool"].element_size()
    idx = x["idx"][:, 0].contiguous()
    kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=LOWER, gate="bounded")
    pool0 = x["pool"].clone()
    touched = torch.zeros(pool0.shape[0], dtype=torch.bool, device="cuda")
    touched[idx.long()] = True
    ref_pool = pool0.clone()
    ref_out = kda_cute.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], ref_pool, idx, **kw)

    def kda():
        return kda_cute.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["pool"], idx,
                               out=x["out"], **kw)

    ceiling = step_bytes(N, 1, H, esz) / bw * 1e3
    row = {"pool": str(dtype).split(".")[-1], "N": N, "H": H, "ceiling_ms": ceiling, "ms": {},
           "checked": {}}
    row["ms"]["kda_cute decode"] = time_ms(graphed(kda), iters, flush)
    out = torch.empty_like(x["out"])

    def params(pool, rows):
        parts = V // rows
        return Dec(x["q"].data_ptr(), x["k"].data_ptr(), x["g"].data_ptr(), x["v"].data_ptr(),
                   x["beta"].data_ptr(), out.data_ptr(), x["A_log"].data_ptr(),
                   x["dt_bias"].data_ptr(), idx.data_ptr(), pool.data_ptr(), pool.stride(0), H,
                   parts, N * H * parts, K ** -0.5, LOWER)

    for name, kernel, rows, grid, threads, smem in variants(sms, esz):
        g = min(grid, N * H * (V // rows))
        try:
            pool = pool0.clone()
            out.fill_(float("nan"))
            probe.launcher(kernel, g, threads, smem, params(pool, rows))()
            torch.cuda.synchronize()
            eo, es = rel(out, ref_out), rel(pool[touched], ref_pool[touched])
            same = bool(torch.equal(pool[~touched], pool0[~touched]))
            ok = eo < 5e-3 and es < (1e-5 if esz == 4 else 2e-3) and same
            row["checked"][name] = {"out": eo, "state": es, "others_same": same, "ok": ok}
            if not ok:
                print(f"{name}: the check FAILED (out {eo:.2e}, state {es:.2e}, "
                      f"others same {same})", file=sys.stderr)
                continue
            row["ms"][name] = time_ms(graphed(probe.launcher(kernel, g, threads, smem,
                                                             params(x["pool"], rows))),
                                      iters, flush)
        except Exception as e:  # a variant the device refuses: say so, go on
            row["ms"][name] = None
            print(f"{name}: {e!r}"[:300], file=sys.stderr)
    # the decode once more, after the variants (drift within the run)
    row["ms"]["kda_cute decode (again)"] = time_ms(graphed(kda), iters, flush)
    row["pct"] = {k: (100 * ceiling / v if v else None) for k, v in row["ms"].items()}
    return row


def markdown(res) -> str:
    lines = [f"Copy bandwidth {res['copy_bandwidth'] / 1e9:.0f} GB/s; % of a decode's "
             "compulsory bytes (state read and written, tokens) at it. K = V = 128, "
             "CUDA graph, cold L2, median.", "",
             "| pool | N | H | kda_cute decode | again | best bulk decode | its ms | next best |",
             "|---|---:|---:|---:|---:|---|---:|---|"]
    for r in res["rows"]:
        items = sorted(((v, k) for k, v in r["pct"].items()
                        if v and not k.startswith("kda_cute")), reverse=True)
        best = f"{items[0][0]:.1f}% ({items[0][1]})" if items else "-"
        ms = f"{r['ms'][items[0][1]]:.4f}" if items else "-"
        nxt = f"{items[1][0]:.1f}% ({items[1][1]})" if len(items) > 1 else "-"
        lines.append(f"| {r['pool']} | {r['N']} | {r['H']} | {r['pct']['kda_cute decode']:.1f}% | "
                     f"{r['pct']['kda_cute decode (again)']:.1f}% | {best} | {ms} | {nxt} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64:32,256:12,256:32,1024:32")
    ap.add_argument("--pools", default="float32,bfloat16")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--cubin", default="/tmp/bulk_decode_probe.cubin")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    probe = Probe(Path(a.cubin), SRC)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth()
    flush = _flusher()
    rows = []
    for pool_name in a.pools.split(","):
        for N, H in parse_shapes(a.shapes):
            row = one_shape(probe, N, H, getattr(torch, pool_name), sms, bw, flush, a.iters)
            rows.append(row)
            best = sorted(((v, k) for k, v in row["pct"].items() if v), reverse=True)
            print(f"{pool_name} N{N} H{H}: "
                  + " | ".join(f"{k} {v:.1f}%" for v, k in best[:6]), flush=True)
    res = {"versions": versions(), "copy_bandwidth": bw, "rows": rows}
    if a.out:
        out = Path(a.out)
        out.write_text(json.dumps(res, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(res))
        plot(res, out.with_suffix(".png"), line=lambda r: (88, "the serving bar (88%)"),
             xlabel="% of the copy ceiling on a decode's compulsory bytes (CUDA graph, cold L2)")


if __name__ == "__main__":
    main()
