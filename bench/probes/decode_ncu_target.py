"""An Nsight Compute target: the decode of a bf16 pool as bench/serving.py runs it (the plan's
tile, eager) and bench/probes/stream_probe.py's tile stream of as many random slots' bytes (64
and 16 rows a program, 4 warps, in place), each launched a few times with L2 flushed before
(a 512 MB memset), so that `ncu -k regex:"kda_step|tile" --launch-skip 3` finds them warm.

    ncu --clock-control none -k regex:"kda_step|tile" --launch-skip 3 --launch-count 3 \
        --section SpeedOfLight --section SchedulerStats --section WarpStateStats ... \
        python3 bench/probes/decode_ncu_target.py [N:H]      (default 64:32)
    (the results of 2026-12-04: bench/results/decode-ncu-h200-2026-12-04.md)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def parse_shape(text: str) -> tuple[int, int]:
    """'64:32' -> (N, H)."""
    bits = text.split(":")
    if len(bits) != 2 or not all(b.isdigit() and int(b) > 0 for b in bits):
        raise SystemExit(f"shape: expected N:H (positive integers), got {text!r}")
    return int(bits[0]), int(bits[1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", nargs="?", default="64:32", help="N:H")
    N, H = parse_shape(ap.parse_args(argv).shape)
    for p in (ROOT, ROOT / "bench", ROOT / "bench" / "probes"):
        sys.path.insert(0, str(p))
    import serving as sv
    import stream_probe as sp
    import torch

    import kda_cute

    K, V = sv.K, sv.V  # bench/serving.py's head dims
    flush = torch.empty(512 << 20, dtype=torch.int8, device="cuda")
    x = sv.inputs(N, 1, H, torch.bfloat16, seed=N * 7 + H)
    idx = x["idx"][:, 0].contiguous()
    tile = sp.kernels()[0]
    gen = torch.Generator(device="cuda").manual_seed(1)
    pool = torch.randn(4 * N, H, V, K, generator=gen, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(4 * N, generator=gen, device="cuda")[:N].to(torch.int32)
    for _ in range(4):
        flush.zero_()
        kda_cute.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["pool"], idx, out=x["out"],
                        A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0, gate="bounded")
        for bv in (64, 16):
            flush.zero_()
            tile[(N * H * (V // bv),)](pool, slots, H, pool.stride(0), BV=bv, KD=K, VD=V,
                                      num_warps=4)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
