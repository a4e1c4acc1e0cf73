"""The segments' combine of the few-heads K2 (kda_cute.segments), on the GPU (sm_90a).

K2's first two runs over the segments of each sequence leave each segment's end state from zero
B_j [V, K] and its state map A_j [K, K]; the start states follow serially,
S_start(0) = S0 (or 0), S_start(j + 1) = S_start(j) A_j + B_j, and the last is the final state.
One launch replaces P batched matmuls and their host calls. The state's V rows are
independent: one CTA per (block of `rows` state rows, head, sequence), one thread per key
column t. Per segment each thread writes its column of the start rows, the rows go to smem
(k-major, so one k's `rows` values are a broadcast vector), and the next rows' column t is
B_j[:, t] + sum over k of S[:, k] A_j[k, t], in fp32 on the CUDA cores (K fused multiply-adds
per row, in k order), A_j's row k read by the CTA's threads as one coalesced row. The maps do
not depend on the rows, so each thread streams its column of them through registers, up to 128
values ahead of the FMAs that use them, across segments (with a few loads in flight at a time it
waited on L2 once per few rows: docs/notes/schedules.md, "The segments' combine, streaming").
The initial state is read and the final state written in fp32 or bf16, dense or at a pool's
slots (kernels.common.StateSlots: a padding row reads and writes neither, its start states are
those from zero).
Constraints: head_dim_k a multiple of 32 up to 256, rows dividing it (specs.combine.supports).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils

from kda_cute.specs.combine import CombineConfig
from kda_cute.specs.recur import INDEX_POOL, STATE_BF16, STATE_F32, STATE_NONE
from kernels.common import StateSlots


class KdaCombineSm90(StateSlots):
    def __init__(self, cfg: CombineConfig):
        self.cfg = cfg
        self.K = cfg.head_dim_k
        self.RB = cfg.rows
        # A_j's rows per register piece, and pieces in flight (D divides K / KB)
        self.KB = 32
        self.D = min(4, self.K // self.KB)
        self.smem_bytes = 0
        self.tma_meta = []

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # (N*P, H, K, K) fp32: the segments' state maps
        mB: cute.Tensor,  # (N*P, H, K, K) fp32: their end states from zero (V = K rows)
        mS0f: cute.Tensor, mS0h: cute.Tensor,  # (N or slots, H, K, K) the initial state
        mStart: cute.Tensor,  # (N*P, H, K, K) fp32: each segment's start state
        mFinal: cute.Tensor, mFinalH: cute.Tensor,  # the final state, as the initial one
        mRIdx: cute.Tensor, mWIdx: cute.Tensor, mHasInit: cute.Tensor, mErr: cute.Tensor,
        segments: cutlass.Int32,
        state_in: cutlass.Int32,  # STATE_NONE / STATE_F32 / STATE_BF16
        state_out: cutlass.Int32,
        index_mode: cutlass.Int32, row_div: cutlass.Int32, slots: cutlass.Int32,
        r_sn: cutlass.Int32, r_wide: cutlass.Int32, w_on: cutlass.Int32, w_sn: cutlass.Int32,
        w_wide: cutlass.Int32, hi_on: cutlass.Int32, null_min: cutlass.Int32,
        num_seqs: cutlass.Int32,
        num_heads: cutlass.Int32,
        stream,
    ):
        K, RB = self.K, self.RB

        @cute.struct
        class SharedStorage:
            rows: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, K * RB], 16]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        self.kernel(mA, mB, mS0f, mS0h, mStart, mFinal, mFinalH, mRIdx, mWIdx, mHasInit, mErr,
                    segments, state_in, state_out, index_mode, row_div, slots, r_sn, r_wide,
                    w_on, w_sn, w_wide, hi_on, null_min).launch(
            grid=(K // RB, num_heads, num_seqs), block=(K, 1, 1), smem=self.smem_bytes,
            stream=stream,
        )

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mA: cute.Tensor, mB: cute.Tensor, mS0f: cute.Tensor, mS0h: cute.Tensor,
               mStart: cute.Tensor, mFinal: cute.Tensor, mFinalH: cute.Tensor,
               mRIdx: cute.Tensor, mWIdx: cute.Tensor, mHasInit: cute.Tensor,
               mErr: cute.Tensor, segments: cutlass.Int32, state_in: cutlass.Int32,
               state_out: cutlass.Int32, index_mode: cutlass.Int32, row_div: cutlass.Int32,
               slots: cutlass.Int32, r_sn: cutlass.Int32, r_wide: cutlass.Int32,
               w_on: cutlass.Int32, w_sn: cutlass.Int32, w_wide: cutlass.Int32,
               hi_on: cutlass.Int32, null_min: cutlass.Int32):
        K, RB = self.K, self.RB
        f32 = cutlass.Float32
        t, _, _ = cute.arch.thread_idx()
        rb, h, b = cute.arch.block_idx()
        r0 = rb * RB
        smem = utils.SmemAllocator()
        st = smem.allocate(self.shared_storage)
        sRows = st.rows.get_tensor(cute.make_layout((K, RB), stride=(RB, 1)))  # [k, row]

        lead = cutlass.Int32(0)
        if t == 0 and rb == 0 and h == 0 and index_mode == INDEX_POOL:
            lead = cutlass.Int32(1)
        live, rs, ws, init = self._slots(
            mRIdx, mWIdx, mHasInit, mErr, b,
            (index_mode, row_div, slots, r_sn, r_wide, w_on, w_sn, w_wide, hi_on, null_min), lead)
        s_in = state_in
        if live == 0 or init == 0:
            s_in = cutlass.Int32(STATE_NONE)
        acc = cute.make_rmem_tensor((RB,), f32)  # column t of the current rows
        for r in cutlass.range_constexpr(RB):
            acc[r] = f32(0.0)
        if s_in == STATE_F32:
            for r in cutlass.range_constexpr(RB):
                acc[r] = mS0f[rs, h, r0 + r, t]
        elif s_in == STATE_BF16:
            for r in cutlass.range_constexpr(RB):
                acc[r] = mS0h[rs, h, r0 + r, t].to(f32)
        # A_j's column t streams through registers in pieces of KB rows, D pieces ahead of
        # their use (across segments: the maps do not depend on the rows), so the loads are
        # in flight while the FMAs run instead of a few at a time before them; B_j's rows one
        # segment ahead likewise
        KB, NQ, D = self.KB, K // self.KB, self.D
        ring = cute.make_rmem_tensor((D * KB,), f32)
        b_next = cute.make_rmem_tensor((RB,), f32)
        n0 = b * segments
        for q in cutlass.range_constexpr(D):
            for i in cutlass.range_constexpr(KB):
                ring[q * KB + i] = mA[n0, h, q * KB + i, t]
        for r in cutlass.range_constexpr(RB):
            b_next[r] = mB[n0, h, r0 + r, t]
        for j in cutlass.range(segments):
            n = n0 + j
            for r in cutlass.range_constexpr(RB):
                mStart[n, h, r0 + r, t] = acc[r]
            sRows[t, None].store(acc.load())
            cute.arch.sync_threads()
            for r in cutlass.range_constexpr(RB):
                acc[r] = b_next[r]
            more = j + 1 < segments
            if more:
                for r in cutlass.range_constexpr(RB):
                    b_next[r] = mB[n + 1, h, r0 + r, t]
            for q in cutlass.range_constexpr(NQ):
                slot = q % D
                for i in cutlass.range_constexpr(KB):
                    s = sRows[q * KB + i, None].load()
                    a = ring[slot * KB + i]
                    for r in cutlass.range_constexpr(RB):
                        acc[r] = acc[r] + s[r] * a
                # the slot takes the piece D further on: this segment's, or the next one's
                if cutlass.const_expr(q + D < NQ):
                    for i in cutlass.range_constexpr(KB):
                        ring[slot * KB + i] = mA[n, h, (q + D) * KB + i, t]
                else:
                    if more:
                        for i in cutlass.range_constexpr(KB):
                            ring[slot * KB + i] = mA[n + 1, h, (q + D - NQ) * KB + i, t]
            cute.arch.sync_threads()  # every thread has read the rows before they change
        if live != 0:
            if state_out == STATE_F32:
                for r in cutlass.range_constexpr(RB):
                    mFinal[ws, h, r0 + r, t] = acc[r]
            elif state_out == STATE_BF16:
                for r in cutlass.range_constexpr(RB):
                    mFinalH[ws, h, r0 + r, t] = acc[r].to(cutlass.BFloat16)
