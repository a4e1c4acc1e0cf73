"""The prefill forward's launch list: K1 then K2 (serial or WY), K2 alongside K1, or K2 over
segments with the combine (kda_cute.segments), from the problem, options, config and device."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from ..ladder import (
    CHECKPOINTS,
    OFFSETS,
    SEGMENT_RUNS,
    FwdConfig,
    alongside_of,
    checkpoints_of,
    combine_config,
    looped_of,
    rescale_of,
)
from ..problem import Options, PoolForm, Problem
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
from .device import DeviceInfo, resident, resources
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
    pool = p.pool or PoolForm(N, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    hi = p.has_init if has_init is None else has_init
    if mode is None:
        mode = INDEX_POOL if p.pool else INDEX_DENSE
    tables = mode != INDEX_DENSE
    return {"state_index": Role("state_indices") if tables else err,
            "out_index": Role("output_state_indices") if tables and pool.w_on else err,
            "has_init": Role("has_initial_state") if hi else err,
            "errors": err,
            "index_mode": Scalar(mode), "row_div": Scalar(row_div), "hi_on": Scalar(int(hi)),
            **{n: Scalar(getattr(pool, n)) for n in _POOL_SCALARS}}


# the pool form's scalars, by their names in Problem.pool (PoolForm)
_POOL_SCALARS = ("slots", "r_sn", "r_wide", "w_on", "w_sn", "w_wide", "null_min")


def _index_syms(p: Problem) -> dict:
    """The dynamic dimensions of the pool form's tables (word counts, at least one)."""
    nri, nwi = (p.pool.NRI, p.pool.NWI) if p.pool else (0, 0)
    return {"NRI": max(1, nri), "NWI": max(1, nwi), "NHI": max(1, p.N if p.has_init else 0)}


# K2 without checkpoints: no table (ck_rows 0; the error words stand in for its tensors)
_NO_CHECKPOINTS = {"ck_at": Errors(), "ck_to": Errors(), "ck_f": Errors(), "ck_h": Errors(),
                   "ck_s": Errors(), "ck_rows": Scalar(0), "ck_dtype": Scalar(STATE_NONE),
                   "side": Scalar(0)}
_NO_CHECKPOINTS_SYMS = {"NCT": 1, "NCK": 1, "NSK": 1}


def _rescale_run(name: str, k2, grid, vals: dict, syms: dict, dev: DeviceInfo) -> list:
    """The rescale run after K2 launch `name` (kernel k2, grid, arguments `vals`): the same
    arguments, its grid's z cut to about two CTAs an SM (each CTA reads its rows' words at
    once and, nearly always, leaves); none where `vals` has fix_on 0. Right after a K2 that
    is not alongside, as that K2's programmatic dependent (the K2 releases it at its start;
    the run waits for the K2 to complete before reading anything it wrote), so its launch
    and prologue run beside the K2's chunks; after an alongside K2 (K1 comes between, and
    the K2 releases K1) an ordinary launch."""
    rs = rescale_of(k2)
    if rs is None or not vals["fix_on"].value:
        return []
    z = min(grid[2], max(1, -(-2 * dev.sms // (grid[0] * grid[1]))))
    return [_launch(name + " rescale", rs, (grid[0], grid[1], z),
                    {**vals, "ordered": Scalar(0)}, syms, dev, programmatic=not k2.alongside)]


def _stores(recur, ck):
    """The main K2 of a forward: its checkpoints build where the forward stores checkpoints
    (`ck`), the plain one otherwise."""
    if not ck:
        return recur
    twin = checkpoints_of(recur)
    if twin is None:
        raise ValueError(f"config: expected a forward with a checkpoints build of its K2 "
                         f"(ladder.CHECKPOINT_RUNS) with checkpoints, got {recur.name}")
    return twin


def side_k1_rows(heads: int, dev: DeviceInfo, kernel, waves: int = 1) -> int:
    """Grid y of the looped K1 side run (`kernel`): `waves` times the CTAs the device holds at
    once, over the heads (rounded down, so that one wave's CTAs are all resident and each loops
    over its share of the slots: a grid a little past a wave leaves the CTAs of the second
    start when the first have run all their slots)."""
    return max(1, waves * resident(dev, resources(kernel, dev.arch)) // heads)


class _Checkpoints:
    """A forward's checkpoints (kda_cute.specs.checkpoints): the steps before K1 (the side
    tables zeroed, the checkpoints kernel, K1's side run), K2's table arguments, and K2's side
    run after the forward."""

    def __init__(self, p: Problem, cfg: FwdConfig, sched, offs, vals1: dict, syms: dict,
                 dev: DeviceInfo, shift: bool):
        self.p, self.cfg, self.dev, self.vals1, self.syms = p, cfg, dev, vals1, syms
        # shift: the rows' grids start at their first boundaries' phase (no partial chunks)
        self.shift = shift
        ck = p.ckpt
        self.E = ck.per_row
        self.S = S = p.N * ck.per_row  # side slots: one an entry
        self.P = P = sched.segments if sched.kind == "segments" else 1
        self.rows = p.N * P  # K2's rows: the sequences, or their segments
        # K2's rows' token offsets: the checked cu_seqlens, or the fixed-length rows' segments
        self.cu = offs[0] if p.varlen else _segment_offsets(p.B, p.T, cfg.chunk, P)[0]
        self.in_place = ck.dtype == F32
        scratch = (lambda use, n, dt=I32: At(Buffer("scratch", (n,), dt, ("checkpoints", use))))
        # (K2 reads up to two entries past a row's end mark, a checkpoint ahead)
        self.at = scratch("at", self.rows * (self.E + 1) + 2)
        self.to = scratch("to", self.rows * (self.E + 1) + 2)
        self.side_cu = scratch("side cu", 2 * S + 1)
        self.k1_chunks = scratch("k1 chunks", 2 * S + 1)
        self.side_chunk = scratch("side chunk", 2 * S + 1)
        self.side_read = scratch("side read", S)
        self.side_write = scratch("side write", S)
        # a bf16 destination's mid-chunk states wait in fp32 scratch rows (its row stride);
        # without side runs K2 stores none there (the error words stand in)
        self.states = Errors()
        if self.side_runs:
            self.states = (Role("checkpoint_state") if self.in_place
                           else scratch("states", S * ck.dest_stride, F32))

    def prepare(self) -> list:
        p, ck, S, C = self.p, self.p.ckpt, self.S, self.cfg.chunk
        entries = Role("checkpoint_slots" if ck.every else "checkpoint_offsets")
        vals = {"cu_seqlens": self.cu, "entries": entries,
                "first": Role("checkpoint_first") if ck.first_on else Errors(),
                "ck_at": self.at, "ck_to": self.to, "side_cu": self.side_cu,
                "k1_chunks": self.k1_chunks, "side_chunk": self.side_chunk,
                "side_read": self.side_read, "side_write": self.side_write,
                **_index_values(p, p.N),
                "row_segments": Scalar(self.P), "per_row": Scalar(self.E),
                "e_sn": Scalar(ck.e_sn), "e_se": Scalar(ck.e_se), "e_wide": Scalar(ck.e_wide),
                "every": Scalar(ck.every), "first_on": Scalar(ck.first_on),
                "f_sn": Scalar(ck.f_sn), "f_wide": Scalar(ck.f_wide),
                "dest_rows": Scalar(ck.dest_rows), "dest_min": Scalar(ck.dest_min),
                "side_slots": Scalar(S),
                "side_base": Scalar(workspace.main_slots(p, C)),
                "chunk_shift": Scalar(C.bit_length() - 1),
                "in_place": Scalar(int(self.in_place)), "shifted": Scalar(int(self.shift))}
        syms = {"N1": self.rows + 1, "NCE": max(1, ck.e_words), "NCF": max(1, ck.f_words),
                "NCT": self.rows * (self.E + 1) + 2, "NSC": 2 * S + 1, **_index_syms(p)}
        launch = _launch("checkpoints", CHECKPOINTS, (p.N, 1, 1), vals, syms, self.dev)
        if not self.side_runs:  # no partial chunks: no side slots, no side runs
            return [launch]
        steps = [Memset("zero side slots", self.side_cu, 0, 2 * S + 1), launch]
        # K1 on the side slots: slot k the partial chunk side_cu[2k] .. side_cu[2k + 1] (a
        # varlen batch of pairs, k at 2k: the sequences between hold no chunk)
        side_planes = {name: Plane(name, off)
                       for name, off in workspace.side_offsets(p, self.cfg).items()}
        vals1 = {**self.vals1, **side_planes, "cu_seqlens": self.side_cu,
                 "cu_chunks": self.k1_chunks, "num_seqs": Scalar(2 * S - 1),
                 "seq_len": Scalar(0)}
        syms1 = {**self.syms, "NCH": S, "R": S * C, "N1": 2 * S}
        # the looped twin of K1: a CTA the side slots y, y + grid y, ... below the count of
        # those in use (side_cu[2S], which it reads: N1 one more), one resident wave of CTAs
        # (side_k1_rows): a CTA a side slot and head, nearly all finding nothing where the
        # boundaries end chunks, cost more (docs/notes/k2.md)
        k1 = looped_of(self.cfg.prep)
        if k1 is not None:
            syms1["N1"] = 2 * S + 1
        grid = (p.H, min(S, K1_GRID_Y), -(-S // K1_GRID_Y)) if k1 is None else (
            p.H, min(S, side_k1_rows(p.H, self.dev, k1)), 1)
        steps.append(_launch("K1 side", k1 or self.cfg.prep, grid, vals1, syms1, self.dev))
        return steps

    @property
    def side_runs(self) -> bool:
        """Whether a boundary may fall inside a chunk (so the side runs are needed)."""
        return not (self.p.ckpt.aligned or self.shift)

    def k2_values(self) -> dict:
        ck = self.p.ckpt
        dest = Role("checkpoint_state")
        # (side 2: a main run over shifted grids, cu_chunks as chunk0 * C + sigma)
        return {"ck_at": self.at, "ck_to": self.to, "ck_f": dest, "ck_h": dest,
                "ck_s": self.states, "ck_rows": Scalar(self.E + 1),
                "ck_dtype": Scalar(_STATE_CODE[ck.dtype]), "side": Scalar(2 if self.shift else 0)}

    def k2_syms(self) -> dict:
        ck = self.p.ckpt
        return {"NCT": self.rows * (self.E + 1) + 2, "NCK": ck.dest_rows, "sCK": ck.dest_stride,
                "NSK": self.S if self.side_runs else 1}

    def side_run(self, k2, vals2: dict, syms: dict) -> Launch:
        """K2 over the side slots used (their count on the device): each from its scratch row
        (the state before its chunk) through its partial chunk into its destination; then its
        rescale run where the forward has one."""
        p, ck, S, dev = self.p, self.p.ckpt, self.S, self.dev
        blocks = p.V // k2.block_v * p.H
        z = min(S, max(1, -(-2 * dev.sms // blocks)))
        rows = max(S, ck.dest_rows)
        vals = {**vals2, **_NO_CHECKPOINTS, "side": Scalar(1),
                "cu_seqlens": self.side_cu, "cu_chunks": self.side_chunk,
                "s0f": self.states, "s0h": self.states,
                "s1f": Role("checkpoint_state"), "s1h": Role("checkpoint_state"),
                "state_in": Scalar(STATE_F32), "state_out": Scalar(_STATE_CODE[ck.dtype]),
                "ordered": Scalar(0),
                "state_index": self.side_read, "out_index": self.side_write,
                "has_init": Errors(), "errors": Errors(),
                "index_mode": Scalar(INDEX_POOL), "row_div": Scalar(1), "slots": Scalar(rows),
                "r_sn": Scalar(1), "r_wide": Scalar(0), "w_on": Scalar(1), "w_sn": Scalar(1),
                "w_wide": Scalar(0), "hi_on": Scalar(0), "null_min": Scalar(0)}
        side_syms = {**syms, **_NO_CHECKPOINTS_SYMS, "N1": 2 * S + 1, "NS": rows,
                     "sS": ck.dest_stride, "NRI": S, "NWI": S, "NHI": 1}
        k2 = replace(k2, alongside=False)
        grid = (p.V // k2.block_v, p.H, z)
        # (a fast forward's: its rescale run after it, from the same scratch rows)
        return [_launch("K2 side", k2, grid, vals, side_syms, dev),
                *_rescale_run("K2 side", k2, grid, vals, side_syms, dev)]


def _segment_offsets(B: int, T: int, C: int, P: int) -> tuple[At, At]:
    """cu_seqlens and cu_chunks of a fixed-length batch as B * P segments."""
    return tuple(At(Buffer("segments", (B * P + 1,), I32, (B, T, C, P, which)))
                 for which in ("cu_seqlens", "cu_chunks"))


def _offsets(p: Problem, C: int, shift: bool, dev: DeviceInfo) -> tuple[Launch, tuple, tuple]:
    """The offsets kernel's launch: cu_seqlens checked and copied on the device, and the chunk
    slots from it. The kernels read only the checked copy (a bad batch runs as empty sequences
    and sets the error word), so no value of the caller's is followed and nothing syncs.
    `shift` (grids shifted to first checkpoint boundaries): also K1's split table and K2's
    chunk slots with each row's shift, from checkpoint_first (a fixed-length batch's offsets
    from the launcher's table). Returns (the launch, K2's (cu_seqlens, cu_chunks), K1's or
    None where K1 reads K2's)."""
    cs = At(Buffer("scratch", (p.N + 1,), I32, ("cu_seqlens",)))
    cc = At(Buffer("scratch", (p.N + 1,), I32, ("cu_chunks",)))
    vals = {"cu_in": Role("cu_seqlens") if p.varlen else _segment_offsets(p.B, p.T, C, 1)[0],
            "cu_seqlens": cs, "cu_chunks": cc, "errors": Errors(),
            "first": Errors(), "k1_cu_seqlens": Errors(), "k1_cu_chunks": Errors(),
            "wide": Scalar(int(p.cu_int64)), "entries": Scalar(p.N + 1),
            "tokens": Scalar(p.B * p.T), "chunk_shift": Scalar(C.bit_length() - 1),
            "shifted": Scalar(0), "f_sn": Scalar(0), "f_wide": Scalar(0)}
    syms = {"NCW": (p.N + 1) * (2 if p.cu_int64 else 1), "N1": p.N + 1, "N2": 1, "NCF": 1}
    k1 = None
    if shift:
        n2, ck = 2 * p.N + 1, p.ckpt
        k1 = tuple(At(Buffer("scratch", (n2,), I32, (name,)))
                   for name in ("k1 cu_seqlens", "k1 cu_chunks"))
        vals.update({"first": Role("checkpoint_first"), "k1_cu_seqlens": k1[0],
                     "k1_cu_chunks": k1[1], "shifted": Scalar(1), "f_sn": Scalar(ck.f_sn),
                     "f_wide": Scalar(ck.f_wide)})
        syms.update({"N2": n2, "NCF": max(1, ck.f_words)})
    return _launch("offsets", OFFSETS, (1, 1, 1), vals, syms, dev), (cs, cc), k1


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
    k1_tables = None
    if p.varlen or shift:
        launch, offs, k1_tables = _offsets(p, C, shift, dev)
        steps.append(launch)
    else:
        offs = _segment_offsets(p.B, p.T, C, 1)
    a_log = Role("A_log") if p.A_log else At(Buffer("zeros", (H,), F32))
    dt_bias = Role("dt_bias") if p.dt_bias else At(Buffer("zeros", (H * K,), F32))
    sq, sk, sg, sv, so, sb = p.token_strides()
    syms = {"T": Tt, "R": R, "H": H, "HK": H * K, "HV": H * V, "HC": H * C, "NCH": nch,
            "N1": p.N + 1, "sQ": sq, "sK": sk, "sG": sg, "sB": sb, "sV": sv,
            "sO": so, "sW": H * K, "sWc": H * C, "FL": nch * H,
            # the states' rows: the sequences', or the pool's slots
            "NS": p.pool.slots if p.pool else p.N, "sS": p.pool.sS if p.pool else H * V * K,
            **_index_syms(p), **_NO_CHECKPOINTS_SYMS, "sCK": H * V * K}
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
        ck = _Checkpoints(p, cfg, sched, offs, vals1, syms, dev, shift)
        if k1_first:
            # (of the greatest priority: K1's grid fills the device, and a side stream of
            # the same priority had the checkpoints kernel start when K1's last blocks did,
            # K2 waiting for it)
            steps += [Fork("fork: checkpoints beside K1", first=True), *ck.prepare(),
                      Merge("merge: K1")]
        else:
            steps += ck.prepare()
    if k1_first:
        steps.append(_launch("K1", cfg.prep, k1_grid, vals1, syms1, dev))
        if ck:
            steps.append(Join("join: checkpoints"))
    s_in = Role("initial_state") if p.state_in is not None else Role("out")
    s_out = Role("final_state") if p.state_out is not None else Role("out")
    vals2 = {**ws, "v": Role("v"), "out": Role("out"), "out_tma": Role("out"),
             "s0f": s_in, "s0h": s_in, "s1f": s_out, "s1h": s_out,
             "cu_seqlens": offs[0], "cu_chunks": offs[1],
             "state_in": Scalar(_STATE_CODE[p.state_in]),
             "state_out": Scalar(_STATE_CODE[p.state_out]),
             "ordered": Scalar(int(sch.longest_first(p, cfg, sched.k2_grid, dev))),
             **_index_values(p, p.N), **(ck.k2_values() if ck else _NO_CHECKPOINTS),
             "fixes": fixes, "fix_on": Scalar(fix_on)}
    if ck:
        syms.update(ck.k2_syms())
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
        steps.append(_launch("K2", _stores(acfg.recur, ck), grid, vals2, syms, dev,
                             dev.smem_per_block))
        # always K1 work here (alongside needs 32 chunks a sequence): K2 waits on its flags
        steps.append(_launch("K1", acfg.prep, k1_grid, vals1, syms1, dev,
                             sch.k1_alongside_smem(dev, ctas), programmatic=True))
        steps += _rescale_run("K2", acfg.recur, grid, vals2, syms, dev)
        k2 = cfg.recur  # (the side run's: the same steps as the alongside build's)
    elif sched.kind == "segments":
        steps += _segments(p, cfg, sched.segments, vals2, syms, dev)
        k2 = cfg.recur
    elif grid is not None:
        k2 = sch.k2_serial(opts, cfg, grid, dev)
        if k2.wy:
            notes.append("K2 in its WY form")
        steps.append(_launch("K2", _stores(k2, ck), grid, vals2, syms, dev))
        steps += _rescale_run("K2", k2, grid, vals2, syms, dev)
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
    # (a fast forward's rescale runs redo what overflowed in the value rows; the identity
    # rows, v = 0 from the identity, stay in range)
    zero_vals = {**vals2, **seg, **dense, **_NO_CHECKPOINTS, "state_in": Scalar(0),
                 "state_out": Scalar(1), "s1f": ends, "s1h": ends}
    # the identity rows on the side stream, beside the value rows and their rescale run (whose
    # launch then overlaps the identity rows); the combine waits for both
    steps = [
        Fork("fork: identity rows beside the value rows"),
        _launch("K2 identity", ident_quiet if quiet_built else ident, (K // bv, H, N),
                {**vals2, **seg, **dense, **_NO_CHECKPOINTS, "v": zeros, "out": scratch,
                 "out_tma": scratch,
                 "state_in": Scalar(1), "s0f": eye, "s0h": eye, "state_out": Scalar(1),
                 "s1f": maps, "s1h": maps, "fix_on": Scalar(0)}, syms_i, dev),
        Merge("merge: value rows"),
        _launch("K2 from zero", quiet if quiet_built else cfg.recur, (V // bv, H, N),
                zero_vals, syms_v, dev),
        *_rescale_run("K2 from zero", cfg.recur, (V // bv, H, N), zero_vals, syms_v, dev),
        Join("join: identity rows"),
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
    start_vals = {**vals2, **seg, **_index_values(
        p, N, INDEX_PAD if p.pool else INDEX_DENSE, P, has_init=False),
        "state_in": Scalar(1), "s0f": starts, "s0h": starts, "state_out": Scalar(0)}
    steps.append(_launch("K2 from starts", _stores(cfg.recur, vals2["ck_rows"].value),
                         (V // bv, H, N), start_vals, syms_v, dev))
    steps += _rescale_run("K2 from starts", cfg.recur, (V // bv, H, N), start_vals, syms_v,
                          dev)
    return steps
