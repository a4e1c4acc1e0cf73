"""A serving step's launch list: one token-step kernel (kernels/kda_step_*_sm90.py) whose every
mode is a scalar of the plan, from the StepProblem alone (kda_cute.specs.step.args says what each
argument means). The grid depends on shapes only: N rows x H heads x V / block_v blocks."""

from __future__ import annotations

import functools
from dataclasses import replace

from ..ladder import config_for
from ..problem import StepOptions, StepProblem
from ..specs.step import STEP_GATES
from ..step_ladder import single_token
from .device import H200, DeviceInfo
from .launches import BF16, F32, I32, kernel_launch
from .steps import At, Buffer, CallScalar, Errors, Plan, Role, Scalar


def step_values(p: StepProblem, opts: StepOptions) -> tuple[dict, dict]:
    """The token-step kernel's argument sources by name, and its dynamic dimensions, for
    problem `p` (the replay kernels take the same, and their ring)."""
    H, K, V = p.H, p.K, p.V
    syms = {"T": p.T, "H": H, "HK": H * K, "HV": H * V, **p.strides._asdict(),
            "P": max(1, p.slots), "sP": p.slot_stride, "PD": max(1, p.dst_rows),
            "sPD": p.dst_stride, **{n: max(1, x) for n, x in p.lengths._asdict().items()}}
    tokens = p.T > 0
    pdt = F32 if p.pool == "float32" else BF16
    err = Errors()

    def role(name, present=True):
        return Role(name) if present else err

    ramp = At(Buffer("ramp", (max(1, p.N),), I32))
    values = {
        "q": role("q", tokens), "k": role("k", tokens), "g": role("g", tokens),
        "v": role("v", tokens), "beta": role("beta", tokens), "out": role("out", tokens),
        "A_log": Role("A_log") if p.A_log else At(Buffer("zeros", (H,), F32)),
        "dt_bias": Role("dt_bias") if p.dt_bias else At(Buffer("zeros", (H * K,), F32)),
        # a step that reads (writes) no state gets a one-slot stand-in
        "pool": Role("pool") if p.slots else At(Buffer("zeros", (1, H, V, K), pdt)),
        "dst": Role("dst") if p.dst_rows else At(Buffer("zeros", (1, H, V, K), pdt)),
        "cu_seqlens": role("cu_seqlens", p.fixed_len < 0),
        "read_index": Role("read_index") if p.lengths.NRI else ramp,
        "write_index": Role("write_index") if p.lengths.NWI else ramp,
        "accepted": role("accepted", bool(p.accepted.acc_on)),
        "parent": role("parent", bool(p.parent.parent_on)),
        "has_init": role("has_init", p.has_init),
        "errors": err,
        "fixed_len": Scalar(p.fixed_len), "cu_wide": Scalar(int(p.cu_wide)),
        "max_tokens": Scalar(p.max_tokens),
        # the index tables' addressing, by the kernel's argument names
        **{n: Scalar(x) for rec in (p.read, p.accepted, p.write, p.parent, p.null_min)
           for n, x in rec._asdict().items()},
        "hi_on": Scalar(int(p.has_init)),
        "gate": Scalar(STEP_GATES[opts.gate]), "a_log_dtype": Scalar(int(p.A_log)),
        "dt_bias_dtype": Scalar(int(p.dt_bias)), "qk_l2norm": Scalar(int(opts.qk_l2norm)),
        "beta_sigmoid": Scalar(int(opts.beta_sigmoid)),
        "scale": CallScalar("scale"), "lower_bound": CallScalar("lower_bound"),
        # kernel parameters of a persistent tile only (grid sizes otherwise)
        "num_rows": Scalar(p.N), "num_heads": Scalar(H),
    }
    return values, syms


@functools.lru_cache(maxsize=256)
def _step_plan(p: StepProblem, opts: StepOptions, dev: DeviceInfo) -> Plan:
    cfg = config_for(p, opts)
    H, V = p.H, p.V
    values, syms = step_values(p, opts)
    grid = (V // cfg.block_v, H, p.N)
    if cfg.persist:  # as many CTAs as fit at once (cfg.persist an SM), at most one a tile
        grid = (max(1, min(V // cfg.block_v * H * p.N, dev.sms * cfg.persist)), 1, 1)
    steps = ()
    if p.N > 0 and H > 0:
        step = kernel_launch("step", cfg, grid, values, syms, dev)
        if single_token(p):
            # a row has at most one token (the kernel refuses more), so a bf16 pool's fp32
            # keep area, used only between tokens, is never touched: more CTAs fit on an SM
            step = replace(step, smem=min(step.smem, cfg.stage_bytes))
        steps = (step,)
    return Plan(p, opts, cfg, dev, p.form, 0, steps)


def step_plan(p: StepProblem, opts: StepOptions | None = None, device: DeviceInfo = H200) -> Plan:
    """The plan of serving step `p` under `opts` on `device` (pure, cached)."""
    return _step_plan(p, opts if opts is not None else StepOptions(), device)
