"""What does the prep of one (chunk, head) cost inside a CTA that walks a sequence's chunks, as a
fused recurrence would run it? (docs/notes/bytes.md, "The byte budget per token-head")

    python3 bench/probes/prep_probe.py [--chunks 256] [--out FILE]

Builds bench/probes/prep_probe.cu with nvcc (K = 128, chunk 16, one warpgroup a CTA, the
bounded gate), checks its outputs (qg, kg, kd, gl, Aw, Mq) against float64 on a small problem,
then times it with 1, 2 and 3 CTAs per SM (as many CTAs as the SMs hold, one head each), its
inputs streamed from HBM or re-read from L2 (a window of four chunks). Prints us per chunk per
CTA and SM-us per (chunk, head): the prep's cost on the SM that would also run the chain; then
the phases' prefixes (none, norms, + the channel pass, + L and Mqk), whose differences share it
out.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
C, K = 16, 128
OUT_FLOATS = 3 * C * K + K + 2 * C * C


def build() -> ctypes.CDLL:
    so = Path(tempfile.gettempdir()) / "kda_prep_probe.so"
    subprocess.run(["nvcc", "-arch=sm_90a", "-O3", "-use_fast_math", "-shared", "-Xcompiler",
                    "-fPIC", "-Xptxas", "-v", "-o", str(so), str(HERE / "prep_probe.cu")],
                   check=True)
    lib = ctypes.CDLL(str(so))
    lib.prep_probe_launch.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + \
        [ctypes.c_float] * 2 + [ctypes.c_void_p] * 3
    return lib


def inputs(T, H, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    return dict(q=r(T, H, K).bfloat16(), k=r(T, H, K).bfloat16(), g=r(T, H, K).bfloat16(),
                beta=r(T, H).bfloat16(), A_log=torch.rand(H, generator=gen, device="cuda"),
                dt_bias=torch.rand(H, K, generator=gen, device="cuda"))


def launch(lib, x, ctas, chunks, window, dump=None, sink=None, phases=15):
    T, H = x["q"].shape[:2]
    sink = sink if sink is not None else torch.empty(ctas * 128, device="cuda")
    rc = lib.prep_probe_launch(
        x["q"].data_ptr(), x["k"].data_ptr(), x["g"].data_ptr(), x["beta"].data_ptr(),
        x["A_log"].data_ptr(), x["dt_bias"].data_ptr(), T, H, ctas, chunks, window, phases, -5.0,
        K ** -0.5, 0 if dump is None else dump.data_ptr(), sink.data_ptr(),
        torch.cuda.current_stream().cuda_stream)
    if rc:
        raise RuntimeError(f"prep_probe_launch: CUDA error {rc}")
    return sink


def reference(x, h, c, scale=K ** -0.5, lb=-5.0):
    """The chunk's outputs in float64, the probe's order."""
    rows = slice(c * C, (c + 1) * C)
    q, k, g = (x[n][rows, h].double() for n in ("q", "k", "g"))
    b = torch.sigmoid(x["beta"][rows, h].double())
    a = lb * torch.sigmoid(x["A_log"][h].double().exp() * (g + x["dt_bias"][h].double()))
    G = a.cumsum(0)
    qn = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    kn = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    gl = G[-1]
    L = torch.tril(b[:, None] * (kn * G.exp()) @ (kn * (-G).exp()).T, -1)
    M = torch.tril(scale * (qn * G.exp()) @ (kn * (-G).exp()).T)
    Tm = torch.linalg.inv(torch.eye(C, dtype=torch.float64, device=q.device) + L)
    aw = Tm * b[None, :]
    return dict(qg=qn * scale * G.exp(), kg=kn * G.exp(), kd=kn * (gl - G).exp(), gl=gl, aw=aw,
                mq=M @ aw)


def check(lib) -> dict:
    H, chunks = 4, 8
    x = inputs(chunks * C, H, seed=1)
    dump = torch.full((H, chunks, OUT_FLOATS), float("nan"), device="cuda")
    launch(lib, x, H, chunks, 0, dump=dump)
    torch.cuda.synchronize()
    worst = {}
    for h in range(H):
        for c in range(chunks):
            d = dump[h, c].double()
            got = dict(qg=d[:C * K].view(C, K), kg=d[C * K:2 * C * K].view(C, K),
                       kd=d[2 * C * K:3 * C * K].view(C, K), gl=d[3 * C * K:3 * C * K + K],
                       aw=d[3 * C * K + K:3 * C * K + K + C * C].view(C, C),
                       mq=d[3 * C * K + K + C * C:].view(C, C))
            for n, ref in reference(x, h, c).items():
                err = ((got[n] - ref).norm() / ref.norm()).item()
                worst[n] = max(worst.get(n, 0.0), err if err == err else float("inf"))
    return worst


def time_case(lib, per_sm, chunks, window, iters=10, phases=15) -> dict:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ctas = sms * per_sm
    x = inputs(chunks * C if window == 0 else 4 * C, ctas)
    sink = torch.empty(ctas * 128, device="cuda")
    for _ in range(2):
        launch(lib, x, ctas, chunks, window, sink=sink, phases=phases)
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        launch(lib, x, ctas, chunks, window, sink=sink, phases=phases)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    us = statistics.median(ts)
    per_chunk = us / chunks
    read = ctas * chunks * (3 * C * K * 2 + 2 * C)
    return {"ctas_per_sm": per_sm, "source": "L2 window" if window else "HBM", "phases": phases,
            "us": us,
            "us_per_chunk_per_cta": per_chunk, "sm_us_per_chunk_head": per_chunk / per_sm,
            "read_TBps": read / us / 1e6}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=256)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    lib = build()
    print("occupancy (CTAs per SM):", lib.prep_probe_occupancy(), "smem bytes:",
          lib.prep_probe_smem(), flush=True)
    errs = check(lib)
    print("errors against float64:", json.dumps({k: f"{v:.1e}" for k, v in errs.items()}))
    rows = [time_case(lib, n, a.chunks, w) for n in (1, 2, 3)
            if n <= lib.prep_probe_occupancy() for w in (0, 4)]
    # the phases' shares: each prefix of the chunk's phases, two CTAs an SM, from L2
    rows += [time_case(lib, 2, a.chunks, 4, phases=m) for m in (0, 1, 3, 7)]
    for r in rows:
        print(f"{r['ctas_per_sm']} CTA/SM, {r['source']:9s}, phases {r['phases']:2d}: "
              f"{r['us_per_chunk_per_cta']:.3f} us a chunk a CTA, "
              f"{r['sm_us_per_chunk_head']:.3f} SM-us a (chunk, head), "
              f"reads {r['read_TBps']:.2f} TB/s")
    if a.out:
        a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "errors": errs,
                                     "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
