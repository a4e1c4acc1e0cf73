"""Where K2's time goes when it runs alongside K1 (the plan's schedule "alongside"): four
schedules of the same forward, each kernel's own GPU time from the profiler, inputs rotated as in
bench.py.

    python3 bench/probes/alongside_probe.py B1_T8192_H32 B1_T32768_H32 --head-dim 128

  serial     K1, then K2 (Options(alongside=False)): K2's pace alone
  alongside  the launcher's plan: K2 first, K1 beside it, K2 waiting on K1's flags
  preset     the same, but the flags are set before K2 starts (the "zero flags" memset writes
             ones): K1 still runs beside K2 and K2 never waits for it; what is left is the two
             kernels sharing the device (memory system, clocks)
  k2-only    flags preset and K1 not launched (the plan's "zero flags" and "K2" steps only): K2
             alone on its padded SMs, reading the workspace a serial forward of the same inputs
             wrote; the flag reads' own cost

Each schedule is the launcher's plan, edited (a Plan is frozen data: `dataclasses.replace` of
the plan and its steps, `Plan.only`), run with kda_cute.launch.run. Each schedule's output must
equal the serial one bit for bit (checked on every input set), so what is timed is the same
computation. Cases as kernel_times.py takes them.

  --k1-ctas N ... K1 beside K2 at most N CTAs per SM, one probe per N (instead of the plan's
                  plans.schedule.k1_alongside_ctas: K1's Launch reserves
                  plans.schedule.k1_alongside_smem(device, N) of shared memory; fewer is a
                  slower K1, lighter on the memory system)
  --clocks        each schedule also runs ~1.5 s in a loop while nvidia-smi samples the SM clock
                  and the board power (median of the samples)
  --shared        K1 on the same SMs as K2, for any grid: the alongside schedule forced, K2's
                  shared memory not padded (one K2 CTA per SM), every kernel preferring the
                  largest shared-memory carveout (else an SM's split, set when K2 arrives,
                  leaves K1 no room), and --k1-ctas N counted in what K2 leaves. Run with
                  --wy off (the serial reference is then the alongside builds' arithmetic)
  --wy MODE       K2's WY form in every plan (Options.wy: auto, off, force; default the
                  environment's KDA_CUTE_WY)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "probes"))

from k1_occupancy_probe import hold_k1  # noqa: E402
from kernel_times import parse_case  # noqa: E402

import bench  # noqa: E402
from kda_cute import checks, plan, plans  # noqa: E402
from kda_cute.launch import driver  # noqa: E402
from kda_cute.plans import schedule as sch  # noqa: E402
from kda_cute.plans.device import SMEM_RESERVED, resources, smem_unit  # noqa: E402

MODES = ("serial", "alongside", "preset", "k2-only")
CARVEOUT = 100  # percent of the SM's unified L1 / shared memory given to shared memory


def options(alongside: bool = True, wy: str | None = None):
    """The forward's options as bench.py times it (its precision and segments), K2 alongside K1
    or not, K2's WY form `wy` (None: the environment's)."""
    return checks.options(precision=bench.PRECISION, segments=bench.SEGMENTS,
                          alongside=alongside, wy=wy)


def beside_k2(dev, k2_smem: int):
    """`dev` as K1 sees an SM that holds one K2 CTA of `k2_smem` bytes of dynamic shared memory:
    its shared memory per SM what that CTA leaves (for hold_k1)."""
    return dataclasses.replace(
        dev, smem_per_sm=dev.smem_per_sm - smem_unit(k2_smem + SMEM_RESERVED))


def forced_alongside(p, opts, dev, ctas: int | None = None):
    """The alongside plan of problem `p` on `dev` whatever K2's grid (--shared): K2's shared
    memory its own (not a whole SM's), K1 held to `ctas` CTAs per SM (None: the launcher's rule,
    plans.schedule.k1_alongside_ctas) in what one K2 CTA leaves of an SM. The plans choose
    alongside only where K2's grid takes at most half of the SMs, so this one is planned for
    `dev` with SMs enough for that (and no segments), then given `dev`'s own K2 grid and
    longest-first flag (what else of the plan the SM count decides) and `dev` itself. A shape
    that `dev`'s plan splits into segments, or that has no alongside build, keeps that plan."""
    own = plan(p, opts, dev)
    if own.schedule.kind == "segments" or own.schedule.k2_grid is None:
        return own
    grid = own.schedule.k2_grid
    wide = dataclasses.replace(dev, sms=max(dev.sms, 2 * math.prod(grid)))
    pl = plan(p, dataclasses.replace(opts, segments=1), wide)
    if pl.schedule.kind != "alongside":
        return own
    k2 = pl.step("K2")
    ordered = own.step("K2").source("ordered")
    k2 = dataclasses.replace(k2.with_source("ordered", ordered), grid=grid,
                             smem=resources(k2.kernel, dev.arch).smem)
    if ctas is None:
        ctas = sch.k1_alongside_ctas(p, math.prod(grid), dev,
                                     resources(pl.step("K1").kernel, dev.arch))
    pl = dataclasses.replace(
        pl, device=dev, schedule=dataclasses.replace(pl.schedule, k2_grid=grid),
        steps=tuple(k2 if s.name == "K2" else s for s in pl.steps),
        notes=(f"alongside forced, K1 held to {ctas} CTAs per SM beside K2",))
    return hold_k1(pl, beside_k2(dev, k2.smem), ctas)


def schedules(p, dev, ctas: int | None = None, shared: bool = False,
              wy: str | None = None) -> dict:
    """Each mode's plan (see the module's doc) of problem `p` on `dev` (a DeviceInfo): K1
    beside K2 held to `ctas` CTAs per SM (None: the launcher's choice), `shared`: --shared."""
    serial = plan(p, options(False, wy), dev)
    if shared:
        base = forced_alongside(p, options(True, wy), dev, ctas)
    else:
        base = plan(p, options(True, wy), dev)
        if ctas and base.schedule.kind == "alongside":
            base = hold_k1(base, dev, ctas)
    if base.schedule.kind != "alongside":
        return {"serial": serial, "alongside": base}
    preset = base.edit("zero flags", value=1)
    return {"serial": serial, "alongside": base, "preset": preset,
            "k2-only": preset.only("zero flags", "K2")}


def prefer_shared(pl, device: int) -> None:
    """Every kernel of `pl` prefers the largest shared-memory carveout on `device` (an attribute
    of its CUfunction, which the launcher fetches once and keeps)."""
    cu = driver.bindings()
    attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    for s in pl.launches():
        f = driver.get_kernel(s.kernel, pl.device.arch).function(device, s.smem)
        driver.check(cu.cuFuncSetAttribute(f, attr, CARVEOUT))


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


def probe(spec, K: int, iters: int, want_clocks: bool = False, modes: tuple[str, ...] = MODES,
          ctas: int | None = None, shared: bool = False, wy: str | None = None
          ) -> dict[str, dict]:
    sets = bench.input_sets(spec, K)
    p = bench.problem_of(sets[0])
    device = torch.cuda.current_device()
    plan_of = schedules(p, plans.device_info(device), ctas, shared, wy)
    sched = plan_of["alongside"].schedule
    if sched.kind != "alongside":
        raise SystemExit(f"this shape runs {str(sched)!r}, not alongside: nothing to probe")
    if shared:
        for pl in plan_of.values():
            prefer_shared(pl, device)
    # serial outputs of every set; its workspace is what k2-only reads
    serial = bench.plan_runner(plan_of["serial"])
    expect = []
    for x in sets:
        serial(x)
        torch.cuda.synchronize()
        expect.append((x["out"].clone(), x["final_state"].clone()))
    res = {}
    for mode in modes:
        run = bench.plan_runner(plan_of[mode])
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
    ap.add_argument("--wy", choices=("auto", "off", "force"), default=None,
                    help="K2's WY form (Options.wy; default: KDA_CUTE_WY's)")
    a = ap.parse_args(argv)
    bench.PRECISION = a.precision
    modes = tuple(m for m in a.modes.split(",") if m)
    if any(m not in MODES for m in modes):
        ap.error(f"--modes: expected a subset of {','.join(MODES)}, got {a.modes!r}")
    for name in a.cases:
        label, spec = parse_case(name)
        for ctas in a.k1_ctas:
            tag = (f" k1 {ctas}/SM" if ctas else "") + (" shared" if a.shared else "")
            res = probe(spec, a.head_dim, a.iters, a.clocks, modes, ctas, a.shared, a.wy)
            _report(label, a, tag, res)


def _report(label, a, tag, res):
    for mode, r in res.items():
        clk = f"  {r['sm_mhz']:.0f} MHz {r['power_w']:.0f} W" if a.clocks else ""
        print(f"{label:<16} K{a.head_dim:<4}{tag} {mode:<10} {r['ms']:.3f} ms  K1 "
              f"{r['k1_ms']:.3f}  K2 {r['k2_ms']:.3f}{clk}  "
              f"{'same' if r['bit_identical'] else 'DIFFERENT'}", flush=True)


if __name__ == "__main__":
    main()
