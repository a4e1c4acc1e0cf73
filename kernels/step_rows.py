"""The token step's shared rows (sm_90a): what the decode / verify kernels have in common.

The kernels (kernels/kda_step_sm90.py the one-tile token kernel, kda_step_persist_sm90.py the
persistent single-token kernel, kda_step_chunk_sm90.py the chunked tile) run the KDA recurrence
token by token against a state pool. A CTA takes a block of BV state rows of one head of one
batch row (a tile), TPR lanes per state row. Thread t owns the rows v = vb BV + grp + G r
(grp = t // TPR, G = threads / TPR row groups, r < R) and, of each, the columns
d = (sub + TPR j) VEC + e (sub = t % TPR, j < NJ, e < VEC): one 16-byte (cfg.access: or 8-byte)
pool access per (row, j), so a warp's accesses cover whole 128-byte lines. Per token, with the
row dot products (and q's and k's norms) reduced over the TPR lanes of a row by butterfly
shuffles:

    a = gate(g);  S = S * exp(a);  u = beta (v - S kn);  S = S + u kn^T;  o = S (scale qn)

(o taken as S qn + u (kn . qn) with S before the update, so that a row has one reduction of
two values: _update_row).

Which slot a row reads, where the state after a token goes and where a row's tokens are are all
run-time arguments (kda_cute.specs.step.args, taken by the kernels as the records below in that
order), so the kernels serve decode, verify with a slot per token (vLLM, fla), verify into a
scratch with tree parents (SGLang, FlashInfer), commit and the dense recurrent forward. A bad
index, length or count is never followed: the row becomes a padding row (zero outputs, nothing
read or written) and the argument's error word is set. Constraints:
kda_cute.specs.step.supports.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from kda_cute.specs.step import ERRORS, WRITE_ALL, WRITE_LAST, StepConfig
from kernels.common import Record, StateSlots, gate_param16, gate_param32, halves

E_CU, E_LEN, E_ACC, E_READ, E_WRITE, E_PARENT = range(6)  # the words of specs.step.ERRORS
assert ERRORS[E_PARENT] == "retrieve_parent_token"
GATE_BOUNDED, GATE_UNBOUNDED = 1, 2
SRC_ZERO, SRC_STAGE, SRC_F32 = 0, 1, 2  # where a row's state comes from at a token


# ---------------------------------------------------------------- the kernels' records
@dataclass
class Tokens(Record):
    """The tokens: q, k, g (T, H*K) bf16 (row stride free), v (T, H*V), beta (T, H), and the
    output (T, H*V)."""
    q: cute.Tensor
    k: cute.Tensor
    g: cute.Tensor
    v: cute.Tensor
    beta: cute.Tensor
    out: cute.Tensor


@dataclass
class GateParams(Record):
    """A_log (H,) and dt_bias (H*K,), as held (Gate.a_log_dtype / dt_bias_dtype)."""
    a_log: cute.Tensor
    dt_bias: cute.Tensor


@dataclass
class States(Record):
    """The pool (P, H, V, K) rows start from (slot stride free), and where states are written
    (PD, H, V, K: the pool or a scratch)."""
    pool: cute.Tensor
    dst: cute.Tensor


@dataclass
class Tables(Record):
    """The int32 word tables (cu_seqlens, read and write slots, accepted counts, tree parents),
    has_initial_state (N,) int8, and the error words (8,) int32."""
    cu: cute.Tensor
    read_index: cute.Tensor
    write_index: cute.Tensor
    accepted: cute.Tensor
    parent: cute.Tensor
    has_init: cute.Tensor
    errors: cute.Tensor


@dataclass
class Grid(Record):
    """The persistent kernels' tiles: batch rows and heads (V / BV tiles each)."""
    num_rows: cutlass.Int32
    num_heads: cutlass.Int32


@dataclass
class Seqs(Record):
    """Where a row's tokens are: fixed_len of them from row n * fixed_len, or (fixed_len < 0)
    cu_seqlens' (int64 where cu_wide); at most max_tokens."""
    fixed_len: cutlass.Int32
    cu_wide: cutlass.Int32
    max_tokens: cutlass.Int32


@dataclass
class Read(Record):
    """The read slot (mode 0: every row starts from zeros): entry n * sn + sel * st of its
    table (int64 where wide), times mul, plus sel * add."""
    mode: cutlass.Int32
    sn: cutlass.Int32
    st: cutlass.Int32
    wide: cutlass.Int32
    mul: cutlass.Int32
    add: cutlass.Int32


@dataclass
class Accepted(Record):
    """The accepted counts (on: read): sel = accepted[n] - base picks the read entry (skip: a
    negative sel makes the row a no-op), below max_sel."""
    on: cutlass.Int32
    wide: cutlass.Int32
    base: cutlass.Int32
    skip: cutlass.Int32
    max_sel: cutlass.Int32


@dataclass
class Starts(Record):
    """Whether has_initial_state is read (hi_on), and the slots below which a read / write
    entry is padding."""
    hi_on: cutlass.Int32
    r_null: cutlass.Int32
    w_null: cutlass.Int32


@dataclass
class Write(Record):
    """Which states are written (specs.step.WRITE_*) and where: entry n * sn + t * st of the
    write table (int64 where wide), times mul, plus t * add."""
    mode: cutlass.Int32
    sn: cutlass.Int32
    st: cutlass.Int32
    wide: cutlass.Int32
    mul: cutlass.Int32
    add: cutlass.Int32


@dataclass
class Parents(Record):
    """Tree drafts (on): token t starts from the state after token parent[n * sn + t * st]."""
    on: cutlass.Int32
    sn: cutlass.Int32
    st: cutlass.Int32
    wide: cutlass.Int32


@dataclass
class Gate(Record):
    """The gate's form (GATE_*; 0: g is the log-decay), how A_log and dt_bias are held
    (abi.GATE_PARAM_DTYPES, 0: not given), q / k L2 norm and beta's sigmoid switches, the
    scale and the bounded gate's lower bound."""
    form: cutlass.Int32
    a_log_dtype: cutlass.Int32
    dt_bias_dtype: cutlass.Int32
    qk_l2norm: cutlass.Int32
    beta_sigmoid: cutlass.Int32
    scale: cutlass.Float32
    lower_bound: cutlass.Float32


class StepRows(StateSlots):
    """The state rows of a tile and the token math every step kernel shares; a kernel class
    adds its kernel(s) and _launch."""

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
        ins = (Tokens(mQ, mK, mG, mV, mBeta, mOut), GateParams(mALog, mDtBias),
               States(mPool, mDst), Tables(mCu, mRIdx, mWIdx, mAcc, mParent, mHasInit, mErr))
        modes = (Seqs(fixed_len, cu_wide, max_tokens),
                 Read(read_mode, r_sn, r_st, r_wide, r_mul, r_add),
                 Accepted(acc_on, acc_wide, acc_base, acc_skip, max_sel),
                 Starts(hi_on, r_null, w_null),
                 Write(write_mode, w_sn, w_st, w_wide, w_mul, w_add),
                 Parents(parent_on, p_sn, p_st, p_wide),
                 Gate(gate, a_log_dtype, dt_bias_dtype, qk_l2norm, beta_sigmoid, scale,
                      lower_bound))
        self._launch(ins, Grid(num_rows, num_heads), modes, stream)

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

    # ------------------------------------------------------------- state rows
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

    def _row_vecs(self, m: cute.Tensor, row, h, v):
        return cute.logical_divide(m[row, h, v, None], cute.make_layout(self.VEC))

    @cute.jit
    def _stage_rows(self, mine, src: cute.Tensor, row, h, vb, grp, sub):
        """cp.async this thread's columns of its R rows of src[row, h] into its staging area
        `mine` (committed by the caller)."""
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
    def _put(self, x, vecs_dst, sub, dtype):
        """Registers x to a row of VEC-vectors (global or shared), converted to dtype."""
        VEC = self.VEC
        frag = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        for j in cutlass.range_constexpr(self.NJ):
            for e in cutlass.range_constexpr(VEC):
                frag[e] = x[j * VEC + e]
            vecs_dst[None, sub + self.TPR * j].store(frag.load().to(dtype))

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
    def _row(self, x, src, stage, keep, r, token, row_io, tok, h, vb, grp, sub, wrow):
        """This thread's row r through token `tok` (token: its columns qv, kv, dv, beta, k . q
        and this lane's v, _v_ahead): its state into registers x (from `src`), the update, its
        output to row_io's out, and the state after it to row_io's dst row `wrow` (>= 0)."""
        qv, kv, dv, beta, kq, vals = token
        mOut, mDst = row_io
        v_idx = vb * self.BV + grp + self.G * r
        self._fetch(x, src, stage, keep, r)
        o = self._update_row(x, qv, kv, dv, beta, kq, vals, r, sub)
        if sub == self.OUT_LANE:
            mOut[tok, h * self.V + v_idx] = o.to(cutlass.BFloat16)
        if wrow >= 0:
            self._put(x, self._row_vecs(mDst, wrow, h, v_idx), sub, self.pdt)

    @cute.jit
    def _zero_outputs(self, mOut: cute.Tensor, tok, h, vb, grp, sub):
        """A padding row's outputs of token `tok`: zeros in this thread's rows."""
        for r in cutlass.range_constexpr(self.R):
            if sub == 0:
                mOut[tok, h * self.V + vb * self.BV + grp + self.G * r] = (
                    cutlass.Float32(0.0).to(cutlass.BFloat16))

    # ----------------------------------------------------------- a row's setup
    @cute.jit
    def _lead(self, tidx, vb, h):
        """1 for the one thread of a batch row that reports its bad values (thread 0 of the
        row's first tile), else 0."""
        lead = cutlass.Int32(0)
        if tidx == 0 and vb == 0 and h == 0:
            lead = cutlass.Int32(1)
        return lead

    @cute.jit
    def _row_tokens(self, tab: Tables, seqs: Seqs, n, lead, num_tokens):
        """Batch row n's tokens, bad values flagged (by `lead`) and turned into an empty row:
        (bos, length). Nothing here waits for the read slot (_row_slot)."""
        i32 = cutlass.Int32
        bos = n * seqs.fixed_len
        length = seqs.fixed_len
        if seqs.fixed_len < 0:
            b0, ok0 = self._word(tab.cu, n, seqs.cu_wide)
            e0, ok1 = self._word(tab.cu, n + 1, seqs.cu_wide)
            bos = b0
            length = e0 - b0
            if ok0 == 0 or ok1 == 0 or b0 < 0 or e0 < b0 or e0 > num_tokens:
                self._flag(tab.errors, E_CU, lead)
                bos = i32(0)
                length = i32(0)
        if length > seqs.max_tokens:
            self._flag(tab.errors, E_LEN, lead)
            length = i32(0)
        return bos, length

    @cute.jit
    def _row_slot(self, tab: Tables, rd: Read, acc: Accepted, starts: Starts, n, lead, slots):
        """Batch row n's read slot, bad values flagged (by `lead`) and turned into padding:
        (pad, sel, slot, start)."""
        i32 = cutlass.Int32
        mRIdx, mErr = tab.read_index, tab.errors
        # ---- the read slot: padding (< r_null), bad (flagged, then padding) -----------------
        # sel = accepted[n] - acc.base picks the read entry (and, times rd.add, the row in it)
        pad = i32(0)
        sel = i32(0)
        if acc.on != 0:
            a, ok = self._word(tab.accepted, n, acc.wide)
            sel = a - acc.base
            if ok != 0 and sel < 0 and acc.skip != 0:
                pad = i32(1)  # a commit's step < 0: nothing to do
            elif ok == 0 or sel < 0 or sel >= acc.max_sel:
                first, _ = self._word(mRIdx, n * rd.sn, rd.wide)
                if first >= starts.r_null:  # a padding row may carry any count
                    self._flag(mErr, E_ACC, lead)
                pad = i32(1)
        slot = i32(-1)
        if pad == 0 and rd.mode != 0:  # read mode 0: every row starts from zeros
            s0, ok = self._word(mRIdx, n * rd.sn + sel * rd.st, rd.wide)
            # s0 < slots first: s0 * rd.mul cannot wrap around then
            slot = cutlass.min(s0, slots) * rd.mul + sel * rd.add
            if ok == 0 or (s0 >= starts.r_null and (s0 >= slots or slot >= slots)):
                self._flag(mErr, E_READ, lead)
                pad = i32(1)
            elif s0 < starts.r_null:
                pad = i32(1)
        start = rd.mode  # 1: the row starts from its slot, 0: from zeros
        if starts.hi_on != 0:
            if tab.has_init[n] == 0:
                start = i32(0)
        return pad, sel, slot, start

    @cute.jit
    def _writes(self, write_mode, t, length):
        """Whether the state after a row's t-th token (of `length`) is written."""
        return write_mode == WRITE_ALL or (write_mode == WRITE_LAST and t == length - 1)

    @cute.jit
    def _write_words(self, mWIdx: cute.Tensor, n, t, wr: Write):
        """The words of batch row n's write entry of token t (low, high; an int32 table's
        entry twice): loads only, nothing waits for them here."""
        i = (n * wr.sn + t * wr.st) * (1 + wr.wide)
        return mWIdx[i], mWIdx[i + wr.wide]

    @cute.jit
    def _write_row_of(self, lo, hi, mErr: cute.Tensor, t, lead, dst_rows, wr: Write, w_null):
        """The dst row the state after token t of a batch row goes to, from the words of its
        write entry (_write_words): -1 for a padding entry, and for a bad one (flagged)."""
        wrow = cutlass.Int32(-1)
        w = lo
        okw = cutlass.Int32(1)
        if wr.wide != 0 and hi != (lo >> 31):
            okw = cutlass.Int32(0)
        # w < dst_rows first: w * wr.mul cannot wrap around then
        row = cutlass.min(w, dst_rows) * wr.mul + t * wr.add
        if okw == 0 or (w >= w_null and (w >= dst_rows or row >= dst_rows)):
            self._flag(mErr, E_WRITE, lead)
        elif w >= w_null:
            wrow = row
        return wrow

    # -------------------------------------------------------------- a token
    def _raw_tensor(self):
        return cute.make_rmem_tensor(cute.make_layout((self.VEC, self.NJ)), cutlass.BFloat16)

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

    @cute.jit
    def _token_loads(self, raw, tk: Tokens, mWIdx: cute.Tensor, tok, t, n, h, vb, grp, sub,
                     writes, wr: Write):
        """Token `tok` (the row's t-th)'s loads, none waited for: q, k and g into raw's rq,
        rk, rg, and (beta as loaded, this lane's v (_v_ahead), the words of its write entry
        where `writes`, else -1)."""
        vals = self._v_ahead(tk.v, tok, h, vb, grp, sub)
        b_raw, w_lo, w_hi = self._head_loads(raw, tk, mWIdx, tok, t, n, h, sub, writes, wr)
        return b_raw, vals, w_lo, w_hi

    @cute.jit
    def _head_loads(self, raw, tk: Tokens, mWIdx: cute.Tensor, tok, t, n, h, sub, writes,
                    wr: Write):
        """_token_loads' and _prep_issue's common part: the words of the write entry of token
        `tok` (the row's t-th) where `writes` (else -1), its beta, and this thread's columns of
        q, k and g into raw's rq, rk, rg, all as loaded. Returns (beta, w_lo, w_hi)."""
        i32 = cutlass.Int32
        rq, rk, rg = raw
        w_lo, w_hi = i32(-1), i32(-1)
        if writes:
            w_lo, w_hi = self._write_words(mWIdx, n, t, wr)
        b_raw = tk.beta[tok, h]
        self._head_raw(rq, tk.q, tok, h, sub)
        self._head_raw(rk, tk.k, tok, h, sub)
        self._head_raw(rg, tk.g, tok, h, sub)
        return b_raw, w_lo, w_hi

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
    def _lanes_sum(self, x):
        for k in cutlass.range_constexpr(self.TPR.bit_length() - 1):
            x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << k)
        return x

    @cute.jit
    def _gate_consts(self, bias, gp: GateParams, h, sub, gate: Gate):
        """Head h's gate constants, loads only: dt_bias of this thread's columns into bias;
        returns A_log[h] (0 without A_log: exp(A_log) is the gate's factor)."""
        K, VEC = self.K, self.VEC
        a_dt, b_dt = gate.a_log_dtype, gate.dt_bias_dtype
        a_log = gate_param32(gp.a_log, h, a_dt)
        for j in cutlass.range_constexpr(self.NJ):
            for e in cutlass.range_constexpr(VEC):
                bias[j * VEC + e] = gate_param32(
                    gp.dt_bias, h * K + (sub + self.TPR * j) * VEC + e, b_dt)
        if halves(a_dt, b_dt):
            a_log = gate_param16(gp.a_log, h, a_dt, a_log)
            for j in cutlass.range_constexpr(self.NJ):
                for e in cutlass.range_constexpr(VEC):
                    bias[j * VEC + e] = gate_param16(
                        gp.dt_bias, h * K + (sub + self.TPR * j) * VEC + e, b_dt,
                        bias[j * VEC + e])
        return a_log

    @cute.jit
    def _qk_norms(self, qv, kv, gate: Gate):
        """q (L2-normed over the row's lanes, times the scale) and k (L2-normed) in place;
        returns k's inverse norm."""
        f32, NC = cutlass.Float32, self.NC
        sq = f32(0.0)
        sk = f32(0.0)
        for c in cutlass.range_constexpr(NC):
            sq = sq + qv[c] * qv[c]
            sk = sk + kv[c] * kv[c]
        rq = gate.scale
        rk = f32(1.0)
        if gate.qk_l2norm != 0:
            sq = self._lanes_sum(sq)
            sk = self._lanes_sum(sk)
            rq = gate.scale * cute.math.rsqrt(sq + 1e-6)
            rk = cute.math.rsqrt(sk + 1e-6)
        for c in cutlass.range_constexpr(NC):
            qv[c] = qv[c] * rq
            kv[c] = kv[c] * rk
        return rk

    @cute.jit
    def _log_decays(self, dv, bias, a_exp, gate: Gate, exp: cutlass.Constexpr):
        """The token's log-decay a per column into dv (which holds g; the gate "none": g as
        given), or with `exp` its decay e^a."""
        NC = self.NC
        if gate.form == GATE_BOUNDED:
            for c in cutlass.range_constexpr(NC):
                y = a_exp * (dv[c] + bias[c])
                sg = cute.arch.rcp_approx(1.0 + cute.math.exp(-y, fastmath=True))
                if cutlass.const_expr(exp):
                    dv[c] = cute.math.exp(gate.lower_bound * sg, fastmath=True)
                else:
                    dv[c] = gate.lower_bound * sg
        elif gate.form == GATE_UNBOUNDED:
            for c in cutlass.range_constexpr(NC):
                y = dv[c] + bias[c]
                sp = cute.arch.fmax(y, 0.0) + cute.math.log1p(
                    cute.math.exp(-cute.arch.fmax(y, -y)))
                if cutlass.const_expr(exp):
                    dv[c] = cute.math.exp(-a_exp * sp, fastmath=True)
                else:
                    dv[c] = -a_exp * sp
        else:
            if cutlass.const_expr(exp):
                for c in cutlass.range_constexpr(NC):
                    dv[c] = cute.math.exp(dv[c], fastmath=True)

    @cute.jit
    def _token_math(self, qv, kv, dv, b_raw, bias, a_exp, gate: Gate):
        """A token's columns of head h past their loads (_token_loads): q (L2-normed, times
        the scale) and k (L2-normed) in place in qv and kv, the decay exp(a) per column into
        dv (which holds g); b_raw is its beta as loaded. Returns (beta, k . q)."""
        f32, NC = cutlass.Float32, self.NC
        self._qk_norms(qv, kv, gate)
        self._log_decays(dv, bias, a_exp, gate, True)
        beta = b_raw.to(f32)
        if gate.beta_sigmoid != 0:
            beta = cute.arch.rcp_approx(1.0 + cute.math.exp(-beta, fastmath=True))
        # k . q (over the whole head), for the rows' outputs (_update_row)
        kq = f32(0.0)
        for c in cutlass.range_constexpr(NC):
            kq = kq + kv[c] * qv[c]
        return beta, self._lanes_sum(kq)

    # ------------------------------------------ prepared tokens (cfg.prep or cfg.chunk)
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
    def _prep_issue(self, raw, rv, tk: Tokens, mWIdx: cute.Tensor, tok, t, n, h, vb, sub,
                    writes, wr: Write):
        """The loads of a token this thread's group prepares (`tok`, the row's t-th), none
        waited for: q, k, g into raw's rq, rk, rg, v of the tile's rows (sub + TPR m) into rv;
        returns (beta as loaded, the words of its write entry where `writes`, else -1)."""
        b_raw, w_lo, w_hi = self._head_loads(raw, tk, mWIdx, tok, t, n, h, sub, writes, wr)
        for m in cutlass.range_constexpr(self.NVP):
            i = sub + self.TPR * m
            if cutlass.const_expr(self.BV % self.TPR == 0):
                rv[m] = tk.v[tok, h * self.V + vb * self.BV + i]
            else:
                if i < self.BV:
                    rv[m] = tk.v[tok, h * self.V + vb * self.BV + i]
        return b_raw, w_lo, w_hi

    @cute.jit
    def _prep_store(self, areas, c, loads, regs, mErr: cute.Tensor, t, live, lead, sub,
                    writes, dst_rows, wr: Write, w_null, gate: Gate):
        """A prepared token (the row's t-th) from its loads (_prep_issue: rq, rk, rg, rv, beta
        as loaded, its write entry's words) into slot c, where `live`: q and k normed, the
        decay, v, beta, k . q and its write row (-1: none). regs: (qv, kv, dv, bias, exp of
        A_log), the first three overwritten."""
        tq, tk, td, tv, ts, tw = areas
        rq, rk, rg, rv, b_raw, w_lo, w_hi = loads
        qv, kv, dv, bias, a_exp = regs
        self._raw_cols(qv, rq)
        self._raw_cols(kv, rk)
        self._raw_cols(dv, rg)
        beta, kq = self._token_math(qv, kv, dv, b_raw, bias, a_exp, gate)
        wrow = cutlass.Int32(-1)
        if writes:
            wrow = self._write_row_of(w_lo, w_hi, mErr, t, lead, dst_rows, wr, w_null)
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
