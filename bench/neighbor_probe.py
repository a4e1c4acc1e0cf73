"""K1 beside an idle K2: does a resident K2 CTA alone slow K1 on its SM, or its chain's work?

    python3 bench/neighbor_probe.py B1_T8192_H64 --ctas 2 3 4 [--head-dim 128]

K1 beside K2 on the same SMs runs at ~0.35 items (chunk, head) per us per SM whether it has 2,
3 or 4 CTAs there, against 0.46-0.72 alone at those residencies (bench/NOTES.md), and neither
K1's memory traffic nor K2's tensor work changes that ratio. Here K2 is resident and idle: the
alongside schedule on K1's SMs (alongside_probe.py --shared), but K1's programmatic launch is
dropped, so every K2 CTA waits at its first chunk's flag (one warp polling, the rest at an
mbarrier). K1's serial build then runs on another stream, padded to N CTAs per SM in what K2
leaves, timed by events on its own stream; then the flags are set and K2 finishes. Against K1
alone at the same padding: equal rates put the cap on the K2 chain's activity, not on its
residency. Run with KDA_CUTE_WY=0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from alongside_probe import _K1Ctas, _Shared  # noqa: E402
from kernel_times import parse_case  # noqa: E402

import bench  # noqa: E402
from kda_cute import api, runtime  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ctas", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)
    os.environ["KDA_CUTE_REPLAY"] = "0"
    sms = api._sm_budget(0)[0]
    main_s, side_s = torch.cuda.Stream(), torch.cuda.Stream()
    for name in args.cases:
        label, spec = parse_case(name)
        sets = bench.input_sets(spec, args.head_dim)
        p = bench.problem_of(sets[0], check_seqlens=False)
        cfg = api.config_for(p)
        items = api._workspace_rows(p, cfg.chunk)[0] * p.H
        fwd, k1_only = bench.kda_runner(), bench.k1_runner()
        for n in args.ctas:
            with _K1Ctas(n), _Shared(True):
                shared_launch = runtime.Kernel.launch_with

                def launch_with(kernel, grid, values, syms, stream, device, smem=None,
                                programmatic=False, _launch=shared_launch, _n=n):
                    if programmatic:  # K1 alongside: not launched, K2 waits
                        return
                    if kernel.manifest["name"].startswith("kda_prep"):
                        smem = api._k1_alongside_smem(0, _n)  # in what K2 leaves
                    _launch(kernel, grid, values, syms, stream, device, smem=smem)

                runtime.Kernel.launch_with = launch_with
                try:
                    # load K1's serial build and torch's fill now: a first load waits for
                    # an idle device, which a waiting K2 never is (it would trap after 5 s)
                    k1_only(sets[0])
                    api.workspace_views(sets[0]["workspace"], p, cfg)["flags"].fill_(1)
                    torch.cuda.synchronize()
                    beside = []
                    for i in range(args.rounds + 1):  # the first: K2's footprint learnt
                        x = sets[i % len(sets)]
                        torch.cuda.synchronize()
                        with torch.cuda.stream(main_s):
                            fwd(x)  # flags zeroed, K2 resident and waiting
                        time.sleep(0.002)
                        with torch.cuda.stream(side_s):
                            a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                            a.record()
                            k1_only(x)
                            b.record()
                        b.synchronize()
                        if i:
                            beside.append(a.elapsed_time(b))
                        with torch.cuda.stream(side_s):  # release K2
                            api.workspace_views(x["workspace"], p, cfg)["flags"].fill_(1)
                        torch.cuda.synchronize()
                    alone = bench.time_fn(k1_only, sets, 50)  # the same padding, no K2
                finally:
                    runtime.Kernel.launch_with = shared_launch
            beside.sort()
            med = beside[len(beside) // 2]
            print(f"{label} K{args.head_dim} K1 {n} CTAs/SM: alone {alone:.3f} ms "
                  f"({items / (alone * 1e3) / sms:.3f} items/us/SM), beside idle K2 "
                  f"{med:.3f} ms ({items / (med * 1e3) / sms:.3f})", flush=True)


if __name__ == "__main__":
    main()
