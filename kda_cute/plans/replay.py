"""A replay call's launch list: one replay kernel (kernels/kda_replay_*_sm90.py) whose modes are
the token step's scalars (plans.step.step_values) with the ring's tensors and the window, from
the ReplayProblem alone. The grid depends on shapes only: N rows x H heads x V / block_v tiles
(a commit: a CTA a row)."""

from __future__ import annotations

import functools

from ..problem import ReplayProblem, StepOptions
from .device import H200, DeviceInfo
from .launches import F32, kernel_launch
from .step import step_values
from .steps import At, Buffer, Plan, Role, Scalar

RING_ROLES = ("ring_k", "ring_r", "ring_u", "ring_g", "cursor", "tickets")


@functools.lru_cache(maxsize=256)
def _replay_plan(rp: ReplayProblem, opts: StepOptions, dev: DeviceInfo) -> Plan:
    p, form, cfg = rp.step, rp.ring, opts.config
    values, syms = step_values(p, opts)
    values.update({n: Role(n) for n in RING_ROLES})
    values["window"] = Scalar(form.window)
    if form.mode == "commit":  # the counts are read as a table of their own; no state
        values["accepted"] = Role("accepted")
        values["pool"] = values["dst"] = At(Buffer("zeros", (1, p.H, p.V, p.K), F32))
    syms.update(sRK=form.sRK, sRR=form.sRR, sRU=form.sRU, sRG=form.sRG)
    grid = (1, 1, p.N) if form.mode == "commit" else (p.V // cfg.block_v, p.H, p.N)
    steps = ()
    if p.N > 0 and p.H > 0:
        steps = (kernel_launch(rp.form, cfg, grid, values, syms, dev),)
    return Plan(rp, opts, cfg, dev, rp.form, 0, steps)


def replay_plan(rp: ReplayProblem, opts: StepOptions, device: DeviceInfo = H200) -> Plan:
    """The plan of replay call `rp` under `opts` (its config the tile the checks chose) on
    `device` (pure, cached)."""
    return _replay_plan(rp, opts, device)
