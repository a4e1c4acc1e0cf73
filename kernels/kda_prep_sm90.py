"""K1: the token-parallel half of the KDA forward (sm_90a).

One CTA per (chunk, head), heads fastest (grid x). A chunk is `chunk` consecutive tokens of
one sequence, starting at the sequence's first token, so the last chunk of a sequence may be
short; CTAs whose chunk slot holds no tokens (past the last chunk, or between two varlen
sequences: plans.workspace.chunk_slots) exit.

Warp roles: none; all `threads` threads run every phase, separated by CTA barriers.
Pipeline: one mbarrier; one elected thread issues three TMA loads (q, k and g tiles of
`chunk x K` bf16, row-strided, OOB rows zero-filled) and every thread waits on phase 0.
Phases:
  A  L2 norms (block reduction), gate activation, cumulative decay G, and the token-indexed
     outputs qg = scale qn e^G, kg = kn e^G, kd = kn e^(Gl - G), gl = e^Gl.
  B  the chunk matrices L and Mqk. When every |G_i - r| of the chunk is at most 80 (r: G at the
     chunk's middle row; always so for the bounded gate up to chunk 32), they are products of
     the factors (kn_i e^(G_i - r)) and (kn_j e^(r - G_j)), each inside fp32 range, on warp
     MMA (16 x 8 tiles, bf16 hi/lo splits); otherwise (strong unbounded decays) each term takes
     e^(G_i - G_j) from the difference on the CUDA cores, so no factor exceeds 1.
  C  thread per column j: forward substitution for Aw = (I + L)^-1 diag(beta).
The workspace holds whole chunks: chunk b's rows are b*C .. b*C + C - 1, and rows past the
sequence's length are written as zeros (so K2 needs no tail masking of its operands).
Constraints: K % 32 == 0, K <= 256, chunk 16 or 32 (specs.prep.supports).

Three classes, one per form (specs.prep.dsl_class; the class names are the cubins' kernel
symbols):
- KdaPrepSm90Split, the shipped K1 (every ladder forward: bf16 operands, chunk 16): phases A
  and B in column passes of W = max(64, threads / 2) key columns (`_body_passes`), so phase B's
  fp32 operand rows exist for one pass's columns only; at K = 128 it needs 26.5 KB of smem and,
  capped at 64 registers without spilling, runs eight CTAs per SM (docs/notes/k1.md, "K1 in
  column passes"). Its outputs are the tensor-core K2's operands: fp16 qg and kg (|x| <= 1 for
  unit-norm rows: kda_cute.abi.QK_DTYPE), written over the q and k tiles in place (each thread
  rewrites only the columns it read) and sent by TMA stores that overlap phase B and C; kd, Aw
  and Mq as bf16 hi + lo planes (x = hi + lo to ~16 bits) or fp16 single planes (cfg.f16),
  straight from registers to the workspace (a warp writes whole 128-byte row segments of kd);
  fp32 gl.
- KdaPrepSm90OnePass (chunk 32, experimental): the same outputs, phases A and B over all K
  columns at once (`_body`), with no staging tiles for kd, Aw and Mq and phase B's L over the
  g tile (dead after the gates).
- KdaPrepSm90 (the SIMT ladder): the one-pass kernel writing fp32 tensors for the SIMT K2.
"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.nvgpu import warp as warp_mma

from kda_cute.abi import QK_DTYPE
from kda_cute.specs.prep import (
    GATE_BOUNDED,
    GATE_UNBOUNDED,
    K1_GRID_Y,
    PrepConfig,
)
from kernels.common import (
    FACTOR_LIMIT,
    LOG2E,
    Record,
    TileCopy,
    bf16x2,
    gate_param,
    gate_param16,
    gate_param32,
    halves,
    pack_bf16x2,
    tma_meta,
)

# sm_90 per-SM budgets: shared memory (228 KB, 1 KB of it reserved per CTA) and registers
SMEM_PER_SM = 233472
SMEM_PER_CTA_RESERVED = 1024
REGS_PER_SM = 65536


@cute.jit
def flag_unfactorable(big, first, ref, last, lim):
    """big, or 1 where a column's factored forms leave fp32's normal range: the factored
    products take e^(G_i - ref) e^(ref - G_j) and the outputs e^G = e^(G - ref) e^ref, so
    |G - ref| over the chunk (G is monotone: its first and last values bound it) and |ref|
    must stay within lim (FACTOR_LIMIT, in the base the G values are in)."""
    if first - ref > lim:
        big = cutlass.Int32(1)
    if ref - last > lim:
        big = cutlass.Int32(1)
    if last - ref > lim:
        big = cutlass.Int32(1)
    if ref - first > lim:
        big = cutlass.Int32(1)
    if ref > lim:
        big = cutlass.Int32(1)
    if ref < -lim:
        big = cutlass.Int32(1)
    return big


@dataclass
class Loads(Record):
    """K1's TMA loads: (atom, global view) of q, k and g."""
    tma_q: cute.CopyAtom
    q: cute.Tensor
    tma_k: cute.CopyAtom
    k: cute.Tensor
    tma_g: cute.CopyAtom
    g: cute.Tensor

    def pairs(self):
        """(atom, view) of q, k and g, in the order their smem tiles are given."""
        return (self.tma_q, self.q), (self.tma_k, self.k), (self.tma_g, self.g)


@dataclass
class Raw(Record):
    """The per-token beta (T, H) and the gate's parameters: A_log (H,), dt_bias (H*K,)."""
    beta: cute.Tensor
    a_log: cute.Tensor
    dt_bias: cute.Tensor


@dataclass
class Offsets(Record):
    """The checked cu_seqlens and each sequence's first chunk slot (N + 1 each)."""
    cu_seqlens: cute.Tensor
    cu_chunks: cute.Tensor


@dataclass
class Outs(Record):
    """The bf16-operand outputs: qg and kg by TMA store, kd, Aw and Mq as (hi, lo) planes (fp16
    builds: the hi planes alone), gl, and the (chunk, head) flags of a K2 alongside."""
    tma_qg: cute.CopyAtom
    qg: cute.Tensor
    tma_kg: cute.CopyAtom
    kg: cute.Tensor
    kdh: cute.Tensor
    kdl: cute.Tensor
    awh: cute.Tensor
    awl: cute.Tensor
    mqh: cute.Tensor
    mql: cute.Tensor
    gl: cute.Tensor
    flags: cute.Tensor


@dataclass
class F32Outs(Record):
    """The f32-operand outputs (the SIMT K2's): qg, kg, kd (R, H, K), gl, Aw, Mq (R, H, C), and
    the (chunk, head) flags."""
    qg: cute.Tensor
    kg: cute.Tensor
    kd: cute.Tensor
    gl: cute.Tensor
    aw: cute.Tensor
    mq: cute.Tensor
    flags: cute.Tensor


@dataclass
class Batch(Record):
    """num_seqs sequences; seq_len > 0: a fixed-length batch of that length, 0: varlen."""
    num_seqs: cutlass.Int32
    seq_len: cutlass.Int32


@dataclass
class Modes(Record):
    """The run-time scalars: q's scale, the gate's lower bound and form, whether q and k are
    normalised and beta goes through its sigmoid, and how A_log and dt_bias are held."""
    scale: cutlass.Float32
    lower_bound: cutlass.Float32
    gate_mode: cutlass.Int32
    qk_l2norm: cutlass.Int32
    beta_sigmoid: cutlass.Int32
    a_log_dtype: cutlass.Int32
    dt_bias_dtype: cutlass.Int32


class Ids(NamedTuple):
    """This thread's place: thread, warp and lane in the CTA, its head and chunk slot."""
    tidx: cutlass.Int32
    warp: cutlass.Int32
    lane: cutlass.Int32
    h: cutlass.Int32
    bid: cutlass.Int32


class Slot(NamedTuple):
    """A chunk slot: its first token, its valid rows, and the slots' bound (`bid < bound`: the
    slot holds a chunk)."""
    bid: cutlass.Int32
    t0: cutlass.Int32
    length: cutlass.Int32
    bound: cutlass.Int32


class KdaPrepSm90Split(TileCopy):
    """The shipped K1: bf16-operand outputs for the tensor-core K2, chunk 16 in column passes
    (specs.prep.column_passes; the name is its cubins' kernel symbol). qg and kg leave by TMA
    stores from smem tiles; kd, Aw and Mq (hi/lo planes, or fp16 single planes) by the threads,
    straight from registers. Phases A and B run W = max(64, threads / 2) key columns at a time,
    so phase B's fp32 operand rows take C x W floats, not C x K (K = 128: 26.5 KB of smem per CTA
    instead of the one-pass kernel's 37.5)."""

    def __init__(self, cfg: PrepConfig):
        self.cfg = cfg
        self.K = cfg.head_dim_k
        self.C = cfg.chunk
        self.alongside = cfg.alongside  # flag each (chunk, head) once written (K2 alongside)
        self.threads = cfg.threads
        self.num_warps = cfg.threads // 32
        self.io_dtype = cutlass.BFloat16
        # the tensor-core operands K1 writes: bf16 (hi + lo planes for kd, Aw, Mq), or fp16
        # single planes (cfg.f16: the lo planes are not written)
        self.f16 = cfg.f16
        self.out_dtype = cutlass.Float16 if cfg.f16 else cutlass.BFloat16
        # qg and kg: fp16 in every tensor-core build (abi.QK_DTYPE), written in place of the
        # q and k tiles through an fp16 view of their bytes
        self.qk_dtype = cutlass.Float16
        self.split = cfg.operands == "bf16"  # outputs as bf16 (hi + lo planes for kd and Aw)
        # a CTA loops over the chunk slots y, y + grid y, ... (the side run: cfg.looped)
        self.looped = cfg.looped
        self.W = max(64, cfg.threads // 2)  # a column pass's width
        self.RPG = cfg.chunk * self.W // (2 * cfg.threads)  # a row group's rows in a pass
        self.smem_bytes = 0
        self.tma_meta = []

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor,
        mBeta: cute.Tensor, mALog: cute.Tensor, mDtBias: cute.Tensor,
        mCuSeq: cute.Tensor, mCuChunk: cute.Tensor,
        mQg: cute.Tensor,  # (R, H*K) bf16: R rows of whole chunks (TMA stores)
        mKg: cute.Tensor,
        mKdh: cute.Tensor,  # (R, H, K) bf16: kd's hi and lo planes
        mKdl: cute.Tensor,
        mAwh: cute.Tensor,  # (R, H, C) bf16: Aw's hi and lo planes, then Mq's
        mAwl: cute.Tensor,
        mMqh: cute.Tensor,
        mMql: cute.Tensor,
        mGl: cute.Tensor,  # (num_chunks, H, K) fp32
        mFlags: cute.Tensor,  # (num_chunks * H,) int32
        num_seqs: cutlass.Int32,
        seq_len: cutlass.Int32,
        num_chunks: cutlass.Int32,
        num_heads: cutlass.Int32,
        scale: cutlass.Float32,
        lower_bound: cutlass.Float32,
        gate_mode: cutlass.Int32,
        qk_l2norm: cutlass.Int32,
        beta_sigmoid: cutlass.Int32,
        a_log_dtype: cutlass.Int32,  # how A_log and dt_bias are held (abi.GATE_PARAM_DTYPES)
        dt_bias_dtype: cutlass.Int32,
        stream,
    ):
        C, K = self.C, self.K
        loads, s_tile = self._make_loads(mQ, mK, mG)
        op = cpasync.CopyBulkTensorTileS2GOp()
        stores = []
        for name, m in (("qg", mQg), ("kg", mKg)):
            atom, tX = cpasync.make_tiled_tma_atom(op, m, s_tile, (C, K))
            stores += [atom, tX]
            self.tma_meta.append(tma_meta(name, atom, QK_DTYPE))
        self._launch((Loads(*loads), Raw(mBeta, mALog, mDtBias), Offsets(mCuSeq, mCuChunk),
                      Outs(*stores, mKdh, mKdl, mAwh, mAwl, mMqh, mMql, mGl, mFlags),
                      Batch(num_seqs, seq_len),
                      Modes(scale, lower_bound, gate_mode, qk_l2norm, beta_sigmoid, a_log_dtype,
                            dt_bias_dtype), s_tile),
                     num_chunks, num_heads, stream)

    def _launch(self, kernel_args, num_chunks, num_heads, stream):
        """Size the shared storage, then one CTA per (chunk, head), heads fastest (grid x): the
        CTAs resident together read whole token rows of q, k and g, contiguous (docs/notes/k1.md,
        "K1's grid, heads fastest"). Chunk = y + K1_GRID_Y z (grid y is at most 65535)."""
        self._make_storage()
        self.kernel(*kernel_args).launch(
            grid=(num_heads, cutlass.min(num_chunks, K1_GRID_Y),
                  (num_chunks + K1_GRID_Y - 1) // K1_GRID_Y),
            block=(self.threads, 1, 1),
            smem=self.smem_bytes, stream=stream, **self._occupancy(),
        )

    def _occupancy(self) -> dict:
        """The passes kernel asks ptxas for as many CTAs per SM as its smem allows, at most
        64 registers per thread: at K = 128 eight CTAs (64 registers, no spills) instead of six."""
        if self.looped:  # (a looped side run: few CTAs, no cap)
            return {}
        per_sm = min(SMEM_PER_SM // (self.smem_bytes + SMEM_PER_CTA_RESERVED),
                     REGS_PER_SM // (64 * self.threads))
        return {"min_blocks_per_mp": per_sm, "preferred_smem_carveout": 100}

    def _make_loads(self, mQ, mK, mG):
        """The q, k and g TMA loads (C x K bf16 tiles) and their smem tile layout."""
        C, K = self.C, self.K
        s_tile = cute.make_layout((C, K), stride=(K, 1))
        op = cpasync.CopyBulkTensorTileG2SOp()
        atoms = []
        self.tma_meta = []
        for name, m in (("q", mQ), ("k", mK), ("g", mG)):
            atom, tX = cpasync.make_tiled_tma_atom(op, m, s_tile, (C, K))
            atoms += [atom, tX]
            self.tma_meta.append(tma_meta(name, atom, "bfloat16"))
        return atoms, s_tile

    def _make_storage(self):
        C, K, W, NT = self.C, self.K, self.W, self.threads
        RG = 2 * NT // W
        # the warps' partial L and Mqk tiles reuse the operand rows after the last pass
        assert (NT // 32) * 2 * C * C <= 3 * C * (W + 1)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 1]
            sQK: cute.struct.Align[cute.struct.MemRange[self.io_dtype, 2 * C * K], 128]
            sG: cute.struct.Align[cute.struct.MemRange[self.io_dtype, C * K], 128]
            # one pass's phase B operand rows fA, fB, fG, each (C, W) padded by a word
            fABG: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 3 * C * (W + 1)], 16]
            part: cute.struct.MemRange[cutlass.Float32, RG * W]  # gate sum per row group
            first: cute.struct.MemRange[cutlass.Float32, W]  # G at row 0
            norm: cute.struct.MemRange[cutlass.Float32, 2 * C]
            beta: cute.struct.MemRange[cutlass.Float32, C]
            # unfactored 64-column groups; the f16 build then keeps the chunk's length there
            flag: cute.struct.MemRange[cutlass.Int32, K // 64 + self._length_slot()]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()

    def _length_slot(self) -> int:
        """1 where the chunk's length waits in smem over phase B (the f16 build: held in a
        register across the last pass, it was spilled at K = 256), else 0."""
        return 1 if self.f16 else 0

    @cute.kernel
    def kernel(self, loads: Loads, raw: Raw, offsets: Offsets, outs: Outs, batch: Batch,
               modes: Modes, s_tile: cute.Layout):
        self._body_passes(loads, raw, offsets, outs, batch, modes, s_tile)

    # ---------------------------------------------------------------- device

    @cute.jit
    def _body_passes(self, loads: Loads, raw: Raw, offsets: Offsets, outs: Outs, batch: Batch,
                     modes: Modes, s_tile: cute.Layout):
        """Chunk 16 in K / W column passes. Thread (pl, rg) = (tidx mod W/2, tidx div W/2) of a
        pass owns columns 2 pl, 2 pl + 1 of row group rg (C / RG rows); a warp covers one
        64-column group of one row group. Per pass:
          1. the gates of its rows and their running sum; group sums to smem;
          2. G from the groups' prefix, r (G at row C/2 - 1) and Gl; the group is factored
             unless some |G - r| or |r| exceeds 80 (a warp vote: every warp of a group sees the
             same columns); the outputs qg, kg (in place, for the TMA stores), kd (hi/lo, to the
             workspace) and phase B's operand rows for the pass's columns;
          3. phase B's partial L and Mqk over those columns, one 16-column block per warp into
             accumulators kept over the passes: factored groups on warp MMA (bf16 hi/lo),
             unfactored ones elementwise with e^(G_i - G_j), each lane its own tile entries.
        Then the warps' partial tiles meet in smem, L goes to smem, Mq to the workspace, and
        phase C (`_phase_c`)."""
        ids = self._ids()
        args = (loads, raw, outs, modes, ids)
        if cutlass.const_expr(self.looped):
            # the checkpoints' side run: side slot b's partial chunk is tokens cu_seqlens[2b]
            # .. cu_seqlens[2b + 1], and the slots in use are counted at cu_seqlens[2S]
            # (num_seqs = 2S - 1: kernels/kda_checkpoints_sm90.py hands the slots out from
            # that counter), so a CTA takes slots y, y + grid y, ... below the count, reading
            # each one's pair directly (no search), and with none in use leaves at once. The
            # mbarrier is initialised once and its phase flipped by each chunk; a CTA barrier
            # between chunks, so that no thread still reads the last chunk's tiles when the
            # next ones' loads are issued
            tiles = self._input_tiles(s_tile)
            if ids.warp == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_init(tiles[1], 1)
                    cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            _, ny, _ = cute.arch.grid_dim()
            phase = cutlass.Int32(0)
            cu = offsets.cu_seqlens
            for b in cutlass.range(ids.bid, cu[batch.num_seqs + 1], ny, unroll=1):
                t0 = cu[2 * b]
                length = cu[2 * b + 1] - t0
                if length > 0:
                    self._chunk_passes(*args, Slot(b, t0, length, b + 1), tiles, phase, False)
                    phase = phase ^ 1
                cute.arch.sync_threads()
        else:
            slot = self._locate(offsets, batch, ids.bid, ids.lane)
            if slot.bid < slot.bound:
                self._chunk_passes(*args, slot, self._input_tiles(s_tile), 0, True)

    @cute.jit
    def _chunk_passes(self, loads: Loads, raw: Raw, outs: Outs, modes: Modes, ids: Ids,
                      slot: Slot, tiles, phase, init: cutlass.Constexpr):
        """_body_passes for one chunk slot in the shared `tiles` (_input_tiles), its loads
        completing mbarrier phase `phase`."""
        tidx, warp, lane, h, _ = ids
        bid, t0, length, bound = slot
        mBeta, mALog, mDtBias = raw.beta, raw.a_log, raw.dt_bias
        a_dtype, b_dtype = modes.a_log_dtype, modes.dt_bias_dtype
        lower_bound, gate_mode = modes.lower_bound, modes.gate_mode
        mGl, mMqh, mMql = outs.gl, outs.mqh, outs.mql
        C, K, NT, W = self.C, self.K, self.threads, self.W
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        NPAIR = W // 2
        NW = NT // 32
        BPW = (W // 16) // NW  # phase B blocks per warp per pass
        NQ = C * C // NT  # (i, j) entries per thread in the final sum
        st, mbar, sQK, sQ, sK, sG = tiles
        f_layout = cute.make_layout((C, W), stride=(W + 1, 1))
        f0 = st.fABG.data_ptr()
        fA = cute.make_tensor(f0, f_layout)
        fB = cute.make_tensor(f0 + C * (W + 1), f_layout)
        fG = cute.make_tensor(f0 + 2 * C * (W + 1), f_layout)
        part = st.part.get_tensor(cute.make_layout((2 * NT // W, W), stride=(W, 1)))
        first = st.first.get_tensor(cute.make_layout(W))
        norm = st.norm.get_tensor(cute.make_layout(2 * C))
        sBeta = st.beta.get_tensor(cute.make_layout(C))
        flag = st.flag.get_tensor(cute.make_layout(K // 64 + self._length_slot()))
        sL = cute.make_tensor(cute.recast_ptr(sG.iterator, dtype=f32),
                              cute.make_layout((C, C), stride=(C, 1)))
        row0 = bid * C
        pl = tidx % NPAIR
        rg = tidx // NPAIR
        # the gate parameters of the first pass load while the TMA loads are in flight
        a_log = gate_param32(mALog, h, a_dtype)
        b0 = gate_param32(mDtBias, h * K + 2 * pl, b_dtype)
        b1 = gate_param32(mDtBias, h * K + 2 * pl + 1, b_dtype)
        if halves(a_dtype, b_dtype):  # (16-bit parameters: off the fp32 path)
            a_log = gate_param16(mALog, h, a_dtype, a_log)
            b0 = gate_param16(mDtBias, h * K + 2 * pl, b_dtype, b0)
            b1 = gate_param16(mDtBias, h * K + 2 * pl + 1, b_dtype, b1)
        bias0 = [b0, b1]
        self._load_tiles(loads.pairs(), (sQ, sK, sG), mbar, mBeta, sBeta, t0, h, length,
                         modes.beta_sigmoid, tidx, warp, phase, init)
        if cutlass.const_expr(self._length_slot() == 1):
            if tidx == 0:
                flag[K // 64] = length  # read back after the passes (a barrier between)
        self._norms(sQK, norm, length, modes.scale, modes.qk_l2norm, tidx)

        a_exp = cute.math.exp(a_log)
        mma = cute.make_tiled_mma(warp_mma.MmaF16BF16Op(bf16, f32, (16, 8, 16)))
        c_shape = mma.get_slice(lane).partition_shape_C((16, 8))
        accs = [cute.make_rmem_tensor(c_shape, f32) for _ in range(4)]
        for acc in accs:
            acc.fill(0.0)
        for ps in cutlass.range_constexpr(K // W):
            gp = ps * NPAIR + pl  # this thread's column pair in the head
            bias = bias0
            if cutlass.const_expr(ps > 0):
                c0 = gate_param32(mDtBias, h * K + 2 * gp, b_dtype)
                c1 = gate_param32(mDtBias, h * K + 2 * gp + 1, b_dtype)
                if halves(b_dtype):
                    c0 = gate_param16(mDtBias, h * K + 2 * gp, b_dtype, c0)
                    c1 = gate_param16(mDtBias, h * K + 2 * gp + 1, b_dtype, c1)
                bias = [c0, c1]
            loc = self._pass_gates(sG, bias, part, first, gp, pl, rg, a_exp,
                                   lower_bound, gate_mode, length)
            cute.arch.sync_threads()
            self._pass_outputs(loc, part, first, flag, (fA, fB, fG), sQ, sK, norm,
                               (outs.kdh, outs.kdl), mGl, row0, h, bid, gp, pl, rg, lane)
            if cutlass.const_expr(ps == K // W - 1):
                cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            if cutlass.const_expr(ps == K // W - 1):
                # qg and kg leave now; the final sums and phase C run while they drain
                if warp == 0:
                    for tma, tX, sX in ((outs.tma_qg, outs.qg, sQ), (outs.tma_kg, outs.kg, sK)):
                        self._tile_store(tma, tX, self._as_qk(sX), (row0, h * K), (C, K))
                    cute.arch.cp_async_bulk_commit_group()
            for bb in cutlass.range_constexpr(BPW):
                c0 = (warp * BPW + bb) * 16
                if flag[(ps * W + c0) // 64] == 0:
                    self._phase_b_block(fA, fB, fG, c0, lane, accs, self.W + 1)
                else:
                    self._phase_b_block_elementwise(fA, fB, fG, c0, lane, accs)
        cute.arch.sync_threads()
        if cutlass.const_expr(self._length_slot() == 1):
            length = flag[K // 64]
        sRed = cute.make_tensor(f0, cute.make_layout(
            (NW, 2, C, C), stride=(2 * C * C, C * C, C, 1)))
        self._phase_b_spill(sRed, warp, lane, accs)
        cute.arch.sync_threads()
        for p in cutlass.range_constexpr(2 * NQ):
            prod = p // NQ
            idx = tidx + (p - prod * NQ) * NT
            i = idx // C
            j = idx - i * C
            acc = sRed[0, prod, i, j]
            for w in cutlass.range_constexpr(1, NW):
                acc = acc + sRed[w, prod, i, j]
            if cutlass.const_expr(prod == 0):
                self._store_l(sL, sBeta, i, j, acc, length)
            else:
                self._store_m(None, (mMqh, mMql), row0, h, i, j, acc, length)
        cute.arch.sync_threads()
        self._phase_c(sL, sBeta, (outs.awh, outs.awl), row0, h, length, tidx)
        self._publish(outs.flags, tidx, warp, h, bid, bound)

    @cute.jit
    def _pass_gates(self, sG, bias, part, first, gp, pl, rg, a_exp,
                    lower_bound: cutlass.Float32, gate_mode: cutlass.Int32, length):
        """Step 1 of a pass: the gate of columns 2 gp + c (c = 0, 1; `bias` their dt_bias) at
        this thread's rows rg * RPG ..., their running sum (rows past the length add nothing)
        returned as (RPG, 2), the group's sum to part[rg] and G at row 0 to first[]. Gates and
        G are in base 2 (log2(e) times the natural ones; the constant folds into a_exp and the
        lower bound), so every exponential of the pass is one ex2."""
        f32 = cutlass.Float32
        RPG = self.RPG
        gW = self._words(sG)
        na2 = a_exp * -LOG2E
        acts = cute.make_rmem_tensor((RPG, 2), f32)
        # one branch per mode (not per row), so the rows' exponentials overlap
        if gate_mode == GATE_BOUNDED:
            for r in cutlass.range_constexpr(RPG):
                gw = gW[rg * RPG + r, gp]
                g2 = bf16x2(gw)
                for c in cutlass.range_constexpr(2):
                    # lower_bound sigmoid(a_exp (g + bias)), base 2
                    acts[r, c] = (lower_bound * LOG2E) * cute.arch.rcp_approx(
                        1.0 + cute.math.exp2((g2[c] + bias[c]) * na2, fastmath=True))
        elif gate_mode == GATE_UNBOUNDED:
            for r in cutlass.range_constexpr(RPG):
                gw = gW[rg * RPG + r, gp]
                g2 = bf16x2(gw)
                for c in cutlass.range_constexpr(2):
                    x = g2[c] + bias[c]
                    # softplus without a branch: max(x, 0) + log1p(e^-|x|)
                    sp = cute.arch.fmax(x, 0.0) + cute.math.log1p(
                        cute.math.exp(-cute.arch.fmax(x, -x)))
                    acts[r, c] = na2 * sp
        else:
            for r in cutlass.range_constexpr(RPG):
                gw = gW[rg * RPG + r, gp]
                g2 = bf16x2(gw)
                for c in cutlass.range_constexpr(2):
                    acts[r, c] = g2[c] * LOG2E
        loc = cute.make_rmem_tensor((RPG, 2), f32)
        for c in cutlass.range_constexpr(2):
            run = cutlass.Float32(0.0)
            for r in cutlass.range_constexpr(RPG):
                if rg * RPG + r < length:
                    run = run + acts[r, c]
                loc[r, c] = run
            part[rg, 2 * pl + c] = run
            if rg == 0:
                first[2 * pl + c] = loc[0, c]
        return loc

    @cute.jit
    def _pass_outputs(self, loc, part, first, flag, fops, sQ, sK, norm, kd_planes, mGl, row0,
                      h, bid, gp, pl, rg, lane):
        """Step 2 of a pass, columns d = 2 gp + c of rows rg * RPG ... (G in base 2): G = (sum
        of the earlier groups) + the running sum, r and Gl from the group sums; the factored
        test as a warp vote (flag[] for phase B; the warp then takes one of two branches, not
        per-element selects); gl = 2^Gl; the outputs qg = scale qn 2^G, kg = kn 2^G and kd = kn
        2^(Gl - G) (zeros past the length, whose rows have zero norms) and phase B's operands,
        factored: (qn 2^(G - r), kn 2^(G - r), kn 2^(r - G)), the outputs being these times
        2^r, 2^r and 2^(Gl - r); otherwise (qn, kn, G)."""
        C, NT, W = self.C, self.threads, self.W
        f32 = cutlass.Float32
        RG = 2 * NT // W
        RGREF = (C // 2 - 1) // self.RPG  # the row group ending at row C/2 - 1
        lim = FACTOR_LIMIT * LOG2E
        offs = cute.make_rmem_tensor((2,), f32)
        ref = cute.make_rmem_tensor((2,), f32)
        gl = cute.make_rmem_tensor((2,), f32)
        big = cutlass.Int32(0)
        for c in cutlass.range_constexpr(2):
            col = 2 * pl + c
            o = cutlass.Float32(0.0)
            run = cutlass.Float32(0.0)
            for r in cutlass.range_constexpr(RG):
                p = part[r, col]
                if r < rg:
                    o = o + p
                run = run + p
                if cutlass.const_expr(r == RGREF):
                    ref[c] = run
            offs[c] = o
            gl[c] = run
            g0 = first[col]
            big = flag_unfactorable(big, g0, ref[c], run, lim)  # base 2 here
        unsafe = cute.arch.vote_any_sync(big != 0)
        if lane == 0:
            flag[(2 * gp) // 64] = cutlass.Int32(unsafe)
        if rg == 0:
            for c in cutlass.range_constexpr(2):
                mGl[bid, h, 2 * gp + c] = cute.math.exp2(gl[c], fastmath=True)
        for r in cutlass.range_constexpr(self.RPG):
            for c in cutlass.range_constexpr(2):
                loc[r, c] = offs[c] + loc[r, c]  # G
        args = (loc, ref, gl, fops, sQ, sK, norm, kd_planes, row0, h, gp, pl, rg)
        if unsafe:
            self._pass_rows(False, *args)
        else:
            self._pass_rows(True, *args)

    @cute.jit
    def _pass_rows(self, factored: cutlass.Constexpr, G, ref, gl, fops, sQ, sK, norm,
                   kd_planes, row0, h, gp, pl, rg):
        """The rows of step 2 (_pass_outputs) in one form, which the whole warp takes; G holds
        this thread's (RPG, 2) entries."""
        C = self.C
        f32 = cutlass.Float32
        RPG = self.RPG
        fA, fB, fG = fops
        cq = cute.make_rmem_tensor((2,), f32)
        cl = cute.make_rmem_tensor((2,), f32)
        if cutlass.const_expr(factored):
            for c in cutlass.range_constexpr(2):
                cq[c] = cute.math.exp2(ref[c], fastmath=True)
                cl[c] = cute.math.exp2(gl[c] - ref[c], fastmath=True)
        vQ, vK = (cute.logical_divide(x, (None, 2)) for x in (sQ, sK))
        qW, kW = self._words(sQ), self._words(sK)
        qs2 = cute.make_rmem_tensor((2,), f32)
        ke2 = cute.make_rmem_tensor((2,), f32)
        kd2 = cute.make_rmem_tensor((2,), f32)
        for r in cutlass.range_constexpr(RPG):
            i = rg * RPG + r
            qw, kw = qW[i, gp], kW[i, gp]
            q2 = bf16x2(qw)
            k2 = bf16x2(kw)
            nq = norm[i]
            nk = norm[C + i]
            for c in cutlass.range_constexpr(2):
                col = 2 * pl + c
                Gi = G[r, c]
                qn = q2[c] * nq
                kn = k2[c] * nk
                if cutlass.const_expr(factored):
                    # 2^(G - r) and its reciprocal are normal floats (the factored test)
                    e1 = cute.math.exp2(Gi - ref[c], fastmath=True)
                    qe = qn * e1
                    ke = kn * e1
                    kx = kn * cute.arch.rcp_approx(e1)
                    fA[i, col] = qe
                    fB[i, col] = ke
                    fG[i, col] = kx
                    qs2[c] = qe * cq[c]
                    ke2[c] = ke * cq[c]
                    kd2[c] = kx * cl[c]
                else:
                    e1 = cute.math.exp2(Gi, fastmath=True)
                    qs2[c] = qn * e1
                    ke2[c] = kn * e1
                    kd2[c] = kn * cute.math.exp2(gl[c] - Gi, fastmath=True)
                    fA[i, col] = qn
                    fB[i, col] = kn
                    fG[i, col] = Gi
            # qg and kg in place of the q and k tiles (only this thread reads these two columns
            # of this row); kd's planes straight to the workspace (128 bytes of a row per warp)
            self._store_row_pair(vQ, vK, kd_planes, row0, h, i, gp, qs2, ke2, kd2)

    @cute.jit
    def _publish(self, mFlags: cute.Tensor, tidx, warp, h, bid, bound):
        """A chunk's end. The TMA stores of qg and kg (bf16 outputs) must have read smem before
        the CTA exits; built `alongside` they must have landed, and then one thread flags this
        (chunk, head) with a release (the barrier orders every thread's stores before it): a
        K2 running alongside (api: K2 first, this grid its programmatic dependent) waits on
        the flag before loading the chunk. The last chunk of the last head then waits for that
        K2 to complete (griddepcontrol.wait; a no-op without a programmatic primary), so what
        follows K1 on the stream sees both kernels done."""
        if cutlass.const_expr(self.alongside):
            if cutlass.const_expr(self.split):
                if warp == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    cute.arch.fence_proxy("async.global")
            cute.arch.sync_threads()
            if tidx == 0:
                nh, _, _ = cute.arch.grid_dim()
                cute.arch.atomic_add(mFlags.iterator + bid * nh + h, cutlass.Int32(1),
                                     sem="release", scope="gpu")
                if h == nh - 1 and bid == bound - 1:
                    cute.arch.griddepcontrol_wait()
        elif cutlass.const_expr(self.split):
            if warp == 0:
                # smem must outlive the stores' reads of it
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _ids(self) -> Ids:
        """This thread's place: heads on grid x, the chunk slot y + K1_GRID_Y z."""
        tidx, _, _ = cute.arch.thread_idx()
        h, by, bz = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        return Ids(tidx, warp, cute.arch.lane_idx(), h, by + bz * K1_GRID_Y)

    @cute.jit
    def _input_tiles(self, s_tile: cute.Layout):
        """The shared storage, its mbarrier and the q, k (one (2C, K) array for the row norms)
        and g tiles."""
        C, K = self.C, self.K
        st = utils.SmemAllocator().allocate(self.shared_storage)
        sQK = st.sQK.get_tensor(cute.make_layout((2 * C, K), stride=(K, 1)))
        return (st, st.mbar.data_ptr(), sQK, cute.make_tensor(sQK.iterator, s_tile),
                cute.make_tensor(sQK.iterator + C * K, s_tile), st.sG.get_tensor(s_tile))

    def _words(self, t):
        """A row-major bf16 smem tile (rows, K) as int32 words (rows, K/2): bf16 pairs, column
        2p in the low half of word p (bf16x2_lo / bf16x2_hi read them exactly)."""
        rows = cute.size(t, mode=[0])
        return cute.make_tensor(cute.recast_ptr(t.iterator, dtype=cutlass.Int32),
                                cute.make_layout((rows, self.K // 2), stride=(self.K // 2, 1)))

    @cute.jit
    def _locate(self, offsets: Offsets, batch: Batch, bid, lane) -> Slot:
        """Chunk slot `bid`: its first token, valid rows and the slots' bound. A fixed-length
        batch (seq_len > 0: num_seqs sequences of seq_len tokens,
        ceil(seq_len / C) slots each) is located by arithmetic, with no load before the TMA's.
        Otherwise (varlen, seq_len 0) the sequence holding the slot is found by a 32-way search,
        each warp by itself: a round's lanes read 32 evenly spaced entries of cu_chunks (and
        the cu_seqlens pair beside each) at once and a ballot counts those at or before `bid`,
        so N <= 32 sequences take one round of loads and N <= 1024 two (a binary search's
        dependent loads were log2(N) rounds, each an L2 round trip at the CTA's start). The
        lane that sampled the sequence in the last round hands its loads over by shuffles. The
        bound is the number of slots, or 0 for a slot that holds no tokens (past the end, or
        between two varlen sequences: workspace.chunk_slots), so `bid < bound` says whether this CTA
        has a chunk."""
        C = self.C
        mCuSeq, mCuChunk = offsets.cu_seqlens, offsets.cu_chunks
        num_seqs, seq_len = batch.num_seqs, batch.seq_len
        t0 = cutlass.Int32(0)
        length = cutlass.Int32(0)
        bound = cutlass.Int32(0)
        if seq_len > 0:
            slots = (seq_len + (C - 1)) // C
            n = bid // slots
            j = bid - n * slots
            t0 = n * seq_len + j * C
            length = cutlass.min(C, seq_len - j * C)
            bound = num_seqs * slots
        else:
            bound = mCuChunk[num_seqs]
            lo, hi, c0, s0, s1, k = self._locate_round(mCuSeq, mCuChunk, cutlass.Int32(0),
                                                       num_seqs, bid, lane)
            while hi - lo > 1:
                lo, hi, c0, s0, s1, k = self._locate_round(mCuSeq, mCuChunk, lo, hi, bid,
                                                           lane)
            c0 = cute.arch.shuffle_sync(c0, k)
            s0 = cute.arch.shuffle_sync(s0, k)
            s1 = cute.arch.shuffle_sync(s1, k)
            t0 = s0 + (bid - c0) * C
            length = cutlass.min(C, s1 - t0)
            if length < 1:
                bound = cutlass.Int32(0)
        return Slot(bid, t0, length, bound)

    @cute.jit
    def _locate_round(self, mCuSeq: cute.Tensor, mCuChunk: cute.Tensor, lo, hi, bid, lane):
        """One round of _locate's search over [lo, hi) (cu_chunks[lo] <= bid, or lo = 0): lane
        l samples entry lo + l * step, step = ceil((hi - lo) / 32), so the 32 samples cover the
        range; cu_chunks increases, so the lanes at or before `bid` are the first k + 1 and the
        sequence lies in [lo + k step, lo + (k + 1) step). Returns the new range, this lane's
        cu_chunks, cu_seqlens pair and k."""
        step = (hi - lo + 31) // 32
        idx = lo + lane * step
        j = cutlass.min(idx, hi - 1)
        c0 = mCuChunk[j]
        s0 = mCuSeq[j]
        s1 = mCuSeq[j + 1]
        ok = cutlass.Int32(0)
        if idx < hi:
            if c0 <= bid:
                ok = cutlass.Int32(1)
        k = cute.arch.popc(cute.arch.vote_ballot_sync(ok != 0)) - 1
        k = cutlass.max(k, 0)
        lo2 = lo + k * step
        return lo2, cutlass.min(lo2 + step, hi), c0, s0, s1, k

    @cute.jit
    def _load_tiles(self, loads, tiles, mbar, mBeta: cute.Tensor, sBeta, t0, h, length,
                    beta_sigmoid: cutlass.Int32, tidx, warp, phase=0,
                    init: cutlass.Constexpr = True):
        """TMA: the q, k and g tiles of this chunk and head into smem (one mbarrier, phase
        `phase`; every thread waits on it); beta (through its sigmoid if asked) into sBeta
        meanwhile. Warp 0 initialises the barrier (`init`: a looped CTA's is initialised once,
        before its loop) and issues the loads at once; the CTA barrier after (every thread
        must see the initialised mbarrier before it waits on it) then runs while they are in
        flight."""
        C, K = self.C, self.K
        if warp == 0:
            with cute.arch.elect_one():
                if cutlass.const_expr(init):
                    cute.arch.mbarrier_init(mbar, 1)
                    cute.arch.mbarrier_init_fence()
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, 3 * C * K * 2)
            cute.arch.sync_warp()
            for (tma, tX), sX_ in zip(loads, tiles, strict=True):
                self._tile_copy(tma, tX, sX_, (t0, h * K), (C, K), mbar)
        if tidx < C:
            b = cutlass.Float32(0.0)
            if tidx < length:
                b = mBeta[t0 + tidx, h].to(cutlass.Float32)
            if beta_sigmoid != 0:
                b = 1.0 / (1.0 + cute.math.exp(-b))
            sBeta[tidx] = b
        cute.arch.sync_threads()
        cute.arch.mbarrier_wait(mbar, phase)

    @cute.jit
    def _norms(self, sQK, norm, length, scale: cutlass.Float32, qk_l2norm: cutlass.Int32,
               tidx):
        """Phase A's row norms, TPR threads per row of q (rows 0..C-1) and k (C..2C-1), into
        norm[]: 8-element (16-byte) vectors, thread `sub_` of a row takes vectors sub_ + TPR m,
        rotated by the row against bank conflicts between the rows of one access phase."""
        C, K, NT = self.C, self.K, self.threads
        TPR = NT // (2 * C)
        nvec = K // 8 // TPR
        row = tidx // TPR
        sub_ = tidx - row * TPR
        vecs = cute.logical_divide(self._words(sQK), (None, 4))  # (2C, (4, K/8)) bf16 pairs
        acc2 = cutlass.Float32(0.0)
        for m in cutlass.range_constexpr(nvec):
            wv = vecs[row, (None, sub_ + TPR * ((m + row) % nvec))].load()
            part = cutlass.Float32(0.0)
            for e in cutlass.range_constexpr(4):
                x0, x1 = bf16x2(wv[e])
                part = part + x0 * x0 + x1 * x1
            acc2 = acc2 + part
        for off in cutlass.range_constexpr(TPR.bit_length() - 1):
            acc2 = acc2 + cute.arch.shuffle_sync_bfly(acc2, offset=1 << off)
        if sub_ == 0:
            r = cutlass.Float32(1.0)
            if qk_l2norm != 0:
                r = cute.math.rsqrt(acc2 + 1e-6)
            # q's rows carry the scale; rows past the length are zero, and with them every
            # output and phase B operand of those rows (no per-element masking)
            if row < C:
                r = r * scale
            if row - (row // C) * C >= length:
                r = cutlass.Float32(0.0)
            norm[row] = r
        cute.arch.sync_threads()

    @cute.jit
    def _phase_c(self, sL, sBeta, aw, row0, h, length, tidx):
        """Phase C: Aw = (I + L)^-1 diag(beta), one column per thread, by forward substitution
        with the column in registers; L entries are smem broadcasts. Right-looking: once x_l is
        final it is taken out of every later row at once, so the dependent chain is C
        multiply-adds long, not C(C-1)/2 (same order of terms per row as the row-by-row form,
        so the same result). `aw`: Aw's (hi, lo) planes (fp16 builds: the hi plane alone) or
        its fp32 tensor, in a tuple."""
        C = self.C
        if tidx < C:
            j = tidx
            xs = cute.make_rmem_tensor((C,), cutlass.Float32)
            bj = sBeta[j]
            for i in cutlass.range_constexpr(C):
                xs[i] = cutlass.Float32(0.0)
                if j == i:
                    xs[i] = bj
            for l_ in cutlass.range_constexpr(C - 1):
                xl = xs[l_]
                for i in cutlass.range_constexpr(l_ + 1, C):
                    xs[i] = xs[i] - sL[i, l_] * xl
            for i in cutlass.range_constexpr(C):
                x = xs[i]
                if j >= length or i >= length:
                    x = cutlass.Float32(0.0)
                if cutlass.const_expr(self.f16):
                    aw[0][row0 + i, h, j] = x.to(self.out_dtype)
                elif cutlass.const_expr(self.split):
                    hi_ = x.to(self.io_dtype)
                    aw[0][row0 + i, h, j] = hi_
                    aw[1][row0 + i, h, j] = (x - hi_.to(cutlass.Float32)).to(self.io_dtype)
                else:
                    aw[0][row0 + i, h, j] = x

    @cute.jit
    def _store_row_pair(self, vQ, vK, kd_planes, row0, h, i, pair, qs2, ke2, kd2):
        """Columns 2 pair, 2 pair + 1 of row i: qg and kg as fp16 pairs in place
        of the q and k tiles (only this thread reads them), for the TMA stores; kd's hi and lo
        planes (fp16: its one plane) straight to the workspace (a warp writes 128 contiguous
        bytes of a row)."""
        f32, io = cutlass.Float32, self.out_dtype
        mKdh, mKdl = kd_planes
        self._as_qk(vQ)[i, (None, pair)].store(qs2.load().to(self.qk_dtype))
        self._as_qk(vK)[i, (None, pair)].store(ke2.load().to(self.qk_dtype))
        x = kd2.load()
        kh = x.to(io)
        pairs_g = cute.make_layout((2, self.K // 2), stride=(1, 2))
        cute.make_tensor(mKdh[row0 + i, h, None].iterator, pairs_g)[None, pair].store(kh)
        if cutlass.const_expr(not self.f16):
            cute.make_tensor(mKdl[row0 + i, h, None].iterator, pairs_g)[None, pair].store(
                (x - kh.to(f32)).to(io))

    def _as_qk(self, t):
        """A bf16 smem tile (the q and k input tiles, which take qg and kg in place) as qg's
        and kg's dtype: an fp16 view of its bytes."""
        return cute.make_tensor(cute.recast_ptr(t.iterator, dtype=self.qk_dtype), t.layout)

    @cute.jit
    def _phase_b_block(self, fA, fB, fG, c0, lane, accs, row_stride: cutlass.Constexpr,
                       width: cutlass.Constexpr = 16):
        """One block of `width` columns (c0 ...) of the factored L' = (kn e^(G-r))
        (kn e^(r-G))^T and Mqk' = (qn e^(G-r))(kn e^(r-G))^T into accs[2 * product + nt]
        (both 16 x 8 column tiles nt), by m16n8k16 bf16 MMAs on hi/lo splits (hi*hi + hi*lo +
        lo*hi), each operand converted once.
        The sum runs over the block's columns in any order, so the MMA's k index is dealt to
        the columns of a 32-column slab as column 8t + 4 kb + 2h + c for k = c + 2t + 8h of
        block kb: lanes (g, t) of a fragment load then read rows g (+ 8) at columns 8t + const,
        and with rows `row_stride` = 1 (mod 32) words apart the 32 lanes hit 32 banks (in
        natural order, g + 2t, it was a 4-way conflict)."""
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        mma = cute.make_tiled_mma(warp_mma.MmaF16BF16Op(bf16, f32, (16, 8, 16)))
        thr = mma.get_slice(lane)
        if cutlass.const_expr(width == 16):
            k_mode = ((2, 4, 2), (1, 8, 2))
            off = c0 - ((c0 // 16) % 2) * 12  # the slab's first column + 4 kb
        else:
            k_mode = ((2, 4, 2, 2), (1, 8, 2, 4))
            off = c0

        def block(src, row0, rows):
            return cute.make_tensor(src.iterator + row0 * row_stride + off, cute.make_layout(
                (rows, k_mode[0]), stride=(row_stride, k_mode[1])))

        vA = [thr.partition_A(block(src, 0, 16)) for src in (fB, fA)]  # L', Mqk'
        vB = [thr.partition_B(block(fG, 8 * nt, 8)) for nt in range(2)]
        a = [self._hi_lo(v) for v in vA]
        b = [self._hi_lo(v) for v in vB]
        for prod in cutlass.range_constexpr(2):
            for nt in cutlass.range_constexpr(2):
                acc = accs[2 * prod + nt]
                for ah, bh in ((0, 0), (0, 1), (1, 0)):
                    cute.gemm(mma, acc, a[prod][ah], b[nt][bh], acc)

    @cute.jit
    def _phase_b_block_elementwise(self, fA, fB, fG, c0, lane, accs):
        """An unfactored 16-column block (pass columns c0 ...: fA = qn, fB = kn, fG = G; steep
        decay) into the same accumulators as `_phase_b_block`: each entry (i, j <= i) this lane
        holds of the four 16 x 8 tiles adds sum_d kn_i kn_j e^(G_i - G_j) (L') and the same with
        qn_i (Mqk'), the exponential taken from the difference, so no factor exceeds 1. Entries
        above the diagonal are left alone (the final sums mask them)."""
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        mma = cute.make_tiled_mma(warp_mma.MmaF16BF16Op(bf16, f32, (16, 8, 16)))
        cC = mma.get_slice(lane).partition_C(cute.make_identity_tensor((16, 8)))
        for nt in cutlass.range_constexpr(2):
            for e in cutlass.range_constexpr(cute.size(cC)):
                i, jj = cC[e]
                j = nt * 8 + jj
                if j <= i:
                    lacc = accs[nt][e]
                    macc = accs[2 + nt][e]
                    for d in cutlass.range(16, unroll=2):
                        t = cute.math.exp2(fG[i, c0 + d] - fG[j, c0 + d]) * fB[j, c0 + d]
                        lacc = lacc + fB[i, c0 + d] * t
                        macc = macc + fA[i, c0 + d] * t
                    accs[nt][e] = lacc
                    accs[2 + nt][e] = macc

    @cute.jit
    def _hi_lo(self, view):
        """(bf16(x), bf16(x - bf16(x))) of every element of an fp32 smem fragment view, a
        pair of elements (one register of the MMA fragment) at a time: one packed conversion
        per plane, and the hi pair back to fp32 by a shift and a mask."""
        bf16 = cutlass.BFloat16
        hi = cute.make_rmem_tensor(view.shape, bf16)
        lo = cute.make_rmem_tensor(view.shape, bf16)
        hw, lw = (cute.recast_tensor(t, cutlass.Int32) for t in (hi, lo))
        for m in cutlass.range_constexpr(cute.size(view) // 2):
            x0, x1 = view[2 * m], view[2 * m + 1]
            w = pack_bf16x2(x0, x1)
            hw[m] = w
            r0, r1 = bf16x2(w)
            lw[m] = pack_bf16x2(x0 - r0, x1 - r1)
        return hi, lo

    @cute.jit
    def _phase_b_spill(self, sRed, warp, lane, accs):
        """This warp's partial tiles into sRed[warp, product, i, j]."""
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        mma = cute.make_tiled_mma(warp_mma.MmaF16BF16Op(bf16, f32, (16, 8, 16)))
        cC = mma.get_slice(lane).partition_C(cute.make_identity_tensor((16, 8)))
        for prod in cutlass.range_constexpr(2):
            for nt in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(cute.size(cC)):
                    i, jj = cC[e]
                    sRed[warp, prod, i, nt * 8 + jj] = accs[2 * prod + nt][e]

    @cute.jit
    def _store_l(self, sL, sBeta, i, j, lacc, length):
        """Entry (i, j) of L = beta_i k_i . k_j (decayed), strictly lower, zero past length."""
        lval = cutlass.Float32(0.0)
        if j < i and i < length:
            lval = sBeta[i] * lacc
        sL[i, j] = lval

    @cute.jit
    def _store_m(self, mMq, sMq, row0, h, i, j, macc, length):
        """Entry (i, j) of Mqk = scale q_i . k_j (decayed; q's norms carry the scale), lower,
        zero past length: to global
        (f32) or as a (hi, lo) pair to the smem planes the TMA store sends (split)."""
        m = cutlass.Float32(0.0)
        if j <= i and i < length:
            m = macc
        if cutlass.const_expr(self.f16):
            sMq[0][row0 + i, h, j] = m.to(self.out_dtype)
        elif cutlass.const_expr(self.split):
            hi = m.to(self.io_dtype)
            sMq[0][row0 + i, h, j] = hi
            sMq[1][row0 + i, h, j] = (m - hi.to(cutlass.Float32)).to(self.io_dtype)
        else:
            mMq[row0 + i, h, j] = m


class KdaPrepSm90OnePass(KdaPrepSm90Split):
    """The one-pass K1 with bf16 outputs (chunk 32, outside the column passes' reach): the
    shipped K1's call, loads and helpers, with phases A and B over all K columns at once
    (`_body`)."""

    def _occupancy(self) -> dict:
        """Launch bounds: none for the one-pass kernel."""
        return {}

    def _make_storage(self):
        C, K = self.C, self.K

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 1]
            # q's tile, then k's: one (2C, K) array for the row norms
            sQK: cute.struct.Align[cute.struct.MemRange[self.io_dtype, 2 * C * K], 128]
            # g's tile; once the gates are computed, phase B's L (fp32, C x C) lives here
            sG: cute.struct.Align[cute.struct.MemRange[self.io_dtype, C * K], 128]
            # fp32 working rows, padded by one word against bank conflicts in phase B:
            # factored chunks hold (qn e^G, kn e^G, kn e^-G), others (qn, kn, G)
            fA: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, C * (K + 1)], 16]
            fB: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, C * (K + 1)], 16]
            fG: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, C * (K + 1)], 16]
            norm: cute.struct.MemRange[cutlass.Float32, 2 * C]
            beta: cute.struct.MemRange[cutlass.Float32, C]
            unsafe: cute.struct.MemRange[cutlass.Int32, 1]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()

    @cute.kernel
    def kernel(self, loads: Loads, raw: Raw, offsets: Offsets, outs: Outs, batch: Batch,
               modes: Modes, s_tile: cute.Layout):
        self._body(loads, raw, offsets, outs, batch, modes, s_tile)

    # ---------------------------------------------------------------- device

    @cute.jit
    def _body(self, loads: Loads, raw: Raw, offsets: Offsets, outs, batch: Batch, modes: Modes,
              s_tile: cute.Layout):
        """The kernel, whatever the output mode: `outs` is Outs (bf16: TMA stores and planes)
        or F32Outs (fp32 tensors)."""
        mBeta, mALog, mDtBias = raw.beta, raw.a_log, raw.dt_bias
        a_dtype, b_dtype = modes.a_log_dtype, modes.dt_bias_dtype
        lower_bound, gate_mode = modes.lower_bound, modes.gate_mode
        mGl = outs.gl
        if cutlass.const_expr(self.split):
            mKdh, mKdl, mMqh, mMql = outs.kdh, outs.kdl, outs.mqh, outs.mql
            mQg = mKg = mKd = mMq = None
            aw = (outs.awh, outs.awl)
        else:
            mQg, mKg, mKd, mMq = outs.qg, outs.kg, outs.kd, outs.mq
            aw = (outs.aw,)
        C, K, NT = self.C, self.K, self.threads
        tidx, warp, lane, h, bid = self._ids()

        _, t0, length, bound = self._locate(offsets, batch, bid, lane)

        if bid < bound:
            st, mbar, sQK, sQ, sK, sG = self._input_tiles(s_tile)
            f_layout = cute.make_layout((C, K), stride=(K + 1, 1))
            fA = st.fA.get_tensor(f_layout)
            fB = st.fB.get_tensor(f_layout)
            fG = st.fG.get_tensor(f_layout)
            norm = st.norm.get_tensor(cute.make_layout(2 * C))
            sBeta = st.beta.get_tensor(cute.make_layout(C))
            # L over g's tile (read by the gate pass only, before phase B writes L)
            sL = cute.make_tensor(cute.recast_ptr(sG.iterator, dtype=cutlass.Float32),
                                  cute.make_layout((C, C), stride=(C, 1)))
            row0 = bid * C  # this chunk's first workspace row
            # split mode: Mq's (hi, lo) planes, written by phase B straight to the workspace
            sMq = (mMqh, mMql) if cutlass.const_expr(self.split) else None
            unsafe = st.unsafe.get_tensor(cute.make_layout(1))

            if tidx == 0:
                unsafe[0] = cutlass.Int32(0)
            self._load_tiles(loads.pairs(), (sQ, sK, sG), mbar, mBeta, sBeta, t0, h, length,
                             modes.beta_sigmoid, tidx, warp)
            self._norms(sQK, norm, length, modes.scale, modes.qk_l2norm, tidx)

            # ---- phase A: gates and cumulative decay G (chunk-local) ---------------------
            a_log = gate_param(mALog, h, a_dtype)
            a_exp = cute.math.exp(a_log)
            acts = cute.make_rmem_tensor((C,), cutlass.Float32)
            for d in cutlass.range(tidx, K, NT):
                bias = gate_param(mDtBias, h * K + d, b_dtype)
                G = cutlass.Float32(0.0)
                big = cutlass.Int32(0)
                # the gate of every row first, one branch per mode (not per row), so the rows'
                # exponentials overlap; then the running sum
                if gate_mode == GATE_BOUNDED:
                    for i in cutlass.range_constexpr(C):
                        x = a_exp * (sG[i, d].to(cutlass.Float32) + bias)
                        acts[i] = lower_bound * cute.arch.rcp_approx(
                            1.0 + cute.math.exp(-x, fastmath=True))
                elif gate_mode == GATE_UNBOUNDED:
                    for i in cutlass.range_constexpr(C):
                        x = sG[i, d].to(cutlass.Float32) + bias
                        # softplus without a branch: max(x, 0) + log1p(e^-|x|)
                        sp = cute.arch.fmax(x, 0.0) + cute.math.log1p(
                            cute.math.exp(-cute.arch.fmax(x, -x)))
                        acts[i] = -a_exp * sp
                else:
                    for i in cutlass.range_constexpr(C):
                        acts[i] = sG[i, d].to(cutlass.Float32)
                for i in cutlass.range_constexpr(C):
                    if i < length:
                        G = G + acts[i]
                    fG[i, d] = G
                    if cutlass.const_expr(i == C // 2 - 1):
                        ref = G
                mGl[bid, h, d] = cute.math.exp(G, fastmath=True)
                big = flag_unfactorable(big, fG[0, d], ref, G, FACTOR_LIMIT)
                if big != 0:
                    unsafe[0] = big
            cute.arch.sync_threads()

            # ---- phase A: token-indexed outputs and phase B's operands -----------------------
            factored = unsafe[0] == 0
            outs_a = (mKdh, mKdl, mQg, mKg, mKd) if cutlass.const_expr(self.split) else (
                None, None, mQg, mKg, mKd)
            # thread t < K: columns 2p, 2p + 1 (p = t mod K/2) of one half of the rows, so the
            # bf16 tiles move as 32-bit pairs; G at rows C/2 - 1 and C - 1 is read before either
            # half overwrites its rows of fG
            HP = K // 2
            pair = tidx % HP
            half = tidx // HP
            gref = cute.make_rmem_tensor((2, 2), cutlass.Float32)  # (Gl, ref) x column
            if tidx < K:
                for c in cutlass.range_constexpr(2):
                    gref[0, c] = fG[C - 1, 2 * pair + c]
                    gref[1, c] = fG[C // 2 - 1, 2 * pair + c]
            cute.arch.sync_threads()
            if tidx < K:
                # one branch for the chunk, not one per row, so the rows' work overlaps
                args = (pair, gref, sQ, sK, fA, fB, fG, norm, outs_a, row0, h)
                if factored:
                    if half == 0:
                        self._output_pair(True, 0, *args)
                    else:
                        self._output_pair(True, 1, *args)
                else:
                    if half == 0:
                        self._output_pair(False, 0, *args)
                    else:
                        self._output_pair(False, 1, *args)
            if cutlass.const_expr(self.split):
                cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            if cutlass.const_expr(self.split):
                # qg and kg leave now; phases B and C run while the stores drain
                if warp == 0:
                    for tma, tX, sX in ((outs.tma_qg, outs.qg, sQ), (outs.tma_kg, outs.kg, sK)):
                        self._tile_store(tma, tX, self._as_qk(sX), (row0, h * K), (C, K))
                    cute.arch.cp_async_bulk_commit_group()

            # ---- phase B: L and Mqk ------------------------------------------------------
            if factored:
                if cutlass.const_expr(C == 16):
                    self._phase_b_ksplit(fA, fB, fG, sL, sBeta, mMq, sMq, row0, h, tidx, warp,
                                         lane, length)
                else:
                    # on warp MMA: 16 x 8 tiles of L and Mqk, dealt round-robin to the warps
                    MT, NTL = C // 16, C // 8
                    for tile in cutlass.range_constexpr(2 * MT * NTL):
                        if tile % (NT // 32) == warp:
                            self._phase_b_mma(fA, fB, fG, sL, sBeta, mMq, sMq, row0, h, lane,
                                              length, tile // (MT * NTL),
                                              (tile % (MT * NTL)) // NTL, tile % NTL)
            else:
                # strong decays: each term takes e^(G_i - G_j), two columns j per thread
                HC = C // 2
                for p in cutlass.range(tidx, C * HC, NT):
                    i = p // HC
                    j1 = p - i * HC
                    j2 = j1 + HC
                    l1 = cutlass.Float32(0.0)
                    l2 = cutlass.Float32(0.0)
                    m1 = cutlass.Float32(0.0)
                    m2 = cutlass.Float32(0.0)
                    if j1 <= i and i < length:
                        for d in cutlass.range(K, unroll=2):
                            gi = fG[i, d]
                            ki = fB[i, d]
                            qi = fA[i, d]
                            e1 = cute.math.exp(gi - fG[j1, d]) * fB[j1, d]
                            e2 = cute.math.exp(gi - fG[j2, d]) * fB[j2, d]
                            l1 = l1 + ki * e1
                            m1 = m1 + qi * e1
                            l2 = l2 + ki * e2
                            m2 = m2 + qi * e2
                    self._store_l(sL, sBeta, i, j1, l1, length)
                    self._store_l(sL, sBeta, i, j2, l2, length)
                    self._store_m(mMq, sMq, row0, h, i, j1, m1, length)
                    self._store_m(mMq, sMq, row0, h, i, j2, m2, length)
            cute.arch.sync_threads()

            self._phase_c(sL, sBeta, aw, row0, h, length, tidx)
            self._publish(outs.flags, tidx, warp, h, bid, bound)

    @cute.jit
    def _output_pair(self, factored: cutlass.Constexpr, half: cutlass.Constexpr, pair, gref,
                     sQ, sK, fA, fB, fG, norm, outs_a, row0, h):
        """Columns d = 2 pair + c (c = 0, 1) of rows half*C/2 .. half*C/2 + C/2 - 1: qg = scale
        qn e^G, kg = kn e^G, kd = kn e^(Gl - G) (zeros past the length, whose rows have zero
        norms: a whole chunk's rows are stored) and phase B's operands (factored: (qn e^(G - r),
        kn e^(G - r), kn e^(r - G)); otherwise (qn, kn, G)). gref holds (Gl, r) per column."""
        C = self.C
        f32 = cutlass.Float32
        mKdh, mKdl, mQg, mKg, mKd = outs_a
        vQ, vK = (cute.logical_divide(x, (None, 2)) for x in (sQ, sK))
        e_ref = cute.make_rmem_tensor((2,), f32)
        e_lr = cute.make_rmem_tensor((2,), f32)
        if cutlass.const_expr(factored):
            # one exponential and one reciprocal per element: e^G = e^(G - r) e^r and
            # e^(Gl - G) = e^(r - G) e^(Gl - r), every factor a normal float (|G - r| <= 80,
            # |r| <= 80: the chunk is not factored otherwise)
            for c in cutlass.range_constexpr(2):
                e_ref[c] = cute.math.exp(gref[1, c], fastmath=True)
                e_lr[c] = cute.math.exp(gref[0, c] - gref[1, c], fastmath=True)
        qs2 = cute.make_rmem_tensor((2,), f32)
        ke2 = cute.make_rmem_tensor((2,), f32)
        kd2 = cute.make_rmem_tensor((2,), f32)
        for ii in cutlass.range_constexpr(C // 2):
            i = half * (C // 2) + ii
            q2 = vQ[i, (None, pair)].load().to(f32)
            k2 = vK[i, (None, pair)].load().to(f32)
            for c in cutlass.range_constexpr(2):
                d = 2 * pair + c
                Gi = fG[i, d]
                qn = q2[c] * norm[i]
                kn = k2[c] * norm[C + i]
                if cutlass.const_expr(factored):
                    # the outputs: phase B's operands times a per-column constant
                    er = cute.math.exp(Gi - gref[1, c], fastmath=True)
                    inv = cute.arch.rcp_approx(er)
                    fa = qn * er
                    fb = kn * er
                    fg = kn * inv
                    fA[i, d] = fa
                    fB[i, d] = fb
                    fG[i, d] = fg
                    qs = fa * e_ref[c]
                    ke = fb * e_ref[c]
                    kd = fg * e_lr[c]
                else:
                    fA[i, d] = qn
                    fB[i, d] = kn
                    eg = cute.math.exp(Gi, fastmath=True)
                    qs = qn * eg
                    ke = kn * eg
                    kd = kn * cute.math.exp(gref[0, c] - Gi, fastmath=True)
                qs2[c] = qs
                ke2[c] = ke
                kd2[c] = kd
                if cutlass.const_expr(not self.split):
                    mQg[row0 + i, h, d] = qs
                    mKg[row0 + i, h, d] = ke
                    mKd[row0 + i, h, d] = kd
            if cutlass.const_expr(self.split):
                # qg and kg in place of the q and k tiles (only this thread reads these two
                # columns of these rows), as bf16 pairs, for the TMA stores; kd's planes
                # straight to the workspace (a warp writes 128 contiguous bytes of a row)
                self._store_row_pair(vQ, vK, (mKdh, mKdl), row0, h, i, pair, qs2, ke2, kd2)

    @cute.jit
    def _phase_b_ksplit(self, fA, fB, fG, sL, sBeta, mMq, sMq, row0, h, tidx, warp, lane,
                        length):
        """Chunk 16, factored: K split over the warps. Each converts its 32-column slabs of the
        three operands once and accumulates all four 16 x 8 tiles of L and Mqk; the partial
        tiles meet in smem (over fA, read by then) and one pass sums and stores them."""
        C, K, NT = self.C, self.K, self.threads
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        nred = min(self.num_warps, K // 32)
        mma = cute.make_tiled_mma(warp_mma.MmaF16BF16Op(bf16, f32, (16, 8, 16)))
        c_shape = mma.get_slice(lane).partition_shape_C((16, 8))
        accs = [cute.make_rmem_tensor(c_shape, f32) for _ in range(4)]
        self._phase_b_partials(fA, fB, fG, warp, lane, accs)
        cute.arch.sync_threads()
        sRed = cute.make_tensor(fA.iterator, cute.make_layout(
            (nred, 2, C, C), stride=(2 * C * C, C * C, C, 1)))
        if warp < nred:
            self._phase_b_spill(sRed, warp, lane, accs)
        cute.arch.sync_threads()
        for p in cutlass.range_constexpr(2 * C * C // NT):
            idx = tidx + p * NT
            prod = idx // (C * C)
            i = (idx - prod * C * C) // C
            j = idx - prod * C * C - i * C
            acc = cutlass.Float32(0.0)
            for w in cutlass.range_constexpr(nred):
                acc = acc + sRed[w, prod, i, j]
            if prod == 0:
                self._store_l(sL, sBeta, i, j, acc, length)
            else:
                self._store_m(mMq, sMq, row0, h, i, j, acc, length)

    @cute.jit
    def _phase_b_partials(self, fA, fB, fG, warp, lane, accs):
        """Chunk 16: this warp's share of L' = (kn e^(G-r))(kn e^(r-G))^T and Mqk' = (qn e^(G-r))
        (kn e^(r-G))^T over the 32-column slabs ks with ks % warps == warp, all four 16 x 8
        tiles ((L', Mqk') x (columns 0-7, 8-15)) into accs[2 * product + nt]."""
        KS = 32
        for acc in accs:
            acc.fill(0.0)
        for ks in cutlass.range_constexpr(self.K // KS):
            if ks % self.num_warps == warp:
                self._phase_b_block(fA, fB, fG, ks * KS, lane, accs, self.K + 1, KS)

    @cute.jit
    def _phase_b_mma(self, fA, fB, fG, sL, sBeta, mMq, sMq, row0, h, lane, length,
                     product: cutlass.Constexpr, mt: cutlass.Constexpr, nt: cutlass.Constexpr):
        """Tile (mt, nt) (16 x 8) of L = diag(beta) (kn e^(G-r))(kn e^(r-G))^T (product 0) or
        Mqk = scale (qn e^(G-r))(kn e^(r-G))^T (product 1), lower parts kept, by m16n8k16 bf16
        MMAs on hi/lo splits (hi*hi + hi*lo + lo*hi: ~16 mantissa bits, fp32 accumulation)."""
        K = self.K
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        KS = 32  # K slab per step: two k16 blocks
        mma = cute.make_tiled_mma(warp_mma.MmaF16BF16Op(bf16, f32, (16, 8, 16)))
        thr = mma.get_slice(lane)
        i0, j0 = mt * 16, nt * 8
        cA = thr.partition_A(cute.make_identity_tensor((16, KS)))  # (i - i0, d - slab)
        cB = thr.partition_B(cute.make_identity_tensor((8, KS)))  # (j - j0, d - slab)
        cC = thr.partition_C(cute.make_identity_tensor((16, 8)))  # (i - i0, j - j0)
        a_hi = cute.make_rmem_tensor(cA.shape, bf16)
        a_lo = cute.make_rmem_tensor(cA.shape, bf16)
        b_hi = cute.make_rmem_tensor(cB.shape, bf16)
        b_lo = cute.make_rmem_tensor(cB.shape, bf16)
        acc = cute.make_rmem_tensor(cC.shape, f32)
        acc.fill(0.0)
        for ks in cutlass.range_constexpr(K // KS):
            for e in cutlass.range_constexpr(cute.size(cA)):
                i, d = cA[e]
                if cutlass.const_expr(product == 0):
                    x = fB[i0 + i, ks * KS + d]
                else:
                    x = fA[i0 + i, ks * KS + d]
                hi = x.to(bf16)
                a_hi[e] = hi
                a_lo[e] = (x - hi.to(f32)).to(bf16)
            for e in cutlass.range_constexpr(cute.size(cB)):
                jj, d = cB[e]
                x = fG[j0 + jj, ks * KS + d]
                hi = x.to(bf16)
                b_hi[e] = hi
                b_lo[e] = (x - hi.to(f32)).to(bf16)
            cute.gemm(mma, acc, a_hi, b_hi, acc)
            cute.gemm(mma, acc, a_hi, b_lo, acc)
            cute.gemm(mma, acc, a_lo, b_hi, acc)
        for e in cutlass.range_constexpr(cute.size(cC)):
            i, jj = cC[e]
            if cutlass.const_expr(product == 0):
                self._store_l(sL, sBeta, i0 + i, j0 + jj, acc[e], length)
            else:
                self._store_m(mMq, sMq, row0, h, i0 + i, j0 + jj, acc[e], length)


class KdaPrepSm90(KdaPrepSm90OnePass):
    """The f32-operand K1 (for the SIMT K2): the one-pass kernel with plain stores of its fp32
    outputs."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (T, H*K) bf16, row stride dynamic
        mK: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,  # (T, H) bf16, row stride dynamic
        mALog: cute.Tensor,  # (H,) fp32, bf16 or fp16 (a_log_dtype)
        mDtBias: cute.Tensor,  # (H*K,) likewise (dt_bias_dtype)
        mCuSeq: cute.Tensor,  # (N+1,) int32
        mCuChunk: cute.Tensor,  # (N+1,) int32
        mQg: cute.Tensor,  # (R, H, K) fp32: R rows of whole chunks
        mKg: cute.Tensor,
        mKd: cute.Tensor,
        mGl: cute.Tensor,  # (num_chunks, H, K) fp32
        mAw: cute.Tensor,  # (R, H, C) fp32
        mMq: cute.Tensor,
        mFlags: cute.Tensor,  # (num_chunks * H,) int32: a (chunk, head)'s flag, set when written
        num_seqs: cutlass.Int32,
        seq_len: cutlass.Int32,
        num_chunks: cutlass.Int32,
        num_heads: cutlass.Int32,
        scale: cutlass.Float32,
        lower_bound: cutlass.Float32,
        gate_mode: cutlass.Int32,
        qk_l2norm: cutlass.Int32,
        beta_sigmoid: cutlass.Int32,
        a_log_dtype: cutlass.Int32,  # how A_log and dt_bias are held (abi.GATE_PARAM_DTYPES)
        dt_bias_dtype: cutlass.Int32,
        stream,
    ):
        loads, s_tile = self._make_loads(mQ, mK, mG)
        self._launch((Loads(*loads), Raw(mBeta, mALog, mDtBias), Offsets(mCuSeq, mCuChunk),
                      F32Outs(mQg, mKg, mKd, mGl, mAw, mMq, mFlags), Batch(num_seqs, seq_len),
                      Modes(scale, lower_bound, gate_mode, qk_l2norm, beta_sigmoid, a_log_dtype,
                            dt_bias_dtype), s_tile),
                     num_chunks, num_heads, stream)

    @cute.kernel
    def kernel(self, loads: Loads, raw: Raw, offsets: Offsets, outs: F32Outs, batch: Batch,
               modes: Modes, s_tile: cute.Layout):
        self._body(loads, raw, offsets, outs, batch, modes, s_tile)
