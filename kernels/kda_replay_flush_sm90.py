"""Replay flush (sm_90a): each row's ring folded into its checkpoint with no token
(kda_cute.specs.replay), over the replay step's shared pieces (kernels/kda_replay_sm90.py).

With G the last live entry's running log-decay, the slot's state is

    S = S_c e^G + sum_(j < c) u_j (r_j k_j e^(G - G_j))^T

written over the checkpoint (a tile's rows, as the decode step's fold), and the cursor goes to 0
(the row's last tile, by the tickets, as decode moves it). A row of an empty ring (c = 0), and a
padding row, touch nothing. Before a prefix-cache boundary, and before a slot goes to the
prefill, which reads and writes the checkpoint alone.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils

from kernels.kda_replay_sm90 import KdaReplaySm90, Ring
from kernels.step_rows import (
    SRC_STAGE,
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


class KdaReplayFlushSm90(KdaReplaySm90):
    @cute.kernel
    def kernel(self, tk: Tokens, gp: GateParams, st: States, tab: Tables, ring: Ring,
               seqs: Seqs, rd: Read, acc: Accepted, starts: Starts, wr: Write, par: Parents,
               gate: Gate, window: cutlass.Int32):
        """A row's fold (the tokens, gate and window: unused; a row is one token long so that
        it is not padding)."""
        f32, i32 = cutlass.Float32, cutlass.Int32
        NC, BV = self.NC, self.BV
        tidx, _, _ = cute.arch.thread_idx()
        vb, h, n = cute.arch.block_idx()
        grp = tidx // self.TPR
        sub = tidx - grp * self.TPR
        lead = self._lead(tidx, vb, h)
        _, _, pad, slot, start, c = self._ring_row(
            (tk, st, tab, ring), (seqs, rd, acc, starts), n, lead)
        if pad == 0 and start != 0 and c > 0:
            taken = self._ticket(ring, slot, tidx)
            shared = utils.SmemAllocator().allocate(self.shared_storage)
            stage, rk_s, rg_s, rr_s, ru_s, vs, ab_s = self._areas(shared, tidx)
            self._stage_rows(stage, st.pool, slot, h, vb, grp, sub)
            self._stage_ring(ring, (rk_s, rg_s, rr_s, ru_s), slot, h, vb, c, tidx)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            self._move_cursor(ring, slot, tidx, c, True, taken)  # the ring emptied
            gt = cute.make_rmem_tensor((NC,), f32)
            eg = cute.make_rmem_tensor((NC,), f32)
            zero = cute.make_rmem_tensor((NC,), f32)
            for q in cutlass.range_constexpr(NC):
                gt[q] = rg_s[c - 1, self._col(q, sub)]
                eg[q] = cute.math.exp(gt[q], fastmath=True)
                zero[q] = f32(0.0)
            self._put_token(vs, gt, zero, zero, grp, sub)
            self._entries((rk_s, rg_s, rr_s, ru_s, vs, ab_s), rg_s, c, tidx)
            x = cute.make_rmem_tensor((NC,), f32)
            for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
                rho = grp + self.G * r
                self._checkpoint_row(x, stage, i32(SRC_STAGE), r)
                for q in cutlass.range_constexpr(NC):
                    x[q] = x[q] * eg[q]
                self._fold_entries(x, ru_s, rg_s, c, rho, sub)
                self._put(x, self._row_vecs(st.dst, slot, h, vb * BV + rho), sub, self.pdt)
