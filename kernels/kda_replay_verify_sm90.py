"""Replay verify, output-only (sm_90a): 1 to `ring` draft tokens a row against a checkpoint pool
and its ring (kda_cute.specs.replay), over the replay step's shared pieces
(kernels/kda_replay_sm90.py) and the rows of kernels/step_rows.py.

A CTA stages its rows of the checkpoint and the slot's c live ring entries once, as the replay
step does, in the same shared memory (the entries' decayed keys are not kept: the log-decays
stay for the next drafts). Token t of the row (at cursor c + t) is the replay step's token with
c + t live entries: the earlier drafts are entries too, each appended by this CTA to its shared
ring (its key, G and r by the first row group, its rows' u by their lanes) and to the ring in
memory (the head's first tile its key, G and r; every tile its rows' u). The checkpoint, the
cursors and the entries below c are not written: a commit moves the cursor over the accepted
drafts. A row whose drafts would pass the ring's end (c + tokens > ring) is reported (tokens per
row) and is padding.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils

from kernels.kda_replay_sm90 import KdaReplaySm90, Ring
from kernels.step_rows import (
    E_LEN,
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
    Tables,
    Tokens,
    Write,
)


class KdaReplayVerifySm90(KdaReplaySm90):
    @cute.jit
    def _append(self, areas, ring: Ring, raw_k, gt, rkn, slot, h, vb, e, grp, sub):
        """Draft entry e's key (as given), G and inverse norm: into the shared ring (the first
        row group) and into the ring in memory (the head's first tile)."""
        rk_s, rg_s, rr_s = areas
        if grp == 0:
            for q in cutlass.range_constexpr(self.NC):
                d = self._col(q, sub)
                kq = raw_k[q % self.VEC, q // self.VEC]
                rk_s[e, d] = kq
                rg_s[e, d] = gt[q]
                if vb == 0:
                    ring.k[slot, h, e, d] = kq
                    ring.g[slot, h, e, d] = gt[q]
            if sub == 0:
                rr_s[e] = rkn
                if vb == 0:
                    ring.r[slot, h, e] = rkn

    @cute.kernel
    def kernel(self, tk: Tokens, gp: GateParams, st: States, tab: Tables, ring: Ring,
               seqs: Seqs, rd: Read, acc: Accepted, starts: Starts, wr: Write, par: Parents,
               gate: Gate, window: cutlass.Int32):
        """Every draft of the row (window: unused, no fold here)."""
        f32, i32 = cutlass.Float32, cutlass.Int32
        NC, L, BV = self.NC, self.L, self.BV
        tidx, _, _ = cute.arch.thread_idx()
        vb, h, n = cute.arch.block_idx()
        grp = tidx // self.TPR
        sub = tidx - grp * self.TPR
        lead = self._lead(tidx, vb, h)
        bos, length, pad, slot, start, c = self._ring_row(
            (tk, st, tab, ring), (seqs, rd, acc, starts), n, lead)
        if pad == 0 and c + length > L:  # the drafts would pass the ring's end
            self._flag(tab.errors, E_LEN, lead)
            pad = i32(1)
            c = i32(0)  # nothing staged: a padding row reads no entry
        shared = utils.SmemAllocator().allocate(self.shared_storage)
        stage, rk_s, rg_s, rr_s, ru_s, vs, ab_s = self._areas(shared, tidx)
        src = i32(SRC_ZERO)
        if pad == 0 and start != 0:
            self._stage_rows(stage, st.pool, slot, h, vb, grp, sub)
            self._stage_ring(ring, (rk_s, rg_s, rr_s, ru_s), slot, h, vb, c, tidx)
            src = i32(SRC_STAGE)
        cute.arch.cp_async_commit_group()

        bias = cute.make_rmem_tensor((NC,), f32)
        a_exp = cute.math.exp(self._gate_consts(bias, gp, h, sub, gate))
        rq, rk, rg = self._raw_tensor(), self._raw_tensor(), self._raw_tensor()
        qv = cute.make_rmem_tensor((NC,), f32)
        kv = cute.make_rmem_tensor((NC,), f32)
        dv = cute.make_rmem_tensor((NC,), f32)
        x = cute.make_rmem_tensor((NC,), f32)
        gt = cute.make_rmem_tensor((NC,), f32)
        eg = cute.make_rmem_tensor((NC,), f32)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # the ring's entries, staged by every thread, visible to all
        for q in cutlass.range_constexpr(NC):  # G of the last entry (0: none)
            g0 = f32(0.0)
            if c > 0:
                g0 = rg_s[c - 1, self._col(q, sub)]
            gt[q] = g0
        areas = (rk_s, rg_s, rr_s, ru_s, vs, ab_s)
        for t in cutlass.range(length):
            tok = bos + t
            b_raw, vals, _, _ = self._token_loads((rq, rk, rg), tk, tab.write_index, tok, t, n,
                                                  h, vb, grp, sub, False, wr)
            self._raw_cols(qv, rq)
            self._raw_cols(kv, rk)
            self._raw_cols(dv, rg)
            rkn, kq = self._norms(qv, kv, gate)
            self._log_decay(dv, bias, a_exp, gate)
            beta = b_raw.to(f32)
            if gate.beta_sigmoid != 0:
                beta = cute.arch.rcp_approx(1.0 + cute.math.exp(-beta, fastmath=True))
            v_me = vals.to(f32)
            for q in cutlass.range_constexpr(NC):
                gt[q] = gt[q] + dv[q]
                eg[q] = cute.math.exp(gt[q], fastmath=True)
            live = c + t
            self._put_token(vs, gt, kv, qv, grp, sub)
            self._entries(areas, None, live, tidx)  # the log-decays serve the next drafts
            ca, cb = self._row_sums(ru_s, ab_s, live, grp, sub)
            if pad != 0:
                self._zero_outputs(tk.out, tok, h, vb, grp, sub)
            else:
                for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
                    rho = grp + self.G * r
                    v_idx = vb * BV + rho
                    self._checkpoint_row(x, stage, src, r)
                    m, u = self._row_step(x, eg, (kv, qv), (v_me, ca, cb), beta, sub, r)
                    if sub == self.OUT_LANE:
                        tk.out[tok, h * self.V + v_idx] = (m + u * kq).to(cutlass.BFloat16)
                        ru_s[live, rho] = u.to(self.udt)
                        ring.u[slot, h, live, v_idx] = u.to(self.udt)
                self._append((rk_s, rg_s, rr_s), ring, rk, gt, rkn, slot, h, vb, live, grp, sub)
