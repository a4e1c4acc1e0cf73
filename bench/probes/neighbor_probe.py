"""K1 beside an idle K2: does a resident K2 CTA alone slow K1 on its SM, or its chain's work?

    python3 bench/probes/neighbor_probe.py B1_T8192_H64 --ctas 2 3 4 [--head-dim 128]

K1 beside K2 on the same SMs runs at ~0.35 items (chunk, head) per us per SM whether it has 2,
3 or 4 CTAs there, against 0.46-0.72 alone at those residencies (docs/notes/schedules.md), and
neither K1's memory traffic nor K2's tensor work changes that ratio. Here K2 is resident and
idle: the alongside schedule on K1's SMs (alongside_probe.py --shared: forced_alongside) without
its K1 (the plan's "zero flags" and "K2" steps only), so every K2 CTA waits at its first chunk's
flag (its producer warp polling, its consumers at an mbarrier) until the flags are set after K1.
K1's serial build (bench.k1_plan) runs on another stream, padded to N CTAs per SM in what K2
leaves, queued behind a short sleep kernel so that its launch path is not in the timing, between
CUDA events on its own stream. "alone" is K1 at the same padding with no K2 (bench.time_fn).
Every kernel prefers the largest shared-memory carveout, as in alongside_probe.py --shared.

(An earlier version, 6eb7412, also tried Triton kernels as neighbours; K1 never shared an SM
with them: bench/results/shared-sm-probes-h200-2026-11-30.txt.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "probes"))

from alongside_probe import beside_k2, forced_alongside, options, prefer_shared  # noqa: E402
from k1_occupancy_probe import hold_k1  # noqa: E402
from kernel_times import parse_case  # noqa: E402

import bench  # noqa: E402
from kda_cute import plans  # noqa: E402


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
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)
    dev = plans.device_info(0)
    torch.cuda._sleep(1000)  # loaded now: a first load waits for an idle device
    torch.cuda.synchronize()
    for name in args.cases:
        label, spec = parse_case(name)
        sets = bench.input_sets(spec, args.head_dim)
        p = bench.problem_of(sets[0], check_seqlens=False)
        along = forced_alongside(p, options(), dev)
        if along.schedule.kind != "alongside":
            raise SystemExit(f"{label}: runs {str(along.schedule)!r}, not alongside")
        cfg = along.config
        items = plans.workspace.rows(p, cfg.chunk)[0] * p.H
        # K2 resident and waiting: the alongside plan without its K1
        idle_k2 = along.only("zero flags", "K2")
        prefer_shared(idle_k2, 0)
        fwd = bench.plan_runner(idle_k2)
        k1_serial = bench.k1_plan(p, 0)
        room = beside_k2(dev, idle_k2.step("K2").smem)

        def release(x, _p=p, _cfg=cfg):  # the flags K2 waits on
            plans.workspace.views(x["workspace"], _p, _cfg)["flags"].fill_(1)

        for n in args.ctas:
            k1 = hold_k1(k1_serial, room, n)
            prefer_shared(k1, 0)
            k1_only = bench.plan_runner(k1)
            # K1's serial build and the fill loaded first (a first load waits for an idle
            # device, which a waiting K2 is not: it would trap after 5 s), then one round
            # unmeasured
            k1_only(sets[0])
            release(sets[0])
            torch.cuda.synchronize()
            k1_beside(k1_only, sets, fwd, release, 1)
            beside = k1_beside(k1_only, sets, fwd, release, args.rounds)
            alone = bench.time_fn(k1_only, sets, 50)
            print(f"{label} K{args.head_dim} K1 {n} CTAs/SM beside k2: "
                  f"{beside:.3f} ms ({items / (beside * 1e3) / dev.sms:.3f} items/us/SM); "
                  f"alone at the same padding {alone:.3f} ms "
                  f"({items / (alone * 1e3) / dev.sms:.3f})", flush=True)


if __name__ == "__main__":
    main()
