"""K2: the sequential chunk recurrence of the KDA forward (sm_90a).

One CTA per (block of `block_v` state rows, head, sequence); the V rows of the state evolve
independently, so splitting V multiplies the parallelism of the recurrence. The state tile
(block_v x K) stays in fp32 registers for the whole sequence: thread t owns row t // tpr and the
K / tpr columns d = t % tpr + tpr * m, so a row's dot products reduce over `tpr` adjacent lanes.

Pipeline: `stages` smem buffers, each filled by TMA (kg, qg, kd, Aw, Mq, gl tiles from K1's
workspace and the v tile) on its own mbarrier; one elected thread issues chunk c + stages - 1
once every thread has left chunk c - 1 (a CTA barrier frees the buffer).
Per chunk (tokens i < length only; rows past it belong to another sequence or are out of bounds):
  W = v - kg S^T ; U = Aw W ; O = qg S^T + Mq U ; S = S * gl + U^T kd
The states are dense or a pool's slots, as the tensor-core K2's (kernels.common.StateSlots): a
padding row reads and writes no state and writes zeros as its output.
Constraints: see kda_cute.specs.recur.supports.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils

from kda_cute.specs.recur import INDEX_POOL, STATE_BF16, STATE_F32, RecurConfig
from kernels.common import ChunkTileLoader, StateSlots


class KdaRecurSm90(ChunkTileLoader, StateSlots):
    def __init__(self, cfg: RecurConfig):
        self.cfg = cfg
        self.K, self.V = cfg.head_dim_k, cfg.head_dim_v
        self.C, self.BV = cfg.chunk, cfg.block_v
        self.threads, self.stages = cfg.threads, cfg.stages
        self.tpr = cfg.threads // cfg.block_v  # threads per state row
        self.cols = self.K // self.tpr  # state columns per thread
        self.tpr_log2 = self.tpr.bit_length() - 1
        self.smem_bytes = 0
        self.tma_meta = []

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mKg: cute.Tensor,  # (T, H*K) fp32, K1 workspace
        mQg: cute.Tensor,
        mKd: cute.Tensor,
        mAw: cute.Tensor,  # (T, H*C) fp32
        mMq: cute.Tensor,
        mGl: cute.Tensor,  # (num_chunks, H*K) fp32
        mV: cute.Tensor,  # (T, H*V) bf16, row stride dynamic
        mOut: cute.Tensor,  # (T, H, V) bf16, row stride dynamic
        mS0f: cute.Tensor,  # (N_s, H, V, K) fp32 / bf16 initial state (one of them used)
        mS0h: cute.Tensor,
        mS1f: cute.Tensor,  # final state, same convention
        mS1h: cute.Tensor,
        mCuSeq: cute.Tensor,  # (N+1,) int32
        mCuChunk: cute.Tensor,  # (N+1,) int32
        # the pool form (kernels.common.StateSlots): index tables, has_init, error words
        mRIdx: cute.Tensor, mWIdx: cute.Tensor, mHasInit: cute.Tensor, mErr: cute.Tensor,
        num_seqs: cutlass.Int32,
        num_heads: cutlass.Int32,
        state_in: cutlass.Int32,  # STATE_NONE / STATE_F32 / STATE_BF16
        state_out: cutlass.Int32,
        index_mode: cutlass.Int32, row_div: cutlass.Int32, slots: cutlass.Int32,
        r_sn: cutlass.Int32, r_wide: cutlass.Int32, w_on: cutlass.Int32, w_sn: cutlass.Int32,
        w_wide: cutlass.Int32, hi_on: cutlass.Int32, null_min: cutlass.Int32,
        stream,
    ):
        C, K, BV, S = self.C, self.K, self.BV, self.stages
        (tma_kg, tKg, tma_qg, tQg, tma_kd, tKd, tma_aw, tAw, tma_mq, tMq, tma_gl, tGl, tma_v,
         tV), (l_ck, l_cc, l_1k, l_cv) = self._make_loads(mKg, mQg, mKd, mAw, mMq, mGl, mV)

        @cute.struct
        class SharedStorage:
            full: cute.struct.MemRange[cutlass.Int64, S]
            sKg: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, S * C * K], 128]
            sQg: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, S * C * K], 128]
            sKd: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, S * C * K], 128]
            sAw: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, S * C * C], 128]
            sMq: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, S * C * C], 128]
            sGl: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, S * K], 128]
            sV: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, S * C * BV], 128]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        self.kernel(
            tma_kg, tKg, tma_qg, tQg, tma_kd, tKd, tma_aw, tAw, tma_mq, tMq, tma_gl, tGl,
            tma_v, tV, mOut, mS0f, mS0h, mS1f, mS1h, mCuSeq, mCuChunk, mRIdx, mWIdx, mHasInit,
            mErr, state_in, state_out, index_mode, row_div, slots, r_sn, r_wide, w_on, w_sn,
            w_wide, hi_on, null_min, l_ck, l_cc, l_1k, l_cv,
        ).launch(
            grid=(self.V // BV, num_heads, num_seqs), block=(self.threads, 1, 1),
            smem=self.smem_bytes, stream=stream,
        )

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        tma_kg: cute.CopyAtom, tKg: cute.Tensor,
        tma_qg: cute.CopyAtom, tQg: cute.Tensor,
        tma_kd: cute.CopyAtom, tKd: cute.Tensor,
        tma_aw: cute.CopyAtom, tAw: cute.Tensor,
        tma_mq: cute.CopyAtom, tMq: cute.Tensor,
        tma_gl: cute.CopyAtom, tGl: cute.Tensor,
        tma_v: cute.CopyAtom, tV: cute.Tensor,
        mOut: cute.Tensor,
        mS0f: cute.Tensor, mS0h: cute.Tensor, mS1f: cute.Tensor, mS1h: cute.Tensor,
        mCuSeq: cute.Tensor, mCuChunk: cute.Tensor,
        mRIdx: cute.Tensor, mWIdx: cute.Tensor, mHasInit: cute.Tensor, mErr: cute.Tensor,
        state_in: cutlass.Int32, state_out: cutlass.Int32,
        index_mode: cutlass.Int32, row_div: cutlass.Int32, slots: cutlass.Int32,
        r_sn: cutlass.Int32, r_wide: cutlass.Int32, w_on: cutlass.Int32, w_sn: cutlass.Int32,
        w_wide: cutlass.Int32, hi_on: cutlass.Int32, null_min: cutlass.Int32,
        l_ck: cute.Layout, l_cc: cute.Layout, l_1k: cute.Layout, l_cv: cute.Layout,
    ):
        C, K, BV, S = self.C, self.K, self.BV, self.stages
        TPR, NCOL = self.tpr, self.cols
        tidx, _, _ = cute.arch.thread_idx()
        vb, h, seq = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        row = tidx // TPR
        sub = tidx - row * TPR
        v_idx = vb * BV + row

        bos = mCuSeq[seq]
        eos = mCuSeq[seq + 1]
        chunk0 = mCuChunk[seq]

        smem = utils.SmemAllocator()
        st = smem.allocate(self.shared_storage)
        full = st.full.data_ptr()

        def staged(layout):
            return cute.append(layout, cute.make_layout(S, stride=cute.cosize(layout)))

        sKg = st.sKg.get_tensor(staged(l_ck))
        sQg = st.sQg.get_tensor(staged(l_ck))
        sKd = st.sKd.get_tensor(staged(l_ck))
        sAw = st.sAw.get_tensor(staged(l_cc))
        sMq = st.sMq.get_tensor(staged(l_cc))
        sGl = st.sGl.get_tensor(staged(l_1k))
        sV = st.sV.get_tensor(staged(l_cv))

        if warp == 0:
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(S):
                    cute.arch.mbarrier_init(full + s, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        loads = (
            (tma_kg, tKg, sKg, K, C), (tma_qg, tQg, sQg, K, C), (tma_kd, tKd, sKd, K, C),
            (tma_aw, tAw, sAw, C, C), (tma_mq, tMq, sMq, C, C),
        )
        head_cols = (h * K, h * K, h * K, h * C, h * C)

        # ---- the state's rows (a padding row: none, zero outputs) ------------------------
        idx = (index_mode, row_div, slots, r_sn, r_wide, w_on, w_sn, w_wide, hi_on, null_min)
        lead = cutlass.Int32(0)
        if tidx == 0 and vb == 0 and h == 0 and index_mode == INDEX_POOL:
            lead = cutlass.Int32(1)
        live, rs, ws, init = self._slots(mRIdx, mWIdx, mHasInit, mErr, seq, idx, lead)
        s_in = state_in
        s_out = state_out
        if live == 0 or init == 0:
            s_in = cutlass.Int32(0)
        if live == 0:
            s_out = cutlass.Int32(0)
            self._zero_rows(mOut, bos, eos, h, vb * BV, tidx, self.threads)
        num_chunks = (eos - bos + C - 1) // C * live  # a padding row runs no chunk

        # ---- initial state -> registers ------------------------------------------------
        state = cute.make_rmem_tensor((NCOL,), cutlass.Float32)
        for m in cutlass.range_constexpr(NCOL):
            d = sub + TPR * m
            x = cutlass.Float32(0.0)
            if s_in == STATE_F32:
                x = mS0f[rs, h, v_idx, d]
            elif s_in == STATE_BF16:
                x = mS0h[rs, h, v_idx, d].to(cutlass.Float32)
            state[m] = x

        # ---- prologue: fill all but one stage --------------------------------------------
        if warp == 0:
            for c in cutlass.range_constexpr(S - 1):
                if c < num_chunks:
                    self._issue(c, bos, chunk0 + c, loads, head_cols, tma_gl, tGl, sGl, h * K,
                                tma_v, tV, sV, h * self.V + vb * BV, full)

        w = cute.make_rmem_tensor((C,), cutlass.Float32)
        u = cute.make_rmem_tensor((C,), cutlass.Float32)
        o = cute.make_rmem_tensor((C,), cutlass.Float32)
        for c in cutlass.range(num_chunks):
            # every thread is done with chunk c - 1, whose buffer chunk c + S - 1 reuses
            cute.arch.sync_threads()
            if warp == 0:
                if c + S - 1 < num_chunks:
                    self._issue(c + S - 1, bos, chunk0 + c + S - 1, loads, head_cols, tma_gl,
                                tGl, sGl, h * K, tma_v, tV, sV, h * self.V + vb * BV, full)
            s = c % S
            cute.arch.mbarrier_wait(full + s, (c // S) % 2)
            t0 = bos + c * C
            length = cutlass.min(C, eos - t0)

            # W = v - kg S^T and qg S^T, reduced over the tpr lanes of a row
            for i in cutlass.range_constexpr(C):
                pw = cutlass.Float32(0.0)
                po = cutlass.Float32(0.0)
                if i < length:
                    for m in cutlass.range_constexpr(NCOL):
                        d = sub + TPR * m
                        pw = pw + sKg[i, d, s] * state[m]
                        po = po + sQg[i, d, s] * state[m]
                    for k in cutlass.range_constexpr(self.tpr_log2):
                        pw = pw + cute.arch.shuffle_sync_bfly(pw, offset=1 << k)
                        po = po + cute.arch.shuffle_sync_bfly(po, offset=1 << k)
                    pw = sV[i, row, s].to(cutlass.Float32) - pw
                w[i] = pw
                o[i] = po
            # U = Aw W (lower triangular; rows and columns past `length` are zero)
            for i in cutlass.range_constexpr(C):
                acc = cutlass.Float32(0.0)
                if i < length:
                    for j in cutlass.range_constexpr(i + 1):
                        acc = acc + sAw[i, j, s] * w[j]
                u[i] = acc
            # O = qg S^T + Mq U; lane `sub` of the row writes tokens i = sub (mod tpr)
            for i in cutlass.range_constexpr(C):
                if i < length:
                    acc = o[i]
                    for j in cutlass.range_constexpr(i + 1):
                        acc = acc + sMq[i, j, s] * u[j]
                    if sub == i % TPR:
                        mOut[t0 + i, h, v_idx] = acc.to(cutlass.BFloat16)
            # S = S * gl + U^T kd
            for m in cutlass.range_constexpr(NCOL):
                d = sub + TPR * m
                acc = state[m] * sGl[0, d, s]
                for i in cutlass.range_constexpr(C):
                    if i < length:
                        acc = acc + u[i] * sKd[i, d, s]
                state[m] = acc

        # ---- final state ----------------------------------------------------------------
        for m in cutlass.range_constexpr(NCOL):
            d = sub + TPR * m
            if s_out == STATE_F32:
                mS1f[ws, h, v_idx, d] = state[m]
            elif s_out == STATE_BF16:
                mS1h[ws, h, v_idx, d] = state[m].to(cutlass.BFloat16)
