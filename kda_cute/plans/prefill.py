"""The prefill forward's launch list: K1 then K2 (serial or WY), K2 alongside K1, or K2 over
segments with the combine (kda_cute.segments), from the problem, options, config and device."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..ladder import OFFSETS, SEGMENT_RUNS, FwdConfig, alongside_of, combine_config
from ..problem import Options, Problem
from ..specs import args_for
from ..specs.prep import GATE_MODES, K1_GRID_Y
from ..specs.recur import (
    INDEX_DENSE,
    INDEX_PAD,
    INDEX_POOL,
    STATE_BF16,
    STATE_F32,
    STATE_NONE,
)
from . import schedule as sch
from . import workspace
from .device import DeviceInfo, resources
from .steps import (
    At,
    Buffer,
    CallScalar,
    Errors,
    Launch,
    Memset,
    Plan,
    Plane,
    Role,
    Scalar,
)

_STATE_CODE = {None: STATE_NONE, torch.float32: STATE_F32, torch.bfloat16: STATE_BF16}
F32, BF16, I32 = torch.float32, torch.bfloat16, torch.int32


def _launch(name, cfg, grid, values: dict, syms: dict, dev: DeviceInfo, smem: int = 0,
            programmatic: bool = False) -> Launch:
    """A Launch of kernel `cfg`: each of its parameter arguments' source taken by name from
    `values`, the dynamic dimensions its arguments use from `syms`."""
    res = resources(cfg, dev.arch)
    args = [a for a in args_for(cfg) if not a.grid_only and a.kind != "mma"]
    used = {e for a in args for e in a.shape + a.stride if isinstance(e, str)}
    return Launch(name, cfg, tuple(grid), (res.threads, 1, 1), max(res.smem, smem),
                  programmatic, tuple(a.name for a in args),
                  tuple(values[a.name] for a in args), tuple((s, syms[s]) for s in sorted(used)))


def _index_values(p: Problem, N: int, mode: int | None = None, row_div: int = 1,
                  has_init: bool | None = None) -> dict:
    """The pool form's arguments of K2 and the combine (kda_cute.specs.recur.index_args) for
    problem `p` (the error words stand in for the tables a plan does not read): dense states
    unless `p.pool`, `mode` (INDEX_*) and `has_init` overriding the problem's."""
    err = Errors()
    pool = p.pool or (N, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    slots, _, r_sn, r_wide, w_on, w_sn, w_wide, null, _, _ = pool
    hi = p.has_init if has_init is None else has_init
    if mode is None:
        mode = INDEX_POOL if p.pool else INDEX_DENSE
    tables = mode != INDEX_DENSE
    return {"state_index": Role("state_indices") if tables else err,
            "out_index": Role("output_state_indices") if tables and w_on else err,
            "has_init": Role("has_initial_state") if hi else err,
            "errors": err,
            "index_mode": Scalar(mode), "row_div": Scalar(row_div), "slots": Scalar(slots),
            "r_sn": Scalar(r_sn), "r_wide": Scalar(r_wide), "w_on": Scalar(w_on),
            "w_sn": Scalar(w_sn), "w_wide": Scalar(w_wide), "hi_on": Scalar(int(hi)),
            "null_min": Scalar(null)}


def _index_syms(p: Problem) -> dict:
    """The dynamic dimensions of the pool form's tables (word counts, at least one)."""
    nri, nwi = (p.pool[8], p.pool[9]) if p.pool else (0, 0)
    return {"NRI": max(1, nri), "NWI": max(1, nwi), "NHI": max(1, p.N if p.has_init else 0)}


def _segment_offsets(B: int, T: int, C: int, P: int) -> tuple[At, At]:
    """cu_seqlens and cu_chunks of a fixed-length batch as B * P segments."""
    return tuple(At(Buffer("segments", (B * P + 1,), I32, (B, T, C, P, which)))
                 for which in ("cu_seqlens", "cu_chunks"))


def forward_plan(p: Problem, opts: Options, cfg: FwdConfig, dev: DeviceInfo) -> Plan:
    C, H, K, V = cfg.chunk, p.H, p.K, p.V
    Tt = p.B * p.T
    nch, R = workspace.rows(p, C)
    ws = {name: Plane(name, off) for name, off in workspace.operand_offsets(p, cfg).items()}
    steps = []
    if p.varlen:
        # cu_seqlens checked and copied on the device, and the chunk slots from it: the
        # kernels read only the checked copy (a bad batch runs as empty sequences and sets
        # the error word), so no value of the caller's is followed and nothing syncs
        cs = Buffer("scratch", (p.N + 1,), I32, ("cu_seqlens",))
        cc = Buffer("scratch", (p.N + 1,), I32, ("cu_chunks",))
        steps.append(_launch(
            "offsets", OFFSETS, (1, 1, 1),
            {"cu_in": Role("cu_seqlens"), "cu_seqlens": At(cs), "cu_chunks": At(cc),
             "errors": Errors(), "wide": Scalar(int(p.cu_int64)), "entries": Scalar(p.N + 1),
             "tokens": Scalar(Tt), "chunk_shift": Scalar(C.bit_length() - 1)},
            {"NCW": (p.N + 1) * (2 if p.cu_int64 else 1), "N1": p.N + 1}, dev))
        offs = (At(cs), At(cc))
    else:
        offs = _segment_offsets(p.B, p.T, C, 1)
    a_log = Role("A_log") if p.A_log else At(Buffer("zeros", (H,), F32))
    dt_bias = Role("dt_bias") if p.dt_bias else At(Buffer("zeros", (H * K,), F32))
    sq, sk, sg, sv, so, sb = p.token_strides()
    syms = {"T": Tt, "R": R, "H": H, "HK": H * K, "HV": H * V, "HC": H * C, "NCH": nch,
            "N1": p.N + 1, "sQ": sq, "sK": sk, "sG": sg, "sB": sb, "sV": sv,
            "sO": so, "sW": H * K, "sWc": H * C, "FL": nch * H,
            # the states' rows: the sequences', or the pool's slots
            "NS": p.pool[0] if p.pool else p.N, "sS": p.pool[1] if p.pool else H * V * K,
            **_index_syms(p)}
    sched = sch.decide(p, opts, cfg, dev)
    vals1 = {"q": Role("q"), "k": Role("k"), "g": Role("g"), "beta": Role("beta"),
             "A_log": a_log, "dt_bias": dt_bias, "cu_seqlens": offs[0], "cu_chunks": offs[1],
             **ws, "num_seqs": Scalar(p.N), "seq_len": Scalar(0 if p.varlen else p.T),
             "scale": CallScalar("scale"), "lower_bound": CallScalar("lower_bound"),
             "gate_mode": Scalar(GATE_MODES[opts.gate]),
             "qk_l2norm": Scalar(int(bool(opts.qk_l2norm))),
             "beta_sigmoid": Scalar(int(bool(opts.beta_sigmoid)))}
    k1_grid = (H, min(nch, K1_GRID_Y), -(-nch // K1_GRID_Y))  # heads fastest; chunks on y, z
    if sched.kind != "alongside" and Tt > 0 and H > 0:
        steps.append(_launch("K1", cfg.prep, k1_grid, vals1, syms, dev))
    s_in = Role("initial_state") if p.state_in is not None else Role("out")
    s_out = Role("final_state") if p.state_out is not None else Role("out")
    vals2 = {**ws, "v": Role("v"), "out": Role("out"), "out_tma": Role("out"),
             "s0f": s_in, "s0h": s_in, "s1f": s_out, "s1h": s_out,
             "cu_seqlens": offs[0], "cu_chunks": offs[1],
             "state_in": Scalar(_STATE_CODE[p.state_in]),
             "state_out": Scalar(_STATE_CODE[p.state_out]),
             "ordered": Scalar(int(sch.longest_first(p, cfg, sched.k2_grid, dev))),
             **_index_values(p, p.N)}
    notes = []
    grid = sched.k2_grid
    if sched.kind == "alongside":
        # the alongside builds: K2 first, alone on its SMs (its shared memory padded to a whole
        # SM's), waiting on K1's per-chunk flags; K1 as its programmatic dependent on the SMs
        # left, held to k1_alongside_ctas CTAs per SM (padded shared memory)
        acfg = alongside_of(cfg)
        ctas = sch.k1_alongside_ctas(p, math.prod(grid), dev, resources(acfg.prep, dev.arch))
        notes.append(f"K1 held to {ctas} CTAs per SM")
        steps.append(Memset("zero flags", ws["flags"], 0, nch * H))
        steps.append(_launch("K2", acfg.recur, grid, vals2, syms, dev, dev.smem_per_block))
        # always K1 work here (alongside needs 32 chunks a sequence): K2 waits on its flags
        steps.append(_launch("K1", acfg.prep, k1_grid, vals1, syms, dev,
                             sch.k1_alongside_smem(dev, ctas), programmatic=True))
    elif sched.kind == "segments":
        steps += _segments(p, cfg, sched.segments, vals2, syms, dev)
    elif grid is not None:
        k2 = sch.k2_serial(opts, cfg, grid, dev)
        if k2.wy:
            notes.append("K2 in its WY form")
        steps.append(_launch("K2", k2, grid, vals2, syms, dev))
    return Plan(p, opts, cfg, dev, sched, workspace.workspace_bytes(p, cfg), tuple(steps),
                alongside=sched.kind == "alongside", notes=tuple(notes))


def _segment_run_configs(recur, K: int) -> tuple:
    """K2's configs for the segment runs: the output-free variant, and the identity run's
    (V = K) with and without outputs."""
    quiet = replace(recur, outputs=False)
    return quiet, replace(quiet, head_dim_v=K), replace(recur, head_dim_v=K)


def _segments(p: Problem, cfg: FwdConfig, P: int, vals2: dict, syms: dict,
              dev: DeviceInfo) -> list:
    """K2 over B * P segments (kda_cute.segments): the value rows from zero (end states B_j),
    the identity rows with v = 0 (state maps A_j), the combine (start states and the final
    state), then the value rows again from each segment's start state, writing `out`. The
    first two runs' outputs are not needed: they run K2's output-free variant
    (ladder.SEGMENT_RUNS) where one is built for this config."""
    B, T, H, K, V = p.B, p.T, p.H, p.K, p.V
    C, bv, N = cfg.chunk, cfg.recur.block_v, p.B * P
    cu, cc = _segment_offsets(B, T, C, P)
    # the end states, the state maps and the combine's start states: one buffer (V == K)
    states = Buffer("scratch", (3, N, H, K, K), F32, ("segment states",))
    one = N * H * K * K * 4
    ends, maps, starts = At(states), At(states, one), At(states, 2 * one)
    zeros = At(Buffer("zeros", (B * T, H, K), BF16))
    eye = At(Buffer("eye", (N, H, K, K), F32))
    quiet, ident_quiet, ident = _segment_run_configs(cfg.recur, K)
    quiet_built = quiet in SEGMENT_RUNS
    # without the output-free variant the value run writes `out` (overwritten by the third
    # run) and the identity run a scratch tensor; with it they write nothing
    scratch = (vals2["out"] if quiet_built
               else At(Buffer("scratch", (B * T, H, K), BF16, ("identity out",))))
    seg = {"cu_seqlens": cu, "cu_chunks": cc}
    dense = _index_values(p, N, INDEX_DENSE, has_init=False)
    syms_v = {**syms, "N1": N + 1, "NS": N, "sS": H * K * K}
    syms_i = {**syms_v, "HV": H * K, "sV": H * K, "sO": H * K}
    steps = [
        _launch("K2 from zero", quiet if quiet_built else cfg.recur, (V // bv, H, N),
                {**vals2, **seg, **dense, "state_in": Scalar(0), "state_out": Scalar(1),
                 "s1f": ends, "s1h": ends}, syms_v, dev),
        _launch("K2 identity", ident_quiet if quiet_built else ident, (K // bv, H, N),
                {**vals2, **seg, **dense, "v": zeros, "out": scratch, "out_tma": scratch,
                 "state_in": Scalar(1), "s0f": eye, "s0h": eye, "state_out": Scalar(1),
                 "s1f": maps, "s1h": maps}, syms_i, dev),
    ]
    # the combine reads the initial state and writes the final one (fp32 or bf16, dense or
    # at the pool's slots); the start states and the maps are fp32 scratch
    s0 = Role("initial_state") if p.state_in is not None else starts
    final = Role("final_state") if p.state_out is not None else starts
    kc = combine_config(K)
    steps.append(_launch(
        "combine", kc, (K // kc.rows, H, B),
        {"maps": maps, "ends": ends, "s0f": s0, "s0h": s0, "starts": starts, "final": final,
         "final_h": final, "segments": Scalar(P),
         "state_in": Scalar(_STATE_CODE[p.state_in]),
         "state_out": Scalar(_STATE_CODE[p.state_out]), **_index_values(p, B)},
        {"NSP": N, "sSP": H * K * K, "NS": syms["NS"], "sS": syms["sS"], "H": H,
         **_index_syms(p)}, dev))
    # the value rows from each segment's start state; in the pool form the index table says
    # which rows are padding (zero outputs)
    steps.append(_launch("K2 from starts", cfg.recur, (V // bv, H, N),
                         {**vals2, **seg, **_index_values(
                             p, N, INDEX_PAD if p.pool else INDEX_DENSE, P, has_init=False),
                          "state_in": Scalar(1), "s0f": starts, "s0h": starts,
                          "state_out": Scalar(0)}, syms_v, dev))
    return steps
