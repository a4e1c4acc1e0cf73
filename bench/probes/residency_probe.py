"""How many K1-shaped CTAs run beside one resident K2-shaped CTA on an SM?

    python3 bench/probes/residency_probe.py [--guests-per-sm 12] [--spin-us 200]

K1 beside an idle resident K2 ran at its alone rate for two CTAs per SM whether two, three or
four were allowed by shared memory (docs/notes/schedules.md, "What caps K1 on SMs it shares with
K2").
This probe tests whether registers decide it per SM sub-partition: an SM's four schedulers each
own a quarter of the register file (16,384 registers), and a CTA's warps are spread over them in
turn, so a K2 CTA of five warps (four consumers and a producer, 164 registers rounded to 168)
puts two warps, 10,752 registers, on one scheduler's quarter, which then holds only two of K1's
2,048-register warps: two K1 CTAs, where the SM-wide count (65,536 - 5 x 5,376) / 8,192 says four.

The kernels (bench/probes/residency/probe.cu, compiled here with nvcc for sm_90a) mimic the
resources only: a "host" CTA of a given thread count and register cap waits at a flag; "guest"
CTAs of 128 threads, 64 registers and K1's 26,496 bytes of dynamic shared memory each spin a
fixed time and log (SM, start, end). Printed per host shape: the most guests seen at once on
each SM, counted over the SMs holding a host CTA and over the others.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kda_cute.launch.driver import bindings, check  # noqa: E402

SRC = Path(__file__).resolve().parent / "residency" / "probe.cu"
K1_SMEM = 26496  # kda_prep_bf16_k128_c16_t128_f16's dynamic shared memory

# (label, host kernel, host threads, host dynamic smem); None: guests alone
SHAPES = [
    ("guests alone", None, 0, 0),
    ("host 160 thr x 168 regs (K2: 4 consumer warps + producer)", "host_r168", 160, 8192),
    ("host 128 thr x 168 regs (K2 without its producer warp)", "host_r168", 128, 8192),
    ("host 160 thr x 160 regs", "host_r160", 160, 8192),
    ("host 160 thr x 128 regs", "host_r128", 160, 8192),
    ("host 192 thr x 168 regs", "host_r168", 192, 8192),
    ("host 160 thr x 168 regs, 70 KB smem (K2 s4)", "host_r168", 160, 71680),
    ("host 128 thr x 168 regs, 70 KB smem", "host_r168", 128, 71680),
    ("host 128 thr x 168 regs, 135 KB smem (K2 s8_al)", "host_r168", 128, 138240),
    ("host 160 thr x 168 regs, warp 4 setmaxnreg.dec to 24", "host_r168_dec", 160, 8192),
    ("host 256 thr x 168 regs, warps 4-7 setmaxnreg.dec to 24", "host_r168_dec", 256, 8192),
]


def build(out: Path) -> Path:
    subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-O3", "-o", str(out), str(SRC)],
                   check=True)
    return out


def most_at_once(rows) -> int:
    """The largest number of (start, end) intervals open at one time."""
    ev = sorted([(s, 1) for s, _ in rows] + [(e, -1) for _, e in rows], key=lambda t: (t[0], t[1]))
    best = cur = 0
    for _, d in ev:
        cur += d
        best = max(best, cur)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--guests-per-sm", type=int, default=12)
    ap.add_argument("--spin-us", type=int, default=200)
    ap.add_argument("--cubin", default="/tmp/residency_probe.cubin")
    args = ap.parse_args(argv)
    cu = bindings()  # cuda.bindings.driver
    torch.zeros(1, device="cuda")  # the primary context
    torch.cuda.synchronize()
    mod = check(cu.cuModuleLoad(str(build(Path(args.cubin))).encode()))
    fns = {n: check(cu.cuModuleGetFunction(mod, n.encode()))
           for n in ("host_r168", "host_r160", "host_r128", "host_r168_dec", "guest_r64")}
    A = cu.CUfunction_attribute
    for n, f in fns.items():
        regs = check(cu.cuFuncGetAttribute(A.CU_FUNC_ATTRIBUTE_NUM_REGS, f))
        print(f"{n}: {regs} registers")
        check(cu.cuFuncSetAttribute(f, A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 150_000))
        check(cu.cuFuncSetAttribute(f, A.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100))
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    streams = [check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)) for _ in range(3)]
    src = torch.randn(4096, device="cuda")
    sink = torch.zeros(1024, device="cuda")
    release = torch.zeros(1, dtype=torch.int32, device="cuda")
    n_guest = nsm * args.guests_per_sm
    host_log = torch.zeros(nsm * 4, dtype=torch.int64, device="cuda")
    guest_log = torch.zeros(n_guest * 4, dtype=torch.int64, device="cuda")
    vp, u64 = ctypes.c_void_p, ctypes.c_ulonglong
    for label, host, threads, smem in SHAPES:
        release.zero_()
        host_log.zero_()
        guest_log.fill_(-1)
        torch.cuda.synchronize()
        if host:
            params = ((src.data_ptr(), sink.data_ptr(), release.data_ptr(), host_log.data_ptr()),
                      (vp, vp, vp, vp))
            check(cu.cuLaunchKernel(fns[host], nsm, 1, 1, threads, 1, 1, smem, streams[0],
                                    params, 0))
            time.sleep(0.02)
        params = ((src.data_ptr(), sink.data_ptr(), args.spin_us * 1000, guest_log.data_ptr()),
                  (vp, vp, u64, vp))
        check(cu.cuLaunchKernel(fns["guest_r64"], n_guest, 1, 1, 128, 1, 1, K1_SMEM, streams[1],
                                params, 0))
        check(cu.cuStreamSynchronize(streams[1]))
        check(cu.cuMemsetD32Async(release.data_ptr(), 1, 1, streams[2]))
        check(cu.cuCtxSynchronize())
        g = guest_log.view(-1, 4).cpu().tolist()
        hosts = set(int(r[0]) for r in host_log.view(-1, 4).cpu().tolist()) if host else set()
        per_sm: dict[int, list] = {}
        for sm, s, e, _ in g:
            per_sm.setdefault(int(sm), []).append((s, e))
        with_host = Counter(most_at_once(per_sm.get(sm, [])) for sm in range(nsm) if sm in hosts)
        without = Counter(most_at_once(per_sm.get(sm, [])) for sm in range(nsm) if sm not in hosts)
        span_us = (max(e for _, _, e, _ in g) - min(s for _, s, _, _ in g)) / 1000
        print(f"{label}: host CTAs on {len(hosts)} SMs; guests at once per SM, SMs with a host "
              f"{dict(sorted(with_host.items()))}, without {dict(sorted(without.items()))}; "
              f"guests' span {span_us:.0f} us", flush=True)


if __name__ == "__main__":
    main()
