"""K1 beside an idle neighbour: does another kernel's resident CTA alone slow K1 on an SM?

    python3 bench/neighbor_probe.py B1_T8192_H64 --ctas 2 3 4 [--head-dim 128]

K1 beside K2 on the same SMs runs at ~0.35 items (chunk, head) per us per SM whether it has 2,
3 or 4 CTAs there, against 0.46-0.72 alone at those residencies (bench/NOTES.md), and neither
K1's memory traffic nor K2's tensor work changes that ratio. Here the neighbour does nothing:
one CTA per SM of a Triton kernel that spins on the global timer (preferring the largest
shared-memory carveout, so K1 fits beside it). K1 (padded to N CTAs per SM, as the alongside
schedule pads it) runs on another stream while the spinners hold every SM, timed by events on
its own stream; then K1 alone at the same padding. Equal rates: residency alone is not the
cap, the K2 chain's activity is. Prints items per us per SM for both.
"""

from __future__ import annotations

import argparse
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

from kernel_times import parse_case  # noqa: E402

import bench  # noqa: E402
from kda_cute import api, runtime  # noqa: E402


@triton.jit
def _spin(out_ptr, ns):
    t0 = tl_cuda.globaltimer()
    t = t0
    while t - t0 < ns:
        t = tl_cuda.globaltimer()
    tl.store(out_ptr + tl.program_id(0), t - t0)


def _carveout(compiled) -> None:
    """The largest shared-memory carveout for a compiled Triton kernel (else the SM's split,
    set when the spinner lands first, leaves K1 no room)."""
    compiled._init_handles()
    cu = runtime._cu()
    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    runtime.check(cu.cuFuncSetAttribute(cu.CUfunction(compiled.function), attr, 100))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ctas", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--spin-ms", type=float, default=20.0)
    args = ap.parse_args(argv)
    sms, per_sm, _ = api._sm_budget(0)
    buf = torch.zeros(sms, dtype=torch.int64, device="cuda")
    _carveout(_spin[(1,)](buf, 1000))
    side = torch.cuda.Stream()
    launch = runtime.Kernel.launch_with
    for name in args.cases:
        label, spec = parse_case(name)
        sets = bench.input_sets(spec, args.head_dim)
        p = bench.problem_of(sets[0], check_seqlens=False)
        items = api._workspace_rows(p, api.config_for(p).chunk)[0] * p.H
        run = bench.k1_runner()
        for n in args.ctas:
            # N CTAs of K1 fit beside the spinner's 1 KB system reservation, and alone
            smem = (per_sm - 2048) // n // api.SMEM_UNIT * api.SMEM_UNIT - 1024

            def padded(self, grid, values, syms, stream, device, smem_=None, programmatic=False,
                       _smem=smem):
                launch(self, grid, values, syms, stream, device, smem=_smem,
                       programmatic=programmatic)

            runtime.Kernel.launch_with = padded
            try:
                alone = bench.time_fn(run, sets, 50)
                beside = []
                for i in range(10):
                    torch.cuda.synchronize()
                    _spin[(sms,)](buf, int(args.spin_ms * 1e6))
                    time.sleep(0.002)  # every spinner resident before K1 starts
                    with torch.cuda.stream(side):
                        a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                        a.record()
                        run(sets[i % len(sets)])
                        b.record()
                    b.synchronize()
                    beside.append(a.elapsed_time(b))
                torch.cuda.synchronize()
                spun = int(buf.max()) / 1e6
            finally:
                runtime.Kernel.launch_with = launch
            beside.sort()
            med = beside[len(beside) // 2]
            print(f"{label} K{args.head_dim} K1 {n} CTAs/SM: alone {alone:.3f} ms "
                  f"({items / (alone * 1e3) / sms:.3f} items/us/SM), beside the spinners "
                  f"{med:.3f} ms ({items / (med * 1e3) / sms:.3f}; spinners ran {spun:.1f} ms)",
                  flush=True)


if __name__ == "__main__":
    main()
