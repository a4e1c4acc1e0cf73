"""A prefill's checkpoints in its plan: K2's checkpoints build, the side runs of partial chunks
and the checkpoints kernel (kda_cute.specs.checkpoints)."""

from __future__ import annotations

from dataclasses import replace

from ..ladder import (
    CHECKPOINTS,
    FwdConfig,
    looped_of,
)
from ..problem import Problem
from ..specs.prep import K1_GRID_Y
from ..specs.recur import (
    INDEX_POOL,
    STATE_F32,
)
from . import workspace
from .device import DeviceInfo, resident, resources
from .launches import (
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
)
from .steps import (
    At,
    Buffer,
    Errors,
    Launch,
    Memset,
    Plane,
    Role,
    Scalar,
)


class CheckpointSteps:
    """A forward's checkpoints (kda_cute.specs.checkpoints): the steps before K1 (the side
    tables zeroed, the checkpoints kernel, K1's side run), K2's table arguments, and K2's side
    run after the forward."""

    def __init__(self, p: Problem, cfg: FwdConfig, sched, offs, vals1: dict, syms: dict,
                 dev: DeviceInfo, shift: bool, seg_tables=None):
        self.p, self.cfg, self.dev, self.vals1, self.syms = p, cfg, dev, vals1, syms
        # shift: the rows' grids start at their first boundaries' phase (no partial chunks)
        self.shift = shift
        ck = p.ckpt
        self.E = ck.per_row
        self.S = S = p.N * ck.per_row  # side slots: one an entry
        self.P = P = sched.segments if sched.kind == "segments" else 1
        self.rows = p.N * P  # K2's rows: the sequences, or their segments
        # K2's rows' token offsets: the checked cu_seqlens, a varlen batch's segments (built
        # by the offsets kernel), or the fixed-length rows' segments
        self.cu = ((seg_tables[0] if P > 1 else offs[0]) if p.varlen
                   else segment_offsets(p.B, p.T, cfg.chunk, P)[0])
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
                **index_values(p, p.N),
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
                "NCT": self.rows * (self.E + 1) + 2, "NSC": 2 * S + 1, **index_syms(p)}
        launch = kernel_launch("checkpoints", CHECKPOINTS, (p.N, 1, 1), vals, syms, self.dev)
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
        # the looped twin of K1 (ladder.SIDE_PREPS; N1 one more: it reads the count of side
        # slots in use, side_cu[2S]) over one resident wave of CTAs, rounded down (a grid a
        # little past a wave leaves its second wave to start when the first has run every slot)
        k1 = looped_of(self.cfg.prep)
        if k1 is None:
            grid = (p.H, min(S, K1_GRID_Y), -(-S // K1_GRID_Y))
        else:
            syms1["N1"] = 2 * S + 1
            wave = resident(self.dev, resources(k1, self.dev.arch))
            grid = (p.H, min(S, max(1, wave // p.H)), 1)
        steps.append(kernel_launch("K1 side", k1 or self.cfg.prep, grid, vals1, syms1, self.dev))
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
                "ck_dtype": Scalar(STATE_CODE[ck.dtype]), "side": Scalar(2 if self.shift else 0)}

    def k2_syms(self) -> dict:
        ck = self.p.ckpt
        return {"NCT": self.rows * (self.E + 1) + 2, "NCK": ck.dest_rows, "sCK": ck.dest_stride,
                "NSK": self.S if self.side_runs else 1}

    def side_run(self, k2, vals2: dict, syms: dict) -> list[Launch]:
        """K2 over the side slots used (their count on the device): each from its scratch row
        (the state before its chunk) through its partial chunk into its destination; then its
        rescale run where the forward has one."""
        p, ck, S, dev = self.p, self.p.ckpt, self.S, self.dev
        blocks = p.V // k2.block_v * p.H
        z = min(S, max(1, -(-2 * dev.sms // blocks)))
        rows = max(S, ck.dest_rows)
        vals = {**vals2, **NO_CHECKPOINTS, "side": Scalar(1),
                "cu_seqlens": self.side_cu, "cu_chunks": self.side_chunk,
                "s0f": self.states, "s0h": self.states,
                "s1f": Role("checkpoint_state"), "s1h": Role("checkpoint_state"),
                "state_in": Scalar(STATE_F32), "state_out": Scalar(STATE_CODE[ck.dtype]),
                "ordered": Scalar(0),
                "state_index": self.side_read, "out_index": self.side_write,
                "has_init": Errors(), "errors": Errors(),
                "index_mode": Scalar(INDEX_POOL), "row_div": Scalar(1), "slots": Scalar(rows),
                "r_sn": Scalar(1), "r_wide": Scalar(0), "w_on": Scalar(1), "w_sn": Scalar(1),
                "w_wide": Scalar(0), "hi_on": Scalar(0), "null_min": Scalar(0)}
        side_syms = {**syms, **NO_CHECKPOINTS_SYMS, "N1": 2 * S + 1, "NS": rows,
                     "sS": ck.dest_stride, "NRI": S, "NWI": S, "NHI": 1}
        k2 = replace(k2, alongside=False)
        grid = (p.V // k2.block_v, p.H, z)
        # (a fast forward's: its rescale run after it, from the same scratch rows)
        return [kernel_launch("K2 side", k2, grid, vals, side_syms, dev),
                *rescale_run("K2 side", k2, grid, vals, side_syms, dev)]
