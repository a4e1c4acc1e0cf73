"""Decode (or verify) with two cubin sets of the same ABI timed in one process: the shipped cubins
(or --new DIR) against --old DIR. Per shape (pool, N, H; bench/serving.py's decode inputs,
K = V = 128; pool:N:H:T a verify of T tokens a row, style (a) with random accepted counts, the
form of bench/serving.py's verify rows) and tile (the plan's own, or --match: the persistent decode
tiles whose name holds one of the parts),
each set's decode is run once from the same pool (outputs and touched slots compared bit for
bit) and captured in a CUDA graph, then the two graphs are timed in alternating order round
after round (cold L2, median of --iters each), so the clock drift under the power cap falls on
both alike. Prints new / old (the median of the rounds' ratios) and each set's % of the copy
ceiling (state and token bytes, bench/serving.py's).

    python3 bench/probes/ab_decode_probe.py --old DIR [--new DIR]
        [--shapes bfloat16:64:32,float32:256:12,bfloat16:64:32:2] [--match _p5,_p4]
        [--rounds 7] [--iters 30]
        [--out JSON]
    (DIR: a cubin root, the folder that holds sm_90a/: build/ab/REV from scripts/ab_build.sh)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def parse_shapes(text: str) -> list[tuple[str, int, int, int]]:
    """'bfloat16:64:32,float32:8:12:4' -> [(pool, N, H, T), ...] (T = 1: decode; the fourth
    field, a verify's tokens a row, defaults to 1)."""
    out = []
    for part in text.split(","):
        bits = part.split(":")
        if len(bits) not in (3, 4) or bits[0] not in ("float32", "bfloat16") or not all(
                b.isdigit() and int(b) > 0 for b in bits[1:]):
            raise SystemExit(f"--shapes: expected pool:N:H or pool:N:H:T with pool float32 or "
                             f"bfloat16, got {part!r}")
        out.append((bits[0], int(bits[1]), int(bits[2]), int(bits[3]) if len(bits) == 4 else 1))
    return out


def ratio(new: list[float], old: list[float]) -> float:
    """new / old: the median of the rounds' ratios (round i's new timing over its old one)."""
    return statistics.median(n / o for n, o in zip(new, old, strict=True))


def order(r: int) -> tuple[str, str]:
    """Which set a round times first: they alternate, so neither always follows the other."""
    return ("new", "old") if r % 2 == 0 else ("old", "new")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", default=None, help="default: the shipped cubins")
    ap.add_argument("--shapes", default="bfloat16:64:32,bfloat16:256:12,float32:64:32")
    ap.add_argument("--match", default="", help="the persistent tiles whose name holds one of "
                    "these comma-separated parts (default: the plan's tile)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    shapes = parse_shapes(a.shapes)
    for p in (ROOT, ROOT / "bench", ROOT / "bench" / "probes"):
        sys.path.insert(0, str(p))
    import serving as sv
    import torch
    from ab_cubins_probe import cubin_roots, use_cubins

    import bench
    import kda_cute
    from kda_cute.ladder import step_tiles

    roots = cubin_roots(a.new, a.old)
    bw = bench.copy_bandwidth()
    flush = sv._flusher()
    rows = []
    for pool_name, N, H, T in shapes:
        x = sv.inputs(N, T, H, getattr(torch, pool_name), seed=N * 7 + H)
        idx = x["idx"][:, 0].contiguous() if T == 1 else x["idx"]
        gen = torch.Generator(device="cuda").manual_seed(N + T)
        acc = torch.randint(1, T + 1, (N,), device="cuda", dtype=torch.int32, generator=gen)
        tiles = [None] if not a.match or T > 1 else [
            c for c in step_tiles() if c.head_dim_k == sv.K and c.pool == pool_name and c.persist
            and any(m in c.name for m in a.match.split(","))]
        ceiling = sv.step_bytes(N, T, H, x["pool"].element_size()) / bw * 1e3
        start = x["pool"].clone()
        for tile in tiles:
            kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0, gate="bounded")
            if tile is not None:
                kw["config"] = tile

            def fn(kw=kw, x=x, idx=idx, acc=acc, T=T):
                if T == 1:
                    kda_cute.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["pool"], idx,
                                    out=x["out"], **kw)
                else:
                    kda_cute.verify(x["q"], x["k"], x["v"], x["g"], x["beta"], x["pool"],
                                    ssm_state_indices=idx, num_accepted_tokens=acc,
                                    out=x["out"], **kw)

            graphs, got = {}, {}
            for which, root in roots.items():
                use_cubins(root)
                x["pool"].copy_(start)
                fn()
                torch.cuda.synchronize()
                got[which] = (x["out"].clone(), x["pool"][idx.flatten().long()].clone())
                graphs[which] = sv.graphed(fn)
            x["pool"].copy_(start)
            same = all(torch.equal(n, o) for n, o in zip(got["new"], got["old"], strict=True))
            ts = {"new": [], "old": []}
            for r in range(a.rounds):
                for which in order(r):
                    ts[which].append(sv.time_ms(graphs[which], a.iters, flush))
            row = {"pool": pool_name, "N": N, "H": H, "T": T,
                   "tile": tile.name if tile is not None else "plan", "ceiling_ms": ceiling,
                   "new_ms": ts["new"], "old_ms": ts["old"],
                   "new_over_old": ratio(ts["new"], ts["old"]), "bit_identical": same}
            for which in ("new", "old"):
                row[f"{which}_pct"] = 100 * ceiling / statistics.median(ts[which])
            rows.append(row)
            print(f"{pool_name} N{N} H{H} T{T} {row['tile']}: new {row['new_pct']:.1f}% "
                  f"old {row['old_pct']:.1f}% of the copy ceiling, new/old "
                  f"{row['new_over_old']:.3f}, outputs and states bit-identical: {same}",
                  flush=True)
        x = idx = acc = start = None
        torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps(
            {"versions": bench.versions(), "roots": {k: str(v) for k, v in roots.items()},
             "copy_bandwidth": bw, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
