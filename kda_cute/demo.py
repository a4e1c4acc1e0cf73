"""The main job: `python -m kda_cute.demo`.

On a Hopper GPU: one KDA forward (fixed length and varlen) checked against the float64 reference.
Without one: says where the AOT-exported cubins are (`make run` builds them first).
"""

from __future__ import annotations

import sys

import torch

from .cubin import BUILD_HINT, CUBIN_ROOT
from .ladder import all_kernels


def main() -> int:
    if not torch.cuda.is_available():
        folder = CUBIN_ROOT / "sm_90a"
        names = sorted(p.name for p in folder.glob("*.cubin")) if folder.exists() else []
        print(f"no CUDA device: {len(names)} cubins exported to {folder}")
        for n in names:
            print(f"  {n}")
        expected = {f"{c.name}.cubin" for c in all_kernels()}
        missing = sorted(expected - set(names))
        if missing:
            print(f"missing: {missing}; " + BUILD_HINT.format(arch="sm_90a"))
        return 1 if missing else 0
    from .testing import errors, make_inputs

    ok = True
    for label, kw in (("fixed B2 T1000 H4 K128", dict(B=2, T=1000, H=4, K=128)),
                      ("varlen [300, 0, 1700] H4 K64", dict(seqlens=[300, 0, 1700], H=4, K=64))):
        res = errors(make_inputs(seed=1, **kw))
        good = res["out_err"] < 3.5e-3 and res["state_err"] < 2.5e-3
        ok &= good
        print(f"{label:<30} out rel err {res['out_err']:.2e}  state rel err "
              f"{res['state_err']:.2e}  {'OK' if good else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
