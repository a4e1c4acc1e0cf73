"""K2 on tensor cores: the chunk recurrence with every product on bf16 warpgroup MMA (sm_90a).

One CTA per (block of 64 state rows, head, sequence z), running sequences z, z + grid z, ... in
turn (the launcher gives a fixed-length batch's CTAs several: schedule.k2_seqs_per_cta; one pipeline
state runs across them, so the next sequence's first chunks load while the current one
finishes). One consumer warpgroup (warps 0-3) owns the state S [64 rows of V, K] in the fp32
accumulator registers of the update MMA; one producer warp (warp 4) streams each chunk's operands
into a `stages`-deep `cutlass.pipeline.PipelineTmaAsync`.
Every product has the 64-row side wgmma needs (M = 64) and takes its A operand from registers
(the previous product's accumulator, converted to bf16), its B operand from swizzled smem that
TMA fills straight from K1's bf16 workspace (no conversion pass, no S round trip through smem):

  P   = S kg^T            M 64, N chunk, reduction K     A = fp16(sigma S), B = kg fp16
  Pq  = S qg^T            M 64, N chunk, reduction K     A = fp16(sigma S), B = qg fp16
  W^T = v^T - P           registers; token columns past the chunk's length are zero
  U^T = W^T Aw^T          M 64, N chunk, reduction chunk A = W hi/lo, B = Aw hi/lo (3 products)
  O^T = Pq + U^T Mq^T     M 64, N chunk, reduction chunk A = U hi/lo, B = Mq hi/lo (3 products)
  S   = S diag(gl) + U^T kd   M 64, N K, reduction chunk  A = U hi/lo, B = kd hi/lo (3 products)

x hi/lo is the pair (bf16(x), bf16(x - bf16(x))): hi*hi + hi*lo + lo*hi carries ~16 mantissa
bits, which keeps the fp32 final state at fp32-level accuracy (with U and kd in single bf16 its
error nears the bar: docs/notes/precision.md). sigma is a power of two per state row, chosen
each chunk from the row's largest |S| so that the fp16 copy neither overflows nor underflows
(_row_scales; P and Pq are scaled back exactly): fp16's 10 mantissa bits with fp32's range.
kd is read as an MN-major B operand (a transposed TMA view), so nothing is transposed on chip.
K1's workspace holds whole chunks with zero rows past each sequence's end, so the operands need
no masking; only v's rows past the length (another sequence's, or zero-filled) are masked in W.
Whole output chunks leave by TMA stores from a double-buffered smem tile, each warp storing its
own 16 state rows (no barrier across the warpgroup); a sequence's last, partial chunk is stored
by the threads (a whole tile would overwrite the next sequence's rows).
Built `alongside` (ladder.ALONGSIDE: K1 runs at the same time on the other SMs), the CTA lets its
programmatic dependent K1 launch once resident, and the producer waits for K1's flag of each
(chunk, head) before loading it; the serial builds carry none of that.
Built `wy` (ladder.WY_RUNS, fp16 only), U skips P: U^T = v^T Aw^T + S kgw^T with kgw = -Aw kg,
which the producer warp forms in place of each landed kg tile (ldmatrix, warp MMA, stmatrix) two
chunks behind its loads and hands over on a per-stage `ready` mbarrier; one product round trip
less on the serial chain (the launcher takes it where each CTA has an SM to itself).
The states are dense (sequence n's is row n) or a pool's slots (kernels.common.StateSlots:
row state_index[n] read, out_index[n] written, in place when equal), looked up once per sequence
by the consumer warpgroup and the producer warp alike; a padding row (or one with a bad index)
reads and writes no state and runs no chunk (nothing is loaded for it): its output rows are
stored as zeros, so the chunk loop is the dense forward's.
Constraints: block_v == 64, threads == 128 (+ 32 producer), chunk == 16, head_dim_k % 64 == 0.
"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.nvgpu import warp as warp_mma
from cutlass.utils import LayoutEnum

from kda_cute.abi import QK_DTYPE, operand_dtype
from kda_cute.specs.recur import (
    CK_DESTS,
    CK_PAD,
    STATE_BF16,
    STATE_F32,
    RecurConfig,
    checkpoint_maps,
    ck_slab_box,
)
from kernels.common import (
    E_NONFINITE,
    Record,
    StateSlots,
    TileCopy,
    absmax_bf16x2,
    bf16x2_hi,
    bf16x2_lo,
    bits_f32,
    bulk_store,
    f32_bits,
    pack_bf16x2,
    swizzle_bytes,
    sync_threads_or,
    tma_meta,
    trap,
)


def _tree(xs: list, op):
    """xs reduced by op pairwise, as a balanced tree (plain Python at trace time)."""
    while len(xs) > 1:
        nxt = [op(xs[i], xs[i + 1]) for i in range(0, len(xs) - 1, 2)]
        if len(xs) % 2:
            nxt.append(xs[-1])
        xs = nxt
    return xs[0]


# the longest K2 waits for one chunk's flag from a K1 running alongside it before failing
WAIT_LIMIT_NS = 5_000_000_000
FLAG_BATCH = 8  # flags a waiting K2 reads at once
# the WY form: the producer warp turns a chunk's kg into kgw this many chunks after issuing
# its loads (< stages, so the consumer's releases never wait on it)
WY_LAG = 2
# a fast forward's K2 flags a warp for its rescale run where every thread's mean |S| at a
# sequence's end is below this (fp16's least normal, 2^-14): values and states that small run
# on subnormal fp16 operands and come out wrong (docs/notes/precision.md, "the rescale runs")
TINY = 2.0 ** -14


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View an m64nN fp32 accumulator fragment ((2, 2, N/8), M, N') as the A-operand fragment of a
    following m64nXk16 wgmma ((2, 2, 2), M, (N/16, N')): for 16-bit operands the accumulator's
    16-column slabs hold exactly the registers an A fragment of one k-block needs."""
    dv = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    layout = cute.make_layout(
        ((dv.shape[0][0], dv.shape[0][1], dv.shape[0][2][0]), dv.shape[1],
         (dv.shape[0][2][1], dv.shape[2])),
        stride=((dv.stride[0][0], dv.stride[0][1], dv.stride[0][2][0]), dv.stride[1],
                (dv.stride[0][2][1], dv.stride[2])))
    return cute.make_tensor(acc.iterator, layout)


@dataclass
class Operands(Record):
    """The TMA loads of a chunk: (atom, global view) of K1's workspace planes kg, qg, kd, Aw
    and Mq (hi, lo), its gl row, and v."""
    tma_kg: cute.CopyAtom
    kg: cute.Tensor
    tma_qg: cute.CopyAtom
    qg: cute.Tensor
    tma_kdh: cute.CopyAtom
    kdh: cute.Tensor
    tma_kdl: cute.CopyAtom
    kdl: cute.Tensor
    tma_awh: cute.CopyAtom
    awh: cute.Tensor
    tma_awl: cute.CopyAtom
    awl: cute.Tensor
    tma_mqh: cute.CopyAtom
    mqh: cute.Tensor
    tma_mql: cute.CopyAtom
    mql: cute.Tensor
    tma_gl: cute.CopyAtom
    gl: cute.Tensor
    tma_v: cute.CopyAtom
    v: cute.Tensor


@dataclass
class Out(Record):
    """The output: (T, H, V) for partial chunks, and the TMA store of whole chunks' slabs."""
    out: cute.Tensor
    tma_o: cute.CopyAtom
    o: cute.Tensor


@dataclass
class States(Record):
    """The initial state (fp32 and bf16 views) and the final state (likewise)."""
    s0f: cute.Tensor
    s0h: cute.Tensor
    s1f: cute.Tensor
    s1h: cute.Tensor


@dataclass
class Offsets(Record):
    """The checked cu_seqlens, each row's first workspace chunk, and K1's (chunk, head) flags."""
    cu_seqlens: cute.Tensor
    cu_chunks: cute.Tensor
    flags: cute.Tensor


@dataclass
class Tables(Record):
    """The pool form (kernels.common.StateSlots): read and write index tables, has_init, and
    the error words."""
    read_index: cute.Tensor
    write_index: cute.Tensor
    has_init: cute.Tensor
    errors: cute.Tensor


@dataclass
class StateModes(Record):
    """How the states are held (STATE_*), and whether grid z takes the z-th longest sequence."""
    state_in: cutlass.Int32
    state_out: cutlass.Int32
    ordered: cutlass.Int32


@dataclass
class Index(Record):
    """The index tables' form (StateSlots._slots reads them in this order)."""
    index_mode: cutlass.Int32
    row_div: cutlass.Int32
    slots: cutlass.Int32
    r_sn: cutlass.Int32
    r_wide: cutlass.Int32
    w_on: cutlass.Int32
    w_sn: cutlass.Int32
    w_wide: cutlass.Int32
    hi_on: cutlass.Int32
    null_min: cutlass.Int32


@dataclass
class Checkpoints(Record):
    """The checkpoint table (ck_rows words a sequence; 0: none) and destination: its fp32,
    bf16 and scratch views (or, in the tensor-map builds, (atom, view) each) and its dtype."""
    at: cute.Tensor
    to: cute.Tensor
    f: object
    h: object
    s: object
    rows: cutlass.Int32
    dtype: cutlass.Int32


@dataclass
class Runs(Record):
    """Which run: side (1: the checkpoints' side run, 2: a main run with shifted grids) and
    the rescale run's words (fix_on 1: an overflowed warp writes no state)."""
    side: cutlass.Int32
    fix: cute.Tensor
    fix_on: cutlass.Int32


@dataclass
class Mmas(Record):
    """The chunk products' (P, Pq, U, O), the state update's, and P / Pq's on fp16 operands."""
    p: cute.TiledMma
    s: cute.TiledMma
    q: cute.TiledMma


@dataclass
class Layouts(Record):
    """The smem layouts: kg / qg, Aw / Mq, kd, gl, v, out, and one warp's output slab."""
    ck: cute.ComposedLayout
    cc: cute.ComposedLayout
    kc: cute.ComposedLayout
    gl: cute.Layout
    v: cute.Layout
    o: cute.Layout
    slab: cute.Layout


class Tiles(NamedTuple):
    """The smem tiles of the stages (kg, qg: (C, K, S); kd: (K, C, S); Aw, Mq: (C, C, S);
    gl: (1, K, S); v: (C, BV, S)), the output's two buffers and the checkpoint rows' base."""
    kg: cute.Tensor
    qg: cute.Tensor
    kdh: cute.Tensor
    kdl: cute.Tensor
    awh: cute.Tensor
    awl: cute.Tensor
    mqh: cute.Tensor
    mql: cute.Tensor
    gl: cute.Tensor
    v: cute.Tensor
    o: cute.Tensor
    ck: cute.Tensor


class KdaRecurTcSm90(TileCopy, StateSlots):
    def __init__(self, cfg: RecurConfig):
        self.cfg = cfg
        self.K, self.V = cfg.head_dim_k, cfg.head_dim_v
        self.C, self.BV = cfg.chunk, cfg.block_v
        self.stages = cfg.stages
        self.mma_threads = cfg.threads
        self.threads = cfg.threads + 32  # + the producer warp
        self.outputs = cfg.outputs  # False: the state runs only (no Pq, O, stores)
        self.alongside = cfg.alongside  # K1 runs alongside: wait for each chunk's flag
        self.producer_warp = cfg.threads // 32
        C, K, BV = self.C, self.K, self.BV
        # cfg.f16: every product on fp16 operands, one each (K1's kd, Aw and Mq fp16 in their
        # hi planes; the lo planes are neither written nor loaded)
        self.f16 = cfg.f16
        self.wy = cfg.wy  # the WY form (producer-formed kgw; config.WY_RUNS)
        self.checkpoints = cfg.checkpoints  # stores the checkpoints of its table
        # the rescale run: redoes what a forward's K2 flagged, its state scaled row by row
        self.rescale = cfg.rescale
        # the tuning switches and their reasons: RecurConfig's properties
        self.releases, self.ck_lanes, self.early = cfg.releases, cfg.ck_lanes, cfg.early
        self.min_blocks, self.carry, self.defer = cfg.min_blocks, cfg.carry, cfg.defer
        # the checkpoints leave through tensor maps, one TMA store a warp (specs.recur)
        self.ck_maps = checkpoint_maps(cfg)
        self.op = cutlass.Float16 if cfg.f16 else cutlass.BFloat16
        # the state's operand copy in `nsplit` slabs of K (two at K = 256, which keeps it inside
        # 255 registers)
        self.nsplit = max(1, cfg.head_dim_k // 128)
        planes = 1 if cfg.f16 else 2
        self.tx_bytes = ((2 + planes) * C * K + 2 * planes * C * C + C * BV) * 2 + K * 4
        self.smem_bytes = 0
        self.tma_meta = []

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mKg: cute.Tensor, mQg: cute.Tensor,  # (T, H*K) bf16
        mKdh: cute.Tensor, mKdl: cute.Tensor,  # (H*K, T) bf16: transposed views
        mAwh: cute.Tensor, mAwl: cute.Tensor,  # (T, H*C) bf16
        mMqh: cute.Tensor, mMql: cute.Tensor,
        mGl: cute.Tensor,  # (num_chunks, H*K) fp32
        mV: cute.Tensor,  # (T, H*V) bf16, row stride dynamic
        mOut: cute.Tensor,  # (T, H, V) bf16, row stride dynamic: partial chunks
        mOutT: cute.Tensor,  # (T, H*V) view of the same: TMA stores of whole chunks
        mS0f: cute.Tensor, mS0h: cute.Tensor, mS1f: cute.Tensor, mS1h: cute.Tensor,
        mCuSeq: cute.Tensor, mCuChunk: cute.Tensor,
        mFlags: cute.Tensor,  # (num_chunks * H,) int32: K1's per-(chunk, head) flags
        # the pool form (kernels.common.StateSlots): index tables, has_init, error words
        mRIdx: cute.Tensor, mWIdx: cute.Tensor, mHasInit: cute.Tensor, mErr: cute.Tensor,
        num_seqs: cutlass.Int32, num_heads: cutlass.Int32,
        state_in: cutlass.Int32, state_out: cutlass.Int32,
        ordered: cutlass.Int32,  # 1: grid z is the z-th longest sequence (a varlen batch)
        index_mode: cutlass.Int32, row_div: cutlass.Int32, slots: cutlass.Int32,
        r_sn: cutlass.Int32, r_wide: cutlass.Int32, w_on: cutlass.Int32, w_sn: cutlass.Int32,
        w_wide: cutlass.Int32, hi_on: cutlass.Int32, null_min: cutlass.Int32,
        # checkpoints (kda_cute.specs.checkpoints): the table (ck_rows words a sequence, 0:
        # none), the destination (fp32 / bf16 views, ck_dtype) and the scratch rows
        mCkAt: cute.Tensor, mCkTo: cute.Tensor, mCkF: cute.Tensor, mCkH: cute.Tensor,
        mCkS: cute.Tensor, ck_rows: cutlass.Int32, ck_dtype: cutlass.Int32,
        side: cutlass.Int32,  # 1: the side run (sequence z's tokens at 2z, 2z + 1; no outputs)
        # the rescale run (kda_cute.specs.recur.rescale_args): four words per (sequence, head,
        # block of state rows), one a warp; fix_on 1: an overflowed warp writes no state
        mFix: cute.Tensor, fix_on: cutlass.Int32,
        stream,
    ):
        C, K, BV, S = self.C, self.K, self.BV, self.stages
        bf16 = cutlass.BFloat16
        odt = self.op  # the operands' type (K1's workspace): bf16, or fp16 (cfg.f16)
        k_major = LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()
        rmem = warpgroup.OperandSource.RMEM
        # N = chunk products (P, Pq, U, O): B K-major
        mma_p = sm90_utils.make_trivial_tiled_mma(
            odt, odt, k_major, k_major, cutlass.Float32, (1, 1, 1), tiler_mn=(BV, C),
            a_source=rmem)
        # the state update: B = kd [chunk, K] read as (K, chunk), MN-major
        mma_s = sm90_utils.make_trivial_tiled_mma(
            odt, odt, k_major, LayoutEnum.COL_MAJOR.sm90_mma_major_mode(), cutlass.Float32,
            (1, 1, 1), tiler_mn=(BV, K), a_source=rmem)
        # P = S kg^T and Pq = S qg^T on fp16 operands (qg, kg fp16: abi.QK_DTYPE); the f16
        # builds' mma_p itself
        qdt = cutlass.Float16
        mma_q = mma_p if self.f16 else sm90_utils.make_trivial_tiled_mma(
            qdt, qdt, k_major, k_major, cutlass.Float32, (1, 1, 1), tiler_mn=(BV, C),
            a_source=rmem)
        l_ck = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BV, C, K), qdt, S)
        l_cc = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BV, C, C), odt, S)
        l_kc = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (BV, K, C), odt, S)
        l_gl = cute.make_layout((1, K, S), stride=(K, 1, K))
        l_v = cute.make_layout((C, BV, S), stride=(BV, 1, C * BV))

        op = cpasync.CopyBulkTensorTileG2SOp()
        one = (None, None, 0)
        atoms, self.tma_meta = [], []
        for name, m, layout, tile, inner in (
                ("kg", mKg, l_ck, (C, K), None), ("qg", mQg, l_ck, (C, K), None),
                ("kdh", mKdh, l_kc, (K, C), 0), ("kdl", mKdl, l_kc, (K, C), 0),
                ("awh", mAwh, l_cc, (C, C), None), ("awl", mAwl, l_cc, (C, C), None),
                ("mqh", mMqh, l_cc, (C, C), None), ("mql", mMql, l_cc, (C, C), None)):
            atom, tX = cpasync.make_tiled_tma_atom(op, m, cute.slice_(layout, one), tile)
            atoms += [atom, tX]
            dtype = QK_DTYPE if name in ("kg", "qg") else operand_dtype(self.f16)
            self.tma_meta.append(tma_meta(name, atom, dtype, swizzle_bytes(layout),
                                          inner_mode=inner))
        for name, m, layout, tile, dtype in (("gl", mGl, l_gl, (1, K), "float32"),
                                             ("v", mV, l_v, (C, BV), "bfloat16")):
            atom, tX = cpasync.make_tiled_tma_atom(op, m, cute.slice_(layout, one), tile)
            atoms += [atom, tX]
            self.tma_meta.append(tma_meta(name, atom, dtype))
        # the output: (chunk, BV) tiles, two buffers, each warp's 16 state rows (its rows of
        # the accumulator) a dense (chunk, 16) slab that the warp stores by itself
        l_o = cute.make_layout((C, (16, BV // 16), 2), stride=(16, (1, C * 16), C * BV))
        l_slab = cute.make_layout((C, 16), stride=(16, 1))
        tma_o, tO = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mOutT,
                                                l_slab, (C, 16))
        self.tma_meta.append(tma_meta("out_tma", tma_o, "bfloat16"))
        # the checkpoints builds with tensor maps: a warp's 16 padded slab rows, one box
        # (the columns past K out of bounds: not written)
        ck_dest = (mCkF, mCkH, mCkS)
        if cutlass.const_expr(self.ck_maps):
            ck_dest = []
            for (name, dtype, _, pad, _), m in zip(CK_DESTS, (mCkF, mCkH, mCkS), strict=True):
                tile, layout = self._ck_slab(pad)
                atom, tX = cpasync.make_tiled_tma_atom(
                    cpasync.CopyBulkTensorTileS2GOp(), m, layout, tile)
                ck_dest += [(atom, tX)]
                self.tma_meta.append(tma_meta(name, atom, dtype))

        buf = cute.struct.MemRange
        align = cute.struct.Align
        # the lo planes' tiles: none in the f16 builds (one element each, never read or loaded)
        lo_kc, lo_cc = self._lo_sizes(cute.cosize(l_kc), cute.cosize(l_cc))
        ck_elems = BV * (K + CK_PAD) if self.checkpoints else 1

        @cute.struct
        class SharedStorage:
            bars: buf[cutlass.Int64, 2 * S]
            # the WY form: stage s's kgw = -Aw kg written (by the producer warp, in place of
            # kg) and visible to the async proxy
            ready: buf[cutlass.Int64, S if self.wy else 1]
            sKg: align[buf[qdt, cute.cosize(l_ck)], 1024]
            sQg: align[buf[qdt, cute.cosize(l_ck)], 1024]
            sKdh: align[buf[odt, cute.cosize(l_kc)], 1024]
            sKdl: align[buf[odt, lo_kc], 1024]
            sAwh: align[buf[odt, cute.cosize(l_cc)], 1024]
            sAwl: align[buf[odt, lo_cc], 1024]
            sMqh: align[buf[odt, cute.cosize(l_cc)], 1024]
            sMql: align[buf[odt, lo_cc], 1024]
            sGl: align[buf[cutlass.Float32, cute.cosize(l_gl)], 128]
            sV: align[buf[bf16, cute.cosize(l_v)], 128]
            sO: align[buf[bf16, cute.cosize(l_o)], 128]
            # `ordered`: cu_seqlens (at most `threads` entries), then the CTA's sequence
            sOrd: buf[cutlass.Int32, self.threads + 1]
            # the checkpoints builds: each warp's 16 state rows on their way out (rows padded
            # by 32 bytes: the accumulator's row pairs land in distinct banks)
            sCk: align[buf[cutlass.Float32, ck_elems], 128]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        self.kernel(
            Operands(*atoms), Out(mOut, tma_o, tO), States(mS0f, mS0h, mS1f, mS1h),
            Offsets(mCuSeq, mCuChunk, mFlags), Tables(mRIdx, mWIdx, mHasInit, mErr),
            StateModes(state_in, state_out, ordered),
            Index(index_mode, row_div, slots, r_sn, r_wide, w_on, w_sn, w_wide, hi_on, null_min),
            Checkpoints(mCkAt, mCkTo, *ck_dest, ck_rows, ck_dtype), Runs(side, mFix, fix_on),
            Mmas(mma_p, mma_s, mma_q), Layouts(l_ck, l_cc, l_kc, l_gl, l_v, l_o, l_slab),
        ).launch(
            grid=(self.V // BV, num_heads, num_seqs), block=(self.threads, 1, 1),
            smem=self.smem_bytes, stream=stream, min_blocks_per_mp=self.min_blocks,
        )

    def _lo_sizes(self, kc: int, cc: int) -> tuple[int, int]:
        """Elements of smem for the lo planes of kd and of Aw / Mq: their tiles', or one each in
        the f16 builds (the lo tensors stay as views for the descriptors, never read)."""
        return (1, 1) if self.f16 else (kc, cc)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, ops: Operands, out: Out, states: States, offsets: Offsets, tables: Tables,
               modes: StateModes, index: Index, ckpt: Checkpoints, runs: Runs, mmas: Mmas,
               layouts: Layouts):
        mCuSeq, mCuChunk, mFlags = offsets.cu_seqlens, offsets.cu_chunks, offsets.flags
        side, mFix = runs.side, runs.fix
        l_ck, l_cc, l_kc = layouts.ck, layouts.cc, layouts.kc
        C, K, BV, S = self.C, self.K, self.BV, self.stages
        tidx, _, _ = cute.arch.thread_idx()
        vb, h, z = cute.arch.block_idx()
        _, nh, nz = cute.arch.grid_dim()
        # this CTA runs sequences z, z + nz, ...; the side run's count is on the device (the
        # table's last word) and its sequences' bounds are pairs
        num_seqs = cutlass.Int32(cute.size(mCuSeq) - 1)
        step = cutlass.Int32(1)
        if cutlass.const_expr(self.checkpoints):  # (side 2: a main run, its grids shifted)
            if side == 1:
                num_seqs = mCuSeq[num_seqs]
                step = cutlass.Int32(2)
        else:
            if side != 0:
                num_seqs = mCuSeq[num_seqs]
                step = cutlass.Int32(2)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        v0 = vb * BV
        if cutlass.const_expr(self.rescale):
            # launched as the programmatic dependent of the K2 it redoes (plans.prefill): its
            # words, states and outputs are read once that grid has completed (a no-op after
            # an ordinary launch)
            cute.arch.griddepcontrol_wait()
            # nearly always nothing to redo: the CTA's words read at once, one a thread, and
            # without a flagged one no sequence is run (the loops below run none)
            if self._any_fixed(mFix, z, num_seqs, nz, nh, h, vb, tidx) == 0:
                num_seqs = z
        if cutlass.const_expr(self.alongside or self.releases):
            # alongside: K1, launched as this grid's programmatic dependent (api: K2 first, K1
            # alongside on the SMs K2 leaves free), may start once every CTA of this grid is
            # resident; the other fp16 builds: their rescale run likewise (it waits above for
            # this grid to complete), its launch and prologue beside this grid's chunks
            cute.arch.griddepcontrol_launch_dependents()

        smem = utils.SmemAllocator()
        st = smem.allocate(self.shared_storage)
        # (the rescale builds never rank: their grid z is cut, and with nothing to redo
        # num_seqs is z, which no rank matches)
        if cutlass.const_expr(not self.rescale):
            if modes.ordered != 0:
                z = self._longest_first(mCuSeq, st.sOrd.get_tensor(cute.make_layout(
                    self.threads + 1)), num_seqs, z, tidx)
        sKg = st.sKg.get_tensor(l_ck.outer, swizzle=l_ck.inner)  # (C, K, S)
        sQg = st.sQg.get_tensor(l_ck.outer, swizzle=l_ck.inner)
        sKdh = st.sKdh.get_tensor(l_kc.outer, swizzle=l_kc.inner)  # (K, C, S)
        # (the f16 builds' lo tensors: views of the hi tiles, never read)
        sKdl = (st.sKdh if self.f16 else st.sKdl).get_tensor(l_kc.outer, swizzle=l_kc.inner)
        sAwh = st.sAwh.get_tensor(l_cc.outer, swizzle=l_cc.inner)  # (C, C, S)
        sAwl = (st.sAwh if self.f16 else st.sAwl).get_tensor(l_cc.outer, swizzle=l_cc.inner)
        sMqh = st.sMqh.get_tensor(l_cc.outer, swizzle=l_cc.inner)
        sMql = (st.sMqh if self.f16 else st.sMql).get_tensor(l_cc.outer, swizzle=l_cc.inner)
        sGl = st.sGl.get_tensor(layouts.gl)  # (1, K, S)
        sV = st.sV.get_tensor(layouts.v)  # (C, BV, S)
        sO = st.sO.get_tensor(layouts.o)  # (C, BV, 2)
        sCk = st.sCk.get_tensor(cute.make_layout(1))  # (its base: the slabs' views are made there)

        ready = st.ready.data_ptr()
        if cutlass.const_expr(self.wy):
            if tidx == 0:
                for i in cutlass.range_constexpr(S):
                    cute.arch.mbarrier_init(ready + i, 1)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.bars.data_ptr(), num_stages=S,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                     self.mma_threads // 32),
            tx_count=self.tx_bytes)

        idx = index.values()
        tab = tables.values()
        if cutlass.const_expr(not self.rescale):  # (the rescale run's K2 reported them)
            if tidx == 0 and vb == 0 and h == 0:  # one thread of a sequence reports its bad
                self._report(*tab, (z, num_seqs, nz), idx)
        if warp == self.producer_warp:
            # ---- producer: one chunk's tiles per stage -----------------------------------
            o = ops
            loads = ((o.tma_kg, o.kg, sKg, (C, K), False), (o.tma_qg, o.qg, sQg, (C, K), False),
                     (o.tma_kdh, o.kdh, sKdh, (K, C), True), (o.tma_kdl, o.kdl, sKdl, (K, C), True),
                     (o.tma_awh, o.awh, sAwh, (C, C), False),
                     (o.tma_awl, o.awl, sAwl, (C, C), False),
                     (o.tma_mqh, o.mqh, sMqh, (C, C), False),
                     (o.tma_mql, o.mql, sMql, (C, C), False))
            if cutlass.const_expr(self.f16):  # no lo planes
                loads = loads[0:3] + loads[4:5] + loads[6:7]
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, S)
            # WY form: the operand of the chunk issued WY_LAG chunks before, once it has landed
            wstate = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, S)
            issued = cutlass.Int32(0)
            # the next sequence's first chunks load while the consumer finishes this one's
            for seq in cutlass.range(z, num_seqs, nz):
                bos = mCuSeq[seq * step]
                chunk0 = mCuChunk[seq]
                vs = bos  # the token the row's chunk grid starts at (_grid)
                if cutlass.const_expr(self.checkpoints):
                    chunk0, vs = self._grid(mCuChunk, seq, bos, side)
                # a padding row runs no chunk (the consumers agree: _slots)
                live, _, _, _ = self._slots(*tab, seq, idx, cutlass.Int32(0))
                if cutlass.const_expr(self.rescale):  # only the items a warp of overflowed
                    live = live * self._fixes(mFix, seq, nh, h, vb)[0]
                nch = (mCuSeq[seq * step + 1] - vs + C - 1) // C * live
                flagged = cutlass.Int32(-1)  # chunks 0 .. flagged known written (K1 alongside)
                for c in cutlass.range(nch):
                    pipe.producer_acquire(state)
                    bar = pipe.producer_get_barrier(state)
                    s = state.index
                    if cutlass.const_expr(self.checkpoints):
                        t0 = cutlass.max(bos, vs + c * C)
                    else:
                        t0 = bos + c * C
                    r0 = (chunk0 + c) * C  # the chunk's first workspace row
                    if cutlass.const_expr(self.alongside):
                        if c > flagged:
                            flagged = self._await_flags(mFlags, chunk0, c, nch, nh, h)
                    for tma, tX, sX, tile, transposed in loads:
                        col = h * tile[1] if not transposed else h * tile[0]
                        coord = (col, r0) if transposed else (r0, col)
                        self._tile_copy(tma, tX, sX[None, None, s], coord, tile, bar)
                    self._tile_copy(ops.tma_gl, ops.gl, sGl[None, None, s], (chunk0 + c, h * K),
                                    (1, K), bar)
                    self._tile_copy(ops.tma_v, ops.v, sV[None, None, s], (t0, h * self.V + v0),
                                    (C, BV), bar)
                    pipe.producer_commit(state)
                    state.advance()
                    if cutlass.const_expr(self.wy):
                        issued = issued + 1
                        if issued > WY_LAG:
                            self._wy_operand(pipe, wstate, sKg, sAwh, ready)
                            wstate.advance()
            if cutlass.const_expr(self.wy):
                for _ in cutlass.range(cutlass.min(issued, WY_LAG)):
                    self._wy_operand(pipe, wstate, sKg, sAwh, ready)
                    wstate.advance()
        else:
            tiles = Tiles(sKg, sQg, sKdh, sKdl, sAwh, sAwl, sMqh, sMql, sGl, sV, sO, sCk)
            self._consume(pipe, tiles, layouts.slab, out, states, modes, mmas,
                          (tidx, warp, h, vb), offsets, (z, num_seqs, nz, step), ready, tab, idx,
                          ckpt, runs, nh)

    @cute.jit
    def _grid(self, mCuChunk: cute.Tensor, seq, bos, side):
        """The checkpoints builds: (row `seq`'s first workspace chunk, the token its chunk
        grid starts at). Side 2, the main run of a forward whose every-n checkpoints start at a
        first boundary (kda_cute.specs.offsets: shifted): cu_chunks holds chunk0 * C + sigma,
        the grid starting sigma < C tokens before the row so that every boundary ends a chunk
        (its first chunk partial, as a row's last may be); otherwise the row's first token."""
        mask, shift = self.C - 1, self.C.bit_length() - 1
        chunk0 = mCuChunk[seq]
        vs = bos
        if side == 2:
            vs = bos - (chunk0 & mask)
            chunk0 = chunk0 >> shift
        return chunk0, vs

    @cute.jit
    def _extent(self, bos, a, rem):
        """(first token, length) of the grid's chunk [a, a + C) cut to a row starting at bos
        with `rem` = its end - a tokens (a >= bos - C)."""
        t0 = cutlass.max(bos, a)
        return t0, cutlass.min(self.C, rem) + a - t0

    @cute.jit
    def _wy_operand(self, pipe, wstate, sKg, sAwh, ready):
        """The producer warp, for the fp16 forward's WY form: once stage s has landed, its kg
        tile becomes kgw = -Aw kg in place (m16n8k16 fp16 MMAs, fp32 accumulation; Aw as K1
        wrote it, fp16): operands by ldmatrix (kg transposed), the result by stmatrix, then a
        proxy fence and stage s's `ready` arrive. The consumer's chunk then needs no
        P = S kg^T before U. Rows past the length stay zero (Aw's are)."""
        C, K = self.C, self.K
        f16, f32 = cutlass.Float16, cutlass.Float32
        lane = cute.arch.lane_idx()
        s = wstate.index
        pipe.consumer_wait(wstate)
        mma = cute.make_tiled_mma(warp_mma.MmaF16BF16Op(f16, f32, (16, 8, 16)), (1, 1, 1),
                                  permutation_mnk=(16, 16, 16))
        thr = mma.get_slice(lane)
        sA = sAwh[None, None, s]  # (i, j): Aw
        sC = sKg[None, None, s]  # (i, column): kg, then kgw
        sB = cute.composition(sC, cute.make_ordered_layout((K, C), order=(1, 0)))  # (col, j)
        rA = thr.make_fragment_A(thr.partition_A(sA))
        rB = thr.make_fragment_B(thr.partition_B(sB))
        acc = thr.make_fragment_C(thr.partition_C(sC))
        ld = warp_mma.LdMatrix8x8x16bOp
        cpA = cute.make_tiled_copy_A(cute.make_copy_atom(ld(False, 4), f16), mma).get_slice(lane)
        cpB = cute.make_tiled_copy_B(cute.make_copy_atom(ld(True, 4), f16), mma).get_slice(lane)
        cute.copy(cpA, cpA.partition_S(sA), cpA.retile(rA))
        cute.copy(cpB, cpB.partition_S(sB), cpB.retile(rB))
        rA.store(-rA.load())
        acc.fill(0.0)
        cute.gemm(mma, acc, rA, rB, acc)
        r16 = cute.make_rmem_tensor_like(acc, f16)
        r16.store(acc.load().to(f16))
        st = warp_mma.StMatrix8x8x16bOp
        cpC = cute.make_tiled_copy_C(cute.make_copy_atom(st(False, 4), f16), mma).get_slice(lane)
        cute.copy(cpC, cpC.retile(r16), cpC.partition_D(sC))
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.mbarrier_arrive(ready + s)

    @cute.jit
    def _longest_first(self, mCuSeq: cute.Tensor, sOrd: cute.Tensor, num_seqs, z, tidx):
        """The sequence of rank z by length, longest first (ties by index): grid z = 0, 1, ...
        is dispatched about in order, so the longest sequences start first and the shortest
        fill the last wave (a varlen batch whose longest sequence comes last otherwise starts
        it last, and its CTAs alone run on at the end). num_seqs < threads: every thread copies
        one cu_seqlens entry to smem, thread i ranks sequence i against all, and the one whose
        rank is z hands its index over."""
        if tidx <= num_seqs:
            sOrd[tidx] = mCuSeq[tidx]
        cute.arch.sync_threads()
        if tidx < num_seqs:
            li = sOrd[tidx + 1] - sOrd[tidx]
            rank = cutlass.Int32(0)
            for j in cutlass.range(num_seqs):
                lj = sOrd[j + 1] - sOrd[j]
                if lj > li:
                    rank = rank + 1
                if lj == li:
                    if j < tidx:
                        rank = rank + 1
            if rank == z:
                sOrd[self.threads] = tidx
        cute.arch.sync_threads()
        return sOrd[self.threads]

    @cute.jit
    def _await_flags(self, mFlags: cute.Tensor, chunk0, c, nch, nh, h):
        """Wait until K1 (running alongside) has flagged chunk c of this head; returns the
        last chunk of the run c, c + 1, ... found flagged. FLAG_BATCH flags are read at once
        (relaxed loads, one round trip) and one fence then orders the tile loads (async proxy)
        after them: one acquire per chunk costs a round trip to L2 each, more than a K2 step.
        A flag that never comes (K1 not running) fails the launch after WAIT_LIMIT_NS."""
        last = c - 1
        since = cute.arch.globaltimer()
        while last < c:
            run = cutlass.Int32(1)
            for i in cutlass.range_constexpr(FLAG_BATCH):
                j = cutlass.min(c + i, nch - 1)
                f = cute.arch.load(mFlags.iterator + (chunk0 + j) * nh + h, cutlass.Int32,
                                   sem="relaxed", scope="gpu")
                if f == 0:
                    run = cutlass.Int32(0)
                last = last + run
            if last < c:
                if cute.arch.globaltimer() - since > WAIT_LIMIT_NS:
                    trap()
        cute.arch.fence_acq_rel_gpu()
        cute.arch.fence_proxy("async.global")
        return last

    @cute.jit
    def _consume(self, pipe, tiles: Tiles, l_slab, out: Out, states: States, modes: StateModes,
                 mmas: Mmas, place, offsets: Offsets, seqs, ready, tables, idx,
                 ckpt: Checkpoints, runs: Runs, nh):
        """The math warpgroup: every chunk of this CTA's rows, state in registers. `place` is
        (thread, warp, head, V-block); `seqs` (z, num_seqs, nz, step): the rows z, z + nz, ...
        below num_seqs, a row's tokens at cu_seqlens[step * row]; `tables` and `idx` the pool
        form's (StateSlots)."""
        sKg, sQg, sKdh, sKdl, sAwh, sAwl, sMqh, sMql, sGl, sV, sO, sCk = tiles
        mOut, store_o = out.out, (out.tma_o, out.o)
        mS0f, mS0h, mS1f, mS1h = states.s0f, states.s0h, states.s1f, states.s1h
        state_in, state_out = modes.state_in, modes.state_out
        mma_p, mma_q, mma_s = mmas.p, mmas.q, mmas.s
        tidx, warp, h, vb = place
        mCuSeq = offsets.cu_seqlens
        side = runs.side
        C, K, BV = self.C, self.K, self.BV
        v0 = vb * BV
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        thr_p = mma_p.get_slice(tidx)
        thr_q = mma_q.get_slice(tidx)
        thr_s = mma_s.get_slice(tidx)
        # B operands: smem descriptors per stage, (MMA, N, k-blocks, stages)
        bKg = mma_q.make_fragment_B(thr_q.partition_B(sKg))
        bQg = mma_q.make_fragment_B(thr_q.partition_B(sQg))
        bAwh = mma_p.make_fragment_B(thr_p.partition_B(sAwh))
        bAwl = mma_p.make_fragment_B(thr_p.partition_B(sAwl))
        bMqh = mma_p.make_fragment_B(thr_p.partition_B(sMqh))
        bMql = mma_p.make_fragment_B(thr_p.partition_B(sMql))
        bKdh = mma_s.make_fragment_B(thr_s.partition_B(sKdh))
        bKdl = mma_s.make_fragment_B(thr_s.partition_B(sKdl))
        # accumulators and the (row, column) each of their elements holds
        acc_s = cute.make_rmem_tensor(thr_s.partition_shape_C((BV, K)), f32)
        acc_p = cute.make_rmem_tensor(thr_p.partition_shape_C((BV, C)), f32)
        acc_o = cute.make_rmem_tensor(thr_p.partition_shape_C((BV, C)), f32)
        acc_u = cute.make_rmem_tensor(thr_p.partition_shape_C((BV, C)), f32)
        cS = thr_s.partition_C(cute.make_identity_tensor((BV, K)))
        cP = thr_p.partition_C(cute.make_identity_tensor((BV, C)))
        # A operands in registers: views of the accumulators, converted to bf16
        vS, vW, vU = acc_as_operand_a(acc_s), acc_as_operand_a(acc_p), acc_as_operand_a(acc_u)
        aS = thr_q.make_fragment_A(thr_q.partition_shape_A((BV, K // self.nsplit)))
        gl_r = cute.make_rmem_tensor_like(acc_s, f32)  # per element; equal d's share registers
        aWh = cute.make_rmem_tensor_like(vW, self.op)
        aWl = cute.make_rmem_tensor_like(vW, bf16)
        aUh = cute.make_rmem_tensor_like(vU, self.op)
        aUl = cute.make_rmem_tensor_like(vU, bf16)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        z, num_seqs, nz, step = seqs
        mCuChunk = offsets.cu_chunks
        mRIdx, mWIdx, mHasInit, mErr = tables
        mCkAt, mCkTo, mCkF, mCkH, mCkS, ck_rows, ck_dtype = ckpt.values()
        mFix, fix_on = runs.fix, runs.fix_on
        lane = cute.arch.lane_idx()
        # the rescale builds: the state scaled row by row (sig: the thread's two rows' powers
        # of two, then their inverses; _rescale)
        sig = cute.make_rmem_tensor((4,), f32) if self.rescale else None
        # the side run stores no output (its partial chunks' outputs are the forward's)
        keep = 1 - side
        if cutlass.const_expr(self.checkpoints):
            keep = 1 - (side & 1)  # (side 2: a main run, its grids shifted)
        for seq in cutlass.range(z, num_seqs, nz):
            bos = mCuSeq[seq * step]
            eos = mCuSeq[seq * step + 1]
            vs = bos  # the token the row's chunk grid starts at (_grid)
            if cutlass.const_expr(self.checkpoints):
                _, vs = self._grid(mCuChunk, seq, bos, side)
            # the rows of the state read and written; a padding row neither reads nor writes,
            # runs no chunk (the producer loads none) and its outputs are zeros
            live, rs, ws, init = self._slots(mRIdx, mWIdx, mHasInit, mErr, seq, idx,
                                             cutlass.Int32(0))
            # mine: this warp's rows are to be written (all but a rescale build's unflagged)
            mine = cutlass.Int32(1)
            if cutlass.const_expr(self.rescale):
                # only the items a warp of overflowed, and of those only the warps' rows that
                # did (the rest were written: their state rows read here are not the initial)
                anyf, mine = self._fixes(mFix, seq, nh, h, vb, warp)
                live = live * anyf
                sig.fill(1.0)
            num_chunks = (eos - vs + C - 1) // C * live
            if cutlass.const_expr(self.outputs and not self.rescale):
                if cutlass.const_expr(self.checkpoints):
                    if live == 0 and keep != 0:
                        self._zero_rows(mOut, bos, eos, h, v0, tidx, self.mma_threads)
                else:
                    if live == 0 and side == 0:
                        self._zero_rows(mOut, bos, eos, h, v0, tidx, self.mma_threads)
            s_in = state_in
            if live == 0 or init == 0:
                s_in = cutlass.Int32(0)
            # ---- initial state -> accumulator registers (one branch, then every load at once) ---
            if s_in == STATE_F32:
                acc_s.store(thr_s.partition_C(self._state_rows(mS0f, rs, h, vb)).load())
            elif s_in == STATE_BF16:
                acc_s.store(thr_s.partition_C(self._state_rows(mS0h, rs, h, vb)).load().to(f32))
            else:
                acc_s.fill(0.0)
            # the sequence's checkpoints: the next one's chunk count (-1: none) and destination,
            # the one after it (read a checkpoint ahead, so no table load waits at a store),
            # and the table entry to read next; the ck_lanes builds: the due one's index k in
            # the row, its chunk count and destination, the row's entries k - k % 32 + lane
            # and + 32 one a lane (read 32 checkpoints ahead), and the row's first entry
            m1 = cutlass.Int32(-1)
            zero = cutlass.Int32(0)
            if cutlass.const_expr(self.ck_lanes):
                ck = (zero, m1, zero, m1, zero, m1, zero, zero)
            else:
                ck = (cutlass.Int32(seq * ck_rows + 2), m1, zero, m1, zero)
            if cutlass.const_expr(self.checkpoints):
                if ck_rows * live != 0:
                    e0 = seq * ck_rows
                    if cutlass.const_expr(self.ck_lanes):
                        a0, t0 = self._ck_lanes(mCkAt, mCkTo, e0, zero, ck_rows, lane)
                        a1, t1 = self._ck_lanes(mCkAt, mCkTo, e0, cutlass.Int32(32), ck_rows,
                                                lane)
                        ck = (zero, cute.arch.shuffle_sync(a0, 0), cute.arch.shuffle_sync(t0, 0),
                              a0, t0, a1, t1, e0)
                    else:
                        ck = (e0 + 2, mCkAt[e0], mCkTo[e0], mCkAt[e0 + 1], mCkTo[e0 + 1])
                    if ck[1] == 0:
                        ck = self._checkpoints(ckpt, ck, cutlass.Int32(0), acc_s, cS, sCk, h,
                                               vb, warp, sig, mine, cutlass.Boolean(False))

            # the chunks run between checkpoints (one run without): the chunk loop itself
            # carries no checkpoint test
            c0 = cutlass.Int32(0)
            # (self.defer) a checkpoint due at the next chunk's products: its destination and
            # whether the newest bulk group is the previous chunk's output store
            pend = cutlass.Int32(0)
            pto = cutlass.Int32(0)
            pheld = cutlass.Boolean(False)
            # whether the chunk's stage was found full (and, WY, ready) by the test after the
            # previous chunk's update was issued: its blocking waits are then skipped. The
            # checkpoints builds carry the test across a checkpoint (a phase found complete
            # stays so until this consumer releases the stage), so the run after one does not
            # wait on barriers the last chunk before it found complete
            full_tok = cutlass.Boolean(False)
            ready_tok = cutlass.Boolean(False)
            while c0 < num_chunks:
                stop = num_chunks
                if ck[1] > c0:
                    stop = cutlass.min(ck[1], num_chunks)
                if cutlass.const_expr(not self.checkpoints):
                    full_tok = cutlass.Boolean(False)
                    ready_tok = cutlass.Boolean(False)
                # (self.carry: the chunk's first token, the tokens left from it and the output
                # buffer carried from chunk to chunk)
                t_run = vs + c0 * C - C
                r_run = eos - t_run
                b_run = (c0 & 1) ^ 1
                for c in cutlass.range(c0, stop):
                    if cutlass.const_expr(self.carry):
                        t_run = t_run + C
                        r_run = r_run - C
                        b_run = b_run ^ 1
                    if cutlass.const_expr(self.early):
                        pipe.consumer_wait(state, full_tok)
                    else:
                        pipe.consumer_wait(state)
                    s = state.index
                    if cutlass.const_expr(self.wy):
                        if cutlass.const_expr(self.early):
                            if not ready_tok:
                                cute.arch.mbarrier_wait(ready + s, state.phase)
                        else:
                            cute.arch.mbarrier_wait(ready + s, state.phase)
                    if cutlass.const_expr(self.checkpoints):
                        # the chunk [a, a + C) of the row's grid, cut to the row
                        if cutlass.const_expr(self.carry):
                            t0, length = self._extent(bos, t_run, r_run)
                        else:
                            a = vs + c * C
                            t0, length = self._extent(bos, a, eos - a)
                    else:
                        if cutlass.const_expr(self.carry):
                            t0 = t_run
                            rem = r_run
                        else:
                            t0 = bos + c * C
                            rem = eos - t0
                        length = cutlass.min(C, rem)
                    out_len = length * keep  # the tokens whose outputs are stored
                    if cutlass.const_expr(self.rescale):
                        out_len = out_len * mine

                    pending = None
                    if cutlass.const_expr(self.defer):
                        pending = (pend, pto, pheld, ckpt, sCk, h, vb, warp)
                    if cutlass.const_expr(self.wy):
                        # the WY form: the producer turned kg's tile into kgw = -Aw kg
                        self._chunk_wy(mma_p, acc_s, acc_p, acc_o, acc_u, vS, vW, vU, aS, gl_r,
                                       (aWh, aWl, aUh, aUl), (bKg, bQg, bAwh), sGl, sV, cS, cP, s,
                                       length, pending)
                    else:
                        self._chunk_pw((mma_p, mma_q), acc_s, acc_p, acc_o, acc_u, vS, vW, vU,
                                       aS, gl_r, (aWh, aWl, aUh, aUl), (bKg, bQg, bAwh, bAwl),
                                       sGl, sV, cS, cP, s, length, sig, pending)

                    if cutlass.const_expr(self.defer):
                        pend = cutlass.Int32(0)
                    # ---- O^T = Pq + U^T Mq^T -----------------------------------------------------
                    # (WY form: U^T Mq^T into acc_p, added to Pq at the store: Pq may still be in
                    # flight, and a product accumulating onto it would make ptxas wait for it here)
                    if cutlass.const_expr(self.outputs):
                        self._product(mma_p, acc_p if self.wy else acc_o, aUh, aUl,
                                      bMqh[None, None, None, s], bMql[None, None, None, s], self.wy)
                        warpgroup.commit_group()

                    # ---- S = S diag(gl) + U^T kd -------------------------------------------------
                    self._product(mma_s, acc_s, aUh, aUl, bKdh[None, None, None, s],
                                  bKdl[None, None, None, s], False)
                    warpgroup.commit_group()
                    # the next stage's barriers tested (not waited on) while the update runs:
                    # the two waits at a chunk's start otherwise stall one after the other
                    if cutlass.const_expr(self.early):
                        nxt = state.clone()
                        nxt.advance()
                        full_tok = pipe.sync_object_full.test_wait(nxt.index, nxt.phase)
                        if cutlass.const_expr(self.wy):
                            ready_tok = cute.arch.mbarrier_test_wait(ready + nxt.index,
                                                                     nxt.phase)

                    if cutlass.const_expr(self.outputs):
                        # O done; the update runs on while the output is stored
                        warpgroup.wait_group(1)
                        if out_len == C:
                            # whole chunk: each warp its 16 rows, through its slab of smem buffer
                            # c % 2 and one TMA store (no barrier across the warpgroup); c & 1,
                            # not c % 2: a run's first chunk c0 is not known non-negative, and a
                            # signed remainder put a branch on the chain (the checkpoints builds)
                            if cutlass.const_expr(self.carry):
                                b = b_run
                            else:
                                b = c & 1
                            # the earlier stores have read their buffers: in the checkpoints
                            # builds all but the newest group (buffer b's last store is older
                            # than it: the chunk before's store, or a checkpoint's after it,
                            # whose slab the next checkpoint waits on), so the chunk after a
                            # checkpoint does not wait for the checkpoint's store to read it
                            cute.arch.cp_async_bulk_wait_group(
                                1 if self.checkpoints else 0, read=True)
                            cute.arch.sync_warp()
                            for e in cutlass.range_constexpr(cute.size(acc_o)):
                                r, i = cP[e]
                                sO[i, r, b] = self._out(acc_o, acc_p, e, sig).to(bf16)
                            cute.arch.fence_proxy("async.shared", space="cta")
                            cute.arch.sync_warp()
                            slab = cute.make_tensor(sO.iterator + b * C * BV + warp * C * 16,
                                                    l_slab)
                            self._tile_store(store_o[0], store_o[1], slab,
                                             (t0, h * self.V + v0 + warp * 16), (C, 16))
                            cute.arch.cp_async_bulk_commit_group()
                        else:
                            for e in cutlass.range_constexpr(cute.size(acc_o)):
                                r, i = cP[e]
                                if i < out_len:
                                    mOut[t0 + i, h, v0 + r] = self._out(
                                        acc_o, acc_p, e, sig).to(bf16)
                    warpgroup.wait_group(0)
                    pipe.consumer_release(state)
                    state.advance()
                c0 = stop
                if cutlass.const_expr(self.checkpoints):
                    if ck[1] == c0:
                        # the run's last chunk stored its output whole (a bulk group younger
                        # than the slab's last store; read by the tensor-map builds only, never
                        # a rescale build)
                        a_end = vs + (c0 - 1) * C
                        held = self._extent(bos, a_end, eos - a_end)[1] * keep
                        if cutlass.const_expr(self.defer):
                            if (c0 < num_chunks and ck[3] != c0 and ck[2] >= 0
                                    and ck_dtype == STATE_BF16):
                                # exactly one due, bf16, and more chunks follow: stored by
                                # the next chunk, beside its first products (_ck_pending)
                                pend = cutlass.Int32(1)
                                pto = ck[2]
                                pheld = held == C
                                ck = self._ck_next(ckpt, ck)
                            else:
                                ck = self._checkpoints(ckpt, ck, c0, acc_s, cS, sCk, h, vb, warp,
                                                       sig, mine, held == C)
                        else:
                            ck = self._checkpoints(ckpt, ck, c0, acc_s, cS, sCk, h, vb, warp,
                                                   sig, mine, held == C)

            cute.arch.cp_async_bulk_wait_group(0, read=True)  # smem outlives every warp's stores

            # ---- final state ------------------------------------------------------------------
            # a non-finite state (an fp16 operand overflowed, or the inputs held inf or NaN:
            # either leaves inf or NaN in the state for good) is never passed on silently: the
            # sum of the magnitudes of the thread's entries is inf or NaN iff one of them is
            # (the rescale builds': of its scaled state, whose sum stays in range)
            entries = []
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                entries.append(cute.math.absf(acc_s[e]))
            total = _tree(entries, lambda a, b: a + b)
            bad = (f32_bits(total) >> 23) & 255 == 255
            if cutlass.const_expr(self.rescale):
                self._scale_rows(acc_s, sig[2], sig[3])  # the row scales undone
            s_out = state_out
            if live == 0:
                s_out = cutlass.Int32(0)
            if cutlass.const_expr(self.rescale):
                if mine == 0:
                    s_out = cutlass.Int32(0)
                elif bad:
                    mErr[E_NONFINITE] = cutlass.Int32(1)  # rescaled and still non-finite
            else:
                if fix_on != 0:
                    # the rescale run redoes the warp's rows where their state turned
                    # non-finite, or all but vanished (every thread's mean |S| under fp16's
                    # least normal, not all zero: the fp16 operands ran on subnormals); the
                    # state stays unwritten (the initial one, which that run reads) and the
                    # warp's word says so (every sequence's words written: none needs zeroing)
                    tiny = cutlass.Int32(cute.arch.vote_all_sync(
                        total < cutlass.Float32(TINY * cute.size(acc_s))))
                    some = cutlass.Int32(cute.arch.vote_any_sync(total > cutlass.Float32(0.0)))
                    badw = cutlass.Int32(cute.arch.vote_any_sync(bad)) | (tiny & some)
                    if lane == 0:
                        mFix[self._fix_base(seq, nh, h, vb) + warp] = badw
                    if badw != 0:
                        s_out = cutlass.Int32(0)
                elif bad:
                    mErr[E_NONFINITE] = cutlass.Int32(1)
            if s_out == STATE_F32:
                thr_s.partition_C(self._state_rows(mS1f, ws, h, vb)).store(acc_s.load())
            elif s_out == STATE_BF16:
                thr_s.partition_C(self._state_rows(mS1h, ws, h, vb)).store(acc_s.load().to(bf16))

    @cute.jit
    def _checkpoints(self, ckpt, ck, done, acc_s, cS, sCk, h, vb, warp, sig, mine, held):
        """Store S (after `done` chunks) for every checkpoint due: into its destination row
        (fp32 or bf16: ck_dtype) or, for a code < 0, scratch row -code - 1 in fp32 (a mid-chunk
        checkpoint, finished by the side run). Each warp writes its 16 rows to its smem slab
        and hands them to the TMA unit: one tensor store a warp whose box spans the padded
        rows (ck_maps: K <= 128, its columns past K out of bounds and not written), or lane
        16 a bulk copy a row; the stores drain while the chunks run on, and the slab is
        reused once they have read it (the warp waits on them there, and at the next
        whole-chunk output store, by then long done). ck = (next entry to read, the due one's
        chunk count and code, the following one's; the ck_lanes builds': the due entry's
        index in the row, its chunk count and code, the lanes' two sets of 32 entries, the
        row's first entry); returns it moved on past the stores. The
        rescale builds store S with its row scales (sig) undone, and only the warps whose
        rows they redo (mine)."""
        mCkAt, mCkTo, mCkF, mCkH, mCkS, ck_rows, ck_dtype = ckpt.values()
        if cutlass.const_expr(self.ck_lanes):
            k, at, to, a0, t0, a1, t1, e0 = ck
        else:
            e, at, to, nat, nto = ck
        lane = cute.arch.lane_idx()
        while at == done:
            self._ck_store(ckpt, to, acc_s, cS, sCk, h, vb, warp, sig, mine, held)
            held = cutlass.Boolean(False)
            if cutlass.const_expr(self.ck_lanes):
                # the next entry from its lane; every 32 the lanes' next 32 move up and the 32
                # after them are read
                k = k + 1
                i = k & 31
                if i == 0:
                    a0, t0 = a1, t1
                    a1, t1 = self._ck_lanes(mCkAt, mCkTo, e0, k + 32, ck_rows, lane)
                at = cute.arch.shuffle_sync(a0, i)
                to = cute.arch.shuffle_sync(t0, i)
            else:
                at = nat
                to = nto
                nat = mCkAt[e]
                nto = mCkTo[e]
                e = e + 1
        if cutlass.const_expr(self.ck_lanes):
            return k, at, to, a0, t0, a1, t1, e0
        return e, at, to, nat, nto

    @cute.jit
    def _ck_pending(self, acc_s, cS, pending):
        """The checkpoint a run's end left pending (self.defer): S, still the state at the
        checkpoint, to its destination's slab and store (one entry: _ck_store)."""
        pend, pto, pheld, ckpt, sCk, h, vb, warp = pending
        if pend != 0:
            self._ck_store(ckpt, pto, acc_s, cS, sCk, h, vb, warp, None, cutlass.Int32(1),
                           pheld)

    @cute.jit
    def _ck_store(self, ckpt, to, acc_s, cS, sCk, h, vb, warp, sig, mine, held):
        """One checkpoint entry's store of S into destination `to` (_checkpoints): the warp's
        rows to its slab once the slab's last stores have read it (held: the newest bulk
        group is the previous chunk's whole output store, younger than them, and is not
        waited for), then one tensor store (ck_maps) or lane 16's row copies."""
        mCkAt, mCkTo, mCkF, mCkH, mCkS, ck_rows, ck_dtype = ckpt.values()
        K = self.K
        lane = cute.arch.lane_idx()
        lo = cutlass.Int32(16)  # the lane that stores (none: a warp the run does not redo)
        if cutlass.const_expr(self.rescale):
            if mine == 0:
                lo = cutlass.Int32(32)
        r0 = warp * 16
        base = sCk.iterator + r0 * (K + CK_PAD)
        slab = cute.make_tensor(base, cute.make_layout((16, K), stride=(K + CK_PAD, 1)))
        slab_h = cute.make_tensor(cute.recast_ptr(base, dtype=cutlass.BFloat16),
                                  cute.make_layout((16, K), stride=(K + 2 * CK_PAD, 1)))
        half = cutlass.Int32(0)
        if to >= 0:
            if ck_dtype == STATE_BF16:
                half = cutlass.Int32(1)
        if cutlass.const_expr(self.ck_maps):
            if held:
                cute.arch.cp_async_bulk_wait_group(1, read=True)
            else:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        elif lane == 16:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.sync_warp()
        if half != 0:
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                r, d = cS[i]
                slab_h[r - r0, d] = self._unscaled(acc_s, i, sig).to(cutlass.BFloat16)
        else:
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                r, d = cS[i]
                slab[r - r0, d] = self._unscaled(acc_s, i, sig)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        if cutlass.const_expr(self.ck_maps):
            # one tensor store a warp: rows h V + vb BV + r0 .. + 15 of [rows, H*V, K]
            row = h * self.V + vb * self.BV + r0
            if to < 0:
                self._slab_store(mCkS, base, CK_PAD, cutlass.Float32, (-to - 1, row, 0))
            elif half != 0:
                self._slab_store(mCkH, base, 2 * CK_PAD, cutlass.BFloat16, (to, row, 0))
            else:
                self._slab_store(mCkF, base, CK_PAD, cutlass.Float32, (to, row, 0))
            cute.arch.cp_async_bulk_commit_group()
        elif lane == lo:
            # one lane issues the 16 row copies, its addresses uniform: copies issued from
            # 16 lanes at once run one lane at a time through a loop of uniform-register
            # moves
            if to < 0:
                g = self._state_rows(mCkS, -to - 1, h, vb)[r0, None].iterator.toint()
                for i in cutlass.range_constexpr(16):
                    bulk_store(g + i * K * 4, slab[i, None].iterator.toint(), K * 4)
            elif half != 0:
                g = self._state_rows(mCkH, to, h, vb)[r0, None].iterator.toint()
                for i in cutlass.range_constexpr(16):
                    bulk_store(g + i * K * 2, slab_h[i, None].iterator.toint(), K * 2)
            else:
                g = self._state_rows(mCkF, to, h, vb)[r0, None].iterator.toint()
                for i in cutlass.range_constexpr(16):
                    bulk_store(g + i * K * 4, slab[i, None].iterator.toint(), K * 4)
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def _ck_next(self, ckpt, ck):
        """The checkpoint table moved on past the due entry (not the ck_lanes builds)."""
        mCkAt, mCkTo = ckpt.at, ckpt.to
        e, at, to, nat, nto = ck
        return e + 1, nat, nto, mCkAt[e], mCkTo[e]

    @cute.jit
    def _ck_lanes(self, mCkAt: cute.Tensor, mCkTo: cute.Tensor, e0, j, ck_rows, lane):
        """Entry j + lane of the checkpoint row at e0 (chunk count, destination), one a lane;
        -1 and 0 past the row's ck_rows entries."""
        a = cutlass.Int32(-1)
        t = cutlass.Int32(0)
        if j + lane < ck_rows:
            a = mCkAt[e0 + j + lane]
            t = mCkTo[e0 + j + lane]
        return a, t

    def _ck_slab(self, pad: int):
        """A warp's checkpoint slab as a TMA box (specs.recur.ck_slab_box, outermost first: 1
        destination row, 16 state rows, K + pad elements) and its dense smem layout (the rows
        padded by `pad`)."""
        tile = tuple(reversed(ck_slab_box(self.K, pad)))
        return tile, cute.make_layout(tile, stride=(16 * (self.K + pad), self.K + pad, 1))

    @cute.jit
    def _slab_store(self, dest, base, pad: cutlass.Constexpr, dtype, coord):
        """A warp's padded slab (16 rows of K + pad elements of `dtype` at smem `base`) to
        rows coord[1] .. + 15 of destination row coord[0] by its tensor map `dest` (atom,
        coordinate tensor): one TMA store; the columns past K fall outside the map."""
        tile, layout = self._ck_slab(pad)
        self._tile_store(dest[0], dest[1], cute.make_tensor(cute.recast_ptr(base, dtype=dtype),
                                                            layout), coord, tile)

    def _out(self, acc_o, acc_p, e, sig):
        """Output element e: Pq + U^T Mq^T, summed in acc_o or (WY form) across acc_o and acc_p;
        the rescale builds' with its row's scale undone."""
        if self.wy:
            return acc_o[e] + acc_p[e]
        return self._unscaled(acc_o, e, sig)

    def _unscaled(self, acc, e, sig):
        """Element e of an accumulator (rows of the state: S, O, P, U), the rescale builds'
        times its row's 1 / sigma (exact: a power of two)."""
        if self.rescale:
            return acc[e] * sig[2 + (e // 2) % 2]
        return acc[e]

    @cute.jit
    def _fix_base(self, seq, nh, h, vb):
        """The first of the four rescale words of (sequence, head, block of state rows)."""
        return ((seq * nh + h) * (self.V // self.BV) + vb) * 4

    @cute.jit
    def _fixes(self, mFix: cute.Tensor, seq, nh, h, vb, warp=None):
        """The rescale run's (any warp of the item flagged, warp `warp`'s word): words of 0 or
        1, written by the forward's K2 at the sequence's end."""
        b = self._fix_base(seq, nh, h, vb)
        w = (mFix[b], mFix[b + 1], mFix[b + 2], mFix[b + 3])
        mine = cutlass.Int32(0)
        if cutlass.const_expr(warp is not None):
            mine = mFix[b + warp]
        return (w[0] | w[1]) | (w[2] | w[3]), mine

    @cute.jit
    def _any_fixed(self, mFix: cute.Tensor, z, num_seqs, nz, nh, h, vb, tidx):
        """1 in every thread if any rescale word of the CTA's sequences z, z + nz, ... is set:
        the words spread over the threads (one load each, mostly), then one barrier with an
        or-reduction."""
        n = (num_seqs - z + nz - 1) // nz * 4
        acc = cutlass.Int32(0)
        for j in cutlass.range(tidx, n, self.threads):
            acc = acc | mFix[self._fix_base(z + (j // 4) * nz, nh, h, vb) + j % 4]
        return sync_threads_or(acc)

    @cute.jit
    def _rescale(self, acc_s, vR, sig):
        """The rescale builds' row scales, each chunk: the largest |x| of each state row over
        its state (unscaled) and the chunk's values (vR: v^T, fp32) sets the row's power of two
        sigma so that sigma x is in [2^4, 2^5) (the fp16 operands' room: S kg^T adds up K
        such entries, U = Aw W another chunk's); S (kept as sigma S) moves to the new sigma,
        exactly. Clamped to 2^-120 .. 2^120: a zero row stays zero, inf or NaN stay."""
        i32 = cutlass.Int32

        def mag(x):
            return bits_f32(f32_bits(x) & 0x7FFFFFFF)

        for r in cutlass.range_constexpr(2):
            m_s = _tree([mag(acc_s[e]) for e in range(cute.size(acc_s)) if (e // 2) % 2 == r],
                        cute.arch.fmax)
            m_v = _tree([mag(vR[e]) for e in range(cute.size(vR)) if (e // 2) % 2 == r],
                        cute.arch.fmax)
            y = cute.arch.fmax(m_s * sig[2 + r], m_v)
            # the four lanes of a row (lanes 4j .. 4j + 3) hold its columns
            y = cute.arch.fmax(y, cute.arch.shuffle_sync_bfly(y, offset=1))
            y = cute.arch.fmax(y, cute.arch.shuffle_sync_bfly(y, offset=2))
            k = i32(131) - ((f32_bits(y) >> 23) & 255)
            k = cutlass.max(cutlass.min(k, i32(120)), i32(-120))
            new = bits_f32((127 + k) << 23)
            old = sig[2 + r]
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                if cutlass.const_expr((e // 2) % 2 == r):
                    acc_s[e] = acc_s[e] * old * new
            sig[r] = new
            sig[2 + r] = bits_f32((127 - k) << 23)

    @cute.jit
    def _decay_factors(self, acc_s, gl_r, sGl, cS, s):
        """With S in one slab: the decay factor of each state element into registers before
        the chunk's products, so their smem latency hides behind them (equal columns share)."""
        if cutlass.const_expr(self.nsplit == 1):
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                _, d = cS[e]
                gl_r[e] = sGl[0, d, s]

    @cute.jit
    def _state_slab(self, aS, vS, part):
        """Slab `part` of S (self.nsplit slabs) as P's and Pq's A operand: an fp16 copy, so S
        stays writable."""
        kb_slab = cute.size(aS, mode=[2])
        for kb in cutlass.range_constexpr(kb_slab):
            aS[None, None, kb].store(
                vS[None, None, part * kb_slab + kb].load().to(cutlass.Float16))

    @cute.jit
    def _row_scales(self, acc_s):
        """The precise builds' per-row powers of two for S's fp16 copy: (sigma, 1 / sigma) for
        each of the thread's two rows (accumulator elements e with (e // 2) % 2 = 0, 1: rows r
        and r + 8 of the warp's 16), sigma putting the row's largest |S| in [2^13, 2^15) (inside
        fp16's range, every scaled product exact to undo), at most 2^60 for a zero row. The
        maxima on bf16 pairs (one packed max a pair of pairs, a tree per row: half the
        instructions of fp32 ones); bf16's rounding moves a maximum's exponent up by one at
        most, never down, so the scaled row stays below 2^15."""
        f32, i32 = cutlass.Float32, cutlass.Int32
        n = cute.size(acc_s)
        # element pairs (e, e + 1) share a row: leaves per row, then a tree
        leaves = [[], []]
        for e in cutlass.range_constexpr(0, n, 2):
            leaves[(e // 2) % 2].append(pack_bf16x2(acc_s[e], acc_s[e + 1]))
        m = []
        for r in cutlass.range_constexpr(2):
            w = _tree(leaves[r], absmax_bf16x2) & 0x7FFF7FFF  # the magnitudes
            m.append(cute.arch.fmax(bf16x2_lo(w), bf16x2_hi(w)))
        out = cute.make_rmem_tensor((4,), f32)
        for r in cutlass.range_constexpr(2):
            y = m[r]
            # the four lanes of a row (lanes 4j .. 4j + 3) hold its columns
            y = cute.arch.fmax(y, cute.arch.shuffle_sync_bfly(y, offset=1))
            y = cute.arch.fmax(y, cute.arch.shuffle_sync_bfly(y, offset=2))
            k = i32(141) - ((f32_bits(y) >> 23) & 255)
            k = cutlass.max(cutlass.min(k, i32(60)), i32(-100))
            out[r] = bits_f32((127 + k) << 23)
            out[2 + r] = bits_f32((127 - k) << 23)
        return out

    @cute.jit
    def _scale_rows(self, acc, s0, s1):
        """acc's elements of the thread's first row times s0, of its second times s1."""
        for e in cutlass.range_constexpr(cute.size(acc)):
            if cutlass.const_expr((e // 2) % 2 == 0):
                acc[e] = acc[e] * s0
            else:
                acc[e] = acc[e] * s1

    @cute.jit
    def _decay_state(self, acc_s, gl_r, sGl, cS, s, rows=None):
        """S diag(gl): factors from registers (one slab: _decay_factors) or from smem; `rows`
        (the precise builds): S was scaled by _row_scales' sigma, undone here (exactly)."""
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            _, d = cS[e]
            x = acc_s[e]
            if cutlass.const_expr(rows is not None):
                x = x * rows[2 + (e // 2) % 2]
            if cutlass.const_expr(self.nsplit == 1):
                acc_s[e] = x * gl_r[e]
            else:
                acc_s[e] = x * sGl[0, d, s]

    @cute.jit
    def _chunk_pw(self, mmas, acc_s, acc_p, acc_o, acc_u, vS, vW, vU, aS,
                    gl_r, regs, smem_b, sGl, sV, cS, cP, s, length, sig, pending=None):
        """A chunk up to U: P = S kg^T, W^T = v^T - P, U^T = W^T Aw^T (hi/lo products, or
        fp16 ones for cfg.f16; P and Pq on fp16 operands either way, the precise builds' S
        scaled per row into fp16's range: _row_scales; the rescale builds' whole state and values:
        _rescale). Leaves what _chunk_wy leaves."""
        K = self.K
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        mma_p, mma_q = mmas
        aWh, aWl, aUh, aUl = regs
        bKg, bQg, bAwh, bAwl = smem_b
        nsplit = self.nsplit
        kb_slab = K // 16 // nsplit
        vR = None
        if cutlass.const_expr(self.rescale):
            # v^T first (tokens past the length zero): its rows' scales move S before P
            vR = cute.make_rmem_tensor_like(acc_p, f32)
            self._values_t(vR, sV, cP, s, length)
            self._rescale(acc_s, vR, sig)
        # ---- P = S kg^T, Pq = S qg^T (A: an fp16 copy of S, so S stays writable) ---------
        self._decay_factors(acc_s, gl_r, sGl, cS, s)
        rows = None
        if cutlass.const_expr(not self.f16):
            rows = self._row_scales(acc_s)
            self._scale_rows(acc_s, rows[0], rows[1])  # undone by _decay_state
        for part in cutlass.range_constexpr(nsplit):
            if part > 0:
                warpgroup.wait_group(0)  # the previous slab's products still read aS
            self._state_slab(aS, vS, part)
            self._gemm(mma_q, acc_p, aS, bKg[None, None, None, s], part == 0,
                       part * kb_slab)
            warpgroup.commit_group()
            if cutlass.const_expr(self.outputs):
                self._gemm(mma_q, acc_o, aS, bQg[None, None, None, s], part == 0,
                           part * kb_slab)
                warpgroup.commit_group()
        if cutlass.const_expr(pending is not None):
            self._ck_pending(acc_s, cS, pending)  # S not written before _decay_state
        # while they run: this thread's v^T entries (widened after the wait, so the
        # loads' latency hides behind the products)
        vT = cute.make_rmem_tensor_like(acc_p, bf16)
        if cutlass.const_expr(not self.rescale):
            for e in cutlass.range_constexpr(cute.size(acc_p)):
                r, i = cP[e]
                vT[e] = sV[i, r, s]
        warpgroup.wait_group(1 if self.outputs else 0)

        # ---- W^T = v^T - P; tokens past the chunk's length are zero ---------------
        for e in cutlass.range_constexpr(cute.size(acc_p)):
            _, i = cP[e]
            w = f32(0.0)
            p = acc_p[e]
            if cutlass.const_expr(not self.f16):
                p = p * rows[2 + (e // 2) % 2]
            if i < length:
                if cutlass.const_expr(self.rescale):
                    w = vR[e] * sig[(e // 2) % 2] - p
                else:
                    w = vT[e].to(f32) - p
            acc_p[e] = w
        self._operand(vW, aWh, aWl)

        # ---- U^T = W^T Aw^T --------------------------------------------------------
        self._product(mma_p, acc_u, aWh, aWl, bAwh[None, None, None, s],
                      bAwl[None, None, None, s], True)
        warpgroup.commit_group()
        # S diag(gl) (the row scales undone), while the products run
        self._decay_state(acc_s, gl_r, sGl, cS, s, rows)
        warpgroup.wait_group(0)
        if cutlass.const_expr(self.outputs and not self.f16):
            self._scale_rows(acc_o, rows[2], rows[3])  # Pq's row scales, before O adds to it
        self._operand(vU, aUh, aUl)  # rows past the length: zero (Aw's are, W's are)

    @cute.jit
    def _chunk_wy(self, mma_p: cute.TiledMma, acc_s, acc_p, acc_o, acc_u, vS, vW, vU, aS,
                  gl_r, regs, smem_b, sGl, sV, cS, cP, s, length, pending=None):
        """A chunk of the fp16 forward up to U, in the WY form: U^T = v^T Aw^T + S kgw^T,
        the producer having turned kg's tile into kgw = -Aw kg. The same U as W^T = v^T - S kg^T,
        U^T = W^T Aw^T, one product round trip shorter: U waits for no P. Leaves acc_u = U^T,
        aUh = fp16(U) (rows past the length zero: Aw's are), S scaled by diag(gl), and Pq =
        S qg^T issued (its group still open) when built with outputs."""
        K = self.K
        aWh, aWl, aUh, aUl = regs
        bKg, bQg, bAwh = smem_b
        nsplit = self.nsplit
        kb_slab = K // 16 // nsplit
        # v^T (tokens past the length zero) as the first product's A operand, and every other
        # register operand, before any product is issued: a register written between two
        # wgmmas in flight makes ptxas wait for them all
        self._values_t(acc_p, sV, cP, s, length)
        self._operand(vW, aWh, aWl)
        self._decay_factors(acc_s, gl_r, sGl, cS, s)
        for part in cutlass.range_constexpr(nsplit):
            if part > 0:
                warpgroup.wait_group(0)  # the previous slab's products still read aS
            self._state_slab(aS, vS, part)
            # U^T (+)= [v^T Aw^T] + S_slab kgw_slab^T: one batch behind one register fence
            mma_p.set(warpgroup.Field.ACCUMULATE, part > 0)
            warpgroup.fence()
            if cutlass.const_expr(part == 0):
                cute.gemm(mma_p, acc_u, aWh[None, None, 0], bAwh[None, None, 0, s], acc_u)
                mma_p.set(warpgroup.Field.ACCUMULATE, True)
            for kb in cutlass.range_constexpr(kb_slab):
                cute.gemm(mma_p, acc_u, aS[None, None, kb],
                          bKg[None, None, part * kb_slab + kb, s], acc_u)
            warpgroup.commit_group()
            if cutlass.const_expr(self.outputs):
                self._gemm(mma_p, acc_o, aS, bQg[None, None, None, s], part == 0,
                           part * kb_slab)
                warpgroup.commit_group()
        if cutlass.const_expr(pending is not None):
            self._ck_pending(acc_s, cS, pending)
        self._decay_state(acc_s, gl_r, sGl, cS, s)  # S diag(gl), while the products run
        warpgroup.wait_group(1 if self.outputs else 0)
        self._operand(vU, aUh, aUl)

    @cute.jit
    def _values_t(self, dst, sV, cP, s, length):
        """This thread's v^T entries of stage s into dst (an m64 x chunk fp32 fragment, cP its
        (row, token) coordinates), tokens past the chunk's length zero."""
        for e in cutlass.range_constexpr(cute.size(dst)):
            r, i = cP[e]
            x = cutlass.Float32(0.0)
            if i < length:
                x = sV[i, r, s].to(cutlass.Float32)
            dst[e] = x

    @cute.jit
    def _state_rows(self, m: cute.Tensor, row, h, vb) -> cute.Tensor:
        """State rows vb*BV .. vb*BV + BV - 1 of (state row, head): a (BV, K) tile of m."""
        return cute.local_tile(m[row, h, None, None], (self.BV, self.K), (vb, 0))

    @cute.jit
    def _split(self, acc_view: cute.Tensor, hi: cute.Tensor, lo: cute.Tensor):
        """hi = bf16(x), lo = bf16(x - hi) of an fp32 accumulator (operand-A view)."""
        x = acc_view.load()
        h = x.to(cutlass.BFloat16)
        hi.store(h)
        lo.store((x - h.to(cutlass.Float32)).to(cutlass.BFloat16))

    @cute.jit
    def _operand(self, acc_view: cute.Tensor, hi: cute.Tensor, lo: cute.Tensor):
        """An fp32 accumulator as the next product's A operand: fp16(x) (cfg.f16), or its
        bf16 hi/lo split."""
        if cutlass.const_expr(self.f16):
            hi.store(acc_view.load().to(cutlass.Float16))
        else:
            self._split(acc_view, hi, lo)

    @cute.jit
    def _product(self, mma: cute.TiledMma, acc, rAh, rAl, rBh, rBl,
                 zero_init: cutlass.Constexpr):
        """acc (+)= A B^T: one fp16 product (cfg.f16), or the three-term hi/lo product."""
        if cutlass.const_expr(self.f16):
            self._gemm(mma, acc, rAh, rBh, zero_init)
        else:
            self._gemm_split(mma, acc, rAh, rAl, rBh, rBl, zero_init)

    @cute.jit
    def _gemm_split(self, mma: cute.TiledMma, acc, rAh, rAl, rBh, rBl,
                    zero_init: cutlass.Constexpr):
        """acc (+)= Ah Bh^T + Ah Bl^T + Al Bh^T (the hi/lo product), behind one register fence:
        the three accumulate into one accumulator, so they issue back to back."""
        mma.set(warpgroup.Field.ACCUMULATE, not zero_init)
        warpgroup.fence()
        for rA, rB in ((rAh, rBh), (rAh, rBl), (rAl, rBh)):
            for kb in cutlass.range_constexpr(cute.size(rA, mode=[2])):
                cute.gemm(mma, acc, rA[None, None, kb], rB[None, None, kb], acc)
                mma.set(warpgroup.Field.ACCUMULATE, True)

    @cute.jit
    def _gemm(self, mma: cute.TiledMma, acc, rA, rB, zero_init: cutlass.Constexpr,
              b_offset: cutlass.Constexpr = 0):
        """acc (+)= A B^T over every k-block of A (registers), against B's k-blocks from
        `b_offset` on (smem)."""
        mma.set(warpgroup.Field.ACCUMULATE, not zero_init)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(rA, mode=[2])):
            cute.gemm(mma, acc, rA[None, None, kb], rB[None, None, kb + b_offset], acc)
            mma.set(warpgroup.Field.ACCUMULATE, True)
