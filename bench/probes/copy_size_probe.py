"""What a plain device-to-device copy reaches at the sizes of the serving benchmark's decodes.

The serving benchmark's ceiling is the compulsory bytes at the bandwidth of a 2 GB copy. A
decode at small N x H moves only tens of MB in tens of microseconds, where launch, ramp-up and
the last wave's tail weigh as well; this probe times `dst.copy_(src)` of the same state bytes
(read and written: N x H x V x K elements of the pool's dtype each way), replayed from a CUDA
graph with the L2 flushed before each launch (bench/serving.py's timing), and prints its
bandwidth as a share of the 2 GB copy's.

    python3 bench/probes/copy_size_probe.py [--out FILE.json]
"""

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serving import DECODE_H, DECODE_N, K, V, _flusher, graphed, time_ms  # noqa: E402

from bench import copy_bandwidth, versions  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args(argv)
    bw = copy_bandwidth()
    flush = _flusher()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for N in DECODE_N:
            for H in DECODE_H:
                n = N * H * V * K
                src = torch.randn(n, device="cuda").to(dtype)
                dst = torch.empty_like(src)
                ms = time_ms(graphed(lambda d=dst, s=src: d.copy_(s)), a.iters, flush)
                moved = 2 * n * src.element_size()
                src = dst = None
                rows.append({"pool": str(dtype).split(".")[-1], "N": N, "H": H,
                             "bytes": moved, "copy_ms": ms,
                             "pct_of_2gb_copy": 100 * moved / (ms * 1e-3) / bw})
                torch.cuda.empty_cache()
                print(json.dumps(rows[-1]), flush=True)
    res = {"versions": versions(), "copy_bandwidth": bw, "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
