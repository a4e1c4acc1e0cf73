"""DRAM rate of the workspace's tile pattern, token-major against head-major.

    python3 bench/probes/layout_probe.py [--heads 64] [--chunks 4096]

K1 writes and K2 reads each (chunk, head) tile of the workspace as 16 rows of 256 bytes (K = 128
fp16). Token-major (the layout today, (T, H*K)) puts those rows H*256 bytes apart; head-major
((H, T, K)) makes each tile one 4 KB block. Plain CUDA kernels (bench/probes/layout/probe.cu,
nvcc here) stream every tile once, heads fastest as the kernels' grids run, 256 threads a tile;
median of 20 timed runs after warm-up, bytes over time.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kda_cute.launch.driver import bindings, check  # noqa: E402

SRC = Path(__file__).resolve().parent / "layout" / "probe.cu"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=4096)
    ap.add_argument("--tiles-per-cta", type=int, default=4)
    args = ap.parse_args(argv)
    cu = bindings()  # cuda.bindings.driver
    out = Path("/tmp/layout_probe.cubin")
    subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-O3", "-o", str(out), str(SRC)], check=True)
    torch.zeros(1, device="cuda")
    mod = check(cu.cuModuleLoad(str(out).encode()))
    rd = check(cu.cuModuleGetFunction(mod, b"tiles_read"))
    wr = check(cu.cuModuleGetFunction(mod, b"tiles_write"))
    tiles = args.heads * args.chunks
    buf = torch.empty(tiles * 4096, dtype=torch.uint8, device="cuda")
    sink = torch.empty(4096, dtype=torch.uint8, device="cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    grid = -(-tiles // args.tiles_per_cta)
    vp, i64, i32 = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int
    stream = torch.cuda.current_stream().cuda_stream
    print(f"{args.heads} heads x {args.chunks} chunks: {tiles * 4096 / 1e9:.2f} GB per pass")
    for name, stride in (("token-major", args.heads * 16), ("head-major", 0)):
        for kind, f in (("read", rd), ("write", wr)):
            if kind == "read":
                params = ((buf.data_ptr(), sink.data_ptr(), tiles, stride, args.heads,
                           args.tiles_per_cta), (vp, vp, i64, i64, i32, i32))
            else:
                params = ((buf.data_ptr(), tiles, stride, args.heads, args.tiles_per_cta),
                          (vp, i64, i64, i32, i32))
            times = []
            for rep in range(25):
                flush.zero_()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                check(cu.cuLaunchKernel(f, grid, 1, 1, 256, 1, 1, 0, stream, params, 0))
                b.record()
                torch.cuda.synchronize()
                if rep >= 5:
                    times.append(a.elapsed_time(b))
            ms = statistics.median(times)
            print(f"{name:<12} {kind:<5} {ms:.3f} ms  {tiles * 4096 / ms / 1e9:.2f} TB/s",
                  flush=True)


if __name__ == "__main__":
    main()
