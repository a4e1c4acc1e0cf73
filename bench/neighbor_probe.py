"""K1 beside a resident neighbour that does no work: what caps K1 on SMs it shares with K2?

    python3 bench/neighbor_probe.py B1_T8192_H64 --ctas 2 3 4 [--neighbor k2,sleeper,spinner]

K1 beside K2 on the same SMs runs at ~0.35 items (chunk, head) per us per SM whether it has 2,
3 or 4 CTAs there, against 0.46-0.72 alone at those residencies (bench/NOTES.md), and neither
K1's memory traffic nor K2's tensor work changes that ratio. Neighbours, one CTA per SM, each
resident before K1 starts and released after it ends:

  k2       K2 itself, idle: the alongside schedule on K1's SMs (alongside_probe.py --shared)
           with K1's programmatic launch dropped, so every K2 CTA waits at its first chunk's
           flag (its producer warp polling, its consumers at an mbarrier) until the flags
           are set after K1. K1 is padded to N CTAs per SM in what K2 leaves.
  sleeper  a Triton kernel of four warps looping on nanosleep (2 us) until a global-timer
           deadline; K1 padded to N CTAs per SM of the whole SM
  spinner  the same without the nanosleep: four warps issuing global-timer reads

Measured on the H200 (bench/results/shared-sm-probes-h200-2026-11-30.txt): K1 never ran beside
the Triton neighbours, with or without their carveout preference: it waited for them to exit
(a neighbour staying 50 ms delayed K1 by ~48 ms). Only the k2 neighbour shares SMs with K1.

K1's serial build runs on another stream, queued behind a short sleep kernel so that its
launch path is not in the timing, between CUDA events on its own stream. "alone" is K1 at the
same padding with no neighbour (bench.time_fn). Run with KDA_CUTE_WY=0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from alongside_probe import CARVEOUT, _K1Ctas, _Shared  # noqa: E402
from kernel_times import parse_case  # noqa: E402

import bench  # noqa: E402
from kda_cute import api, runtime  # noqa: E402

NEIGHBORS = ("k2", "sleeper", "spinner")


@triton.jit
def _wait(out_ptr, ns, SLEEP: tl.constexpr):
    t0 = tl_cuda.globaltimer()
    t = t0
    while t - t0 < ns:
        if SLEEP:
            tl.inline_asm_elementwise("nanosleep.u32 2000;\n mov.u32 $0, 0;", "=r", [],
                                      dtype=tl.int32, is_pure=False, pack=1)
        t = tl_cuda.globaltimer()
    tl.store(out_ptr + tl.program_id(0), t - t0)


def _carveout(compiled) -> None:
    """The largest shared-memory carveout for a compiled Triton kernel (else the SM's split,
    set when the neighbour lands first, could leave K1 no room)."""
    compiled._init_handles()
    cu = runtime._cu()
    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    runtime.check(cu.cuFuncSetAttribute(cu.CUfunction(compiled.function), attr, CARVEOUT))


def _padded(launch, smem_of):
    """Kernel.launch_with with K1's shared memory from smem_of() and K1's programmatic
    (alongside) launch dropped."""
    def launch_with(kernel, grid, values, syms, stream, device, smem=None, programmatic=False):
        if programmatic:
            return
        if kernel.manifest["name"].startswith("kda_prep"):
            smem = smem_of()
        launch(kernel, grid, values, syms, stream, device, smem=smem)
    return launch_with


def k1_beside(k1_only, sets, start, release, rounds: int) -> float:
    """Median ms of K1 while start()'s neighbour holds the SMs (release() ends it)."""
    main_s, side_s = torch.cuda.Stream(), torch.cuda.Stream()
    times = []
    for i in range(rounds):
        x = sets[i % len(sets)]
        torch.cuda.synchronize()
        with torch.cuda.stream(main_s):
            start(x)
        time.sleep(0.002)  # every neighbour CTA resident
        with torch.cuda.stream(side_s):
            torch.cuda._sleep(400_000)  # K1's launch path runs meanwhile
            a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            a.record()
            k1_only(x)
            b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
        with torch.cuda.stream(side_s):
            release(x)
        torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ctas", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--neighbor", default=",".join(NEIGHBORS))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--neighbor-ms", type=float, default=50.0,
                    help="how long the Triton neighbours stay (K1 must end well within it)")
    ap.add_argument("--no-carveout", action="store_true",
                    help="leave the Triton neighbours' carveout to the driver")
    args = ap.parse_args(argv)
    os.environ["KDA_CUTE_REPLAY"] = "0"  # the launches are patched below
    sms, per_sm, _ = api._sm_budget(0)
    buf = torch.zeros(sms, dtype=torch.int64, device="cuda")
    waits = {}
    for sleep in (0, 1):
        waits[sleep] = _wait[(1,)](buf, 1000, SLEEP=sleep)
        if not args.no_carveout:
            _carveout(waits[sleep])
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    for name in args.cases:
        label, spec = parse_case(name)
        sets = bench.input_sets(spec, args.head_dim)
        p = bench.problem_of(sets[0], check_seqlens=False)
        cfg = api.config_for(p)
        items = api._workspace_rows(p, cfg.chunk)[0] * p.H
        fwd, k1_only = bench.kda_runner(), bench.k1_runner()

        def flags(x, _p=p, _cfg=cfg):
            return api.workspace_views(x["workspace"], _p, _cfg)["flags"]

        for neighbor in args.neighbor.split(","):
            for n in args.ctas:
                launch = runtime.Kernel.launch_with
                if neighbor == "k2":
                    with _K1Ctas(n), _Shared(True):
                        shared = runtime.Kernel.launch_with
                        runtime.Kernel.launch_with = _padded(
                            shared, lambda _n=n: api._k1_alongside_smem(0, _n))
                        try:
                            # K2's footprint learnt, K1's serial build and the fill loaded
                            # (a first load waits for an idle device, which a waiting K2 is
                            # not: it would trap after 5 s)
                            k1_only(sets[0])
                            flags(sets[0]).fill_(1)
                            torch.cuda.synchronize()
                            release = lambda x: flags(x).fill_(1)  # noqa: E731
                            k1_beside(k1_only, sets, fwd, release, 1)  # K2's footprint learnt
                            beside = k1_beside(k1_only, sets, fwd, release, args.rounds)
                            alone = bench.time_fn(k1_only, sets, 50)
                        finally:
                            runtime.Kernel.launch_with = shared
                else:
                    smem = ((per_sm - 2048) // n // api.SMEM_UNIT * api.SMEM_UNIT - 1024 if n
                            else None)  # 0: K1 unpadded
                    runtime.Kernel.launch_with = _padded(launch, lambda _s=smem: _s)
                    sleep = int(neighbor == "sleeper")
                    try:
                        beside = k1_beside(
                            k1_only, sets, lambda x, _s=sleep: _wait[(sms,)](
                                buf, int(args.neighbor_ms * 1e6), SLEEP=_s),
                            lambda x: None, args.rounds)
                        alone = bench.time_fn(k1_only, sets, 50)
                    finally:
                        runtime.Kernel.launch_with = launch
                print(f"{label} K{args.head_dim} K1 {n} CTAs/SM beside {neighbor}: "
                      f"{beside:.3f} ms ({items / (beside * 1e3) / sms:.3f} items/us/SM); "
                      f"alone at the same padding {alone:.3f} ms "
                      f"({items / (alone * 1e3) / sms:.3f})", flush=True)


if __name__ == "__main__":
    main()
