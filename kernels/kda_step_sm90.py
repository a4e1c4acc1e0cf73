"""Decode and multi-token verify (sm_90a): the KDA recurrence token by token against a state pool.

One CTA per (block of BV state rows, head, batch row n), TPR lanes per state row. Thread t owns
the rows v = vb BV + grp + G r (grp = t // TPR, G = threads / TPR row groups, r < R) and, of
each, the columns d = (sub + TPR j) VEC + e (sub = t % TPR, j < NJ, e < VEC): one 16-byte
(cfg.access: or 8-byte) pool access per (row, j), so a warp's accesses cover whole 128-byte
lines. Per token, with the row
dot products (and q's and k's norms) reduced over the TPR lanes of a row by butterfly shuffles:

    a = gate(g);  S = S * exp(a);  u = beta (v - S kn);  S = S + u kn^T;  o = S (scale qn)

(o taken as S qn + u (kn . qn) with S before the update, so that a row has one reduction of
two values: _update_row).

The kernel is a stream of state bytes, so what sets its speed is how many are in flight: the
start state goes to shared memory by cp.async (cfg.access bytes a copy, every one of a thread's
issued at once, none holding a register), and each thread reads back only what it copied itself,
so a cp.async.wait_group is all the synchronisation there is (no CTA barrier in the per-token
tiles; the chunked tile, cfg.chunk, shares its rows' products through three). A row's
state comes into registers for its token's update and goes out to the pool at once; between
tokens (verify) it is kept in shared memory in fp32 (a bf16 pool's staging area stays as it was
loaded; its fp32 keep area follows the staging one, and a single-token plan reserves only the
staging area: the keep area is touched only between tokens). Shared memory layout:
[R][NJ][threads][VEC], so each 16-byte access of a warp is contiguous and conflict-free.

Which slot a row reads, where the state after a token goes and where a row's tokens are are all
run-time arguments (kda_cute.specs.step.args), so one kernel serves decode, verify with a slot
per token (vLLM, fla), verify into a scratch with tree parents (SGLang, FlashInfer), commit and
the dense recurrent forward. A bad index, length or count is never followed: the row becomes a
padding row (zero outputs, nothing read or written) and the argument's error word is set.
Constraints: kda_cute.specs.step.supports.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.nvgpu import warp as warp_mma

from kda_cute.specs.step import ERRORS, WRITE_ALL, WRITE_LAST, WRITE_START, StepConfig
from kernels.common import (
    StateSlots,
    bits_f32,
    f32_bits,
    gate_param16,
    gate_param32,
    halves,
    tf32_rna,
)

E_CU, E_LEN, E_ACC, E_READ, E_WRITE, E_PARENT = range(6)  # the words of specs.step.ERRORS
assert ERRORS[E_PARENT] == "retrieve_parent_token"
GATE_BOUNDED, GATE_UNBOUNDED = 1, 2
SRC_ZERO, SRC_STAGE, SRC_F32 = 0, 1, 2  # where a row's state comes from at a token


class KdaStepSm90(StateSlots):
    def __init__(self, cfg: StepConfig):
        self.cfg = cfg
        self.K, self.V = cfg.head_dim_k, cfg.head_dim_v
        self.pdt = cutlass.Float32 if cfg.pool == "float32" else cutlass.BFloat16
        self.VEC, self.TPR = cfg.vec, cfg.tpr
        self.NJ = self.K // (cfg.tpr * cfg.vec)
        self.NC = self.NJ * cfg.vec  # columns per thread
        self.BV, self.threads = cfg.block_v, cfg.threads
        self.G = cfg.threads // cfg.tpr
        self.R = cfg.block_v // self.G
        self.U = cfg.unroll  # the row loops' unroll (0: whole; fewer registers otherwise)
        self.OUT_LANE = 1 if cfg.tpr > 1 else 0  # the lane of a row that writes its output
        # tokens a chunk prepared together (0: every group does its own); the chunked kernel
        # prepares a row's tokens (at most cfg.chunk) the same way
        self.C = cfg.prep or cfg.chunk
        self.CH = cfg.chunk
        self.NP = max(8, 2 * cfg.chunk)  # the chunked kernel's product columns (n8 tiles)
        # its staged tile's and operand planes' row stride: rows 16 bytes apart in banks (a
        # bf16 pool's planes bf16 hi / lo for m16n8k16, an fp32 pool's fp32 words rounded to
        # tf32 hi / lo for m16n8k8)
        self.KP = self.K + (4 if self.pdt is cutlass.Float32 else 8)
        self.NVP = -(-cfg.block_v // cfg.tpr)  # v values a lane of a preparing group loads
        self.smem_bytes = 0
        self.tma_meta = []

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor,  # (T, H*K) bf16, row stride free
        mV: cute.Tensor,  # (T, H*V) bf16
        mBeta: cute.Tensor,  # (T, H) bf16
        mOut: cute.Tensor,  # (T, H*V) bf16
        mALog: cute.Tensor, mDtBias: cute.Tensor,  # (H,), (H*K,) as held (*_dtype)
        mPool: cute.Tensor,  # (P, H, V, K) the state pool, slot stride free
        mDst: cute.Tensor,  # (PD, H, V, K) where states are written (the pool or a scratch)
        mCu: cute.Tensor, mRIdx: cute.Tensor, mWIdx: cute.Tensor, mAcc: cute.Tensor,
        mParent: cute.Tensor,  # int32 words
        mHasInit: cute.Tensor,  # (N,) int8
        mErr: cute.Tensor,  # (8,) int32 error words
        num_rows: cutlass.Int32, num_heads: cutlass.Int32,
        fixed_len: cutlass.Int32, cu_wide: cutlass.Int32, max_tokens: cutlass.Int32,
        read_mode: cutlass.Int32, r_sn: cutlass.Int32, r_st: cutlass.Int32,
        r_wide: cutlass.Int32, r_mul: cutlass.Int32, r_add: cutlass.Int32,
        acc_on: cutlass.Int32, acc_wide: cutlass.Int32, acc_base: cutlass.Int32,
        acc_skip: cutlass.Int32, max_sel: cutlass.Int32,
        hi_on: cutlass.Int32, r_null: cutlass.Int32, w_null: cutlass.Int32,
        write_mode: cutlass.Int32, w_sn: cutlass.Int32, w_st: cutlass.Int32,
        w_wide: cutlass.Int32, w_mul: cutlass.Int32, w_add: cutlass.Int32,
        parent_on: cutlass.Int32, p_sn: cutlass.Int32, p_st: cutlass.Int32,
        p_wide: cutlass.Int32,
        gate: cutlass.Int32, a_log_dtype: cutlass.Int32, dt_bias_dtype: cutlass.Int32,
        qk_l2norm: cutlass.Int32, beta_sigmoid: cutlass.Int32,
        scale: cutlass.Float32, lower_bound: cutlass.Float32,
        stream,
    ):
        self.shared_storage = self._shared_storage()
        self.smem_bytes = self.shared_storage.size_in_bytes()
        if cutlass.const_expr(self.cfg.persist != 0):
            # the grid (CTAs per SM x SMs, at most one per tile) is the plan's
            self.kernel_pipe(
                mQ, mK, mG, mV, mBeta, mOut, mALog, mDtBias, mPool, mDst, mCu, mRIdx, mWIdx,
                mAcc, mParent, mHasInit, mErr, num_rows, num_heads, fixed_len, cu_wide,
                max_tokens, read_mode, r_sn, r_st, r_wide, r_mul, r_add, acc_on, acc_wide,
                acc_base, acc_skip, max_sel, hi_on, r_null, w_null, write_mode, w_sn, w_st,
                w_wide, w_mul, w_add, parent_on, p_sn, p_st, p_wide, gate, a_log_dtype,
                dt_bias_dtype, qk_l2norm, beta_sigmoid, scale, lower_bound,
            ).launch(grid=(num_rows, 1, 1), block=(self.threads, 1, 1), smem=self.smem_bytes,
                     stream=stream, **self._occupancy())
            return
        self.kernel(
            mQ, mK, mG, mV, mBeta, mOut, mALog, mDtBias, mPool, mDst, mCu, mRIdx, mWIdx, mAcc,
            mParent, mHasInit, mErr, fixed_len, cu_wide, max_tokens, read_mode, r_sn, r_st,
            r_wide, r_mul, r_add, acc_on, acc_wide, acc_base, acc_skip, max_sel, hi_on,
            r_null, w_null, write_mode, w_sn, w_st, w_wide, w_mul,
            w_add, parent_on, p_sn, p_st, p_wide, gate, a_log_dtype, dt_bias_dtype, qk_l2norm,
            beta_sigmoid, scale, lower_bound,
        ).launch(grid=(self.V // self.BV, num_heads, num_rows), block=(self.threads, 1, 1),
                 smem=self.smem_bytes, stream=stream, **self._occupancy())

    def _shared_storage(self):
        """The CTA's shared memory: the staging area (two tiles' for a persistent tile: the next
        lands while this one runs), the prepared tokens' area (cfg.prep) and a bf16 pool's fp32
        keep area, in that order (a single-token plan keeps only the part before the keep area:
        StepConfig.stage_bytes)."""
        A, MR, f32 = cute.struct.Align, cute.struct.MemRange, cutlass.Float32
        n_el, C, K, BV = self.BV * self.K, self.C, self.K, self.BV
        fields = {"stage": A[MR[self.pdt, (2 if self.cfg.persist else 1) * n_el], 128]}
        if self.CH:  # the chunked kernel: the start state row-major, rows KP apart
            fields["stage"] = A[MR[self.pdt, (2 if self.cfg.persist else 1) * BV * self.KP],
                                128]
        if C:
            fields.update(tq=A[MR[f32, C * K], 128], tk=A[MR[f32, C * K], 128],
                          td=A[MR[f32, C * K], 128], tv=A[MR[f32, C * BV], 128],
                          ts=A[MR[f32, 2 * C], 128], tw=A[MR[cutlass.Int32, C], 128])
        if self.CH:
            CH, NP = self.CH, self.NP
            fields.update(ta=A[MR[f32, CH * CH], 128], tb=A[MR[f32, CH * CH], 128],
                          bh=A[MR[self.pdt, NP * self.KP], 128],
                          bl=A[MR[self.pdt, NP * self.KP], 128],
                          tp=A[MR[f32, (BV + 4) * NP], 128])
        elif not self.cfg.persist and self.pdt is not f32:
            fields["keep"] = A[MR[f32, n_el], 128]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def _occupancy(self) -> dict:
        """Launch options for cfg.min_blocks: ptxas caps the registers so that that many CTAs
        fit on an SM (a carveout is named only so that the DSL asks no device for one; the
        launcher leaves the driver to choose it)."""
        if not self.cfg.min_blocks:
            return {}
        return dict(min_blocks_per_mp=self.cfg.min_blocks, preferred_smem_carveout=100)

    # ---------------------------------------------------------------- device
    @cute.jit
    def _flag(self, mErr: cute.Tensor, code: cutlass.Constexpr, lead):
        if lead != 0:
            mErr[code] = cutlass.Int32(1)

    def _mine(self, area, tidx):
        """This thread's elements of a shared area, as [e, j, r] (its VEC-vectors)."""
        VEC, NT = self.VEC, self.threads
        whole = cute.make_tensor(area.iterator, cute.make_layout(
            (VEC, NT, self.NJ, self.R), stride=(1, VEC, NT * VEC, self.NJ * NT * VEC)))
        return whole[None, tidx, None, None]

    def _mine_keep(self, area, tidx):
        """This thread's elements of a bf16 pool's fp32 keep area, as _mine's [e, j, r]: the
        VEC (8) fp32 of an access in two 16-byte halves NT * 16 bytes apart, so that each
        16-byte access of a warp is contiguous and conflict-free."""
        VEC, NT = self.VEC, self.threads
        whole = cute.make_tensor(area.iterator, cute.make_layout(
            ((4, VEC // 4), NT, self.NJ, self.R),
            stride=((1, 4 * NT), 4, NT * VEC, self.NJ * NT * VEC)))
        return whole[None, tidx, None, None]

    def _row_vecs(self, m: cute.Tensor, row, h, v):
        return cute.logical_divide(m[row, h, v, None], cute.make_layout(self.VEC))

    @cute.jit
    def _stage(self, mine, src: cute.Tensor, row, h, vb, grp, sub):
        """cp.async this thread's columns of its R rows of src[row, h] into its staging area
        (one commit group)."""
        self._stage_rows(mine, src, row, h, vb, grp, sub)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _stage_rows(self, mine, src: cute.Tensor, row, h, vb, grp, sub):
        """_stage's copies, committed by the caller."""
        mode = cpasync.LoadCacheMode.GLOBAL if self.cfg.access == 16 else \
            cpasync.LoadCacheMode.ALWAYS  # cp.async.cg copies 16 bytes only
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=mode), self.pdt,
                                   num_bits_per_copy=8 * self.cfg.access)
        for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
            vecs = self._row_vecs(src, row, h, vb * self.BV + grp + self.G * r)
            for j in cutlass.range_constexpr(self.NJ):
                cute.copy(atom, vecs[None, sub + self.TPR * j], mine[None, j, r])

    @cute.jit
    def _fetch(self, x, src, stage, keep, r):
        """Row r's state into registers x: from the staging area, the fp32 keep area, or
        zeros."""
        VEC = self.VEC
        for j in cutlass.range_constexpr(self.NJ):
            if src == SRC_STAGE:
                y = stage[None, j, r].load().to(cutlass.Float32)
                for e in cutlass.range_constexpr(VEC):
                    x[j * VEC + e] = y[e]
            elif src == SRC_F32:
                y = keep[None, j, r].load()
                for e in cutlass.range_constexpr(VEC):
                    x[j * VEC + e] = y[e]
            else:
                for e in cutlass.range_constexpr(VEC):
                    x[j * VEC + e] = cutlass.Float32(0.0)

    @cute.jit
    def _zero_stage(self, stage):
        """Zeros over this thread's staging area, for a row that starts from zeros (each
        thread reads back only what it wrote: no barrier)."""
        z = cute.make_rmem_tensor((self.VEC,), self.pdt)
        z.fill(0.0)
        for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
            for j in cutlass.range_constexpr(self.NJ):
                stage[None, j, r].store(z.load())

    @cute.jit
    def _put(self, x, vecs_dst, sub, dtype):
        """Registers x to a row of VEC-vectors (global or shared), converted to dtype."""
        VEC = self.VEC
        frag = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        for j in cutlass.range_constexpr(self.NJ):
            for e in cutlass.range_constexpr(VEC):
                frag[e] = x[j * VEC + e]
            vecs_dst[None, sub + self.TPR * j].store(frag.load().to(dtype))

    @cute.jit
    def _keep(self, x, keep, r):
        VEC = self.VEC
        frag = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        for j in cutlass.range_constexpr(self.NJ):
            for e in cutlass.range_constexpr(VEC):
                frag[e] = x[j * VEC + e]
            keep[None, j, r].store(frag.load())

    @cute.jit
    def _reload(self, keep, src: cute.Tensor, row, h, vb, grp, sub):
        """A tree parent's state: rows of src[row, h] (written by this thread before) into the
        keep area, through registers."""
        x = cute.make_rmem_tensor((self.NC,), cutlass.Float32)
        for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
            vecs = self._row_vecs(src, row, h, vb * self.BV + grp + self.G * r)
            for j in cutlass.range_constexpr(self.NJ):
                y = vecs[None, sub + self.TPR * j].load().to(cutlass.Float32)
                for e in cutlass.range_constexpr(self.VEC):
                    x[j * self.VEC + e] = y[e]
            self._keep(x, keep, r)

    @cute.jit
    def _head_raw(self, raw, m: cute.Tensor, tok, h, sub):
        """This thread's columns of head h of token row `tok` of a (T, H*K) bf16 tensor, as
        loaded (bf16, [VEC, NJ]): nothing waits for them here."""
        vecs = cute.logical_divide(m[tok, None], cute.make_layout(self.VEC))
        base = h * (self.K // self.VEC) + sub
        for j in cutlass.range_constexpr(self.NJ):
            raw[None, j].store(vecs[None, base + self.TPR * j].load())

    @cute.jit
    def _raw_cols(self, x, raw):
        """_head_raw's columns into fp32 registers x."""
        for j in cutlass.range_constexpr(self.NJ):
            y = raw[None, j].load().to(cutlass.Float32)
            for e in cutlass.range_constexpr(self.VEC):
                x[j * self.VEC + e] = y[e]

    def _raw_tensor(self):
        return cute.make_rmem_tensor(cute.make_layout((self.VEC, self.NJ)), cutlass.BFloat16)

    @cute.jit
    def _token_loads(self, rq, rk, rg, mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor,
                     mBeta: cute.Tensor, mV: cute.Tensor, mWIdx: cute.Tensor, tok, t, n, h, vb,
                     grp, sub, writes, w_sn, w_st, w_wide):
        """Token `tok` (the row's t-th)'s loads, none waited for: q, k and g into rq, rk, rg,
        and (beta as loaded, this lane's v (_v_ahead), the words of its write entry where
        `writes`, else -1)."""
        vals = self._v_ahead(mV, tok, h, vb, grp, sub)
        b_raw, w_lo, w_hi = self._head_loads(rq, rk, rg, mQ, mK, mG, mBeta, mWIdx, tok, t, n, h,
                                             sub, writes, w_sn, w_st, w_wide)
        return b_raw, vals, w_lo, w_hi

    @cute.jit
    def _head_loads(self, rq, rk, rg, mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor,
                    mBeta: cute.Tensor, mWIdx: cute.Tensor, tok, t, n, h, sub, writes, w_sn,
                    w_st, w_wide):
        """_token_loads' and _prep_issue's common part: the words of the write entry of token
        `tok` (the row's t-th) where `writes` (else -1), its beta, and this thread's columns of
        q, k and g into rq, rk, rg, all as loaded. Returns (beta, w_lo, w_hi)."""
        i32 = cutlass.Int32
        w_lo, w_hi = i32(-1), i32(-1)
        if writes:
            w_lo, w_hi = self._write_words(mWIdx, n, t, w_sn, w_st, w_wide)
        b_raw = mBeta[tok, h]
        self._head_raw(rq, mQ, tok, h, sub)
        self._head_raw(rk, mK, tok, h, sub)
        self._head_raw(rg, mG, tok, h, sub)
        return b_raw, w_lo, w_hi

    @cute.jit
    def _lanes_sum(self, x):
        for k in cutlass.range_constexpr(self.TPR.bit_length() - 1):
            x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << k)
        return x

    @cute.jit
    def _row_tokens(self, mCu: cute.Tensor, mErr: cute.Tensor, n, lead, num_tokens, fixed_len,
                    cu_wide, max_tokens):
        """Batch row n's tokens, bad values flagged (by `lead`) and turned into an empty row:
        (bos, length). Nothing here waits for the read slot (_row_slot)."""
        i32 = cutlass.Int32
        bos = n * fixed_len
        length = fixed_len
        if fixed_len < 0:
            b0, ok0 = self._word(mCu, n, cu_wide)
            e0, ok1 = self._word(mCu, n + 1, cu_wide)
            bos = b0
            length = e0 - b0
            if ok0 == 0 or ok1 == 0 or b0 < 0 or e0 < b0 or e0 > num_tokens:
                self._flag(mErr, E_CU, lead)
                bos = i32(0)
                length = i32(0)
        if length > max_tokens:
            self._flag(mErr, E_LEN, lead)
            length = i32(0)
        return bos, length

    @cute.jit
    def _row_slot(self, mRIdx: cute.Tensor, mAcc: cute.Tensor, mHasInit: cute.Tensor,
                  mErr: cute.Tensor, n, lead, slots, read_mode, r_sn, r_st, r_wide, r_mul,
                  r_add, acc_on, acc_wide, acc_base, acc_skip, max_sel, hi_on, r_null):
        """Batch row n's read slot, bad values flagged (by `lead`) and turned into padding:
        (pad, sel, slot, start)."""
        i32 = cutlass.Int32
        # ---- the read slot: padding (< r_null), bad (flagged, then padding) -----------------
        # sel = accepted[n] - acc_base picks the read entry (and, times r_add, the row in it)
        pad = i32(0)
        sel = i32(0)
        if acc_on != 0:
            a, ok = self._word(mAcc, n, acc_wide)
            sel = a - acc_base
            if ok != 0 and sel < 0 and acc_skip != 0:
                pad = i32(1)  # a commit's step < 0: nothing to do
            elif ok == 0 or sel < 0 or sel >= max_sel:
                first, _ = self._word(mRIdx, n * r_sn, r_wide)
                if first >= r_null:  # a padding row may carry any count
                    self._flag(mErr, E_ACC, lead)
                pad = i32(1)
        slot = i32(-1)
        if pad == 0 and read_mode != 0:  # read_mode 0: every row starts from zeros
            s0, ok = self._word(mRIdx, n * r_sn + sel * r_st, r_wide)
            # s0 < slots first: s0 * r_mul cannot wrap around then
            slot = cutlass.min(s0, slots) * r_mul + sel * r_add
            if ok == 0 or (s0 >= r_null and (s0 >= slots or slot >= slots)):
                self._flag(mErr, E_READ, lead)
                pad = i32(1)
            elif s0 < r_null:
                pad = i32(1)
        start = read_mode  # 1: the row starts from its slot, 0: from zeros
        if hi_on != 0:
            if mHasInit[n] == 0:
                start = i32(0)
        return pad, sel, slot, start

    @cute.jit
    def _token_math(self, qv, kv, dv, b_raw, bias, a_exp, gate, qk_l2norm, beta_sigmoid,
                    scale, lower_bound):
        """A token's columns of head h past their loads (_token_loads): q (L2-normed, times
        the scale) and k (L2-normed) in place in qv and kv, the decay exp(a) per column into
        dv (which holds g); b_raw is its beta as loaded. Returns (beta, k . q)."""
        f32, NC = cutlass.Float32, self.NC
        # q and k norms over the row's lanes; q carries the scale
        sq = f32(0.0)
        sk = f32(0.0)
        for c in cutlass.range_constexpr(NC):
            sq = sq + qv[c] * qv[c]
            sk = sk + kv[c] * kv[c]
        rq = scale
        rk = f32(1.0)
        if qk_l2norm != 0:
            sq = self._lanes_sum(sq)
            sk = self._lanes_sum(sk)
            rq = scale * cute.math.rsqrt(sq + 1e-6)
            rk = cute.math.rsqrt(sk + 1e-6)
        for c in cutlass.range_constexpr(NC):
            qv[c] = qv[c] * rq
            kv[c] = kv[c] * rk
        # the decay exp(a) per column
        if gate == GATE_BOUNDED:
            for c in cutlass.range_constexpr(NC):
                y = a_exp * (dv[c] + bias[c])
                sg = cute.arch.rcp_approx(1.0 + cute.math.exp(-y, fastmath=True))
                dv[c] = cute.math.exp(lower_bound * sg, fastmath=True)
        elif gate == GATE_UNBOUNDED:
            for c in cutlass.range_constexpr(NC):
                y = dv[c] + bias[c]
                sp = cute.arch.fmax(y, 0.0) + cute.math.log1p(
                    cute.math.exp(-cute.arch.fmax(y, -y)))
                dv[c] = cute.math.exp(-a_exp * sp, fastmath=True)
        else:
            for c in cutlass.range_constexpr(NC):
                dv[c] = cute.math.exp(dv[c], fastmath=True)
        beta = b_raw.to(f32)
        if beta_sigmoid != 0:
            beta = cute.arch.rcp_approx(1.0 + cute.math.exp(-beta, fastmath=True))
        # k . q (over the whole head), for the rows' outputs (_update_row)
        kq = f32(0.0)
        for c in cutlass.range_constexpr(NC):
            kq = kq + kv[c] * qv[c]
        return beta, self._lanes_sum(kq)

    @cute.jit
    def _v_ahead(self, mV: cute.Tensor, tok, h, vb, grp, sub):
        """v of token `tok` for this thread's row r = sub (bf16 as loaded, so that nothing
        waits for it here; 0 where sub >= R): the row's lanes hold the v of all its R rows
        between them (R <= TPR), loaded at once ahead of the row loop instead of one dependent
        load a row; _update_row adds it on that lane."""
        val = cutlass.BFloat16(0.0)
        if cutlass.const_expr(self.R == self.TPR):
            val = mV[tok, h * self.V + vb * self.BV + grp + self.G * sub]
        else:
            if sub < self.R:
                val = mV[tok, h * self.V + vb * self.BV + grp + self.G * sub]
        return val

    @cute.jit
    def _update_row(self, x, qv, kv, dv, beta, kq, vals, r, sub):
        """Row r of this thread, in registers x, through a token: decay, delta rule; returns
        its output, valid on the row's lane OUT_LANE.

        One reduction a row: with Sd = S exp(a) and u = beta (v - Sd k), the output is
        (Sd + u k^T) q = Sd q + u (k . q), so v - Sd k and Sd q are reduced together, before
        the update (k . q is the token's). The lane holding the row's v (_v_ahead) adds it to
        its share of -Sd k. The first shuffle level halves the pair: each lane of two sends
        one value and keeps the other (even lanes keep v - Sd k, odd ones Sd q); one more
        shuffle gives the even lanes' sum to the odd ones. TPR = 16: 5 shuffles a row."""
        f32, NC = cutlass.Float32, self.NC
        mine = sub == r
        a = f32(cutlass.select_(mine, vals, f32(0.0)))  # v - Sd k, this lane's share
        b = f32(0.0)  # Sd q
        for c in cutlass.range_constexpr(NC):
            s = x[c] * dv[c]
            x[c] = s
            a = a - s * kv[c]
            b = b + s * qv[c]
        if cutlass.const_expr(self.TPR > 1):
            odd = (sub & 1) != 0
            m = f32(cutlass.select_(odd, b, a)) + cute.arch.shuffle_sync_bfly(
                f32(cutlass.select_(odd, a, b)), offset=1)
            for k in cutlass.range_constexpr(1, self.TPR.bit_length() - 1):
                m = m + cute.arch.shuffle_sync_bfly(m, offset=1 << k)
            a = f32(cutlass.select_(odd, cute.arch.shuffle_sync_bfly(m, offset=1), m))
            b = m
        u = beta * a
        for c in cutlass.range_constexpr(NC):
            x[c] = x[c] + u * kv[c]
        return b + u * kq

    @cute.jit
    def _gate_consts(self, bias, mALog: cute.Tensor, mDtBias: cute.Tensor, h, sub, a_dt, b_dt):
        """Head h's gate constants, loads only: dt_bias of this thread's columns into bias;
        returns A_log[h] (0 without A_log: exp(A_log) is the gate's factor). a_dt / b_dt: how
        each is held (abi.GATE_PARAM_DTYPES, 0: not given)."""
        K, VEC = self.K, self.VEC
        a_log = gate_param32(mALog, h, a_dt)
        for j in cutlass.range_constexpr(self.NJ):
            for e in cutlass.range_constexpr(VEC):
                bias[j * VEC + e] = gate_param32(
                    mDtBias, h * K + (sub + self.TPR * j) * VEC + e, b_dt)
        if halves(a_dt, b_dt):
            a_log = gate_param16(mALog, h, a_dt, a_log)
            for j in cutlass.range_constexpr(self.NJ):
                for e in cutlass.range_constexpr(VEC):
                    bias[j * VEC + e] = gate_param16(
                        mDtBias, h * K + (sub + self.TPR * j) * VEC + e, b_dt, bias[j * VEC + e])
        return a_log

    @cute.jit
    def _writes(self, write_mode, t, length):
        """Whether the state after a row's t-th token (of `length`) is written."""
        return write_mode == WRITE_ALL or (write_mode == WRITE_LAST and t == length - 1)

    @cute.jit
    def _lead(self, tidx, vb, h):
        """1 for the one thread of a batch row that reports its bad values (thread 0 of the
        row's first tile), else 0."""
        lead = cutlass.Int32(0)
        if tidx == 0 and vb == 0 and h == 0:
            lead = cutlass.Int32(1)
        return lead

    @cute.jit
    def _write_words(self, mWIdx: cute.Tensor, n, t, w_sn, w_st, w_wide):
        """The words of batch row n's write entry of token t (low, high; an int32 table's
        entry twice): loads only, nothing waits for them here."""
        i = (n * w_sn + t * w_st) * (1 + w_wide)
        return mWIdx[i], mWIdx[i + w_wide]

    @cute.jit
    def _write_row_of(self, lo, hi, mErr: cute.Tensor, t, lead, dst_rows, w_wide, w_mul,
                      w_add, w_null):
        """The dst row the state after token t of a batch row goes to, from the words of its
        write entry (_write_words): -1 for a padding entry, and for a bad one (flagged)."""
        wrow = cutlass.Int32(-1)
        w = lo
        okw = cutlass.Int32(1)
        if w_wide != 0 and hi != (lo >> 31):
            okw = cutlass.Int32(0)
        # w < dst_rows first: w * w_mul cannot wrap around then
        row = cutlass.min(w, dst_rows) * w_mul + t * w_add
        if okw == 0 or (w >= w_null and (w >= dst_rows or row >= dst_rows)):
            self._flag(mErr, E_WRITE, lead)
        elif w >= w_null:
            wrow = row
        return wrow

    # ------------------------------------------------ prepared tokens (cfg.prep = C > 0)
    def _tok_cols(self, area, c, sub):
        """This thread's columns of prepared token slot c of a (C, K) fp32 area, as [e, j]
        (_raw_cols' order): the VEC values of column block b = sub + TPR j in 16-byte quarters
        K / 2 floats apart (VEC 8), so that a warp's 16-byte accesses are contiguous."""
        K, VEC = self.K, self.VEC
        off = cute.assume(c * K + sub * 4, divby=4)
        return cute.make_tensor(area.iterator + off, cute.make_layout(
            ((4, VEC // 4), self.NJ), stride=((1, K // 2), self.TPR * 4)))

    def _tok_areas(self, shared):
        C, K = self.C, self.K
        return (shared.tq.get_tensor(cute.make_layout(C * K)),
                shared.tk.get_tensor(cute.make_layout(C * K)),
                shared.td.get_tensor(cute.make_layout(C * K)),
                shared.tv.get_tensor(cute.make_layout(C * self.BV)),
                shared.ts.get_tensor(cute.make_layout(2 * C)),
                shared.tw.get_tensor(cute.make_layout(C)))

    @cute.jit
    def _tok_put(self, area, c, sub, x):
        cols = self._tok_cols(area, c, sub)
        frag = cute.make_rmem_tensor((self.VEC,), cutlass.Float32)
        for j in cutlass.range_constexpr(self.NJ):
            for e in cutlass.range_constexpr(self.VEC):
                frag[e] = x[j * self.VEC + e]
            cols[None, j].store(frag.load())

    @cute.jit
    def _tok_get(self, area, c, sub, x):
        cols = self._tok_cols(area, c, sub)
        for j in cutlass.range_constexpr(self.NJ):
            y = cols[None, j].load()
            for e in cutlass.range_constexpr(self.VEC):
                x[j * self.VEC + e] = y[e]

    @cute.jit
    def _prep_issue(self, rq, rk, rg, rv, mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor,
                    mBeta: cute.Tensor, mV: cute.Tensor, mWIdx: cute.Tensor, tok, t, n, h, vb,
                    sub, writes, w_sn, w_st, w_wide):
        """The loads of a token this thread's group prepares (`tok`, the row's t-th), none
        waited for: q, k, g into rq, rk, rg, v of the tile's rows (sub + TPR m) into rv;
        returns (beta as loaded, the words of its write entry where `writes`, else -1)."""
        b_raw, w_lo, w_hi = self._head_loads(rq, rk, rg, mQ, mK, mG, mBeta, mWIdx, tok, t, n, h,
                                             sub, writes, w_sn, w_st, w_wide)
        for m in cutlass.range_constexpr(self.NVP):
            i = sub + self.TPR * m
            if cutlass.const_expr(self.BV % self.TPR == 0):
                rv[m] = mV[tok, h * self.V + vb * self.BV + i]
            else:
                if i < self.BV:
                    rv[m] = mV[tok, h * self.V + vb * self.BV + i]
        return b_raw, w_lo, w_hi

    @cute.jit
    def _prep_store(self, areas, c, rq, rk, rg, rv, b_raw, w_lo, w_hi, qv, kv, dv, bias,
                    a_exp, mErr: cute.Tensor, t, live, lead, sub, writes, dst_rows, w_wide,
                    w_mul, w_add, w_null, gate, qk_l2norm, beta_sigmoid, scale, lower_bound):
        """A prepared token (the row's t-th) from its loads (_prep_issue) into slot c, where
        `live`: q and k normed, the decay, v, beta, k . q and its write row (-1: none)."""
        tq, tk, td, tv, ts, tw = areas
        self._raw_cols(qv, rq)
        self._raw_cols(kv, rk)
        self._raw_cols(dv, rg)
        beta, kq = self._token_math(qv, kv, dv, b_raw, bias, a_exp, gate, qk_l2norm,
                                    beta_sigmoid, scale, lower_bound)
        wrow = cutlass.Int32(-1)
        if writes:
            wrow = self._write_row_of(w_lo, w_hi, mErr, t, lead, dst_rows, w_wide, w_mul, w_add,
                                      w_null)
        if live:
            self._tok_put(tq, c, sub, qv)
            self._tok_put(tk, c, sub, kv)
            self._tok_put(td, c, sub, dv)
            for m in cutlass.range_constexpr(self.NVP):
                i = sub + self.TPR * m
                if cutlass.const_expr(self.BV % self.TPR == 0):
                    tv[c * self.BV + i] = rv[m].to(cutlass.Float32)
                else:
                    if i < self.BV:
                        tv[c * self.BV + i] = rv[m].to(cutlass.Float32)
            if sub == 0:
                ts[2 * c] = beta
                ts[2 * c + 1] = kq
                tw[c] = wrow

    @cute.jit
    def _prep_chunk(self, areas, t0, rq, rk, rg, rv, qv, kv, dv, bias, a_exp, mQ: cute.Tensor,
                    mK: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mV: cute.Tensor,
                    mWIdx: cute.Tensor, mErr: cute.Tensor, bos, length, n, h, vb, grp, sub,
                    lead, write_mode, w_sn, w_st, w_wide, dst_rows, w_mul, w_add, w_null, gate,
                    qk_l2norm, beta_sigmoid, scale, lower_bound):
        """The chunk of the row's tokens from t0: group g prepares token t0 + g into slot g;
        then a CTA barrier (every thread of the CTA calls this, at the same tokens).

        The preparing groups fill whole warps (supports: prep * tpr is a multiple of 32) and a
        group past the row's last token works on that token again without storing it, so that
        every lane of a warp takes part in the math's shuffles."""
        t = t0 + grp
        if grp < self.C:
            tt = cutlass.min(t, length - 1)
            writes = self._writes(write_mode, tt, length)
            b_raw, w_lo, w_hi = self._prep_issue(rq, rk, rg, rv, mQ, mK, mG, mBeta, mV, mWIdx,
                                                 bos + tt, tt, n, h, vb, sub, writes, w_sn,
                                                 w_st, w_wide)
            self._prep_store(areas, grp, rq, rk, rg, rv, b_raw, w_lo, w_hi, qv, kv, dv, bias,
                             a_exp, mErr, tt, t < length, lead, sub, writes, dst_rows, w_wide,
                             w_mul, w_add, w_null, gate, qk_l2norm, beta_sigmoid, scale,
                             lower_bound)
        cute.arch.sync_threads()

    @cute.jit
    def _prep_read(self, areas, c, qv, kv, dv, grp, sub):
        """Prepared token slot c: this thread's columns of q, k and the decay into qv, kv, dv;
        returns (beta, k . q, the write row, the v of this lane's row sub (_v_ahead's))."""
        tq, tk, td, tv, ts, tw = areas
        self._tok_get(tq, c, sub, qv)
        self._tok_get(tk, c, sub, kv)
        self._tok_get(td, c, sub, dv)
        vals = cutlass.Float32(0.0)
        if cutlass.const_expr(self.R == self.TPR):
            vals = tv[c * self.BV + grp + self.G * sub]
        else:
            if sub < self.R:
                vals = tv[c * self.BV + grp + self.G * sub]
        return ts[2 * c], ts[2 * c + 1], tw[c], vals

    @cute.jit
    def _zero_outputs(self, mOut: cute.Tensor, tok, h, vb, grp, sub):
        """A padding row's outputs of token `tok`: zeros in this thread's rows."""
        for r in cutlass.range_constexpr(self.R):
            if sub == 0:
                mOut[tok, h * self.V + vb * self.BV + grp + self.G * r] = (
                    cutlass.Float32(0.0).to(cutlass.BFloat16))

    @cute.jit
    def _row(self, x, src, stage, keep, r, qv, kv, dv, beta, kq, vals, mOut: cute.Tensor,
             mDst: cute.Tensor, tok, h, vb, grp, sub, wrow):
        """This thread's row r through token `tok` (its row's v values: `vals`, _v_ahead):
        its state into registers x (from `src`), the update, its output, and the state after
        it to dst row `wrow` (>= 0)."""
        v_idx = vb * self.BV + grp + self.G * r
        self._fetch(x, src, stage, keep, r)
        o = self._update_row(x, qv, kv, dv, beta, kq, vals, r, sub)
        if sub == self.OUT_LANE:
            mOut[tok, h * self.V + v_idx] = o.to(cutlass.BFloat16)
        if wrow >= 0:
            self._put(x, self._row_vecs(mDst, wrow, h, v_idx), sub, self.pdt)

    @cute.jit
    def _rows(self, x, src: cutlass.Constexpr, stage, keep, qv, kv, dv, beta, kq, vals,
              mOut: cute.Tensor, mDst: cute.Tensor, tok, h, vb, grp, sub, wrow, more):
        """Every row of this thread through token `tok`, its state from `src` (a constant);
        the state after it kept (shared memory) where `more` tokens follow."""
        for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
            self._row(x, src, stage, keep, r, qv, kv, dv, beta, kq, vals, mOut, mDst, tok, h,
                      vb, grp, sub, wrow)
            if more:
                self._keep(x, keep, r)

    @cute.kernel
    def kernel(
        self, mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor, mV: cute.Tensor,
        mBeta: cute.Tensor, mOut: cute.Tensor, mALog: cute.Tensor, mDtBias: cute.Tensor,
        mPool: cute.Tensor, mDst: cute.Tensor, mCu: cute.Tensor, mRIdx: cute.Tensor,
        mWIdx: cute.Tensor, mAcc: cute.Tensor, mParent: cute.Tensor, mHasInit: cute.Tensor,
        mErr: cute.Tensor,
        fixed_len: cutlass.Int32, cu_wide: cutlass.Int32, max_tokens: cutlass.Int32,
        read_mode: cutlass.Int32, r_sn: cutlass.Int32, r_st: cutlass.Int32,
        r_wide: cutlass.Int32, r_mul: cutlass.Int32, r_add: cutlass.Int32,
        acc_on: cutlass.Int32, acc_wide: cutlass.Int32, acc_base: cutlass.Int32,
        acc_skip: cutlass.Int32, max_sel: cutlass.Int32,
        hi_on: cutlass.Int32, r_null: cutlass.Int32, w_null: cutlass.Int32,
        write_mode: cutlass.Int32, w_sn: cutlass.Int32, w_st: cutlass.Int32,
        w_wide: cutlass.Int32, w_mul: cutlass.Int32, w_add: cutlass.Int32,
        parent_on: cutlass.Int32, p_sn: cutlass.Int32, p_st: cutlass.Int32,
        p_wide: cutlass.Int32,
        gate: cutlass.Int32, a_log_dtype: cutlass.Int32, dt_bias_dtype: cutlass.Int32,
        qk_l2norm: cutlass.Int32, beta_sigmoid: cutlass.Int32,
        scale: cutlass.Float32, lower_bound: cutlass.Float32,
    ):
        if cutlass.const_expr(self.CH != 0):
            # the chunked tile (cfg.chunk): a row's tokens (at most the chunk; no tree parents,
            # no commit: the plan's choice) as one chunk (_chunk_issue, _chunk_prep, _chunk_rows)
            tidx, _, _ = cute.arch.thread_idx()
            vb, h, n = cute.arch.block_idx()
            grp = tidx // self.TPR
            sub = tidx - grp * self.TPR
            shared, areas, area, rq, rk, rg, rv, bias, qv, kv, dv, x = self._chunk_setup()
            regs = (rq, rk, rg, rv, bias)
            ins = (mQ, mK, mG, mBeta, mV, mALog, mDtBias, mPool, mCu, mRIdx, mWIdx, mAcc,
                   mHasInit, mErr)
            modes = (fixed_len, cu_wide, max_tokens, read_mode, r_sn, r_st, r_wide, r_mul, r_add,
                     acc_on, acc_wide, acc_base, acc_skip, max_sel, hi_on, r_null, write_mode,
                     w_sn, w_st, w_wide, a_log_dtype, dt_bias_dtype)
            tile = self._chunk_tile(area, 0)
            bos, live_len, length, b_raw, w_lo, w_hi, a_log = self._chunk_issue(
                True, vb, h, n, tile, regs, ins, modes, tidx, grp, sub)
            self._chunk_prep(areas, live_len, rq, rk, rg, rv, b_raw, w_lo, w_hi, qv, kv, dv, bias,
                             a_log, mErr, vb, h, grp, sub, write_mode, mDst.shape[0], w_wide,
                             w_mul, w_add, w_null, gate, qk_l2norm, beta_sigmoid, scale,
                             lower_bound)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            self._chunk_rows(tile, shared, areas, bos, live_len, length, x, dv, kv, mOut, mDst,
                             vb, h, tidx, grp, sub)
            return
        f32, i32 = cutlass.Float32, cutlass.Int32
        K, NC = self.K, self.NC
        tidx, _, _ = cute.arch.thread_idx()
        vb, h, n = cute.arch.block_idx()
        grp = tidx // self.TPR
        sub = tidx - grp * self.TPR
        lead = self._lead(tidx, vb, h)
        num_tokens = mQ.shape[0]
        slots = mPool.shape[0]
        dst_rows = mDst.shape[0]

        bos, length = self._row_tokens(mCu, mErr, n, lead, num_tokens, fixed_len, cu_wide,
                                       max_tokens)
        pad, sel, slot, start = self._row_slot(
            mRIdx, mAcc, mHasInit, mErr, n, lead, slots, read_mode, r_sn, r_st, r_wide, r_mul,
            r_add, acc_on, acc_wide, acc_base, acc_skip, max_sel, hi_on, r_null)

        smem = utils.SmemAllocator()
        shared = smem.allocate(self.shared_storage)
        n_el = self.BV * K
        stage = self._mine(shared.stage.get_tensor(cute.make_layout(n_el)), tidx)
        keep = stage  # an fp32 pool keeps its state where it was staged
        if cutlass.const_expr(self.pdt is not cutlass.Float32):
            keep = self._mine_keep(shared.keep.get_tensor(cute.make_layout(n_el)), tidx)
        src = i32(SRC_ZERO)
        if pad == 0 and start != 0:
            self._stage(stage, mPool, slot, h, vb, grp, sub)
            src = i32(SRC_STAGE)
        # the first token's loads (q, k, g, beta, v, its write entry) and the gate's constants,
        # in flight with the staging of the start state
        rq, rk, rg = self._raw_tensor(), self._raw_tensor(), self._raw_tensor()
        b_raw = cutlass.BFloat16(0.0)
        vals = cutlass.BFloat16(0.0)
        w_lo, w_hi = i32(-1), i32(-1)
        if cutlass.const_expr(self.cfg.ahead):
            if length > 0:
                b_raw, vals, w_lo, w_hi = self._token_loads(
                    rq, rk, rg, mQ, mK, mG, mBeta, mV, mWIdx, bos, i32(0), n, h, vb, grp, sub,
                    self._writes(write_mode, i32(0), length), w_sn, w_st, w_wide)
        bias = cute.make_rmem_tensor((NC,), f32)
        a_log = self._gate_consts(bias, mALog, mDtBias, h, sub, a_log_dtype, dt_bias_dtype)
        a_exp = cute.math.exp(a_log)

        qv = cute.make_rmem_tensor((NC,), f32)
        kv = cute.make_rmem_tensor((NC,), f32)
        dv = cute.make_rmem_tensor((NC,), f32)
        x = cute.make_rmem_tensor((NC,), f32)
        # prepared tokens (cfg.prep): group g prepares token g of each chunk of C; the first
        # chunk while the start state is staged
        if cutlass.const_expr(self.C != 0):
            areas = self._tok_areas(shared)
            rv = cute.make_rmem_tensor((self.NVP,), cutlass.BFloat16)
            lead_p = i32(0)  # reports a prepared token's bad write entry
            if sub == 0 and vb == 0 and h == 0:
                lead_p = i32(1)
            if pad == 0 and length > 0:
                self._prep_chunk(areas, i32(0), rq, rk, rg, rv, qv, kv, dv, bias, a_exp, mQ, mK,
                                 mG, mBeta, mV, mWIdx, mErr, bos, length, n, h, vb, grp, sub,
                                 lead_p, write_mode, w_sn, w_st, w_wide, dst_rows, w_mul, w_add,
                                 w_null, gate, qk_l2norm, beta_sigmoid, scale, lower_bound)
        for t in cutlass.range(length):
            tok = bos + t
            if pad != 0:
                self._zero_outputs(mOut, tok, h, vb, grp, sub)
            else:
                # tree drafts: a token whose parent is not the previous one restarts from the
                # start state (parent -1) or from the state after its parent, already written
                if parent_on != 0 and t > 0:
                    par, ok = self._word(mParent, n * p_sn + t * p_st, p_wide)
                    if par != t - 1:
                        prow = i32(-1)
                        if ok != 0 and par >= 0 and par < t and write_mode == WRITE_ALL:
                            w, okw = self._word(mWIdx, n * w_sn + par * w_st, w_wide)
                            prow = cutlass.min(w, dst_rows) * w_mul + par * w_add
                            if okw == 0 or w < w_null or w >= dst_rows or prow >= dst_rows:
                                prow = i32(-2)
                        elif ok == 0 or par != -1:
                            prow = i32(-2)
                        if prow == -2:
                            self._flag(mErr, E_PARENT, lead)
                            prow = i32(-1)
                        if prow >= 0:
                            self._reload(keep, mDst, prow, h, vb, grp, sub)
                            src = i32(SRC_F32)
                        elif start != 0:
                            self._stage(stage, mPool, slot, h, vb, grp, sub)
                            src = i32(SRC_STAGE)
                        else:
                            src = i32(SRC_ZERO)
                if cutlass.const_expr(self.C != 0):
                    c = t % self.C
                    if c == 0 and t > 0:  # the next chunk, once every group is done with this
                        cute.arch.sync_threads()
                        self._prep_chunk(areas, t, rq, rk, rg, rv, qv, kv, dv, bias, a_exp, mQ,
                                         mK, mG, mBeta, mV, mWIdx, mErr, bos, length, n, h, vb,
                                         grp, sub, lead_p, write_mode, w_sn, w_st, w_wide,
                                         dst_rows, w_mul, w_add, w_null, gate, qk_l2norm,
                                         beta_sigmoid, scale, lower_bound)
                    beta, kq, wrow, v_now = self._prep_read(areas, c, qv, kv, dv, grp, sub)
                else:
                    # this token's loads (v, its write entry, q, k, g, beta) were issued
                    # together, before the previous token's rows (cfg.ahead, the first token's
                    # with the staging) or here
                    writes = self._writes(write_mode, t, length)
                    if cutlass.const_expr(not self.cfg.ahead):
                        b_raw, vals, w_lo, w_hi = self._token_loads(
                            rq, rk, rg, mQ, mK, mG, mBeta, mV, mWIdx, tok, t, n, h, vb, grp,
                            sub, writes, w_sn, w_st, w_wide)
                    self._raw_cols(qv, rq)
                    self._raw_cols(kv, rk)
                    self._raw_cols(dv, rg)
                    v_now = vals.to(f32)
                    beta, kq = self._token_math(qv, kv, dv, b_raw, bias, a_exp, gate, qk_l2norm,
                                                beta_sigmoid, scale, lower_bound)
                    # where the state after this token goes (-1: nowhere)
                    wrow = i32(-1)
                    if writes:
                        wrow = self._write_row_of(w_lo, w_hi, mErr, t, lead, dst_rows, w_wide,
                                                  w_mul, w_add, w_null)
                more = t + 1 < length
                if cutlass.const_expr(self.cfg.ahead):
                    if more:  # the next token's loads, in flight through this one's rows
                        b_raw, vals, w_lo, w_hi = self._token_loads(
                            rq, rk, rg, mQ, mK, mG, mBeta, mV, mWIdx, tok + 1, t + 1, n, h, vb,
                            grp, sub, self._writes(write_mode, t + 1, length), w_sn, w_st,
                            w_wide)
                cute.arch.cp_async_wait_group(0)  # this thread's staged rows have landed
                # one row loop per state source, so that no row decides where its state is
                if src == SRC_STAGE:
                    self._rows(x, SRC_STAGE, stage, keep, qv, kv, dv, beta, kq, v_now, mOut,
                               mDst, tok, h, vb, grp, sub, wrow, more)
                elif src == SRC_F32:
                    self._rows(x, SRC_F32, stage, keep, qv, kv, dv, beta, kq, v_now, mOut,
                               mDst, tok, h, vb, grp, sub, wrow, more)
                else:
                    self._rows(x, SRC_ZERO, stage, keep, qv, kv, dv, beta, kq, v_now, mOut,
                               mDst, tok, h, vb, grp, sub, wrow, more)
                src = i32(SRC_F32)

        # a commit: the start state itself to the row's write slot
        if write_mode == WRITE_START and pad == 0:
            w, okw = self._word(mWIdx, n * w_sn, w_wide)
            if okw == 0 or w >= dst_rows:
                self._flag(mErr, E_WRITE, lead)
            elif w >= w_null:
                cute.arch.cp_async_wait_group(0)
                for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
                    self._fetch(x, src, stage, keep, r)
                    self._put(x, self._row_vecs(mDst, w * w_mul, h, vb * self.BV + grp
                                                + self.G * r), sub, self.pdt)
        cute.arch.cp_async_wait_group(0)  # nothing in flight when the CTA exits

    # --------------------------------------------- the chunked multi-token kernel (cfg.chunk)
    @cute.jit
    def _stage_tile(self, tile, src: cute.Tensor, row, h, vb, grp, sub):
        """cp.async this thread's columns of its R rows of src[row, h] into the row-major tile
        (committed by the caller)."""
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   self.pdt, num_bits_per_copy=128)
        for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
            rho = grp + self.G * r
            vecs = self._row_vecs(src, row, h, vb * self.BV + rho)
            dst = cute.logical_divide(tile[rho, None], cute.make_layout(self.VEC))
            for j in cutlass.range_constexpr(self.NJ):
                cute.copy(atom, vecs[None, sub + self.TPR * j], dst[None, sub + self.TPR * j])

    @cute.jit
    def _zero_tile(self, tile, grp, sub):
        """Zeros over this thread's columns of its R rows of the row-major tile."""
        z = cute.make_rmem_tensor((self.VEC,), self.pdt)
        z.fill(0.0)
        for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
            dst = cute.logical_divide(tile[grp + self.G * r, None], cute.make_layout(self.VEC))
            for j in cutlass.range_constexpr(self.NJ):
                dst[None, sub + self.TPR * j].store(z.load())

    @cute.jit
    def _chunk_products(self, areas, ta, tb, bh, bl, live_len, grp, sub):
        """Group t (< chunk) makes token t's row of A (A[t][i] = sum kn_t kn_i prod_{s=i+1..t}
        d_s, i < t) and B (B[t][i] = sum qn_t kn_i prod_{s=i+1..t} d_s, i <= t; B[t][t] = k . q)
        and its operand columns kn_t D_t (column t) and qn_t D_t (column chunk + t), D_t =
        prod_{s <= t} d_s, split into hi and lo planes (bf16 for a bf16 pool, tf32 values in
        fp32 words for an fp32 one); zeros past the row's `live_len` tokens. Every lane of a
        group runs every shuffle (the conditions are selects)."""
        f32, NC, CH, VEC, pdt = cutlass.Float32, self.NC, self.CH, self.VEC, self.pdt
        tq, tk, td, tv, ts, tw = areas
        t = grp
        live = t < live_len
        kn = cute.make_rmem_tensor((NC,), f32)
        qn = cute.make_rmem_tensor((NC,), f32)
        d = cute.make_rmem_tensor((NC,), f32)
        ki = cute.make_rmem_tensor((NC,), f32)
        cum = cute.make_rmem_tensor((NC,), f32)
        r = cute.make_rmem_tensor((NC,), f32)
        self._tok_get(tk, t, sub, kn)
        self._tok_get(tq, t, sub, qn)
        cum.fill(1.0)
        r.fill(1.0)
        for s in cutlass.range_constexpr(CH):
            self._tok_get(td, s, sub, d)
            use = s <= t
            for c in cutlass.range_constexpr(NC):
                cum[c] = cum[c] * f32(cutlass.select_(use, d[c], f32(1.0)))
        if sub == 0:
            for i in cutlass.range_constexpr(CH):
                ta[t * CH + i] = f32(0.0)
                tb[t * CH + i] = f32(0.0)
        for ii in cutlass.range_constexpr(CH - 1):
            i = t - 1 - ii
            ok = i >= 0
            ic = cutlass.max(i, 0)
            self._tok_get(td, ic + 1, sub, d)
            self._tok_get(tk, ic, sub, ki)
            pa = f32(0.0)
            pb = f32(0.0)
            for c in cutlass.range_constexpr(NC):
                r[c] = r[c] * f32(cutlass.select_(ok, d[c], f32(1.0)))
                w = ki[c] * r[c]
                pa = pa + kn[c] * w
                pb = pb + qn[c] * w
            pa = self._lanes_sum(pa)
            pb = self._lanes_sum(pb)
            if sub == 0 and ok and live:
                ta[t * CH + ic] = pa
                tb[t * CH + ic] = pb
        if sub == 0 and live:
            tb[t * CH + t] = ts[2 * t + 1]
        # the columns as 16-byte vectors: hi and lo of k D and of q D
        fr = [cute.make_rmem_tensor((VEC,), pdt) for _ in range(4)]
        rows = [cute.logical_divide(pl[row, None], cute.make_layout(VEC))
                for pl, row in ((bh, t), (bl, t), (bh, CH + t), (bl, CH + t))]
        for j in cutlass.range_constexpr(self.NJ):
            for e in cutlass.range_constexpr(VEC):
                xk = f32(cutlass.select_(live, kn[j * VEC + e] * cum[j * VEC + e], f32(0.0)))
                xq = f32(cutlass.select_(live, qn[j * VEC + e] * cum[j * VEC + e], f32(0.0)))
                if cutlass.const_expr(pdt is f32):
                    hk = tf32_rna(xk)
                    hq = tf32_rna(xq)
                    fr[0][e] = hk
                    fr[1][e] = xk - hk  # exact; the MMA reads its top 19 bits
                    fr[2][e] = hq
                    fr[3][e] = xq - hq
                else:
                    hk = xk.to(pdt)
                    hq = xq.to(pdt)
                    fr[0][e] = hk
                    fr[1][e] = (xk - hk.to(f32)).to(pdt)
                    fr[2][e] = hq
                    fr[3][e] = (xq - hq.to(f32)).to(pdt)
            for f, dst in zip(fr, rows, strict=True):
                dst[None, sub + self.TPR * j].store(f.load())

    @cute.jit
    def _chunk_mma(self, tile, bh, bl, tp, warp, lane):
        """Rows 16 warp .. + 15 of the start state times the operand planes, into one fp32
        accumulator a column tile: every token's k . S0 and q . S0 products, into tp (column-
        major: tp[column (BV + 4) + row]). A bf16 state is an exact operand (m16n8k16: S hi +
        S lo); an fp32 state is split into tf32 hi and lo in registers (m16n8k8: S_hi hi +
        S_hi lo + S_lo hi, the products to about fp32's precision: modelled in float64, the states
        come as near float64 as the fp32 token loop's; docs/notes/step.md, "The chunked tile")."""
        f32, K, KP, NP = cutlass.Float32, self.K, self.KP, self.NP
        is_f32 = self.pdt is f32
        op_t = cutlass.TFloat32 if is_f32 else cutlass.BFloat16
        KT = 8 if is_f32 else 16  # the MMA's k
        mma = cute.make_tiled_mma(warp_mma.MmaTF32Op((16, 8, 8)) if is_f32 else
                                  warp_mma.MmaF16BF16Op(op_t, f32, (16, 8, 16)))
        thr = mma.get_slice(lane)
        c_shape = thr.partition_shape_C((16, 8))
        accs = [cute.make_rmem_tensor(c_shape, f32) for _ in range(NP // 8)]
        for acc in accs:
            acc.fill(0.0)
        row0 = 16 * warp
        for kt in cutlass.range_constexpr(K // KT):
            va = cute.make_tensor(tile.iterator + row0 * KP + KT * kt,
                                  cute.make_layout((16, KT), stride=(KP, 1)))
            pa = thr.partition_A(va)
            fa = cute.make_rmem_tensor(pa.shape, op_t)
            fl = cute.make_rmem_tensor(pa.shape, op_t)  # an fp32 state's lo part
            if cutlass.const_expr(is_f32):
                xa = cute.make_rmem_tensor(pa.shape, f32)
                xa.store(pa.load())
                for e in cutlass.range_constexpr(cute.size(xa)):
                    # hi truncated (one AND; the planes' hi are rounded): with lo, the
                    # products lose 2^-20 of |S| instead of 2^-21
                    hi = bits_f32(f32_bits(xa[e]) & cutlass.Int32(-8192))
                    fa[e] = hi
                    fl[e] = xa[e] - hi  # exact; the MMA reads its top 19 bits
            else:
                fa.store(pa.load())
            for nt in cutlass.range_constexpr(NP // 8):
                fbs = []
                for plane in (bh, bl):
                    vb_ = cute.make_tensor(plane.iterator + nt * 8 * KP + KT * kt,
                                           cute.make_layout((8, KT), stride=(KP, 1)))
                    pb = thr.partition_B(vb_)
                    fb = cute.make_rmem_tensor(pb.shape, op_t)
                    if cutlass.const_expr(is_f32):
                        fb.store(pb.load().to(op_t))
                    else:
                        fb.store(pb.load())
                    cute.gemm(mma, accs[nt], fa, fb, accs[nt])
                    fbs.append(fb)
                if cutlass.const_expr(is_f32):
                    cute.gemm(mma, accs[nt], fl, fbs[0], accs[nt])
        cC = thr.partition_C(cute.make_identity_tensor((16, 8)))
        for nt in cutlass.range_constexpr(NP // 8):
            for e in cutlass.range_constexpr(cute.size(cC)):
                i, jj = cC[e]
                tp[(nt * 8 + jj) * (self.BV + 4) + row0 + i] = accs[nt][e]

    def _chunk_setup(self):
        """The chunked kernel's shared memory (its storage, the prepared tokens' areas, the
        staging area) and registers (a token's raw loads; its gate constants, q, k, decay and
        a row's state, fp32)."""
        smem = utils.SmemAllocator()
        shared = smem.allocate(self.shared_storage)
        halves = 2 if self.cfg.persist else 1
        area = shared.stage.get_tensor(cute.make_layout(halves * self.BV * self.KP))
        regs = [cute.make_rmem_tensor((self.NC,), cutlass.Float32) for _ in range(5)]
        return (shared, self._tok_areas(shared), area, self._raw_tensor(), self._raw_tensor(),
                self._raw_tensor(), cute.make_rmem_tensor((self.NVP,), cutlass.BFloat16), *regs)

    def _chunk_tile(self, area, buf):
        """Half `buf` (0 or 1) of the chunked kernel's staging area, as the row-major tile."""
        n_el = self.BV * self.KP
        layout = cute.make_layout((self.BV, self.K), stride=(self.KP, 1))
        if isinstance(buf, int):
            return cute.make_tensor(area.iterator + buf * n_el, layout)
        off = cute.assume(buf * n_el, divby=n_el)  # keeps the 16-byte alignment of the copies
        return cute.make_tensor(area.iterator + off, layout)

    @cute.jit
    def _chunk_issue(self, ok, vb, h, n, tile, regs, ins, modes, tidx, grp, sub):
        """Tile (vb, h, n) of the chunked kernel (nothing where not `ok`): its row's tokens and
        read slot (bad values flagged, the row then padding), its start state staged into
        `tile` (zeros for a row that starts from zeros, or is padding), one commit group either
        way; the head's gate constants into bias and, in the preparing groups (grp < chunk),
        their token's loads into rq, rk, rg, rv. Nothing waits for the loads here. Returns
        (bos, the row's live tokens (0 for padding), its tokens, beta as loaded, the words of
        the token's write entry, A_log). regs: (rq, rk, rg, rv, bias); ins and modes: the
        kernel's tensors and scalars it reads, in the order unpacked below."""
        rq, rk, rg, rv, bias = regs
        (mQ, mK, mG, mBeta, mV, mALog, mDtBias, mPool, mCu, mRIdx, mWIdx, mAcc, mHasInit,
         mErr) = ins
        (fixed_len, cu_wide, max_tokens, read_mode, r_sn, r_st, r_wide, r_mul, r_add, acc_on,
         acc_wide, acc_base, acc_skip, max_sel, hi_on, r_null, write_mode, w_sn, w_st, w_wide,
         a_log_dtype, dt_bias_dtype) = modes
        i32 = cutlass.Int32
        bos, length, live_len = i32(0), i32(0), i32(0)
        b_raw, w_lo, w_hi, a_log = cutlass.BFloat16(0.0), i32(-1), i32(-1), cutlass.Float32(0.0)
        if ok:
            lead = self._lead(tidx, vb, h)
            bos, length = self._row_tokens(mCu, mErr, n, lead, mQ.shape[0], fixed_len, cu_wide,
                                           max_tokens)
            pad, _, slot, start = self._row_slot(
                mRIdx, mAcc, mHasInit, mErr, n, lead, mPool.shape[0], read_mode, r_sn, r_st,
                r_wide, r_mul, r_add, acc_on, acc_wide, acc_base, acc_skip, max_sel, hi_on,
                r_null)
            if length > self.CH:  # the plan bounds max_tokens by the chunk: never taken
                self._flag(mErr, E_LEN, lead)
                pad = i32(1)
            if pad == 0 and start != 0 and length > 0:
                self._stage_tile(tile, mPool, slot, h, vb, grp, sub)
            else:
                self._zero_tile(tile, grp, sub)
            if pad == 0:
                live_len = length
            a_log = self._gate_consts(bias, mALog, mDtBias, h, sub, a_log_dtype, dt_bias_dtype)
            if grp < self.CH and live_len > 0:
                tt = cutlass.min(grp, live_len - 1)
                b_raw, w_lo, w_hi = self._prep_issue(
                    rq, rk, rg, rv, mQ, mK, mG, mBeta, mV, mWIdx, bos + tt, tt, n, h, vb, sub,
                    self._writes(write_mode, tt, live_len), w_sn, w_st, w_wide)
        cute.arch.cp_async_commit_group()
        return bos, live_len, length, b_raw, w_lo, w_hi, a_log

    @cute.jit
    def _chunk_prep(self, areas, live_len, rq, rk, rg, rv, b_raw, w_lo, w_hi, qv, kv, dv, bias,
                    a_log, mErr: cute.Tensor, vb, h, grp, sub, write_mode, dst_rows, w_wide,
                    w_mul, w_add, w_null, gate, qk_l2norm, beta_sigmoid, scale, lower_bound):
        """The preparing groups: group g's token (the row's g-th; a group past the row's last
        token works on that one again without storing it) from its loads (_chunk_issue) into
        prepared slot g."""
        if grp < self.CH and live_len > 0:
            tt = cutlass.min(grp, live_len - 1)
            lead_p = cutlass.Int32(0)  # reports a prepared token's bad write entry
            if sub == 0 and vb == 0 and h == 0:
                lead_p = cutlass.Int32(1)
            self._prep_store(areas, grp, rq, rk, rg, rv, b_raw, w_lo, w_hi, qv, kv, dv, bias,
                             cute.math.exp(a_log), mErr, tt, grp < live_len, lead_p, sub,
                             self._writes(write_mode, tt, live_len), dst_rows, w_wide, w_mul,
                             w_add, w_null, gate, qk_l2norm, beta_sigmoid, scale, lower_bound)

    @cute.jit
    def _chunk_rows(self, tile, shared, areas, bos, live_len, length, x, dv, kv,
                    mOut: cute.Tensor, mDst: cute.Tensor, vb, h, tidx, grp, sub):
        """A staged and prepared tile (after a CTA barrier): the tokens' products among
        themselves and the operand planes (_chunk_products), every token's products with the
        start state (_chunk_mma), the rows' solves (one lane a row: the deltas over the row's
        products in tp, read by that lane alone; the outputs) and the states after each token,
        each to its write row; a padding row's outputs zeros. Two CTA barriers (after the
        caller's). The rows' products tp are column-major, columns BV + 4 apart, so that the
        MMA's stores and the solving lanes' reads (rows G apart) take distinct banks."""
        f32 = cutlass.Float32
        K, NC, CH, NP, VEC = self.K, self.NC, self.CH, self.NP, self.VEC
        ta = shared.ta.get_tensor(cute.make_layout(CH * CH))
        tb = shared.tb.get_tensor(cute.make_layout(CH * CH))
        bh = shared.bh.get_tensor(cute.make_layout((NP, K), stride=(self.KP, 1)))
        bl = shared.bl.get_tensor(cute.make_layout((NP, K), stride=(self.KP, 1)))
        BVP = self.BV + 4  # tp's column stride
        tp = shared.tp.get_tensor(cute.make_layout(BVP * NP))
        if grp < CH:
            self._chunk_products(areas, ta, tb, bh, bl, live_len, grp, sub)
        if cutlass.const_expr(NP > 2 * CH):  # the planes' columns past 2 chunk: zeros
            for i in cutlass.range(tidx, (NP - 2 * CH) * K, self.threads):
                bh[2 * CH + i // K, i % K] = self.pdt(0.0)
                bl[2 * CH + i // K, i % K] = self.pdt(0.0)
        cute.arch.sync_threads()
        warp = tidx // 32
        self._chunk_mma(tile, bh, bl, tp, warp, tidx - 32 * warp)
        cute.arch.sync_threads()

        tq, tk, td, tv, ts, tw = areas
        if live_len > 0 and sub < self.R:  # lanes sub < R of a group: its R rows
            rho = grp + self.G * sub
            v_idx = vb * self.BV + rho
            dl = cute.make_rmem_tensor((CH,), f32)
            for t in cutlass.range_constexpr(CH):
                acc = f32(0.0)
                if t < live_len:
                    acc = tv[t * self.BV + rho] - tp[t * BVP + rho]
                    for i in cutlass.range_constexpr(t):
                        acc = acc - dl[i] * ta[t * CH + i]
                    acc = ts[2 * t] * acc
                dl[t] = acc
            for t in cutlass.range_constexpr(CH):
                if t < live_len:
                    o = tp[(CH + t) * BVP + rho]
                    for i in cutlass.range_constexpr(t + 1):
                        o = o + dl[i] * tb[t * CH + i]
                    mOut[bos + t, h * self.V + v_idx] = o.to(cutlass.BFloat16)
            for t in cutlass.range_constexpr(CH):  # over the row's P (read above)
                tp[t * BVP + rho] = dl[t]
        cute.arch.sync_warp()  # a group's rows are its warp's
        for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
            rho = grp + self.G * r
            v_idx = vb * self.BV + rho
            if live_len == 0:
                for t in cutlass.range(length):
                    if sub == 0:
                        mOut[bos + t, h * self.V + v_idx] = f32(0.0).to(cutlass.BFloat16)
            else:
                src = cute.logical_divide(tile[rho, None], cute.make_layout(VEC))
                for j in cutlass.range_constexpr(self.NJ):
                    y = src[None, sub + self.TPR * j].load().to(f32)
                    for e in cutlass.range_constexpr(VEC):
                        x[j * VEC + e] = y[e]
                for t in cutlass.range_constexpr(CH):
                    if t < live_len:
                        self._tok_get(td, t, sub, dv)
                        self._tok_get(tk, t, sub, kv)
                        u = tp[t * BVP + rho]
                        for c in cutlass.range_constexpr(NC):
                            x[c] = x[c] * dv[c] + u * kv[c]
                        wrow = tw[t]
                        if wrow >= 0:
                            self._put(x, self._row_vecs(mDst, wrow, h, v_idx), sub, self.pdt)

    # ------------------------------------------------- the persistent single-token kernel
    @cute.kernel
    def kernel_pipe(
        self, mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor, mV: cute.Tensor,
        mBeta: cute.Tensor, mOut: cute.Tensor, mALog: cute.Tensor, mDtBias: cute.Tensor,
        mPool: cute.Tensor, mDst: cute.Tensor, mCu: cute.Tensor, mRIdx: cute.Tensor,
        mWIdx: cute.Tensor, mAcc: cute.Tensor, mParent: cute.Tensor, mHasInit: cute.Tensor,
        mErr: cute.Tensor, num_rows: cutlass.Int32, num_heads: cutlass.Int32,
        fixed_len: cutlass.Int32, cu_wide: cutlass.Int32, max_tokens: cutlass.Int32,
        read_mode: cutlass.Int32, r_sn: cutlass.Int32, r_st: cutlass.Int32,
        r_wide: cutlass.Int32, r_mul: cutlass.Int32, r_add: cutlass.Int32,
        acc_on: cutlass.Int32, acc_wide: cutlass.Int32, acc_base: cutlass.Int32,
        acc_skip: cutlass.Int32, max_sel: cutlass.Int32,
        hi_on: cutlass.Int32, r_null: cutlass.Int32, w_null: cutlass.Int32,
        write_mode: cutlass.Int32, w_sn: cutlass.Int32, w_st: cutlass.Int32,
        w_wide: cutlass.Int32, w_mul: cutlass.Int32, w_add: cutlass.Int32,
        parent_on: cutlass.Int32, p_sn: cutlass.Int32, p_st: cutlass.Int32,
        p_wide: cutlass.Int32,  # unused: no tree parents in single-token plans
        gate: cutlass.Int32, a_log_dtype: cutlass.Int32, dt_bias_dtype: cutlass.Int32,
        qk_l2norm: cutlass.Int32, beta_sigmoid: cutlass.Int32,
        scale: cutlass.Float32, lower_bound: cutlass.Float32,
    ):
        """Single-token plans (a row has at most one token; plans.step picks this kernel for
        no other): each CTA walks tiles bid, bid + grid, .. of the (V / BV, H, rows) tiles
        and, before a tile's row loop, looks up the next tile's slots and issues its staging
        into the other half of its shared memory, so its reads stay in flight while it
        computes. Per tile, what the one-tile kernel does for its first token.

        Each thread reads back only what it staged itself, so the halves need no barrier: the
        next tile's copies (or zeros) go to the half the previous tile was read from, and every
        value read from it there fed that tile's row loop, which comes before them in program
        order (in-order issue: the reads have returned before the copies are issued).

        A chunked tile (cfg.chunk) walks its tiles the same way: before a tile's products and
        rows it stages the next tile into the other half and issues that tile's token loads
        (after its own prepared tokens are stored: they share the registers); a CTA barrier
        after the rows frees the half and the prepared tokens' area."""
        if cutlass.const_expr(self.CH != 0):
            NVB = self.V // self.BV
            tidx, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            nb, _, _ = cute.arch.grid_dim()
            grp = tidx // self.TPR
            sub = tidx - grp * self.TPR
            tiles = NVB * num_heads * num_rows
            shared, areas, area, rq, rk, rg, rv, bias, qv, kv, dv, x = self._chunk_setup()
            regs = (rq, rk, rg, rv, bias)
            ins = (mQ, mK, mG, mBeta, mV, mALog, mDtBias, mPool, mCu, mRIdx, mWIdx, mAcc,
                   mHasInit, mErr)
            modes = (fixed_len, cu_wide, max_tokens, read_mode, r_sn, r_st, r_wide, r_mul, r_add,
                     acc_on, acc_wide, acc_base, acc_skip, max_sel, hi_on, r_null, write_mode,
                     w_sn, w_st, w_wide, a_log_dtype, dt_bias_dtype)
            bos, live_len, length, b_raw, w_lo, w_hi, a_log = self._chunk_issue(
                bid < tiles, bid % NVB, (bid // NVB) % num_heads, bid // (NVB * num_heads),
                self._chunk_tile(area, 0), regs, ins, modes, tidx, grp, sub)
            buf = cutlass.Int32(0)
            for t in cutlass.range(bid, tiles, nb):
                vb = t % NVB
                h = (t // NVB) % num_heads
                self._chunk_prep(areas, live_len, rq, rk, rg, rv, b_raw, w_lo, w_hi, qv, kv, dv,
                                 bias, a_log, mErr, vb, h, grp, sub, write_mode, mDst.shape[0],
                                 w_wide, w_mul, w_add, w_null, gate, qk_l2norm, beta_sigmoid,
                                 scale, lower_bound)
                u = t + nb
                bos2, live2, len2, b_raw2, w_lo2, w_hi2, a_log2 = self._chunk_issue(
                    u < tiles, u % NVB, (u // NVB) % num_heads, u // (NVB * num_heads),
                    self._chunk_tile(area, 1 - buf), regs, ins, modes, tidx, grp, sub)
                cute.arch.cp_async_wait_group(1)  # this tile's staged rows have landed
                cute.arch.sync_threads()
                self._chunk_rows(self._chunk_tile(area, buf), shared, areas, bos, live_len,
                                 length, x, dv, kv, mOut, mDst, vb, h, tidx, grp, sub)
                cute.arch.sync_threads()  # the half and the prepared tokens' area are free
                bos, live_len, length, b_raw, w_lo, w_hi, a_log = (
                    bos2, live2, len2, b_raw2, w_lo2, w_hi2, a_log2)
                buf = 1 - buf
            cute.arch.cp_async_wait_group(0)  # nothing in flight when the CTA exits
            return
        f32, i32 = cutlass.Float32, cutlass.Int32
        NVB, n_el = self.V // self.BV, self.BV * self.K
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nb, _, _ = cute.arch.grid_dim()
        grp = tidx // self.TPR
        sub = tidx - grp * self.TPR
        num_tokens = mQ.shape[0]
        slots = mPool.shape[0]
        dst_rows = mDst.shape[0]
        tiles = NVB * num_heads * num_rows
        smem = utils.SmemAllocator()
        shared = smem.allocate(self.shared_storage)
        area = shared.stage.get_tensor(cute.make_layout(2 * n_el))
        qv = cute.make_rmem_tensor((self.NC,), f32)
        kv = cute.make_rmem_tensor((self.NC,), f32)
        dv = cute.make_rmem_tensor((self.NC,), f32)
        bias = cute.make_rmem_tensor((self.NC,), f32)
        x = cute.make_rmem_tensor((self.NC,), f32)

        rq, rk, rg = self._raw_tensor(), self._raw_tensor(), self._raw_tensor()

        # the first tile's slots, staging and loads
        bos, length, pad, wrow, b_raw, vals, a_log = self._pipe_issue(
            bid, i32(0), area, rq, rk, rg, bias, tiles, num_heads, mQ, mK, mG, mBeta, mV,
            mALog, mDtBias, mPool, mCu, mRIdx, mWIdx, mAcc, mHasInit, mErr, tidx, grp, sub,
            num_tokens, slots, dst_rows, fixed_len, cu_wide, max_tokens, read_mode, r_sn, r_st,
            r_wide, r_mul, r_add, acc_on, acc_wide, acc_base, acc_skip, max_sel, hi_on, r_null,
            w_null, write_mode, w_sn, w_st, w_wide, w_mul, w_add, a_log_dtype, dt_bias_dtype)
        buf = i32(0)
        for t in cutlass.range(bid, tiles, nb):
            vb = t % NVB
            h = (t // NVB) % num_heads
            tok, live, wr = bos, length, wrow
            if pad != 0:
                live = i32(0)
            # this tile's loads (issued before the previous tile's rows) into registers
            beta, kq, v_now = f32(0.0), f32(0.0), f32(0.0)
            if live > 0:
                self._raw_cols(qv, rq)
                self._raw_cols(kv, rk)
                self._raw_cols(dv, rg)
                v_now = vals.to(f32)
                beta, kq = self._token_math(qv, kv, dv, b_raw, bias, cute.math.exp(a_log),
                                            gate, qk_l2norm, beta_sigmoid, scale, lower_bound)
            # the next tile's slots, staging (into the other half) and loads
            zeros = length > 0 and pad != 0
            bos, length, pad, wrow, b_raw, vals, a_log = self._pipe_issue(
                t + nb, 1 - buf, area, rq, rk, rg, bias, tiles, num_heads, mQ, mK, mG, mBeta,
                mV, mALog, mDtBias, mPool, mCu, mRIdx, mWIdx, mAcc, mHasInit, mErr, tidx, grp,
                sub, num_tokens, slots, dst_rows, fixed_len, cu_wide, max_tokens, read_mode,
                r_sn, r_st, r_wide, r_mul, r_add, acc_on, acc_wide, acc_base, acc_skip, max_sel,
                hi_on, r_null, w_null, write_mode, w_sn, w_st, w_wide, w_mul, w_add, a_log_dtype,
                dt_bias_dtype)
            cute.arch.cp_async_wait_group(1)  # this tile's staged rows have landed
            if zeros:
                self._zero_outputs(mOut, tok, h, vb, grp, sub)
            elif live > 0:
                stage = self._mine_at(area, buf, tidx)
                for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
                    self._row(x, SRC_STAGE, stage, stage, r, qv, kv, dv, beta, kq, v_now, mOut,
                              mDst, tok, h, vb, grp, sub, wr)
            buf = 1 - buf
        cute.arch.cp_async_wait_group(0)  # nothing in flight when the CTA exits

    def _mine_at(self, area, buf, tidx):
        """This thread's elements of half `buf` (0 or 1) of a two-tile staging area."""
        n_el = self.BV * self.K
        off = cute.assume(buf * n_el, divby=n_el)  # keeps the 16-byte alignment of the copies
        return self._mine(cute.make_tensor(area.iterator + off, cute.make_layout(n_el)), tidx)

    @cute.jit
    def _pipe_issue(self, t, buf, area, rq, rk, rg, bias, tiles, num_heads, mQ: cute.Tensor,
                    mK: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mV: cute.Tensor,
                    mALog: cute.Tensor, mDtBias: cute.Tensor, mPool: cute.Tensor,
                    mCu: cute.Tensor, mRIdx: cute.Tensor, mWIdx: cute.Tensor,
                    mAcc: cute.Tensor, mHasInit: cute.Tensor, mErr: cute.Tensor, tidx, grp,
                    sub, num_tokens, slots, dst_rows, fixed_len, cu_wide, max_tokens,
                    read_mode, r_sn, r_st, r_wide, r_mul, r_add, acc_on, acc_wide, acc_base,
                    acc_skip, max_sel, hi_on, r_null, w_null, write_mode, w_sn, w_st, w_wide,
                    w_mul, w_add, a_log_dtype, dt_bias_dtype):
        """Tile t's row setup (nothing past the last tile), its write row (-1: none), its
        token's loads (q, k, g into rq, rk, rg, the gate's constants into bias; nothing waits
        for them here) and its start state staged into half `buf` (zeros there for a row that
        starts from zeros); one commit group either way. Returns (bos, length, pad, wrow,
        beta and v as loaded, A_log)."""
        i32 = cutlass.Int32
        NVB = self.V // self.BV
        bos, length, pad, slot, start, wrow = i32(0), i32(0), i32(1), i32(-1), i32(0), i32(-1)
        b_raw, vals, a_log = cutlass.BFloat16(0.0), cutlass.BFloat16(0.0), cutlass.Float32(0.0)
        if t < tiles:
            vb = t % NVB
            h = (t // NVB) % num_heads
            n = t // (NVB * num_heads)
            lead = self._lead(tidx, vb, h)
            bos, length = self._row_tokens(mCu, mErr, n, lead, num_tokens, fixed_len, cu_wide,
                                           max_tokens)
            w_lo, w_hi = i32(-1), i32(-1)
            if length > 0:  # in flight through the slot lookup
                b_raw, vals, w_lo, w_hi = self._token_loads(
                    rq, rk, rg, mQ, mK, mG, mBeta, mV, mWIdx, bos, i32(0), n, h, vb, grp, sub,
                    self._writes(write_mode, i32(0), length), w_sn, w_st, w_wide)
                a_log = self._gate_consts(bias, mALog, mDtBias, h, sub, a_log_dtype, dt_bias_dtype)
            pad, _, slot, start = self._row_slot(
                mRIdx, mAcc, mHasInit, mErr, n, lead, slots, read_mode, r_sn, r_st, r_wide,
                r_mul, r_add, acc_on, acc_wide, acc_base, acc_skip, max_sel, hi_on, r_null)
            if pad == 0 and length > 0:
                if write_mode == WRITE_ALL or write_mode == WRITE_LAST:
                    wrow = self._write_row_of(w_lo, w_hi, mErr, i32(0), lead, dst_rows, w_wide,
                                              w_mul, w_add, w_null)
                stage = self._mine_at(area, buf, tidx)
                if start != 0:
                    self._stage_rows(stage, mPool, slot, h, vb, grp, sub)
                else:
                    self._zero_stage(stage)
        cute.arch.cp_async_commit_group()
        return bos, length, pad, wrow, b_raw, vals, a_log
