"""Run one decode case (or, with --tokens T, a verify of T tokens a row, every one accepted) a
few times, for a profiler to attach to (Nsight Compute on the H200).

    ncu --clock-control none -k regex:kda_step --launch-skip 3 --launch-count 1 \
        python3 bench/probes/step_profile.py 1024 32 bfloat16 [--config NAME] [--tokens T]

The inputs are bench/serving.py's (a pool four times the touched slots, random slots).
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serving import inputs  # noqa: E402

import kda_cute  # noqa: E402
from kda_cute.ladder import step_tiles  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("N", type=int)
    ap.add_argument("H", type=int)
    ap.add_argument("pool", choices=("float32", "bfloat16"))
    ap.add_argument("--config", default=None, help="a token-step config name (default: the "
                    "ladder's)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=1, help="> 1: a verify of that many tokens")
    a = ap.parse_args(argv)
    cfg = None
    if a.config:
        cfg = {c.name: c for c in step_tiles()}[a.config]
    x = inputs(a.N, a.tokens, a.H, getattr(torch, a.pool), seed=1)
    if a.tokens > 1:
        acc = torch.full((a.N,), a.tokens, device="cuda", dtype=torch.int32)
        for _ in range(a.runs):
            kda_cute.verify(x["q"], x["k"], x["v"], x["g"], x["beta"], x["pool"],
                            ssm_state_indices=x["idx"], num_accepted_tokens=acc, out=x["out"],
                            A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0,
                            config=cfg)
    else:
        idx = x["idx"][:, 0].contiguous()
        for _ in range(a.runs):
            kda_cute.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["pool"], idx,
                            out=x["out"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                            lower_bound=-5.0, config=cfg)
    torch.cuda.synchronize()
    form = f"verify T{a.tokens}" if a.tokens > 1 else "decode"
    print(f"{form} N{a.N} H{a.H} {a.pool} {cfg.name if cfg else 'ladder'}: {a.runs} runs, "
          "out finite:", bool(torch.isfinite(x["out"].float()).all()))


if __name__ == "__main__":
    main()
