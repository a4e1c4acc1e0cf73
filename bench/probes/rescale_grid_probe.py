"""What a fast forward's rescale runs cost, by their grid: bench.py with the plan's rescale-run
grid z replaced (a patch of this process's plans only).

    python3 bench/probes/rescale_grid_probe.py --rescale-z planned|1|none [bench.py arguments]

planned: the plan's own z (about two CTAs an SM); 1: one CTA column, each CTA looping over every
sequence's words; none: no rescale runs at all, the bound of what the node costs (not a valid
forward where values overflow fp16: nothing redoes them). Results:
bench/results/rescale-grid-h200-2026-12-04.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def patch(mode: str) -> None:
    """Replace plans.prefill._rescale_run so that its grid z follows `mode` (the plans made
    so far forgotten)."""
    from kda_cute import plans
    from kda_cute.plans import prefill

    planned = prefill._rescale_run
    if mode == "planned":
        return

    def rescale_run(name, k2, grid, vals, syms, dev):
        if mode == "none":
            return []
        steps = planned(name, k2, grid, vals, syms, dev)
        return [dataclasses.replace(s, grid=(*s.grid[:2], 1)) for s in steps]

    prefill._rescale_run = rescale_run
    plans.clear()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rescale-z", choices=("planned", "1", "none"), required=True)
    a, rest = ap.parse_known_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    patch(a.rescale_z)
    import bench
    bench.main(rest)


if __name__ == "__main__":
    main()
