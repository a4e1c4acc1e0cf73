"""Replay decode, one tile a CTA (sm_90a): a token per row against a checkpoint pool and a ring
of the tokens since each slot's checkpoint (kda_cute.specs.replay), over the shared rows of
kernels/step_rows.py.

A CTA stages its BV rows of the checkpoint as the token kernel does (cp.async, each thread its
own columns) and, beside them, the slot's live ring entries for its head (keys, inverse norms,
running log-decays, and the corrections of its rows) into shared memory; one CTA barrier makes
the ring visible to every row group. With the token's log-decay a and G = G_(c-1) + a:
- each entry's key decayed to this token, w_j = r_j k_j e^(G - G_j), over its log-decay in
  shared memory, and its products with the token's k and q (a_j, b_j): an entry a warp, the
  token's G, k and q put in shared memory by the first row group (two more CTA barriers);
- each row: Sd = S_c e^G, u = beta (v - Sd k - sum_j u_j a_j), o = Sd q + sum_j u_j b_j +
  u (k . q) (the ring's sums for row sub taken on lane sub, as v is: step_rows._v_ahead); the
  rows do not depend on each other, so where a group's lanes are twice its rows every row's
  two products are taken first and reduced together, lane r ending with row r's;
- below the window's last token (c < window - 1): u to the ring (every tile its rows), k, G
  and r (the head's first tile), the cursor + 1; from it: the row's state Sd + sum_j u_j w_j^T
  + u k^T (the w_j from shared memory, the tile's first `hoist` read once into registers) to
  the checkpoint slot and the cursor 0;
- the cursor moves in place, by the row's last tile: every tile takes a ticket (an atomic add
  on the slot's word) as soon as it has read the cursor, and the one that takes the last writes
  the cursor once its loads are in (before any store of its own) and puts the ticket word back
  to zero, so one launch moves it and a graph replays.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
from cutlass.cute.nvgpu import cpasync

from kda_cute.specs.replay import ReplayConfig
from kernels.common import Record
from kernels.step_rows import (
    E_READ,
    SRC_STAGE,
    SRC_ZERO,
    Accepted,
    Gate,
    GateParams,
    Parents,
    Read,
    Seqs,
    Starts,
    States,
    StepRows,
    Tables,
    Tokens,
    Write,
)


@dataclass
class Ring(Record):
    """The ring: keys [P, H, L, K] bf16 as given, inverse norms [P, H, L] fp32, corrections
    [P, H, L, V], running log-decays [P, H, L, K] fp32; the cursors (P,), and the tickets
    (P,) by which a row's last tile knows every tile has read its cursor (zero between
    launches)."""
    k: cute.Tensor
    r: cute.Tensor
    u: cute.Tensor
    g: cute.Tensor
    cursor: cute.Tensor
    tickets: cute.Tensor


class KdaReplaySm90(StepRows):
    def __init__(self, cfg: ReplayConfig):
        super().__init__(cfg)
        self.L = cfg.ring
        self.udt = cutlass.Float16 if cfg.u_dtype == "float16" else cutlass.Float32

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor, mV: cute.Tensor,
        mBeta: cute.Tensor, mOut: cute.Tensor, mALog: cute.Tensor, mDtBias: cute.Tensor,
        mPool: cute.Tensor, mDst: cute.Tensor,
        mCu: cute.Tensor, mRIdx: cute.Tensor, mWIdx: cute.Tensor, mAcc: cute.Tensor,
        mParent: cute.Tensor, mHasInit: cute.Tensor, mErr: cute.Tensor,
        mRingK: cute.Tensor, mRingR: cute.Tensor, mRingU: cute.Tensor, mRingG: cute.Tensor,
        mCursor: cute.Tensor, mTickets: cute.Tensor,
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
        window: cutlass.Int32,
        stream,
    ):
        self.shared_storage = self._shared_storage()
        self.smem_bytes = self.shared_storage.size_in_bytes()
        self.kernel(
            Tokens(mQ, mK, mG, mV, mBeta, mOut), GateParams(mALog, mDtBias),
            States(mPool, mDst), Tables(mCu, mRIdx, mWIdx, mAcc, mParent, mHasInit, mErr),
            Ring(mRingK, mRingR, mRingU, mRingG, mCursor, mTickets),
            Seqs(fixed_len, cu_wide, max_tokens),
            Read(read_mode, r_sn, r_st, r_wide, r_mul, r_add),
            Accepted(acc_on, acc_wide, acc_base, acc_skip, max_sel),
            Starts(hi_on, r_null, w_null),
            Write(write_mode, w_sn, w_st, w_wide, w_mul, w_add),
            Parents(parent_on, p_sn, p_st, p_wide),
            Gate(gate, a_log_dtype, dt_bias_dtype, qk_l2norm, beta_sigmoid, scale, lower_bound),
            window,
        ).launch(grid=self._grid(num_heads, num_rows), block=(self.threads, 1, 1),
                 smem=self.smem_bytes, stream=stream, **self._occupancy())

    def _grid(self, num_heads, num_rows):
        """A tile a CTA: (V / BV, heads, rows)."""
        return (self.V // self.BV, num_heads, num_rows)

    def _shared_storage(self):
        """The staged checkpoint rows, then the ring's live entries of the slot's head: keys,
        log-decays, inverse norms and the tile's rows of the corrections."""
        A, MR, f32 = cute.struct.Align, cute.struct.MemRange, cutlass.Float32
        L, K, BV = self.L, self.K, self.BV
        fields = {"stage": A[MR[self.pdt, BV * K], 128],
                  "rk": A[MR[cutlass.BFloat16, L * K], 128], "rg": A[MR[f32, L * K], 128],
                  "rr": A[MR[f32, L], 128], "ru": A[MR[self.udt, L * BV], 128],
                  "vs": A[MR[f32, 3 * K], 128], "ab": A[MR[f32, 2 * L], 128]}
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    # ---------------------------------------------------------------- device
    @cute.jit
    def _stage_ring(self, ring: Ring, areas, slot, h, vb, c, tidx):
        """cp.async the slot's c live entries of head h into the ring's areas (every thread a
        share of the 16-byte pieces; the caller commits and waits, then a CTA barrier)."""
        rk_s, rg_s, rr_s, ru_s = areas
        L, K, BV = self.L, self.K, self.BV
        mode = cpasync.LoadCacheMode.GLOBAL
        atom16 = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=mode), cutlass.BFloat16,
                                     num_bits_per_copy=128)
        atom32 = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=mode), cutlass.Float32,
                                     num_bits_per_copy=128)
        atomu = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=mode), self.udt,
                                    num_bits_per_copy=128)
        self._copy_entries(atom16, ring.k, rk_s, slot, h, c, 8, K // 8, 0, tidx)
        self._copy_entries(atom32, ring.g, rg_s, slot, h, c, 4, K // 4, 0, tidx)
        ue = 16 // (2 if self.udt is cutlass.Float16 else 4)  # elements a piece
        self._copy_entries(atomu, ring.u, ru_s, slot, h, c, ue, BV // ue, vb * (BV // ue), tidx)
        if tidx < L // 4:
            src = cute.logical_divide(ring.r[slot, h, None], cute.make_layout(4))
            dst = cute.logical_divide(rr_s, cute.make_layout(4))
            cute.copy(atom32, src[None, tidx], dst[None, tidx])

    @cute.jit
    def _copy_entries(self, atom, src: cute.Tensor, dst, slot, h, c, elems, per, first, tidx):
        """cp.async entries j < c of src[slot, h] (pieces first .. first + per of `elems`
        elements each) into rows j of dst, the pieces shared out over the CTA's threads."""
        for i in cutlass.range(tidx, c * per, self.threads):
            j = i // per
            b = i - j * per
            s = cute.logical_divide(src[slot, h, j, None], cute.make_layout(elems))
            d = cute.logical_divide(dst[j, None], cute.make_layout(elems))
            cute.copy(atom, s[None, first + b], d[None, b])

    @cute.jit
    def _norms(self, qv, kv, gate: Gate):
        """q (L2-normed, times the scale) and k (L2-normed) in place; returns (k's inverse
        norm, k . q)."""
        f32 = cutlass.Float32
        rk = self._qk_norms(qv, kv, gate)
        kq = f32(0.0)
        for c in cutlass.range_constexpr(self.NC):
            kq = kq + kv[c] * qv[c]
        return rk, self._lanes_sum(kq)

    def _col(self, c, sub):
        """The head column of this thread's register column c."""
        return (sub + self.TPR * (c // self.VEC)) * self.VEC + c % self.VEC

    @cute.jit
    def _ring_row(self, ins, modes, n, lead):
        """Batch row n's tokens, read slot and cursor, bad values flagged (by `lead`) and turned
        into padding (a row of no tokens is padding too): (bos, length, pad, slot, start, c).
        ins: (tk, st, tab, ring); modes: (seqs, rd, acc, starts)."""
        i32 = cutlass.Int32
        tk, st, tab, ring = ins
        seqs, rd, acc, starts = modes
        bos, length = self._row_tokens(tab, seqs, n, lead, tk.q.shape[0])
        pad, _, slot, start = self._row_slot(tab, rd, acc, starts, n, lead, st.pool.shape[0])
        if length == 0:
            pad = i32(1)
        c = i32(0)
        if pad == 0 and start != 0:
            c = ring.cursor[slot]
            if c < 0 or c >= self.L:
                self._flag(tab.errors, E_READ, lead)
                pad = i32(1)
                c = i32(0)
        return bos, length, pad, slot, start, c

    def _areas(self, shared, tidx):
        """The CTA's shared areas: this thread's staged checkpoint rows, the ring's keys,
        log-decays, inverse norms and rows of u, the token's (G, k, q) and the entries'
        products."""
        L, K, BV = self.L, self.K, self.BV
        return (self._mine(shared.stage.get_tensor(cute.make_layout(BV * K)), tidx),
                shared.rk.get_tensor(cute.make_layout((L, K), stride=(K, 1))),
                shared.rg.get_tensor(cute.make_layout((L, K), stride=(K, 1))),
                shared.rr.get_tensor(cute.make_layout(L)),
                shared.ru.get_tensor(cute.make_layout((L, BV), stride=(BV, 1))),
                shared.vs.get_tensor(cute.make_layout((3, K), stride=(K, 1))),
                shared.ab.get_tensor(cute.make_layout((2, L), stride=(L, 1))))

    @cute.jit
    def _put_token(self, vs, gt, kv, qv, grp, sub):
        """The token's G, k and q of every column into vs, for the entries' keys (group 0's
        lanes hold every column between them); a CTA barrier after."""
        if grp == 0:
            for q in cutlass.range_constexpr(self.NC):
                d = self._col(q, sub)
                vs[0, d] = gt[q]
                vs[1, d] = kv[q]
                vs[2, d] = qv[q]
        cute.arch.sync_threads()

    @cute.jit
    def _entries(self, areas, w_dst, live, tidx):
        """Each of the `live` entries' key decayed to this token, w_j = r_j k_j e^(G - G_j)
        (into w_dst, the log-decays' own area where they are not needed again; None: kept
        nowhere), and its products with k and q into ab: entry j by warp j mod warps, K / 32
        columns a lane; a CTA barrier after."""
        f32, K, L = cutlass.Float32, self.K, self.L
        rk_s, rg_s, rr_s, ru_s, vs, ab_s = areas
        NW = self.threads // 32
        warp = tidx // 32
        lane = tidx - 32 * warp
        CPL = K // 32
        for jw in cutlass.range_constexpr(-(-(L - 1) // NW)):
            j = warp + NW * jw
            pa = f32(0.0)
            pb = f32(0.0)
            if j < live:
                rj = rr_s[j]
                for e in cutlass.range_constexpr(CPL):
                    d = lane * CPL + e
                    w = rk_s[j, d].to(f32) * rj * cute.math.exp(vs[0, d] - rg_s[j, d],
                                                                 fastmath=True)
                    if cutlass.const_expr(w_dst is not None):
                        w_dst[j, d] = w
                    pa = pa + w * vs[1, d]
                    pb = pb + w * vs[2, d]
            for k in cutlass.range_constexpr(5):
                pa = pa + cute.arch.shuffle_sync_bfly(pa, offset=1 << k)
                pb = pb + cute.arch.shuffle_sync_bfly(pb, offset=1 << k)
            if lane == 0 and j < live:
                ab_s[0, j] = pa
                ab_s[1, j] = pb
        cute.arch.sync_threads()

    @cute.jit
    def _row_sums(self, ru_s, ab_s, live, grp, sub):
        """The ring's sums for this lane's row sub (as its v): (sum_j u_j a_j, sum_j u_j b_j)
        over the `live` entries."""
        f32 = cutlass.Float32
        ca = f32(0.0)
        cb = f32(0.0)
        if sub < self.R:
            rho = grp + self.G * sub
            for j in cutlass.range_constexpr(self.L - 1):
                if j < live:
                    uj = ru_s[j, rho].to(f32)
                    ca = ca + uj * ab_s[0, j]
                    cb = cb + uj * ab_s[1, j]
        return ca, cb

    @cute.jit
    def _fold_entries(self, x, ru_s, rg_s, c, rho, sub):
        """Row rho's sum of the c entries' u_j w_j (the decayed keys in rg_s) added to x, the
        entries unrolled (for a caller of a row at a time: over many rows the compiler would
        hoist every entry's keys out of them)."""
        for j in cutlass.range_constexpr(self.L - 1):
            if j < c:
                self._fold_entry(x, ru_s, rg_s, j, rho, sub)

    @cute.jit
    def _fold_entry(self, x, ru_s, rg_s, j, rho, sub):
        """Entry j's u_j w_j of row rho added to x."""
        uj = ru_s[j, rho].to(cutlass.Float32)
        for q in cutlass.range_constexpr(self.NC):
            x[q] = x[q] + uj * rg_s[j, self._col(q, sub)]

    @cute.jit
    def _ticket(self, ring: Ring, slot, tidx):
        """This tile's ticket on the slot's word (thread 0; -1 elsewhere), taken once its cursor
        read is done and before anything else is issued: a release (the read before it) with no
        store of the tile's yet to wait on, its round trip in flight with the tile's loads."""
        taken = cutlass.Int32(-1)
        if tidx == 0:
            taken = cute.arch.atomic_add(ring.tickets.iterator + slot, cutlass.Int32(1),
                                         sem="release", scope="gpu")
        return taken

    @cute.jit
    def _move_cursor(self, ring: Ring, slot, tidx, c, folded, taken):
        """The tile that took the row's last ticket (every tile has read the cursor) writes it,
        c + 1 or 0 where the row folded, and puts the word back to zero; called before the
        tile's first store, so that the acquiring fence waits on nothing."""
        if tidx == 0:
            gx, gy, _ = cute.arch.grid_dim()
            if taken == gx * gy - 1:
                cute.arch.fence_acq_rel_gpu()
                nxt = c + 1
                if folded:
                    nxt = cutlass.Int32(0)
                ring.cursor[slot] = nxt
                ring.tickets[slot] = cutlass.Int32(0)

    @cute.jit
    def _checkpoint_row(self, x, stage, src, r):
        """Row r of the staged checkpoint into registers x (zeros where src is SRC_ZERO: one
        branch, the same for the whole CTA)."""
        f32 = cutlass.Float32
        if src == SRC_STAGE:
            for jj in cutlass.range_constexpr(self.NJ):
                y = stage[None, jj, r].load().to(f32)
                for e in cutlass.range_constexpr(self.VEC):
                    x[jj * self.VEC + e] = y[e]
        else:
            x.fill(0.0)

    @cute.jit
    def _row_step(self, x, eg, keys, sums, beta, sub, r):
        """Row r (in x: the checkpoint row, decayed here by e^G) through the token: keys the
        token's (k, q) columns, sums this lane's (v, the ring's two sums) for its row sub.
        Returns (the output less u (k . q); u), both on every lane."""
        f32, NC = cutlass.Float32, self.NC
        kv, qv = keys
        v_me, ca, cb = sums
        mine = sub == r
        a = f32(cutlass.select_(mine, v_me - ca, f32(0.0)))
        b = f32(cutlass.select_(mine, cb, f32(0.0)))
        for q in cutlass.range_constexpr(NC):
            s = x[q] * eg[q]
            x[q] = s
            a = a - s * kv[q]
            b = b + s * qv[q]
        odd = (sub & 1) != 0
        m = f32(cutlass.select_(odd, b, a)) + cute.arch.shuffle_sync_bfly(
            f32(cutlass.select_(odd, a, b)), offset=1)
        for k in cutlass.range_constexpr(1, self.TPR.bit_length() - 1):
            m = m + cute.arch.shuffle_sync_bfly(m, offset=1 << k)
        other = cute.arch.shuffle_sync_bfly(m, offset=1)
        a = f32(cutlass.select_(odd, other, m))
        b = f32(cutlass.select_(odd, m, other))
        return b, beta * a

    @cute.jit
    def _rows_by_lanes(self, stage, src, eg, keys, sums, beta, kq, sub):
        """Every row's two products, reduced as one transposed reduction of the group's 2R
        sums over its 2R lanes (a shuffle a sum instead of log2(TPR) a row; the rows are
        independent but for the fold): lane r < R ends with row r's Sd k and, one shuffle
        on, its Sd q. Returns (output, u) of row sub, on lanes sub < R."""
        f32, NC = cutlass.Float32, self.NC
        kv, qv = keys
        v_me, ca, cb = sums
        kd = cute.make_rmem_tensor((NC,), f32)
        qd = cute.make_rmem_tensor((NC,), f32)
        for q in cutlass.range_constexpr(NC):
            kd[q] = kv[q] * eg[q]
            qd[q] = qv[q] * eg[q]
        x = cute.make_rmem_tensor((NC,), f32)
        sdk = self._reduced(0, 1, (x, stage, src, kd, qd, sub))
        sdq = cute.arch.shuffle_sync_bfly(sdk, offset=self.R)
        u = beta * (v_me - ca - sdk)
        return sdq + cb + u * kq, u

    def _reduced(self, i, d, ctx):
        """Sum i of the transposed reduction after its level of offset d (d = R: row i's two
        products, paired over the lanes R apart; below: sums i and i + d of the level above),
        built depth first so that a few partial sums are live at a time, not 2R."""
        f32 = cutlass.Float32
        x, stage, src, kd, qd, sub = ctx
        if d == self.R:
            self._checkpoint_row(x, stage, src, i)
            lo = f32(0.0)
            hi_v = f32(0.0)
            for q in range(self.NC):  # not a jit function: Python's loop, unrolled
                lo = lo + x[q] * kd[q]
                hi_v = hi_v + x[q] * qd[q]
        else:
            lo = self._reduced(i, 2 * d, ctx)
            hi_v = self._reduced(i + d, 2 * d, ctx)
        hi = (sub & d) != 0
        keep = f32(cutlass.select_(hi, hi_v, lo))
        send = f32(cutlass.select_(hi, lo, hi_v))
        return keep + cute.arch.shuffle_sync_bfly(send, offset=d)

    @cute.jit
    def _fold_rows(self, x, stage, src, eg, kv, u, areas, dst: cute.Tensor, where, c, grp,
                   sub):
        """The flush: every row's state after this token, Sd + u k^T + sum_j u_j w_j^T (row
        r's u from lane r), to the checkpoint pool dst's rows (where: slot, head, tile). The
        first HB entries' decayed keys are read once into registers for all rows (every row
        of a thread takes the same columns), the rest a row from shared memory; the row loop
        is not unrolled where keys are held (unrolled, each would cost twice its registers)."""
        ru_s, rg_s = areas
        slot, h, vb = where
        HB, NC = self.cfg.hoist, self.NC
        lane0 = (cute.arch.lane_idx() // self.TPR) * self.TPR
        held = cute.make_rmem_tensor((HB * NC,), cutlass.Float32) if HB else None
        for j in cutlass.range_constexpr(HB):
            if j < c:
                for q in cutlass.range_constexpr(NC):
                    held[j * NC + q] = rg_s[j, self._col(q, sub)]
        U = 1 if HB else self.U
        for r in cutlass.range(self.R, unroll=U, unroll_full=U == 0):
            self._checkpoint_row(x, stage, src, r)
            ur = cute.arch.shuffle_sync(u, offset=lane0 + r)
            for q in cutlass.range_constexpr(NC):
                x[q] = x[q] * eg[q] + ur * kv[q]
            rho = grp + self.G * r
            for j in cutlass.range_constexpr(HB):
                if j < c:
                    uj = ru_s[j, rho].to(cutlass.Float32)
                    for q in cutlass.range_constexpr(NC):
                        x[q] = x[q] + uj * held[j * NC + q]
            for j in cutlass.range(HB, c):
                self._fold_entry(x, ru_s, rg_s, j, rho, sub)
            self._put(x, self._row_vecs(dst, slot, h, vb * self.BV + rho), sub, self.pdt)

    @cute.kernel
    def kernel(self, tk: Tokens, gp: GateParams, st: States, tab: Tables, ring: Ring,
               seqs: Seqs, rd: Read, acc: Accepted, starts: Starts, wr: Write, par: Parents,
               gate: Gate, window: cutlass.Int32):
        f32, i32 = cutlass.Float32, cutlass.Int32
        NC, BV = self.NC, self.BV
        tidx, _, _ = cute.arch.thread_idx()
        vb, h, n = cute.arch.block_idx()
        grp = tidx // self.TPR
        sub = tidx - grp * self.TPR
        lead = self._lead(tidx, vb, h)
        bos, length, pad, slot, start, c = self._ring_row(
            (tk, st, tab, ring), (seqs, rd, acc, starts), n, lead)
        taken = i32(-1)
        if pad == 0:
            taken = self._ticket(ring, slot, tidx)
        shared = utils.SmemAllocator().allocate(self.shared_storage)
        stage, rk_s, rg_s, rr_s, ru_s, vs, ab_s = self._areas(shared, tidx)
        src = i32(SRC_ZERO)
        if pad == 0 and start != 0:
            self._stage_rows(stage, st.pool, slot, h, vb, grp, sub)
            self._stage_ring(ring, (rk_s, rg_s, rr_s, ru_s), slot, h, vb, c, tidx)
            src = i32(SRC_STAGE)
        cute.arch.cp_async_commit_group()

        # the token's loads and the gate's constants, in flight with the staging
        rq, rk, rg = self._raw_tensor(), self._raw_tensor(), self._raw_tensor()
        b_raw, vals, _, _ = self._token_loads((rq, rk, rg), tk, tab.write_index, bos, i32(0), n,
                                              h, vb, grp, sub, False, wr)
        bias = cute.make_rmem_tensor((NC,), f32)
        a_log = self._gate_consts(bias, gp, h, sub, gate)
        qv = cute.make_rmem_tensor((NC,), f32)
        kv = cute.make_rmem_tensor((NC,), f32)
        dv = cute.make_rmem_tensor((NC,), f32)
        x = cute.make_rmem_tensor((NC,), f32)
        self._raw_cols(qv, rq)
        self._raw_cols(kv, rk)
        self._raw_cols(dv, rg)
        rkn, kq = self._norms(qv, kv, gate)
        self._log_decays(dv, bias, cute.math.exp(a_log), gate, False)
        beta = b_raw.to(f32)
        if gate.beta_sigmoid != 0:
            beta = cute.arch.rcp_approx(1.0 + cute.math.exp(-beta, fastmath=True))
        v_me = vals.to(f32)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # the ring's entries, staged by every thread, visible to all
        flush = c >= window - 1  # the window is full with this token: fold
        self._move_cursor(ring, slot, tidx, c, flush, taken)  # a padding row took no ticket

        # G and e^G of this thread's columns
        gt = cute.make_rmem_tensor((NC,), f32)
        eg = cute.make_rmem_tensor((NC,), f32)
        for q in cutlass.range_constexpr(NC):
            g0 = f32(0.0)
            if c > 0:
                g0 = rg_s[c - 1, self._col(q, sub)]
            gt[q] = g0 + dv[q]
            eg[q] = cute.math.exp(gt[q], fastmath=True)
        areas = (rk_s, rg_s, rr_s, ru_s, vs, ab_s)
        self._put_token(vs, gt, kv, qv, grp, sub)
        self._entries(areas, rg_s, c, tidx)
        ca, cb = self._row_sums(ru_s, ab_s, c, grp, sub)

        if pad != 0:
            if length > 0:
                self._zero_outputs(tk.out, bos, h, vb, grp, sub)
        else:
            if cutlass.const_expr(2 * self.R == self.TPR):
                o_mine, u_mine = self._rows_by_lanes(stage, src, eg, (kv, qv), (v_me, ca, cb),
                                                     beta, kq, sub)
                if flush:  # the state after this token is the new checkpoint
                    self._fold_rows(x, stage, src, eg, kv, u_mine, (ru_s, rg_s), st.dst,
                                    (slot, h, vb), c, grp, sub)
            else:
                # row r's output and u kept by lane r, stored once after the rows (a row's own
                # stores would cost every lane their address arithmetic)
                o_mine = f32(0.0)
                u_mine = f32(0.0)
                for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
                    self._checkpoint_row(x, stage, src, r)
                    m, u = self._row_step(x, eg, (kv, qv), (v_me, ca, cb), beta, sub, r)
                    mine = sub == r
                    o_mine = f32(cutlass.select_(mine, m + u * kq, o_mine))
                    u_mine = f32(cutlass.select_(mine, u, u_mine))
                    if flush:  # the state after this token is the new checkpoint
                        for q in cutlass.range_constexpr(NC):
                            x[q] = x[q] + u * kv[q]
                        self._fold_entries(x, ru_s, rg_s, c, grp + self.G * r, sub)
                        self._put(x, self._row_vecs(st.dst, slot, h,
                                                    vb * BV + grp + self.G * r), sub, self.pdt)
            if sub < self.R:
                v_idx = vb * BV + grp + self.G * sub
                tk.out[bos, h * self.V + v_idx] = o_mine.to(cutlass.BFloat16)
                if not flush:
                    ring.u[slot, h, c, v_idx] = u_mine.to(self.udt)
            if c < window - 1:
                if vb == 0 and grp == 0:  # the head's key, as given, and G
                    for q in cutlass.range_constexpr(NC):
                        d = self._col(q, sub)
                        ring.k[slot, h, c, d] = rk[q % self.VEC, q // self.VEC]
                        ring.g[slot, h, c, d] = gt[q]
                    if sub == 0:
                        ring.r[slot, h, c] = rkn
