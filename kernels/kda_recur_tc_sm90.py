"""K2 on tensor cores: the chunk recurrence with the state products on bf16 warpgroup MMA (sm_90a).

One CTA (one warpgroup, 128 threads) per (block of 64 state rows, head, sequence). The state is
kept transposed-free as S [64 rows of V, K] in the fp32 accumulator registers of the update MMA, so
every product has the 64-row side wgmma needs (M = 64):
  P  = S kg^T   (M 64, N chunk, reduction K)      bf16 operands, fp32 accumulate
  Pq = S qg^T   (same)
  W^T = v^T - P ; U^T = W^T Aw^T ; O^T = Pq + U^T Mq^T     fp32 on the CUDA cores (chunk x chunk)
  S = S * gl + U^T kd  (M 64, N K, reduction chunk)  as three bf16 MMAs on hi/lo splits of U and kd
The hi/lo split keeps the final state at fp32 accuracy (bench/NOTES.md: bf16 U and kd alone put the
state error at the 2.5e-3 bar; the output tolerates bf16 operands).

Loads: the same `stages`-deep TMA + mbarrier pipeline of K1's fp32 workspace tiles as the SIMT K2
(same kernel arguments, same launcher); threads convert each tile into the swizzled bf16 operand
buffers. kd is read as an MN-major B operand, so it needs no transpose.
Constraints: block_v == 64, threads == 128, head_dim_k % 64 == 0, chunk % 16 == 0.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum

from kda_cute.config import RecurConfig
from kernels.common import ChunkTileLoader

STATE_NONE, STATE_F32, STATE_BF16 = 0, 1, 2


class KdaRecurTcSm90(ChunkTileLoader):
    def __init__(self, cfg: RecurConfig):
        self.cfg = cfg
        self.K, self.V = cfg.head_dim_k, cfg.head_dim_v
        self.C, self.BV = cfg.chunk, cfg.block_v
        self.threads, self.stages = cfg.threads, cfg.stages
        self.smem_bytes = 0
        self.tma_meta = []

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mKg: cute.Tensor, mQg: cute.Tensor, mKd: cute.Tensor,
        mAw: cute.Tensor, mMq: cute.Tensor, mGl: cute.Tensor, mV: cute.Tensor,
        mOut: cute.Tensor,
        mS0f: cute.Tensor, mS0h: cute.Tensor, mS1f: cute.Tensor, mS1h: cute.Tensor,
        mCuSeq: cute.Tensor, mCuChunk: cute.Tensor,
        num_seqs: cutlass.Int32, num_heads: cutlass.Int32,
        state_in: cutlass.Int32, state_out: cutlass.Int32,
        stream,
    ):
        C, K, BV, S = self.C, self.K, self.BV, self.stages
        bf16 = cutlass.BFloat16
        (tma_kg, tKg, tma_qg, tQg, tma_kd, tKd, tma_aw, tAw, tma_mq, tMq, tma_gl, tGl, tma_v,
         tV), (l_ck, l_cc, l_1k, l_cv) = self._make_loads(mKg, mQg, mKd, mAw, mMq, mGl, mV)

        # P = S kg^T: A = S [BV, K] K-major, B = kg [C, K] K-major
        mma_p = sm90_utils.make_trivial_tiled_mma(
            bf16, bf16, LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(), cutlass.Float32, (1, 1, 1),
            tiler_mn=(BV, C))
        # S += U^T kd: A = U^T [BV, C] K-major, B = kd [C, K] read as [K, C] MN-major
        mma_s = sm90_utils.make_trivial_tiled_mma(
            bf16, bf16, LayoutEnum.ROW_MAJOR.sm90_mma_major_mode(),
            LayoutEnum.COL_MAJOR.sm90_mma_major_mode(), cutlass.Float32, (1, 1, 1),
            tiler_mn=(BV, K))
        l_sS = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BV, C, K), bf16, 1)
        l_sKg = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BV, C, K), bf16, 1)
        l_sU = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BV, K, C), bf16, 1)
        l_sKd = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (BV, K, C), bf16, 1)
        l_f = cute.make_layout((BV, C), stride=(C + 1, 1))  # fp32 W^T / U^T, padded rows

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
            bS: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_sS)], 1024]
            bKg: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_sKg)], 1024]
            bQg: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_sKg)], 1024]
            bKdHi: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_sKd)], 1024]
            bKdLo: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_sKd)], 1024]
            bUHi: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_sU)], 1024]
            bULo: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(l_sU)], 1024]
            fW: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(l_f)], 16]
            fU: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(l_f)], 16]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        self.kernel(
            tma_kg, tKg, tma_qg, tQg, tma_kd, tKd, tma_aw, tAw, tma_mq, tMq, tma_gl, tGl,
            tma_v, tV, mOut, mS0f, mS0h, mS1f, mS1h, mCuSeq, mCuChunk, state_in, state_out,
            mma_p, mma_s, l_ck, l_cc, l_1k, l_cv, l_sS, l_sKg, l_sU, l_sKd, l_f,
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
        state_in: cutlass.Int32, state_out: cutlass.Int32,
        mma_p: cute.TiledMma, mma_s: cute.TiledMma,
        l_ck: cute.Layout, l_cc: cute.Layout, l_1k: cute.Layout, l_cv: cute.Layout,
        l_sS: cute.ComposedLayout, l_sKg: cute.ComposedLayout, l_sU: cute.ComposedLayout,
        l_sKd: cute.ComposedLayout, l_f: cute.Layout,
    ):
        C, K, BV, S, NT = self.C, self.K, self.BV, self.stages, self.threads
        bf16 = cutlass.BFloat16
        tidx, _, _ = cute.arch.thread_idx()
        vb, h, seq = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        v0 = vb * BV

        bos = mCuSeq[seq]
        eos = mCuSeq[seq + 1]
        chunk0 = mCuChunk[seq]
        num_chunks = (eos - bos + C - 1) // C

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
        bS = st.bS.get_tensor(l_sS.outer, swizzle=l_sS.inner)  # (BV, K, 1)
        bKg = st.bKg.get_tensor(l_sKg.outer, swizzle=l_sKg.inner)  # (C, K, 1)
        bQg = st.bQg.get_tensor(l_sKg.outer, swizzle=l_sKg.inner)
        bKdHi = st.bKdHi.get_tensor(l_sKd.outer, swizzle=l_sKd.inner)  # (K, C, 1)
        bKdLo = st.bKdLo.get_tensor(l_sKd.outer, swizzle=l_sKd.inner)
        bUHi = st.bUHi.get_tensor(l_sU.outer, swizzle=l_sU.inner)  # (BV, C, 1)
        bULo = st.bULo.get_tensor(l_sU.outer, swizzle=l_sU.inner)
        fW = st.fW.get_tensor(l_f)
        fU = st.fU.get_tensor(l_f)

        if warp == 0:
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(S):
                    cute.arch.mbarrier_init(full + s, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # ---- MMA partitions --------------------------------------------------------------
        wg_p = mma_p.get_slice(0)  # A/B smem descriptors are per warpgroup
        wg_s = mma_s.get_slice(0)
        thr_p = mma_p.get_slice(tidx)
        thr_s = mma_s.get_slice(tidx)
        rA_p = mma_p.make_fragment_A(wg_p.partition_A(bS))
        rB_kg = mma_p.make_fragment_B(wg_p.partition_B(bKg))
        rB_qg = mma_p.make_fragment_B(wg_p.partition_B(bQg))
        rA_uhi = mma_s.make_fragment_A(wg_s.partition_A(bUHi))
        rA_ulo = mma_s.make_fragment_A(wg_s.partition_A(bULo))
        rB_kdhi = mma_s.make_fragment_B(wg_s.partition_B(bKdHi))
        rB_kdlo = mma_s.make_fragment_B(wg_s.partition_B(bKdLo))
        cP = thr_p.partition_C(cute.make_identity_tensor((BV, C)))  # (row, token) per element
        cS = thr_s.partition_C(cute.make_identity_tensor((BV, K)))  # (row, key) per element
        acc_p = cute.make_rmem_tensor(cP.shape, cutlass.Float32)
        acc_q = cute.make_rmem_tensor(cP.shape, cutlass.Float32)
        acc_s = cute.make_rmem_tensor(cS.shape, cutlass.Float32)
        # S as the A operand of P: the thread's accumulator elements land where partition_C of
        # the (BV, K) smem view puts them
        tSbS = thr_s.partition_C(cute.slice_(bS, (None, None, 0)))

        loads = (
            (tma_kg, tKg, sKg, K, C), (tma_qg, tQg, sQg, K, C), (tma_kd, tKd, sKd, K, C),
            (tma_aw, tAw, sAw, C, C), (tma_mq, tMq, sMq, C, C),
        )
        head_cols = (h * K, h * K, h * K, h * C, h * C)

        # ---- initial state -> accumulator registers ----------------------------------------
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            r, d = cS[e]
            x = cutlass.Float32(0.0)
            if state_in == STATE_F32:
                x = mS0f[seq, h, v0 + r, d]
            elif state_in == STATE_BF16:
                x = mS0h[seq, h, v0 + r, d].to(cutlass.Float32)
            acc_s[e] = x

        if warp == 0:
            for c in cutlass.range_constexpr(S - 1):
                if c < num_chunks:
                    self._issue(c, bos, chunk0 + c, loads, head_cols, tma_gl, tGl, sGl, h * K,
                                tma_v, tV, sV, h * self.V + v0, full)

        for c in cutlass.range(num_chunks):
            cute.arch.sync_threads()  # buffer (c - 1) % S is free: refill it
            if warp == 0:
                if c + S - 1 < num_chunks:
                    self._issue(c + S - 1, bos, chunk0 + c + S - 1, loads, head_cols, tma_gl,
                                tGl, sGl, h * K, tma_v, tV, sV, h * self.V + v0, full)
            s = c % S
            cute.arch.mbarrier_wait(full + s, (c // S) % 2)
            t0 = bos + c * C
            length = cutlass.min(C, eos - t0)

            # ---- operands to bf16: S (from registers), kg, qg, kd hi/lo ------------------
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                tSbS[e] = acc_s[e].to(bf16)
            for p in cutlass.range_constexpr(C * K // NT):
                idx = tidx + p * NT
                i = idx // K
                d = idx - i * K
                bKg[i, d, 0] = sKg[i, d, s].to(bf16)
                bQg[i, d, 0] = sQg[i, d, s].to(bf16)
                # kd rows past `length` meet U^T columns that are zero; zero them too, since a
                # workspace row no sequence covers may hold NaN bits (0 * NaN = NaN)
                x = cutlass.Float32(0.0)
                if i < length:
                    x = sKd[i, d, s]
                hi = x.to(bf16)
                bKdHi[d, i, 0] = hi
                bKdLo[d, i, 0] = (x - hi.to(cutlass.Float32)).to(bf16)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()

            # ---- P = S kg^T, Pq = S qg^T -------------------------------------------------
            self._gemm(mma_p, acc_p, rA_p, rB_kg, False)
            self._gemm(mma_p, acc_q, rA_p, rB_qg, False)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

            # ---- W^T = v^T - P (tokens past `length` are zero) -----------------------------
            for e in cutlass.range_constexpr(cute.size(acc_p)):
                r, i = cP[e]
                w = cutlass.Float32(0.0)
                if i < length:
                    w = sV[i, r, s].to(cutlass.Float32) - acc_p[e]
                fW[r, i] = w
            cute.arch.sync_threads()

            # ---- U^T = W^T Aw^T in fp32; hi/lo bf16 copies for the update ------------------
            for p in cutlass.range_constexpr(BV * C // NT):
                idx = tidx + p * NT
                r = idx // C
                i = idx - r * C
                u = cutlass.Float32(0.0)
                if i < length:
                    for j in cutlass.range_constexpr(C):
                        if j <= i:
                            u = u + fW[r, j] * sAw[i, j, s]
                fU[r, i] = u
                hi = u.to(bf16)
                bUHi[r, i, 0] = hi
                bULo[r, i, 0] = (u - hi.to(cutlass.Float32)).to(bf16)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()

            # ---- O^T = Pq + U^T Mq^T -> out ------------------------------------------------
            for e in cutlass.range_constexpr(cute.size(acc_q)):
                r, i = cP[e]
                if i < length:
                    o = acc_q[e]
                    for j in cutlass.range_constexpr(C):
                        if j <= i:
                            o = o + fU[r, j] * sMq[i, j, s]
                    mOut[t0 + i, h, v0 + r] = o.to(bf16)

            # ---- S = S * gl + U^T kd (hi*hi + hi*lo + lo*hi) --------------------------------
            for e in cutlass.range_constexpr(cute.size(acc_s)):
                _, d = cS[e]
                acc_s[e] = acc_s[e] * sGl[0, d, s]
            self._gemm(mma_s, acc_s, rA_uhi, rB_kdhi, True)
            self._gemm(mma_s, acc_s, rA_uhi, rB_kdlo, True)
            self._gemm(mma_s, acc_s, rA_ulo, rB_kdhi, True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

        # ---- final state ------------------------------------------------------------------
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            r, d = cS[e]
            if state_out == STATE_F32:
                mS1f[seq, h, v0 + r, d] = acc_s[e]
            elif state_out == STATE_BF16:
                mS1h[seq, h, v0 + r, d] = acc_s[e].to(bf16)

    @cute.jit
    def _gemm(self, mma, acc, rA, rB, accumulate: cutlass.Constexpr):
        """acc (+)= A B^T over all k-blocks of the (single-stage) operand fragments."""
        mma.set(warpgroup.Field.ACCUMULATE, accumulate)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(rA, mode=[2])):
            cute.gemm(mma, acc, rA[None, None, kb, 0], rB[None, None, kb, 0], acc)
            mma.set(warpgroup.Field.ACCUMULATE, True)
