"""CPU study: where fast precision's fp16 operands overflow. The emulated K2 of
precision_products.py (fp16 P, U, O and update operands, as the "fast" kernels round them) on
FlashKDA-like inputs with v and the initial state scaled up; prints whether the output and
state stay finite, and their errors (the reference is scaled with them; the inputs' own bf16
rounding after scaling also shows in these errors, in both modes).

    python bench/studies/precision_range.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from precision_products import hi, k2  # noqa: E402
from precision_study import study_inputs  # noqa: E402

from kda_cute.chunked import chunk_intermediates  # noqa: E402
from kda_cute.reference import rel_err  # noqa: E402


def main():
    K, C, T, H = 128, 16, 512, 2
    v, s0, (ro, rs), (qn, kn, al, b) = study_inputs(T, H, K)
    inter = chunk_intermediates(qn, kn, al, b, chunk=C, scale=K ** -0.5)
    inter = {n: (hi(x) if n in ("qg", "kg") else x) for n, x in inter.items()}
    for scale in (1.0, 1e2, 1e3, 3e3, 1e4, 3e4):
        # v and the initial state scaled together (the state tracks the values); the
        # recurrence is linear in them, so the reference scales too
        vs = (v.float() * scale).to(torch.bfloat16).float()
        for name, modes in (("precise", {"U": "3", "O": "3", "S": "3"}),
                            ("fast", {"P": "fp16", "U": "fp16", "O": "fp16", "S": "fp16"})):
            o, s = k2(inter, vs, C, s0 * scale, modes)
            fin = bool(torch.isfinite(o).all() and torch.isfinite(s).all())
            print(json.dumps({"v_scale": scale, "mode": name, "finite": fin,
                              "out_err": rel_err(o.to(torch.bfloat16), ro * scale) if fin
                              else None,
                              "state_err": rel_err(s, rs * scale) if fin else None}), flush=True)


if __name__ == "__main__":
    main()
