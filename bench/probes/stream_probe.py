"""How fast can anything stream a decode's state bytes: the touched slots of a pool read and
written back in place (random slots, a pool four times the touched ones, K = V = 128), by plain
Triton kernels that do nothing else (a tile a program; persistent programs looping over the
tiles with their loads pipelined; or moving each tile by TMA), beside `dst.copy_(src)` of the
same bytes and kda_cute's decode of the same shape. CUDA graph, L2 flushed before each launch
(bench/serving.py's timing); % of the compulsory bytes (state only for the streams; state and
tokens for the decode, as bench/serving.py counts them) at the 2 GB copy's bandwidth.

The question it answers: is the serving bar (88% at N x H = 2048) within reach of a stream of
these bytes at all, and by which kind of kernel.

    python3 bench/probes/stream_probe.py [--shapes "64:32,256:12"] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serving import K, V, _flusher, decode_case, graphed, time_ms  # noqa: E402

from bench import copy_bandwidth, versions  # noqa: E402


def kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def tile(pool, idx, n_heads, slot_stride, BV: tl.constexpr, KD: tl.constexpr,
             VD: tl.constexpr):
        pid = tl.program_id(0)
        nb = VD // BV
        vb = pid % nb
        h = (pid // nb) % n_heads
        n = pid // (nb * n_heads)
        s = tl.load(idx + n).to(tl.int64)
        base = pool + s * slot_stride + h * VD * KD + vb * BV * KD
        offs = tl.arange(0, BV)[:, None] * KD + tl.arange(0, KD)[None, :]
        x = tl.load(base + offs)
        tl.store(base + offs, x * 0.5 + x * 0.5)

    @triton.jit
    def moved(src, dst, idx, odx, n_heads, slot_stride, BV: tl.constexpr, KD: tl.constexpr,
              VD: tl.constexpr):
        # tile's stream out of place: read slot idx[n], write slot odx[n]
        pid = tl.program_id(0)
        nb = VD // BV
        vb = pid % nb
        h = (pid // nb) % n_heads
        n = pid // (nb * n_heads)
        inner = h * VD * KD + vb * BV * KD
        offs = tl.arange(0, BV)[:, None] * KD + tl.arange(0, KD)[None, :]
        x = tl.load(src + tl.load(idx + n).to(tl.int64) * slot_stride + inner + offs)
        tl.store(dst + tl.load(odx + n).to(tl.int64) * slot_stride + inner + offs,
                 x * 0.5 + x * 0.5)

    @triton.jit
    def persist(pool, idx, n_heads, slot_stride, ntiles, BV: tl.constexpr, KD: tl.constexpr,
                VD: tl.constexpr, NPROG: tl.constexpr, STAGES: tl.constexpr):
        pid = tl.program_id(0)
        nb = VD // BV
        offs = tl.arange(0, BV)[:, None] * KD + tl.arange(0, KD)[None, :]
        for t in tl.range(pid, ntiles, NPROG, num_stages=STAGES):
            vb = t % nb
            h = (t // nb) % n_heads
            n = t // (nb * n_heads)
            s = tl.load(idx + n).to(tl.int64)
            base = pool + s * slot_stride + h * VD * KD + vb * BV * KD
            x = tl.load(base + offs)
            tl.store(base + offs, x * 0.5 + x * 0.5)

    @triton.jit
    def tma(pool, idx, n_heads, slot_stride, ntiles, n_slots, BV: tl.constexpr,
            KD: tl.constexpr, VD: tl.constexpr, NPROG: tl.constexpr, STAGES: tl.constexpr):
        # the pool as (slots * H * V, K) rows: a tile is BV rows of one slot and head, moved
        # by TMA (a descriptor made in the kernel)
        desc = tl.make_tensor_descriptor(pool, shape=[n_slots * n_heads * VD, KD],
                                         strides=[KD, 1], block_shape=[BV, KD])
        pid = tl.program_id(0)
        nb = VD // BV
        for t in tl.range(pid, ntiles, NPROG, num_stages=STAGES):
            vb = t % nb
            h = (t // nb) % n_heads
            n = t // (nb * n_heads)
            s = tl.load(idx + n)
            row = (s * n_heads + h) * VD + vb * BV
            x = desc.load([row, 0])
            desc.store([row, 0], x * 0.5 + x * 0.5)

    return tile, persist, tma, moved


def variants(sms: int):
    out = [("tile", dict(BV=bv, num_warps=w)) for bv in (16, 32, 64) for w in (4, 8)]
    out += [("persist", dict(BV=bv, per_sm=c, STAGES=s, num_warps=4))
            for bv in (16, 32) for c in (4, 8) for s in (1, 3)]
    out += [("tma", dict(BV=bv, per_sm=c, STAGES=s, num_warps=4))
            for bv in (32, 64) for c in (2, 4, 8) for s in (1, 3)]
    return out


def one_shape(N, H, dtype, sms, bw, flush, iters, kern) -> dict:
    tile, persist, tma, moved = kern
    gen = torch.Generator(device="cuda").manual_seed(N * 7 + H)
    slots = 4 * N
    pool = torch.randn(slots, H, V, K, generator=gen, device="cuda").to(dtype)
    idx = torch.randperm(slots, generator=gen, device="cuda")[:N].to(torch.int32)
    state = 2 * N * H * V * K * pool.element_size()
    row = {"pool": str(dtype).split(".")[-1], "N": N, "H": H, "state_bytes": state,
           "ceiling_ms": state / bw * 1e3, "ms": {}}
    src = torch.empty(N * H * V * K, dtype=dtype, device="cuda").normal_()
    dst = torch.empty_like(src)
    row["ms"]["copy_"] = time_ms(graphed(lambda: dst.copy_(src)), iters, flush)
    for kind, kw in variants(sms):
        bv, warps = kw["BV"], kw["num_warps"]
        ntiles = N * H * (V // bv)
        if kind == "tile":
            name = f"tile bv{bv} w{warps}"

            def fn(bv=bv, warps=warps, ntiles=ntiles):
                tile[(ntiles,)](pool, idx, H, pool.stride(0), BV=bv, KD=K, VD=V,
                                num_warps=warps)
        elif kind == "tma":
            nprog = min(ntiles, kw["per_sm"] * sms)
            name = f"tma bv{bv} {kw['per_sm']}/SM stages{kw['STAGES']}"
            if pool.stride(0) != H * V * K:
                raise ValueError("pool: the TMA variants need packed slots")

            def fn(bv=bv, warps=warps, ntiles=ntiles, nprog=nprog, st=kw["STAGES"]):
                tma[(nprog,)](pool, idx, H, pool.stride(0), ntiles, pool.shape[0], BV=bv,
                              KD=K, VD=V, NPROG=nprog, STAGES=st, num_warps=warps)
        else:
            nprog = min(ntiles, kw["per_sm"] * sms)
            name = f"persist bv{bv} {kw['per_sm']}/SM stages{kw['STAGES']}"

            def fn(bv=bv, warps=warps, ntiles=ntiles, nprog=nprog, st=kw["STAGES"]):
                persist[(nprog,)](pool, idx, H, pool.stride(0), ntiles, BV=bv, KD=K, VD=V,
                                  NPROG=nprog, STAGES=st, num_warps=warps)
        try:
            row["ms"][name] = time_ms(graphed(fn), iters, flush)
        except Exception as e:  # a variant the compiler refuses: say so, go on
            row["ms"][name] = None
            print(f"{name}: {e!r}"[:300], file=sys.stderr)
    # where the streams lose to copy_: the gather, or reading and writing the same lines
    perm = torch.randperm(slots, generator=gen, device="cuda").to(torch.int32)
    odx = perm[:N].contiguous()  # distinct slots, some among idx's: a second pool is written
    out = torch.empty_like(pool)
    packed = torch.randn(N, H, V, K, generator=gen, device="cuda").to(dtype)
    ramp = torch.arange(N, dtype=torch.int32, device="cuda")
    for bv in (16, 64):
        ntiles = N * H * (V // bv)

        def gather_out(bv=bv, ntiles=ntiles):
            moved[(ntiles,)](pool, out, idx, odx, H, pool.stride(0), BV=bv, KD=K, VD=V,
                             num_warps=4)

        def packed_in_place(bv=bv, ntiles=ntiles):
            tile[(ntiles,)](packed, ramp, H, packed.stride(0), BV=bv, KD=K, VD=V,
                            num_warps=4)

        def packed_out(bv=bv, ntiles=ntiles):
            moved[(ntiles,)](packed, src.view(packed.shape), ramp, ramp, H, packed.stride(0),
                             BV=bv, KD=K, VD=V, num_warps=4)

        for name, fn in ((f"tile bv{bv} w4 gathered, out of place", gather_out),
                         (f"tile bv{bv} w4 packed, in place", packed_in_place),
                         (f"tile bv{bv} w4 packed, out of place", packed_out)):
            row["ms"][name] = time_ms(graphed(fn), iters, flush)
    d = decode_case(N, H, dtype, None, bw, iters, flush)
    row["decode_graph_ms"], row["decode_pct"] = d["kda_graph_ms"], d["kda_pct"]
    row["pct"] = {k: (100 * row["ceiling_ms"] / v if v else None) for k, v in row["ms"].items()}
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64:32,256:12,256:32,1024:32")
    ap.add_argument("--pools", default="float32,bfloat16")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import triton

    # the TMA variants' descriptors live in global scratch the launcher asks for
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device="cuda"))
    kern = kernels()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth()
    flush = _flusher()
    rows = []
    for pool_name in a.pools.split(","):
        for shape in a.shapes.split(","):
            N, H = map(int, shape.split(":"))
            row = one_shape(N, H, getattr(torch, pool_name), sms, bw, flush, a.iters,
                            kern)
            rows.append(row)
            best = sorted((v, k) for k, v in row["pct"].items() if v)[::-1][:4]
            print(f"{pool_name} N{N} H{H}: decode {row['decode_pct']:.1f}% | "
                  + " | ".join(f"{k} {v:.1f}%" for v, k in best)
                  + f" | copy_ {row['pct']['copy_']:.1f}%", flush=True)
    res = {"versions": versions(), "copy_bandwidth": bw, "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
