"""Where a decode's time goes in the memory system: the same decode in place, to other slots,
reading only (every write slot padding), and a plain copy of the same bytes, CUDA graph, cold L2.

    python3 bench/probes/step_memory_probe.py [--config NAME]

Prints one JSON line per (pool, N, H) with each variant's median ms and GB/s on its bytes.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serving import _flusher, graphed, inputs, time_ms  # noqa: E402

import kda_cute  # noqa: E402
from kda_cute.ladder import step_tiles  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64:32,1024:32")
    ap.add_argument("--pools", default="bfloat16,float32")
    ap.add_argument("--config", default="", help="token-step config names, comma-separated, "
                    "one per pool (default: the ladder's)")
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args(argv)
    named = {c.name: c for c in step_tiles()}
    forced = {named[n].pool: named[n] for n in a.config.split(",") if n}
    flush = _flusher()
    for pool in a.pools.split(","):
        for N, H in (tuple(map(int, s.split(":"))) for s in a.shapes.split(",")):
            print(json.dumps(case(pool, N, H, forced.get(pool), a.iters, flush)), flush=True)
            torch.cuda.empty_cache()


def case(pool, N, H, cfg, iters, flush) -> dict:
    x = inputs(N, 2, H, getattr(torch, pool), seed=2)  # two slots a row: read, other
    ri, wi = x["idx"][:, 0].contiguous(), x["idx"][:, 1].contiguous()
    none = torch.full_like(ri, -1)
    t = {k: v[:, :1].contiguous() for k, v in x.items() if k in ("q", "k", "v", "g", "beta")}
    out = t["v"].clone()

    def dec(w):
        return lambda: kda_cute.decode(
            t["q"], t["k"], t["v"], t["g"], t["beta"], x["pool"], ri,
            output_state_indices=w, out=out, A_log=x["A_log"], dt_bias=x["dt_bias"],
            lower_bound=-5.0, config=cfg)
    state = N * H * 128 * 128 * x["pool"].element_size()
    src = torch.empty(state, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    res = {"pool": pool, "N": N, "H": H, "config": cfg.name if cfg else "ladder",
           "state_bytes": state}
    for name, fn, nbytes in (("in_place", dec(ri), 2 * state),
                             ("other_slots", dec(wi), 2 * state),
                             ("read_only", dec(none), state),
                             ("copy", lambda: dst.copy_(src), 2 * state)):
        ms = time_ms(graphed(fn), iters, flush)
        res[name] = {"ms": round(ms, 5), "GBps": round(nbytes / ms / 1e6)}
    return res

if __name__ == "__main__":
    main()
