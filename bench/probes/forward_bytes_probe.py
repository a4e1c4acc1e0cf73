"""DRAM bytes and time of each kernel of a forward, with and without checkpoints (Nsight
Compute: dram__bytes_read.sum, dram__bytes_write.sum, gpu__time_duration.sum; caches flushed
before each kernel, clocks as they run), and what the checkpoints' extra bytes cost at the
copy bandwidth measured in the same run: the floor under a checkpoint mode's cost when the
forward's kernels already move their bytes near that bandwidth.

    python3 bench/probes/forward_bytes_probe.py [--cases "B1 T8192 H64,varlen mix H64"]
        [--modes "none,every 64 bf16,every 64 fp32"] [--out JSON]
    (runs ncu on itself: `--child CASE MODE` is one forward twice, the second one profiled)

Modes are checkpoints_probe.py's; K = V = 128, fast precision, eager.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum")
RUNS = 2  # forwards in a child: the first warms up, the last is the one read


def _child(case: str, mode: str) -> None:
    sys.path.insert(0, str(ROOT / "bench" / "probes"))
    import checkpoints_probe as cp
    import torch

    bench = cp._imports()
    sets = bench.input_sets(bench.CASES[case], 128, workspace=False)[:1]
    kw, extra = cp.checkpoint_args(sets[0], mode)
    cp.give_workspace(sets, [kw])
    run = cp.runner(kw)
    for _ in range(RUNS):
        run(sets[0])
    torch.cuda.synchronize()
    print(json.dumps({"extra_bytes": extra, "finite": bool(torch.isfinite(
        sets[0]["out"].float()).all())}))


def parse(text: str, runs: int = RUNS) -> list[dict]:
    """ncu --csv --print-units base rows -> the last forward's kernels in launch order, each
    {name, ns, read, write} (a forward launches the same kernels each time: the last
    1 / runs of them)."""
    start = text.find('"ID"')
    if start < 0:
        raise RuntimeError("ncu: no CSV rows in its output:\n" + text[-2000:])
    by_id: dict[int, dict] = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        k = by_id.setdefault(int(row["ID"]), {"name": row["Kernel Name"]})
        value = float(row["Metric Value"].replace(",", ""))
        k[{"gpu__time_duration.sum": "ns", "dram__bytes_read.sum": "read",
           "dram__bytes_write.sum": "write"}[row["Metric Name"]]] = value
    kernels = [by_id[i] for i in sorted(by_id)]
    if not kernels or len(kernels) % runs:
        raise RuntimeError(f"ncu: {len(kernels)} kernels, not {runs} forwards' worth")
    return kernels[len(kernels) - len(kernels) // runs:]


def short(name: str) -> str:
    """A kernel's name without the DSL's prefix and argument spelling."""
    for key in ("kda_checkpoints", "kda_offsets", "kda_prep", "kda_recur_tc", "kda_recur",
                "kda_combine", "kda_step"):
        if key in name:
            return key + ("_rescale" if "Rescale" in name else "")
    return name[:40]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="B1 T8192 H64,varlen mix H64")
    ap.add_argument("--modes", default="none,every 64 bf16,every 64 fp32")
    ap.add_argument("--out", default=None)
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--child", nargs=2, metavar=("CASE", "MODE"))
    a = ap.parse_args(argv)
    if a.child:
        _child(*a.child)
        return
    sys.path.insert(0, str(ROOT / "bench"))
    from bench import copy_bandwidth

    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    res = {"copy_bandwidth": bw, "rows": []}
    for case in a.cases.split(","):
        base = None
        for mode in a.modes.split(","):
            cmd = [a.ncu, "--csv", "--print-units", "base", "--clock-control", "none",
                   "--metrics", ",".join(METRICS), "-k", "regex:kernel_cutlass",
                   sys.executable, __file__, "--child", case, mode]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode:
                raise RuntimeError(f"ncu failed ({p.returncode}):\n{p.stdout[-2000:]}"
                                   f"\n{p.stderr[-2000:]}")
            info = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
            ks = parse(p.stdout)
            tot = {f: sum(k[f] for k in ks) for f in ("ns", "read", "write")}
            row = {"case": case, "mode": mode, **info, "kernels": ks, "total": tot}
            res["rows"].append(row)
            print(f"{case} | {mode} | finite {info['finite']} | kernels "
                  f"{tot['ns'] / 1e3:.1f} us | read {tot['read'] / 1e6:.0f} MB | write "
                  f"{tot['write'] / 1e6:.0f} MB | at copy bandwidth "
                  f"{(tot['read'] + tot['write']) / bw * 1e6:.1f} us")
            for k in ks:
                print(f"    {short(k['name']):24s} {k['ns'] / 1e3:8.1f} us  read "
                      f"{k['read'] / 1e6:7.1f} MB  write {k['write'] / 1e6:7.1f} MB  "
                      f"{(k['read'] + k['write']) / k['ns'] / 1e3:5.2f} TB/s")
            if mode == "none":
                base = tot
            elif base is not None:
                more = tot["read"] + tot["write"] - base["read"] - base["write"]
                print(f"    vs none: +{more / 1e6:.0f} MB moved ({info['extra_bytes'] / 1e6:.0f}"
                      f" MB of checkpoints), {more / bw * 1e6:.1f} us at copy bandwidth = "
                      f"{more / bw / (base['ns'] / 1e9):+.1%} of the forward's kernel time; "
                      f"kernel time {tot['ns'] / base['ns'] - 1:+.1%}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
