"""K1 alone at a given number of CTAs per SM: how its throughput scales with residency, the
reference for K1 sharing SMs with K2 (docs/notes/workspace.md, "The smaller workspace probed").

    python3 bench/probes/k1_occupancy_probe.py B1_T8192_H64 --ctas 1 2 3 4 6 8 \
        [--head-dim 128]

Each N pads K1's dynamic shared memory so that at most N CTAs fit on an SM (as the alongside
schedule does beside K2: the K1 Launch of bench.k1_plan given plans.schedule.k1_alongside_smem
of N); N = 0 is the launch unpadded. Prints K1's median time (CUDA events, input sets rotated
as in bench.py) and its items (chunk, head) per us per SM.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "probes"))

from kernel_times import parse_case  # noqa: E402

import bench  # noqa: E402
from kda_cute import plans  # noqa: E402
from kda_cute.plans import schedule as sch  # noqa: E402
from kda_cute.plans.device import resources  # noqa: E402


def hold_k1(pl, dev, ctas: int):
    """`pl` with K1 held to `ctas` CTAs per SM of `dev` (a DeviceInfo): its Launch's shared
    memory padded as the alongside schedule pads it, at least the kernel's own."""
    own = resources(pl.step("K1").kernel, dev.arch).smem
    return pl.edit("K1", smem=max(own, sch.k1_alongside_smem(dev, ctas)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ctas", type=int, nargs="+", default=[0, 1, 2, 3, 4, 6, 8])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--precision", choices=("fast", "precise"), default="fast")
    args = ap.parse_args(argv)
    bench.PRECISION = args.precision
    dev = plans.device_info(0)
    for name in args.cases:
        label, spec = parse_case(name)
        sets = bench.input_sets(spec, args.head_dim)
        p = bench.problem_of(sets[0], check_seqlens=False)
        k1 = bench.k1_plan(p, 0)
        items = plans.workspace.rows(p, k1.config.chunk)[0] * p.H
        for n in args.ctas:
            run = bench.plan_runner(hold_k1(k1, dev, n) if n else k1)
            ms = bench.time_fn(run, sets, args.iters)
            print(f"{label} K{args.head_dim} K1 at {n or 'unpadded'} CTAs/SM: {ms:.3f} ms, "
                  f"{items / (ms * 1e3) / dev.sms:.3f} items/us/SM", flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
