"""Where K2's time goes when it runs alongside K1 (api: "alongside"): four schedules of the same
forward, each kernel's own GPU time from the profiler, inputs rotated as in bench.py.

    python3 bench/alongside_probe.py B1_T8192_H32 B1_T32768_H32 --head-dim 128

  serial     K1, then K2 (KDA_CUTE_ALONGSIDE=0): K2's pace alone
  alongside  the launcher's schedule: K2 first, K1 beside it, K2 waiting on K1's flags
  preset     the same, but the flags are set before K2 starts (the memset writes ones): K1
             still runs beside K2 and K2 never waits for it; what is left is the two kernels
             sharing the device (memory system, clocks)
  k2-only    flags preset and K1 not launched: K2 alone on its padded SMs, reading the
             workspace a serial forward of the same inputs wrote; the flag reads' own cost

Each schedule's output must equal the serial one bit for bit (checked on every input set), so
what is timed is the same computation. Cases as kernel_times.py takes them.

  --k1-ctas N ... K1 beside K2 at most N CTAs per SM, one probe per N (instead of the
                  launcher's api._k1_alongside_ctas; it pads K1's shared memory: fewer is a
                  slower K1, lighter on the memory system)
  --clocks        each schedule also runs ~1.5 s in a loop while nvidia-smi samples the SM clock
                  and the board power (median of the samples)
  --shared        K1 on the same SMs as K2, for any grid: the alongside schedule forced, K2's
                  shared memory not padded (one K2 CTA per SM), every kernel preferring the
                  largest shared-memory carveout (else an SM's split, set when K2 arrives,
                  leaves K1 no room), and --k1-ctas N counted in what K2 leaves. Run with
                  KDA_CUTE_WY=0 (the serial reference is then the alongside builds' arithmetic)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kernel_times import parse_case  # noqa: E402

import bench  # noqa: E402
from kda_cute import api, runtime  # noqa: E402

MODES = ("serial", "alongside", "preset", "k2-only")


class _Schedule:
    """Patches the launcher's flags memset and K1's programmatic launch for one mode."""

    def __init__(self, mode: str):
        self.mode = mode
        self.saved = (runtime.memset_d32, runtime.Kernel.launch_with,
                      os.environ.get("KDA_CUTE_ALONGSIDE"))

    def __enter__(self):
        memset, launch, _ = self.saved
        if self.mode == "serial":
            os.environ["KDA_CUTE_ALONGSIDE"] = "0"
        else:
            os.environ.pop("KDA_CUTE_ALONGSIDE", None)
        if self.mode in ("preset", "k2-only"):
            runtime.memset_d32 = lambda ptr, value, count, stream: memset(ptr, 1, count, stream)
        if self.mode == "k2-only":
            def launch_with(kernel, *args, programmatic=False, **kw):
                if not programmatic:
                    launch(kernel, *args, programmatic=programmatic, **kw)
            runtime.Kernel.launch_with = launch_with
        return self

    def __exit__(self, *exc):
        runtime.memset_d32, runtime.Kernel.launch_with, env = self.saved
        if env is None:
            os.environ.pop("KDA_CUTE_ALONGSIDE", None)
        else:
            os.environ["KDA_CUTE_ALONGSIDE"] = env
        return False


class _K1Ctas:
    """Holds K1 alongside K2 to `ctas` CTAs per SM (None: the launcher's choice)."""

    def __init__(self, ctas: int | None):
        self.ctas = ctas
        self.saved = api._k1_alongside_ctas

    def __enter__(self):
        if self.ctas:
            api._k1_alongside_ctas = lambda *args: self.ctas
        return self

    def __exit__(self, *exc):
        api._k1_alongside_ctas = self.saved
        return False


CARVEOUT = 100  # percent of the SM's unified L1 / shared memory given to shared memory


class _Shared:
    """--shared: the alongside schedule on any grid with K1 beside K2 on the same SMs (see the
    module's doc)."""

    def __init__(self, on: bool):
        self.on = on
        self.saved = (api._k2_alongside, api._k1_alongside_smem, runtime.Kernel.launch_with,
                      runtime.Kernel._function)

    def __enter__(self):
        if not self.on:
            return self
        k2_along, _, launch, function = self.saved
        budget = api._sm_budget(torch.cuda.current_device())
        k2_smem = {}

        def k1_smem(device, ctas):
            left = budget[1] - api._smem_unit(k2_smem.get("k2", 0) + 1024)
            return left // ctas // api.SMEM_UNIT * api.SMEM_UNIT - 1024

        def launch_with(kernel, grid, values, syms, stream, device, smem=None,
                        programmatic=False):
            if smem == budget[2]:  # K2's padding to a whole SM: dropped
                smem = None
                k2_smem["k2"] = kernel.smem
            launch(kernel, grid, values, syms, stream, device, smem=smem,
                   programmatic=programmatic)

        def _function(kernel, device, smem=0):
            f = function(kernel, device, smem)
            cu = runtime._cu()
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
            runtime.check(cu.cuFuncSetAttribute(f, attr, CARVEOUT))
            return f

        api._k2_alongside = lambda cfg, grid, device: (
            api.alongside_of(cfg) is not None
            and os.environ.get("KDA_CUTE_ALONGSIDE", "1") != "0")
        api._k1_alongside_smem = k1_smem
        runtime.Kernel.launch_with = launch_with
        runtime.Kernel._function = _function
        return self

    def __exit__(self, *exc):
        (api._k2_alongside, api._k1_alongside_smem, runtime.Kernel.launch_with,
         runtime.Kernel._function) = self.saved
        return False


def clocks(fn, sets, seconds: float = 1.5) -> tuple[float, float]:
    """(median SM clock MHz, median board power W) sampled by nvidia-smi while fn runs over
    the input sets in a loop; nan where nvidia-smi is missing."""
    try:
        smi = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
             "-lms", "50", "-i", str(torch.cuda.current_device())],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return float("nan"), float("nan")
    end = time.time() + seconds
    while time.time() < end:
        for x in sets:
            fn(x)
        torch.cuda.synchronize()
    smi.terminate()
    out, _ = smi.communicate()
    rows = [r.split(",") for r in out.strip().splitlines() if "," in r]
    vals = [(float(a), float(b)) for a, b in rows if a.strip() and b.strip()]
    if not vals:
        return float("nan"), float("nan")
    return statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals)


run = bench.kda_runner()  # the launcher's choice of config and segments, as bench.py times it


def probe(spec, K: int, iters: int, want_clocks: bool = False,
          modes: tuple[str, ...] = MODES) -> dict[str, dict]:
    sets = bench.input_sets(spec, K)
    p = bench.problem_of(sets[0])
    sched = api.schedule(p, api.config_for(p), torch.cuda.current_device())
    if sched != "alongside":
        raise SystemExit(f"this shape runs {sched!r}, not alongside: nothing to probe")
    # serial outputs of every set; its workspace is what k2-only reads
    with _Schedule("serial"):
        expect = []
        for x in sets:
            run(x)
            torch.cuda.synchronize()
            expect.append((x["out"].clone(), x["final_state"].clone()))
    res = {}
    for mode in modes:
        with _Schedule(mode):
            ms = bench.time_fn(run, sets, iters)
            k1, k2, _ = bench.kernel_split(bench.gpu_kernel_ms(run, sets))
            same = True
            for x, (o, s) in zip(sets, expect, strict=True):
                x["out"].fill_(float("nan"))
                x["final_state"].fill_(float("nan"))
                run(x)
                torch.cuda.synchronize()
                same = same and torch.equal(x["out"], o) and torch.equal(x["final_state"], s)
            if mode == "k2-only":
                k1 = float("nan")
            mhz, watts = clocks(run, sets) if want_clocks else (float("nan"), float("nan"))
        res[mode] = {"ms": ms, "k1_ms": k1, "k2_ms": k2, "bit_identical": same,
                     "sm_mhz": mhz, "power_w": watts}
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--k1-ctas", type=int, nargs="+", default=[None],
                    help="one probe per value")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset")
    ap.add_argument("--clocks", action="store_true")
    ap.add_argument("--shared", action="store_true", help="K1 on the same SMs as K2")
    ap.add_argument("--precision", choices=("fast", "precise"), default="fast")
    a = ap.parse_args(argv)
    bench.PRECISION = a.precision
    os.environ["KDA_CUTE_REPLAY"] = "0"  # the probes patch choices a replayed call would skip
    modes = tuple(m for m in a.modes.split(",") if m)
    if any(m not in MODES for m in modes):
        ap.error(f"--modes: expected a subset of {','.join(MODES)}, got {a.modes!r}")
    for name in a.cases:
        label, spec = parse_case(name)
        for ctas in a.k1_ctas:
            tag = (f" k1 {ctas}/SM" if ctas else "") + (" shared" if a.shared else "")
            with _K1Ctas(ctas), _Shared(a.shared):
                res = probe(spec, a.head_dim, a.iters, a.clocks, modes)
            _report(label, a, tag, res)


def _report(label, a, tag, res):
    for mode, r in res.items():
        clk = f"  {r['sm_mhz']:.0f} MHz {r['power_w']:.0f} W" if a.clocks else ""
        print(f"{label:<16} K{a.head_dim:<4}{tag} {mode:<10} {r['ms']:.3f} ms  K1 "
              f"{r['k1_ms']:.3f}  K2 {r['k2_ms']:.3f}{clk}  "
              f"{'same' if r['bit_identical'] else 'DIFFERENT'}", flush=True)


if __name__ == "__main__":
    main()
