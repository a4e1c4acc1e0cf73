"""The prefill forward's launch list: K1 then K2 (serial or WY), K2 alongside K1, or K2 over
segments with the combine (kda_cute.segments), from the problem, options, config and device."""

from __future__ import annotations

import math
from dataclasses import replace

from ..ladder import (
    OFFSETS,
    SEGMENT_RUNS,
    FwdConfig,
    alongside_of,
    combine_config,
    rescale_of,
)
from ..problem import Options, Problem
from ..specs.prep import GATE_MODES, K1_GRID_Y
from ..specs.recur import (
    INDEX_DENSE,
    INDEX_PAD,
)
from . import schedule as sch
from . import workspace
from .checkpoints import CheckpointSteps
from .device import DeviceInfo, resources
from .launches import (
    BF16,
    F32,
    I32,
    NO_CHECKPOINTS,
    NO_CHECKPOINTS_SYMS,
    STATE_CODE,
    index_syms,
    index_values,
    kernel_launch,
    rescale_run,
    segment_offsets,
    stores_build,
)
from .steps import (
    At,
    Buffer,
    CallScalar,
    Errors,
    Fork,
    Join,
    Launch,
    Memset,
    Merge,
    Plan,
    Plane,
    Role,
    Scalar,
)


def _offsets(p: Problem, C: int, shift: bool, dev: DeviceInfo,
             segments: int = 1) -> tuple[Launch, tuple, tuple, tuple]:
    """The offsets kernel's launch: cu_seqlens checked and copied on the device, and the chunk
    slots from it. The kernels read only the checked copy (a bad batch runs as empty sequences
    and sets the error word), so no value of the caller's is followed and nothing syncs.
    `shift` (grids shifted to first checkpoint boundaries): also K1's split table and K2's
    chunk slots with each row's shift, from checkpoint_first (a fixed-length batch's offsets
    from the launcher's table). A varlen batch over `segments` > 1 a sequence: also the
    segments' cu_seqlens and first chunk slots. Returns (the launch, K2's (cu_seqlens,
    cu_chunks), K1's or None where K1 reads K2's, the segments' or None)."""
    cs = At(Buffer("scratch", (p.N + 1,), I32, ("cu_seqlens",)))
    cc = At(Buffer("scratch", (p.N + 1,), I32, ("cu_chunks",)))
    vals = {"cu_in": Role("cu_seqlens") if p.varlen else segment_offsets(p.B, p.T, C, 1)[0],
            "cu_seqlens": cs, "cu_chunks": cc, "errors": Errors(),
            "first": Errors(), "k1_cu_seqlens": Errors(), "k1_cu_chunks": Errors(),
            "wide": Scalar(int(p.cu_int64)), "entries": Scalar(p.N + 1),
            "tokens": Scalar(p.B * p.T), "chunk_shift": Scalar(C.bit_length() - 1),
            "shifted": Scalar(0), "f_sn": Scalar(0), "f_wide": Scalar(0),
            "seg_cu": Errors(), "seg_cc": Errors(), "segments": Scalar(0)}
    syms = {"NCW": (p.N + 1) * (2 if p.cu_int64 else 1), "N1": p.N + 1, "N2": 1, "NCF": 1,
            "NSP1": 1}
    seg = None
    if segments > 1:
        n = p.N * segments + 1
        seg = tuple(At(Buffer("scratch", (n,), I32, (name,)))
                    for name in ("segments cu_seqlens", "segments cu_chunks"))
        vals.update({"seg_cu": seg[0], "seg_cc": seg[1], "segments": Scalar(segments)})
        syms["NSP1"] = n
    k1 = None
    if shift:
        n2, ck = 2 * p.N + 1, p.ckpt
        k1 = tuple(At(Buffer("scratch", (n2,), I32, (name,)))
                   for name in ("k1 cu_seqlens", "k1 cu_chunks"))
        vals.update({"first": Role("checkpoint_first"), "k1_cu_seqlens": k1[0],
                     "k1_cu_chunks": k1[1], "shifted": Scalar(1), "f_sn": Scalar(ck.f_sn),
                     "f_wide": Scalar(ck.f_wide)})
        syms.update({"N2": n2, "NCF": max(1, ck.f_words)})
    return kernel_launch("offsets", OFFSETS, (1, 1, 1), vals, syms, dev), (cs, cc), k1, seg


def forward_plan(p: Problem, opts: Options, cfg: FwdConfig, dev: DeviceInfo) -> Plan:
    C, H, K, V = cfg.chunk, p.H, p.K, p.V
    Tt = p.B * p.T
    nch, R = workspace.rows(p, C)
    nmain = workspace.main_slots(p, C)  # K1's main run: the sequences' own chunks
    ws = {name: Plane(name, off) for name, off in workspace.operand_offsets(p, cfg).items()}
    steps = []
    sched = sch.decide(p, opts, cfg, dev)
    # every-n checkpoints from first boundaries: each row's chunk grid starts at its first
    # boundary's phase, so that every boundary ends a chunk (the segments do not shift)
    shift = (p.ckpt is not None and p.ckpt.shifts and sched.kind != "segments"
             and sched.k2_grid is not None)
    k1_tables = seg_tables = None
    if p.varlen or shift:
        P = sched.segments if sched.kind == "segments" and p.varlen else 1
        launch, offs, k1_tables, seg_tables = _offsets(p, C, shift, dev, P)
        steps.append(launch)
    else:
        offs = segment_offsets(p.B, p.T, C, 1)
    a_log = Role("A_log") if p.A_log else At(Buffer("zeros", (H,), F32))
    dt_bias = Role("dt_bias") if p.dt_bias else At(Buffer("zeros", (H * K,), F32))
    sq, sk, sg, sv, so, sb = p.token_strides()
    syms = {"T": Tt, "R": R, "H": H, "HK": H * K, "HV": H * V, "HC": H * C, "NCH": nch,
            "N1": p.N + 1, "sQ": sq, "sK": sk, "sG": sg, "sB": sb, "sV": sv,
            "sO": so, "sW": H * K, "sWc": H * C, "FL": nch * H,
            # the states' rows: the sequences', or the pool's slots
            "NS": p.pool.slots if p.pool else p.N, "sS": p.pool.sS if p.pool else H * V * K,
            **index_syms(p), **NO_CHECKPOINTS_SYMS, "sCK": H * V * K}
    # the rescale words: 4 per (K2 row, head, block of state rows); a fast forward's K2s flag
    # the warps whose state overflowed and the rescale run after each redoes them
    fix_on = int(rescale_of(cfg.recur) is not None)
    rows2 = max(p.N * (sched.segments if sched.kind == "segments" else 1),
                workspace.side_slots(p) if sched.k2_grid is not None else 0)
    nfx = rows2 * H * (V // cfg.recur.block_v) * 4 if fix_on else 0
    fixes = At(Buffer("scratch", (nfx,), I32, ("rescale",))) if nfx else Errors()
    syms["NFX"] = max(1, nfx)
    vals1 = {"q": Role("q"), "k": Role("k"), "g": Role("g"), "beta": Role("beta"),
             "A_log": a_log, "dt_bias": dt_bias, "cu_seqlens": offs[0], "cu_chunks": offs[1],
             **ws, "num_seqs": Scalar(p.N), "seq_len": Scalar(0 if p.varlen else p.T),
             "scale": CallScalar("scale"), "lower_bound": CallScalar("lower_bound"),
             "gate_mode": Scalar(GATE_MODES[opts.gate]),
             "qk_l2norm": Scalar(int(bool(opts.qk_l2norm))),
             "beta_sigmoid": Scalar(int(bool(opts.beta_sigmoid))),
             "a_log_dtype": Scalar(int(p.A_log)), "dt_bias_dtype": Scalar(int(p.dt_bias))}
    syms1 = syms
    if k1_tables:  # K1 over each row in two: its partial first chunk, then the rest
        vals1.update({"cu_seqlens": k1_tables[0], "cu_chunks": k1_tables[1],
                      "num_seqs": Scalar(2 * p.N), "seq_len": Scalar(0)})
        syms1 = {**syms, "N1": 2 * p.N + 1}
    k1_grid = (H, min(nmain, K1_GRID_Y), -(-nmain // K1_GRID_Y))  # heads fastest; chunks y, z
    ck = None
    # K1 a launch of its own before K2: the checkpoints' preparation (read by K2 and its side
    # run only) runs beside it on the side stream, off the forward's path
    k1_first = sched.kind != "alongside" and Tt > 0 and H > 0
    if p.ckpt is not None and sched.k2_grid is not None:
        ck = CheckpointSteps(p, cfg, sched, offs, vals1, syms, dev, shift, seg_tables)
        if k1_first:
            # (of the greatest priority: K1's grid fills the device, and a side stream of
            # the same priority had the checkpoints kernel start when K1's last blocks did,
            # K2 waiting for it)
            steps += [Fork("fork: checkpoints beside K1", first=True), *ck.prepare(),
                      Merge("merge: K1")]
        else:
            steps += ck.prepare()
    if k1_first:
        steps.append(kernel_launch("K1", cfg.prep, k1_grid, vals1, syms1, dev))
        if ck:
            steps.append(Join("join: checkpoints"))
    s_in = Role("initial_state") if p.state_in is not None else Role("out")
    s_out = Role("final_state") if p.state_out is not None else Role("out")
    vals2 = {**ws, "v": Role("v"), "out": Role("out"), "out_tma": Role("out"),
             "s0f": s_in, "s0h": s_in, "s1f": s_out, "s1h": s_out,
             "cu_seqlens": offs[0], "cu_chunks": offs[1],
             "state_in": Scalar(STATE_CODE[p.state_in]),
             "state_out": Scalar(STATE_CODE[p.state_out]),
             "ordered": Scalar(int(sch.longest_first(p, cfg, sched.k2_grid, dev))),
             **index_values(p, p.N), **(ck.k2_values() if ck else NO_CHECKPOINTS),
             "fixes": fixes, "fix_on": Scalar(fix_on)}
    if ck:
        syms.update(ck.k2_syms())
    notes = []
    grid = sched.k2_grid
    k2 = cfg.recur  # (the side run's K2; an alongside build's takes the same steps)
    if sched.kind == "alongside":
        # the alongside builds: K2 first, alone on its SMs (its shared memory padded to a whole
        # SM's), waiting on K1's per-chunk flags; K1 as its programmatic dependent on the SMs
        # left, held to k1_alongside_ctas CTAs per SM (padded shared memory)
        acfg = alongside_of(cfg)
        ctas = sch.k1_alongside_ctas(p, math.prod(grid), dev, resources(acfg.prep, dev.arch))
        notes.append(f"K1 held to {ctas} CTAs per SM")
        steps.append(Memset("zero flags", ws["flags"], 0, nch * H))
        steps.append(kernel_launch("K2", stores_build(acfg.recur, ck), grid, vals2, syms, dev,
                                   dev.smem_per_block))
        # always K1 work here (alongside needs 32 chunks a sequence): K2 waits on its flags
        steps.append(kernel_launch("K1", acfg.prep, k1_grid, vals1, syms1, dev,
                                   sch.k1_alongside_smem(dev, ctas), programmatic=True))
        steps += rescale_run("K2", acfg.recur, grid, vals2, syms, dev)
    elif sched.kind == "segments":
        steps += _segments(p, cfg, sched.segments, vals2, syms, dev, seg_tables)
    elif grid is not None:
        k2 = sch.k2_serial(opts, cfg, grid, dev)
        if k2.wy:
            notes.append("K2 in its WY form")
        steps.append(kernel_launch("K2", stores_build(k2, ck), grid, vals2, syms, dev))
        steps += rescale_run("K2", k2, grid, vals2, syms, dev)
    if ck:
        if ck.side_runs:
            steps += ck.side_run(k2, vals2, syms)
        notes.append(f"checkpoints: {p.ckpt.per_row} a sequence, "
                     + (f"every {p.ckpt.every} tokens" if p.ckpt.every else "at offsets")
                     + (", on chunk boundaries (no side runs)" if p.ckpt.aligned else "")
                     + (", the rows' chunk grids shifted to their first boundaries (no side "
                        "runs)" if shift else ""))
    return Plan(p, opts, cfg, dev, sched, workspace.workspace_bytes(p, cfg), tuple(steps),
                alongside=sched.kind == "alongside", notes=tuple(notes))


# the segments' ends, maps and start states (one buffer; plans.context moves it)
SEGMENT_STATES = ("segment states",)


def _segments(p: Problem, cfg: FwdConfig, P: int, vals2: dict, syms: dict,
              dev: DeviceInfo, tables: tuple | None = None) -> list:
    """K2 over B * P segments (kda_cute.segments): the value rows from zero (end states B_j),
    the identity rows with v = 0 (state maps A_j), the combine (start states and the final
    state), then the value rows again from each segment's start state, writing `out`. The
    first two runs' outputs are not needed: they run K2's output-free variant
    (ladder.SEGMENT_RUNS) where one is built for this config. A varlen batch's segments come
    from the offsets kernel (`tables`); a fixed-length batch's from the launcher's table."""
    B, T, H, K, V = p.N, p.T, p.H, p.K, p.V
    C, bv, N = cfg.chunk, cfg.recur.block_v, p.N * P
    # (a varlen batch's segments: the offsets kernel's; one a sequence: the sequences')
    cu, cc = ((tables or (vals2["cu_seqlens"], vals2["cu_chunks"])) if p.varlen
              else segment_offsets(B, T, C, P))
    # the end states, the state maps and the combine's start states: one buffer (V == K)
    states = Buffer("scratch", (3, N, H, K, K), F32, SEGMENT_STATES)
    one = N * H * K * K * 4
    ends, maps, starts = At(states), At(states, one), At(states, 2 * one)
    zeros = At(Buffer("zeros", (p.B * T, H, K), BF16))
    eye = At(Buffer("eye", (N, H, K, K), F32))
    # K2's output-free variant, and the identity run's (V = K) with and without outputs
    quiet = replace(cfg.recur, outputs=False)
    ident_quiet, ident = replace(quiet, head_dim_v=K), replace(cfg.recur, head_dim_v=K)
    quiet_built = quiet in SEGMENT_RUNS
    # without the output-free variant the value run writes `out` (overwritten by the third
    # run) and the identity run a scratch tensor; with it they write nothing
    scratch = (vals2["out"] if quiet_built
               else At(Buffer("scratch", (p.B * T, H, K), BF16, ("identity out",))))
    # (the segment rows in their order: a varlen batch's longest-first ranking is of sequences)
    seg = {"cu_seqlens": cu, "cu_chunks": cc, "ordered": Scalar(0)}
    dense = index_values(p, N, INDEX_DENSE, has_init=False)
    syms_v = {**syms, "N1": N + 1, "NS": N, "sS": H * K * K}
    syms_i = {**syms_v, "HV": H * K, "sV": H * K, "sO": H * K}
    # (a fast forward's rescale runs redo what overflowed in the value rows; the identity
    # rows, v = 0 from the identity, stay in range)
    zero_vals = {**vals2, **seg, **dense, **NO_CHECKPOINTS, "state_in": Scalar(0),
                 "state_out": Scalar(1), "s1f": ends, "s1h": ends}
    # the identity rows on the side stream, beside the value rows and their rescale run (whose
    # launch then overlaps the identity rows); the combine waits for both
    steps = [
        Fork("fork: identity rows beside the value rows"),
        kernel_launch("K2 identity", ident_quiet if quiet_built else ident, (K // bv, H, N),
                      {**zero_vals, "v": zeros, "out": scratch, "out_tma": scratch,
                       "state_in": Scalar(1), "s0f": eye, "s0h": eye, "s1f": maps, "s1h": maps,
                       "fix_on": Scalar(0)}, syms_i, dev),
        Merge("merge: value rows"),
        kernel_launch("K2 from zero", quiet if quiet_built else cfg.recur, (V // bv, H, N),
                      zero_vals, syms_v, dev),
        *rescale_run("K2 from zero", cfg.recur, (V // bv, H, N), zero_vals, syms_v, dev),
        Join("join: identity rows"),
    ]
    # the combine reads the initial state and writes the final one (fp32 or bf16, dense or
    # at the pool's slots); the start states and the maps are fp32 scratch
    s0 = Role("initial_state") if p.state_in is not None else starts
    final = Role("final_state") if p.state_out is not None else starts
    kc = combine_config(K)
    steps.append(kernel_launch(
        "combine", kc, (K // kc.rows, H, B),
        {"maps": maps, "ends": ends, "s0f": s0, "s0h": s0, "starts": starts, "final": final,
         "final_h": final, "segments": Scalar(P),
         "state_in": Scalar(STATE_CODE[p.state_in]),
         "state_out": Scalar(STATE_CODE[p.state_out]), **index_values(p, B)},
        {"NSP": N, "sSP": H * K * K, "NS": syms["NS"], "sS": syms["sS"], "H": H,
         **index_syms(p)}, dev))
    # the value rows from each segment's start state; in the pool form the index table says
    # which rows are padding (zero outputs)
    start_vals = {**vals2, **seg, **index_values(
        p, N, INDEX_PAD if p.pool else INDEX_DENSE, P, has_init=False),
        "state_in": Scalar(1), "s0f": starts, "s0h": starts, "state_out": Scalar(0)}
    steps.append(kernel_launch("K2 from starts", stores_build(cfg.recur, vals2["ck_rows"].value),
                               (V // bv, H, N), start_vals, syms_v, dev))
    steps += rescale_run("K2 from starts", cfg.recur, (V // bv, H, N), start_vals, syms_v, dev)
    return steps
