"""K1 alone at a given number of CTAs per SM: how its throughput scales with residency, the
reference for K1 sharing SMs with K2 (bench/NOTES.md, "The smaller workspace probed").

    python3 bench/k1_occupancy_probe.py B1_T8192_H64 --ctas 1 2 3 4 6 8 [--head-dim 128]

Each N pads K1's dynamic shared memory so that at most N CTAs fit on an SM (as the alongside
schedule does beside K2); N = 0 is the launch unpadded. Prints K1's median time (CUDA events,
input sets rotated as in bench.py) and its items (chunk, head) per us per SM.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kernel_times import parse_case  # noqa: E402

import bench  # noqa: E402
from kda_cute import api, runtime  # noqa: E402


def padded_k1(launch, smem_of):
    """Kernel.launch_with with K1's dynamic shared memory from smem_of() (None: its own) and
    programmatic launches (K1 alongside K2) dropped."""
    def launch_with(kernel, grid, values, syms, stream, device, smem=None, programmatic=False):
        if programmatic:
            return
        if kernel.manifest["name"].startswith("kda_prep"):
            smem = smem_of()
        launch(kernel, grid, values, syms, stream, device, smem=smem)
    return launch_with


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ctas", type=int, nargs="+", default=[0, 1, 2, 3, 4, 6, 8])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--precision", choices=("fast", "precise"), default="fast")
    args = ap.parse_args(argv)
    bench.PRECISION = args.precision
    sms = api._sm_budget(0)[0]
    launch = runtime.Kernel.launch_with
    for name in args.cases:
        label, spec = parse_case(name)
        sets = bench.input_sets(spec, args.head_dim)
        p = bench.problem_of(sets[0], check_seqlens=False)
        items = api._workspace_rows(p, api.config_for(p).chunk)[0] * p.H
        for n in args.ctas:
            smem = api._k1_alongside_smem(0, n) if n else None
            runtime.Kernel.launch_with = padded_k1(launch, lambda _s=smem: _s)
            try:
                ms = bench.time_fn(bench.k1_runner(), sets, args.iters)
            finally:
                runtime.Kernel.launch_with = launch
            print(f"{label} K{args.head_dim} K1 at {n or 'unpadded'} CTAs/SM: {ms:.3f} ms, "
                  f"{items / (ms * 1e3) / sms:.3f} items/us/SM", flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
