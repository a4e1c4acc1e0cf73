"""How fast can a CUDA C++ kernel stream a decode's state bytes: the touched slots of a pool read
and written back in place (random slots, a pool four times the touched ones, K = V = 128), by
kernels that do nothing else (bench/probes/gather_stream/probe.cu): a CTA a tile with every
16-byte load issued before any store (`vec`), a persistent grid keeping 1-8 loads a thread in
flight (`flat`), and one-warp CTAs moving whole tiles through shared memory with the bulk copy
engine, up to 2-6 tiles in flight a CTA (`bulk`). Beside them `dst.copy_(src)` of the same bytes
packed and kda_cute's decode of the shape. CUDA graph, L2 flushed before each launch
(bench/serving.py's timing); % of the state bytes at the 2 GB copy's bandwidth, as
bench/probes/stream_probe.py (its Triton streams) counts them.

The question: is the serving bar (88% of the copy ceiling at N x H = 2048) within reach of any
stream of these bytes, and which memory structure gets closest.

Each variant is first run out of place into a second pool and checked: every touched tile
copied, nothing else written.

    python3 bench/probes/gather_stream_probe.py [--shapes 64:32,256:12] [--out FILE.json]
        [--cubin FILE]   (built with nvcc -arch=sm_90a where the file does not exist)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serving import K, V, _flusher, decode_case, graphed, time_ms  # noqa: E402

from bench import copy_bandwidth, pyplot, versions  # noqa: E402
from kda_cute.launch.driver import bindings, check  # noqa: E402

SRC = Path(__file__).resolve().parent / "gather_stream" / "probe.cu"
VEC = [(4096, 128), (8192, 128), (16384, 128), (16384, 256), (32768, 256), (32768, 512)]
FLAT = [1, 2, 4, 8]
BULK = [(2, 16384), (3, 16384), (4, 16384), (6, 16384), (2, 32768), (3, 32768), (4, 32768),
        (6, 32768)]


class Tiles(ctypes.Structure):
    """probe.cu's kernel parameter (its field order and types)."""
    _fields_ = [("idx", ctypes.c_void_p), ("pool", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("slot_stride", ctypes.c_longlong), ("heads", ctypes.c_int),
                ("head_bytes", ctypes.c_int), ("tile_bytes", ctypes.c_int),
                ("parts", ctypes.c_int), ("tiles", ctypes.c_int)]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        bits = part.split(":")
        if len(bits) != 2 or not all(b.isdigit() and int(b) > 0 for b in bits):
            raise SystemExit(f"--shapes: expected N:H pairs of positive integers, got {part!r}")
        out.append((int(bits[0]), int(bits[1])))
    return out


def variants(sms: int, head_bytes: int) -> list[tuple[str, str, int, int, int, int]]:
    """(name, kernel, tile bytes, grid (0: a CTA a tile), threads, dynamic shared memory)."""
    out = [(f"vec {t // 1024} KB {th} thr", f"vec_{t}_{th}", t, 0, th, 0) for t, th in VEC
           if head_bytes % t == 0]
    out += [(f"flat unroll {u} (8 CTAs/SM)", f"flat_{u}", head_bytes, 8 * sms, 256, 0)
            for u in FLAT]
    for stages, t in BULK:
        smem = stages * t
        for per_sm in (1, 2, 4, 8):
            if per_sm * (smem + 1024) <= 228 * 1024:
                out.append((f"bulk {t // 1024} KB x {stages} stages, {per_sm}/SM",
                            f"bulk_{stages}", t, per_sm * sms, 32, smem))
    return out


class Probe:
    """A CUDA C++ probe's cubin (built from `src` with nvcc where `cubin` does not exist) and
    launchers of its kernels, each taking one ctypes structure."""

    def __init__(self, cubin: Path, src: Path = SRC):
        self.cu = cu = bindings()
        torch.zeros(1, device="cuda")  # the primary context
        if not cubin.exists():
            subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-O3", "-o", str(cubin), str(src)],
                           check=True)
        self.mod = check(cu.cuModuleLoad(str(cubin).encode()))
        self.fns = {}

    def fn(self, name: str, smem: int):
        """The kernel, allowed `smem` bytes of dynamic shared memory (the attribute raised to what
        a launch asks, never to the whole 227 KB: the kernel's static shared memory counts too)."""
        f, allowed = self.fns.get(name, (None, 0))
        if f is None:
            f = check(self.cu.cuModuleGetFunction(self.mod, name.encode()))
        if smem > allowed:
            A = self.cu.CUfunction_attribute
            check(self.cu.cuFuncSetAttribute(
                f, A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
            allowed = smem
        self.fns[name] = (f, allowed)
        return f

    def launcher(self, kernel, grid, threads, smem, p: ctypes.Structure):
        f = self.fn(kernel, smem)
        ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(p))
        cu = self.cu

        def run():
            stream = torch.cuda.current_stream().cuda_stream
            check(cu.cuLaunchKernel(f, grid, 1, 1, threads, 1, 1, smem, cu.CUstream(stream),
                                    ctypes.addressof(ptrs), 0))
        run.keep = (p, ptrs)  # the parameter block lives as long as the launcher
        return run


def one_shape(probe: Probe, N, H, dtype, sms, bw, flush, iters) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(N * 7 + H)
    slots = 4 * N
    pool = torch.randn(slots, H, V, K, generator=gen, device="cuda").to(dtype)
    idx = torch.randperm(slots, generator=gen, device="cuda")[:N].to(torch.int32)
    esz = pool.element_size()
    head_bytes = V * K * esz
    state = 2 * N * H * head_bytes
    row = {"pool": str(dtype).split(".")[-1], "N": N, "H": H, "state_bytes": state,
           "ceiling_ms": state / bw * 1e3, "ms": {}, "checked": {}}
    src = torch.empty(N * H * V * K, dtype=dtype, device="cuda").normal_()
    dst = torch.empty_like(src)
    row["ms"]["copy_"] = time_ms(graphed(lambda: dst.copy_(src)), iters, flush)
    other = torch.empty_like(pool)
    touched = torch.zeros(slots, dtype=torch.bool, device="cuda")
    touched[idx.long()] = True
    for name, kernel, tile, grid, threads, smem in variants(sms, head_bytes):
        parts = head_bytes // tile
        ntiles = N * H * parts

        def params(out, tile=tile, parts=parts, ntiles=ntiles):
            return Tiles(idx.data_ptr(), pool.data_ptr(), out.data_ptr(),
                         pool.stride(0) * esz, H, head_bytes, tile, parts, ntiles)

        g = grid if grid else ntiles
        g = min(g, ntiles) if kernel.startswith("bulk") else g
        try:
            other.fill_(7)
            probe.launcher(kernel, g, threads, smem, params(other))()
            torch.cuda.synchronize()
            ok = (torch.equal(other[touched], pool[touched])
                  and bool((other[~touched] == 7).all()))
            row["checked"][name] = ok
            if not ok:
                print(f"{name}: the out-of-place check FAILED", file=sys.stderr)
                continue
            row["ms"][name] = time_ms(graphed(probe.launcher(kernel, g, threads, smem,
                                                             params(pool))), iters, flush)
        except Exception as e:  # a variant the device refuses: say so, go on
            row["ms"][name] = None
            print(f"{name}: {e!r}"[:300], file=sys.stderr)
    d = decode_case(N, H, dtype, None, bw, iters, flush)
    row["decode_graph_ms"], row["decode_pct"] = d["kda_graph_ms"], d["kda_pct"]
    row["pct"] = {k: (100 * row["ceiling_ms"] / v if v else None) for k, v in row["ms"].items()}
    return row


def kind(name: str) -> str:
    """A variant's family: vec, flat, bulk, or the name itself (copy_)."""
    return name.split(" ")[0]


def markdown(res) -> str:
    """Per shape: the decode, each family's best variant and copy_, as % of the copy ceiling on
    the state bytes."""
    lines = [f"Copy bandwidth {res['copy_bandwidth'] / 1e9:.0f} GB/s. % of the state bytes "
             "(touched slots read and written) at that bandwidth (the decode's: of its state "
             "and token bytes, as bench/serving.py counts them); CUDA graph, cold L2, median.",
             "", "| pool | N | H | decode | best vec | best flat | best bulk | copy_ |",
             "|---|---:|---:|---:|---|---|---|---:|"]
    for r in res["rows"]:
        best = {}
        for name, pct in r["pct"].items():
            if pct and (kind(name) not in best or pct > best[kind(name)][1]):
                best[kind(name)] = (name, pct)

        def cell(k, best=best):
            return f"{best[k][1]:.1f}% ({best[k][0]})" if k in best else "-"
        lines.append(f"| {r['pool']} | {r['N']} | {r['H']} | {r['decode_pct']:.1f}% | "
                     f"{cell('vec')} | {cell('flat')} | {cell('bulk')} | "
                     f"{r['pct']['copy_']:.1f}% |")
    return "\n".join(lines) + "\n"


def plot(res, path, line=lambda r: (r["decode_pct"], "kda_cute decode"),
         xlabel="% of the copy ceiling on the state bytes (CUDA graph, cold L2)"):
    """Each shape's variants (a row's "pct") as % of the copy ceiling, a panel a shape, with
    line(row) = (x, label) drawn across it (here the decode's %)."""
    plt = pyplot()
    if plt is None:
        return
    rows = res["rows"]
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 3.2 * len(rows)), squeeze=False)
    for ax, r in zip(axes[:, 0], rows, strict=True):
        items = sorted((v, k) for k, v in r["pct"].items() if v)
        ax.barh(range(len(items)), [v for v, _ in items])
        ax.set_yticks(range(len(items)), [k for _, k in items], fontsize=6)
        x, label = line(r)
        ax.axvline(x, color="k", linestyle="--", label=label)
        ax.set_xlim(0, 100)
        ax.set_title(f"{r['pool']} N{r['N']} H{r['H']}", fontsize=8)
        ax.legend(fontsize=6)
    axes[-1, 0].set_xlabel(xlabel)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64:32,256:12,256:32,1024:32")
    ap.add_argument("--pools", default="bfloat16,float32")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--cubin", default="/tmp/gather_stream_probe.cubin")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    shapes = parse_shapes(a.shapes)
    probe = Probe(Path(a.cubin))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth()
    flush = _flusher()
    rows = []
    for pool_name in a.pools.split(","):
        for N, H in shapes:
            row = one_shape(probe, N, H, getattr(torch, pool_name), sms, bw, flush, a.iters)
            rows.append(row)
            best = sorted((v, k) for k, v in row["pct"].items() if v and k != "copy_")[::-1]
            print(f"{pool_name} N{N} H{H}: decode {row['decode_pct']:.1f}% | "
                  + " | ".join(f"{k} {v:.1f}%" for v, k in best[:5])
                  + f" | copy_ {row['pct']['copy_']:.1f}%", flush=True)
    res = {"versions": versions(), "copy_bandwidth": bw, "rows": rows}
    if a.out:
        out = Path(a.out)
        out.write_text(json.dumps(res, indent=1) + "\n")
        out.with_suffix(".md").write_text(markdown(res))
        plot(res, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
