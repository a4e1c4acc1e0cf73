"""Replay commit (sm_90a): each row's cursor moved over its accepted drafts
(kda_cute.specs.replay): c = c + accepted[n], in place. A CTA a row (its first thread). A count
below zero or past the ring (c + accepted > ring - 1, where the next decode could not read it)
is reported as a bad accepted count and the cursor stays; a bad cursor as a bad read slot. The
next decode folds if the window is past full, so a commit never touches a state.
"""

import cutlass
import cutlass.cute as cute

from kernels.kda_replay_sm90 import KdaReplaySm90, Ring
from kernels.step_rows import (
    E_ACC,
    E_READ,
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


class KdaReplayCommitSm90(KdaReplaySm90):
    def _grid(self, num_heads, num_rows):
        return (1, 1, num_rows)

    def _shared_storage(self):
        A, MR = cute.struct.Align, cute.struct.MemRange
        return cute.struct(type("SharedStorage", (), {"__annotations__": {
            "unused": A[MR[cutlass.Int32, 4], 16]}}))

    @cute.kernel
    def kernel(self, tk: Tokens, gp: GateParams, st: States, tab: Tables, ring: Ring,
               seqs: Seqs, rd: Read, acc: Accepted, starts: Starts, wr: Write, par: Parents,
               gate: Gate, window: cutlass.Int32):
        """Row n's commit (acc.wide: how its count is held; the tokens, gate and window:
        unused)."""
        i32 = cutlass.Int32
        tidx, _, _ = cute.arch.thread_idx()
        _, _, n = cute.arch.block_idx()
        if tidx == 0:
            lead = i32(1)
            pad, _, slot, _ = self._row_slot(tab, rd, acc, starts, n, lead, ring.cursor.shape[0])
            if pad == 0:
                a, ok = self._word(tab.accepted, n, acc.wide)
                c = ring.cursor[slot]
                if c < 0 or c >= self.L:
                    self._flag(tab.errors, E_READ, lead)
                elif ok == 0 or a < 0 or a > self.L - 1 - c:
                    self._flag(tab.errors, E_ACC, lead)
                else:
                    ring.cursor[slot] = c + a
