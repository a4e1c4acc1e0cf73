"""Decode and multi-token verify, one tile a CTA (sm_90a): the KDA recurrence token by token
against a state pool, over the shared rows of kernels/step_rows.py.

One CTA per (block of BV state rows, head, batch row n); the thread layout, the token math and
the run-time arguments are step_rows'. The kernel is a stream of state bytes, so what sets its
speed is how many are in flight: the start state goes to shared memory by cp.async (cfg.access
bytes a copy, every one of a thread's issued at once, none holding a register), and each thread
reads back only what it copied itself, so a cp.async.wait_group is all the synchronisation there
is (no CTA barrier). A row's state comes into registers for its token's update and goes out to
the pool at once; between tokens (verify) it is kept in shared memory in fp32 (a bf16 pool's
staging area stays as it was loaded; its fp32 keep area follows the staging one, and a
single-token plan reserves only the staging area: the keep area is touched only between
tokens). Shared memory layout: [R][NJ][threads][VEC], so each 16-byte access of a warp is
contiguous and conflict-free. With cfg.prep, the groups of the CTA prepare a chunk of the row's
tokens together (norms, decays, the write rows) into shared memory.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils

from kda_cute.specs.step import WRITE_ALL, WRITE_START
from kernels.step_rows import (
    E_PARENT,
    E_WRITE,
    SRC_F32,
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


class KdaStepSm90(StepRows):
    def _launch(self, ins, grid, modes, stream):
        self.kernel(*ins, *modes).launch(
            grid=(self.V // self.BV, grid.num_heads, grid.num_rows), block=(self.threads, 1, 1),
            smem=self.smem_bytes, stream=stream, **self._occupancy())

    # ---------------------------------------------------------------- device
    def _mine_keep(self, area, tidx):
        """This thread's elements of a bf16 pool's fp32 keep area, as _mine's [e, j, r]: the
        VEC (8) fp32 of an access in two 16-byte halves NT * 16 bytes apart, so that each
        16-byte access of a warp is contiguous and conflict-free."""
        VEC, NT = self.VEC, self.threads
        whole = cute.make_tensor(area.iterator, cute.make_layout(
            ((4, VEC // 4), NT, self.NJ, self.R),
            stride=((1, 4 * NT), 4, NT * VEC, self.NJ * NT * VEC)))
        return whole[None, tidx, None, None]

    @cute.jit
    def _stage(self, mine, src: cute.Tensor, row, h, vb, grp, sub):
        """cp.async this thread's columns of its R rows of src[row, h] into its staging area
        (one commit group)."""
        self._stage_rows(mine, src, row, h, vb, grp, sub)
        cute.arch.cp_async_commit_group()

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
    def _prep_chunk(self, areas, t0, raw, rv, regs, ins, row, lead, wr: Write, starts: Starts,
                    gate: Gate):
        """The chunk of the row's tokens from t0: group g prepares token t0 + g into slot g;
        then a CTA barrier (every thread of the CTA calls this, at the same tokens). ins: the
        tokens, the write table, the error words and the dst rows; row: (bos, length, n, h,
        vb, grp, sub).

        The preparing groups fill whole warps (supports: prep * tpr is a multiple of 32) and a
        group past the row's last token works on that token again without storing it, so that
        every lane of a warp takes part in the math's shuffles."""
        tk, mWIdx, mErr, dst_rows = ins
        bos, length, n, h, vb, grp, sub = row
        t = t0 + grp
        if grp < self.C:
            tt = cutlass.min(t, length - 1)
            writes = self._writes(wr.mode, tt, length)
            b_raw, w_lo, w_hi = self._prep_issue(raw, rv, tk, mWIdx, bos + tt, tt, n, h, vb,
                                                 sub, writes, wr)
            rq, rk, rg = raw
            self._prep_store(areas, grp, (rq, rk, rg, rv, b_raw, w_lo, w_hi), regs, mErr, tt,
                             t < length, lead, sub, writes, dst_rows, wr, starts.w_null, gate)
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
    def _rows(self, x, src: cutlass.Constexpr, stage, keep, token, row_io, tok, h, vb, grp, sub,
              wrow, more):
        """Every row of this thread through token `tok`, its state from `src` (a constant);
        the state after it kept (shared memory) where `more` tokens follow."""
        for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
            self._row(x, src, stage, keep, r, token, row_io, tok, h, vb, grp, sub, wrow)
            if more:
                self._keep(x, keep, r)

    @cute.jit
    def _parent_src(self, src, tab: Tables, par: Parents, wr: Write, starts: Starts, stage,
                    keep, st: States, slot, start, n, t, lead, dst_rows, h, vb, grp, sub):
        """Tree drafts: where token t's state comes from (`src` where its parent is the
        previous token): the start state (parent -1, restaged from the pool, or zeros) or the
        state after its parent, already written (reloaded into the keep area); a bad parent is
        flagged and taken as -1. Returns the source (SRC_*)."""
        i32 = cutlass.Int32
        p, ok = self._word(tab.parent, n * par.sn + t * par.st, par.wide)
        if p != t - 1:
            prow = i32(-1)
            if ok != 0 and p >= 0 and p < t and wr.mode == WRITE_ALL:
                w, okw = self._word(tab.write_index, n * wr.sn + p * wr.st, wr.wide)
                prow = cutlass.min(w, dst_rows) * wr.mul + p * wr.add
                if okw == 0 or w < starts.w_null or w >= dst_rows or prow >= dst_rows:
                    prow = i32(-2)
            elif ok == 0 or p != -1:
                prow = i32(-2)
            if prow == -2:
                self._flag(tab.errors, E_PARENT, lead)
                prow = i32(-1)
            if prow >= 0:
                self._reload(keep, st.dst, prow, h, vb, grp, sub)
                src = i32(SRC_F32)
            elif start != 0:
                self._stage(stage, st.pool, slot, h, vb, grp, sub)
                src = i32(SRC_STAGE)
            else:
                src = i32(SRC_ZERO)
        return src

    @cute.kernel
    def kernel(self, tk: Tokens, gp: GateParams, st: States, tab: Tables, seqs: Seqs, rd: Read,
               acc: Accepted, starts: Starts, wr: Write, par: Parents, gate: Gate):
        f32, i32 = cutlass.Float32, cutlass.Int32
        K, NC = self.K, self.NC
        tidx, _, _ = cute.arch.thread_idx()
        vb, h, n = cute.arch.block_idx()
        grp = tidx // self.TPR
        sub = tidx - grp * self.TPR
        lead = self._lead(tidx, vb, h)
        num_tokens = tk.q.shape[0]
        slots = st.pool.shape[0]
        dst_rows = st.dst.shape[0]

        bos, length = self._row_tokens(tab, seqs, n, lead, num_tokens)
        pad, sel, slot, start = self._row_slot(tab, rd, acc, starts, n, lead, slots)

        smem = utils.SmemAllocator()
        shared = smem.allocate(self.shared_storage)
        n_el = self.BV * K
        stage = self._mine(shared.stage.get_tensor(cute.make_layout(n_el)), tidx)
        keep = stage  # an fp32 pool keeps its state where it was staged
        if cutlass.const_expr(self.pdt is not cutlass.Float32):
            keep = self._mine_keep(shared.keep.get_tensor(cute.make_layout(n_el)), tidx)
        src = i32(SRC_ZERO)
        if pad == 0 and start != 0:
            self._stage(stage, st.pool, slot, h, vb, grp, sub)
            src = i32(SRC_STAGE)
        # the first token's loads (q, k, g, beta, v, its write entry) and the gate's constants,
        # in flight with the staging of the start state
        rq, rk, rg = self._raw_tensor(), self._raw_tensor(), self._raw_tensor()
        raw = (rq, rk, rg)
        b_raw = cutlass.BFloat16(0.0)
        vals = cutlass.BFloat16(0.0)
        w_lo, w_hi = i32(-1), i32(-1)
        if cutlass.const_expr(self.cfg.ahead):
            if length > 0:
                b_raw, vals, w_lo, w_hi = self._token_loads(
                    raw, tk, tab.write_index, bos, i32(0), n, h, vb, grp, sub,
                    self._writes(wr.mode, i32(0), length), wr)
        bias = cute.make_rmem_tensor((NC,), f32)
        a_log = self._gate_consts(bias, gp, h, sub, gate)
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
                self._prep_chunk(areas, i32(0), raw, rv, (qv, kv, dv, bias, a_exp),
                                 (tk, tab.write_index, tab.errors, dst_rows),
                                 (bos, length, n, h, vb, grp, sub), lead_p, wr, starts, gate)
        for t in cutlass.range(length):
            tok = bos + t
            if pad != 0:
                self._zero_outputs(tk.out, tok, h, vb, grp, sub)
            else:
                # tree drafts: a token whose parent is not the previous one restarts from the
                # start state (parent -1) or from the state after its parent, already written
                if par.on != 0 and t > 0:
                    src = self._parent_src(src, tab, par, wr, starts, stage, keep, st, slot,
                                           start, n, t, lead, dst_rows, h, vb, grp, sub)
                if cutlass.const_expr(self.C != 0):
                    c = t % self.C
                    if c == 0 and t > 0:  # the next chunk, once every group is done with this
                        cute.arch.sync_threads()
                        self._prep_chunk(areas, t, raw, rv, (qv, kv, dv, bias, a_exp),
                                         (tk, tab.write_index, tab.errors, dst_rows),
                                         (bos, length, n, h, vb, grp, sub), lead_p, wr, starts,
                                         gate)
                    beta, kq, wrow, v_now = self._prep_read(areas, c, qv, kv, dv, grp, sub)
                else:
                    # this token's loads (v, its write entry, q, k, g, beta) were issued
                    # together, before the previous token's rows (cfg.ahead, the first token's
                    # with the staging) or here
                    writes = self._writes(wr.mode, t, length)
                    if cutlass.const_expr(not self.cfg.ahead):
                        b_raw, vals, w_lo, w_hi = self._token_loads(
                            raw, tk, tab.write_index, tok, t, n, h, vb, grp, sub, writes, wr)
                    self._raw_cols(qv, rq)
                    self._raw_cols(kv, rk)
                    self._raw_cols(dv, rg)
                    v_now = vals.to(f32)
                    beta, kq = self._token_math(qv, kv, dv, b_raw, bias, a_exp, gate)
                    # where the state after this token goes (-1: nowhere)
                    wrow = i32(-1)
                    if writes:
                        wrow = self._write_row_of(w_lo, w_hi, tab.errors, t, lead, dst_rows, wr,
                                                  starts.w_null)
                more = t + 1 < length
                if cutlass.const_expr(self.cfg.ahead):
                    if more:  # the next token's loads, in flight through this one's rows
                        b_raw, vals, w_lo, w_hi = self._token_loads(
                            raw, tk, tab.write_index, tok + 1, t + 1, n, h, vb, grp, sub,
                            self._writes(wr.mode, t + 1, length), wr)
                cute.arch.cp_async_wait_group(0)  # this thread's staged rows have landed
                # one row loop per state source, so that no row decides where its state is
                token = (qv, kv, dv, beta, kq, v_now)
                row_io = (tk.out, st.dst)
                if src == SRC_STAGE:
                    self._rows(x, SRC_STAGE, stage, keep, token, row_io, tok, h, vb, grp, sub,
                               wrow, more)
                elif src == SRC_F32:
                    self._rows(x, SRC_F32, stage, keep, token, row_io, tok, h, vb, grp, sub,
                               wrow, more)
                else:
                    self._rows(x, SRC_ZERO, stage, keep, token, row_io, tok, h, vb, grp, sub,
                               wrow, more)
                src = i32(SRC_F32)

        # a commit: the start state itself to the row's write slot
        if wr.mode == WRITE_START and pad == 0:
            w, okw = self._word(tab.write_index, n * wr.sn, wr.wide)
            if okw == 0 or w >= dst_rows:
                self._flag(tab.errors, E_WRITE, lead)
            elif w >= starts.w_null:
                cute.arch.cp_async_wait_group(0)
                for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
                    self._fetch(x, src, stage, keep, r)
                    self._put(x, self._row_vecs(st.dst, w * wr.mul, h, vb * self.BV + grp
                                                + self.G * r), sub, self.pdt)
        cute.arch.cp_async_wait_group(0)  # nothing in flight when the CTA exits
