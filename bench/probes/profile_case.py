"""Run one forward case a few times, for a profiler to attach to (Nsight Compute on the H200).

    ncu --clock-control none -k regex:kda --launch-skip 4 --launch-count 2 \
        python3 bench/probes/profile_case.py "B1 T8192 H64" --head-dim 128

A case is what bench.parse_case takes (a bench.py case, B<b>_T<t>_H<h> or V<len>x<n>_H<h>).
Each forward launches K1 then K2; the skip passes the warm-up launches.
scripts/gpu_profile.sh runs it under ncu and summarises the report.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.py (see bench/README.md)
import bench  # noqa: E402
from kda_cute import fwd  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", help="a case name of bench.py ('_' for ' '), or a shape")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--runs", type=int, default=4)
    a = ap.parse_args(argv)
    label, spec = bench.parse_case(a.case)
    x = bench.case_inputs(spec, a.head_dim, seed=0)
    out = torch.empty_like(x["v"])
    final = torch.empty_like(x["initial_state"])
    for _ in range(a.runs):
        fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], out, x["A_log"],
            x["dt_bias"], x["lower_bound"], x["initial_state"], final, x["cu_seqlens"],
            check_seqlens=False)
    torch.cuda.synchronize()
    print(f"{label} K{a.head_dim}: {a.runs} forwards, out finite:",
          bool(torch.isfinite(out.float()).all()))


if __name__ == "__main__":
    main()
