"""A varlen forward's time as a user calls it, by how cu_seqlens is checked: `fwd` with its
defaults, with check_seqlens=False and with check_seqlens=True, eager (CUDA events around each
call, so a host sync's stall counts), median of --iters, input sets rotated (cold L2), and the
same default call replayed as a CUDA graph (captured once: a host check cannot run there).

    python3 bench/probes/seqlens_probe.py [--tree DIR] [--out JSON]
    python3 bench/probes/seqlens_probe.py --compare BEFORE.json AFTER.json --out PREFIX
        (one JSON, a Markdown table and a plot of two runs side by side: PREFIX.json/.md/.png)

--tree DIR: time the kda_cute of DIR (an older revision that scripts/ab_build.sh put in
build/ab/<rev>/src, with KDA_CUTE_CUBIN_DIR=build/ab/<rev>) instead of this checkout's; only its
kda_cute is imported (fwd), the inputs and timing are this checkout's bench.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = ("varlen mix H96", "varlen mix H64", "varlen 8x1024 H64")
MODES = {"default": {}, "check_seqlens=False": {"check_seqlens": False},
         "check_seqlens=True": {"check_seqlens": True}}


def _imports(tree: str | None):
    sys.path.insert(0, str(Path(tree).resolve() if tree is not None else ROOT))
    import kda_cute  # noqa: F401

    if str(ROOT / "bench") not in sys.path:
        sys.path.append(str(ROOT / "bench"))
    import bench
    return bench


def runner(kw: dict):
    from kda_cute import fwd

    def run(x):
        fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["out"], x["A_log"],
            x["dt_bias"], x["lower_bound"], x["initial_state"], x["final_state"],
            x["cu_seqlens"], x["workspace"], **kw)
    return run


def compare(before: str, after: str, prefix: str, labels=("before", "after")) -> None:
    runs = [json.loads(Path(p).read_text()) for p in (before, after)]
    res = {"runs": dict(zip(labels, runs, strict=True))}
    Path(prefix + ".json").write_text(json.dumps(res, indent=1) + "\n")
    cols = list(MODES) + ["graph default"]
    lines = ["| case | run | " + " | ".join(cols) + " |", "|---|---|" + "---:|" * len(cols)]
    for i, row in enumerate(runs[0]["rows"]):
        for lab, run in zip(labels, runs, strict=True):
            r = run["rows"][i]
            lines.append(f"| {row['case']} | {lab} | "
                         + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
    Path(prefix + ".md").write_text(
        "ms, median of CUDA-event-timed calls (eager; graph: the default call replayed), cold "
        "L2, K = V = 128\n\n" + "\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    n = len(runs[0]["rows"])
    width = 0.8 / (2 * len(cols))
    for j, c in enumerate(cols):
        for k, (lab, run) in enumerate(zip(labels, runs, strict=True)):
            off = (2 * j + k) * width - 0.4
            ax.bar([i + off for i in range(n)], [r[c] for r in run["rows"]], width,
                   label=f"{lab}: {c}")
    ax.set_xticks(range(n), [r["case"] for r in runs[0]["rows"]])
    ax.set_ylabel("ms")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(prefix + ".png", dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=None)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default=None)
    ap.add_argument("--compare", nargs=2, default=None, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--labels", default="before,after")
    a = ap.parse_args(argv)
    if a.compare:
        compare(*a.compare, a.out, tuple(a.labels.split(",")))
        return
    bench = _imports(a.tree)
    import torch

    import kda_cute

    rows = []
    for name in CASES:
        sets = bench.input_sets(bench.CASES[name], 128)
        row = {"case": name}
        for mode, kw in MODES.items():
            row[mode] = bench.time_fn(runner(kw), sets, a.iters)
        row["graph default"] = bench.time_fn(bench.graph_runner(runner({}), sets), sets, a.iters)
        torch.cuda.synchronize()
        rows.append(row)
        print(json.dumps(row), flush=True)
    res = {"tree": a.tree or "this checkout", "kda_cute": str(Path(kda_cute.__file__).parent),
           "versions": bench.versions(), "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
