"""A prefill's checkpoints on the GPU (sm_90a): K2's per-row table of where to store the state,
and the side slots of mid-chunk checkpoints, from the caller's offsets or slots with no host
sync (kda_cute.specs.checkpoints).

One CTA per batch row. Its threads read the row's entries (one each, in turn), check them and
keep each valid one's key (chunks done * 64 + tokens into the next chunk) and destination in
shared memory; after one barrier each thread ranks its entries among the row's valid ones (ties
by index) and writes them to the table of the K2 row (segment) whose chunks hold the boundary,
and the first threads write each K2 row's end mark. A mid-chunk entry takes a side slot from a
global counter: its partial chunk's tokens, workspace chunk, scratch row and destination (an
fp32 destination is its own scratch row: `in_place`). A
padding row (the pool form) has no entries; a bad slot is skipped and sets the write slot's
error word (kda_cute.errors).

Shifted (the every-n form with first boundaries, K2 run over the rows whole): each row's chunk
grid starts sigma = (C - first % C) % C tokens before it (kernels/kda_offsets_sm90.py), so a
boundary o is after (o + sigma) / C chunks, every one ends a chunk, and no side slot is taken.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils

from kda_cute.specs.checkpoints import MAX_ENTRIES, CheckpointsConfig
from kernels.common import E_WRITE, StateSlots


class KdaCheckpointsSm90(StateSlots):
    def __init__(self, cfg: CheckpointsConfig):
        self.cfg = cfg
        self.threads = cfg.threads
        self.smem_bytes = 0
        self.tma_meta = []

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mCuSeq: cute.Tensor, mEntries: cute.Tensor, mFirst: cute.Tensor,
        mCkAt: cute.Tensor, mCkTo: cute.Tensor, mSideCu: cute.Tensor, mK1Chunks: cute.Tensor,
        mSideChunk: cute.Tensor, mSideRead: cute.Tensor, mSideWrite: cute.Tensor,
        mRIdx: cute.Tensor, mWIdx: cute.Tensor, mHasInit: cute.Tensor, mErr: cute.Tensor,
        index_mode: cutlass.Int32, row_div: cutlass.Int32, slots: cutlass.Int32,
        r_sn: cutlass.Int32, r_wide: cutlass.Int32, w_on: cutlass.Int32, w_sn: cutlass.Int32,
        w_wide: cutlass.Int32, hi_on: cutlass.Int32, null_min: cutlass.Int32,
        num_rows: cutlass.Int32, row_segments: cutlass.Int32, per_row: cutlass.Int32,
        e_sn: cutlass.Int32, e_se: cutlass.Int32, e_wide: cutlass.Int32, every: cutlass.Int32,
        first_on: cutlass.Int32, f_sn: cutlass.Int32, f_wide: cutlass.Int32,
        dest_rows: cutlass.Int32, dest_min: cutlass.Int32, side_slots: cutlass.Int32,
        side_base: cutlass.Int32, chunk_shift: cutlass.Int32, in_place: cutlass.Int32,
        shifted: cutlass.Int32,
        stream,
    ):
        @cute.struct
        class SharedStorage:
            key: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, MAX_ENTRIES], 16]
            dest: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, MAX_ENTRIES], 16]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        idx = (index_mode, row_div, slots, r_sn, r_wide, w_on, w_sn, w_wide, hi_on, null_min)
        self.kernel(mCuSeq, mEntries, mFirst, mCkAt, mCkTo, mSideCu, mK1Chunks, mSideChunk,
                    mSideRead, mSideWrite, mRIdx, mWIdx, mHasInit, mErr, idx, row_segments,
                    per_row, e_sn, e_se, e_wide, every, first_on, f_sn, f_wide, dest_rows,
                    dest_min, side_slots, side_base, chunk_shift, in_place, shifted).launch(
            grid=(num_rows, 1, 1), block=(self.threads, 1, 1), smem=self.smem_bytes,
            stream=stream)

    # ---------------------------------------------------------------- device
    @cute.jit
    def _seg_chunk(self, mCuSeq: cute.Tensor, j, start, chunk_shift):
        """The chunks of its batch row before K2 row j starts (ceil: an empty trailing segment
        starts at the row's end)."""
        c = cutlass.Int32(1) << chunk_shift
        return (mCuSeq[j] - start + c - 1) >> chunk_shift

    @cute.kernel
    def kernel(self, mCuSeq: cute.Tensor, mEntries: cute.Tensor, mFirst: cute.Tensor,
               mCkAt: cute.Tensor, mCkTo: cute.Tensor, mSideCu: cute.Tensor,
               mK1Chunks: cute.Tensor, mSideChunk: cute.Tensor, mSideRead: cute.Tensor,
               mSideWrite: cute.Tensor, mRIdx: cute.Tensor, mWIdx: cute.Tensor,
               mHasInit: cute.Tensor, mErr: cute.Tensor, idx, row_segments: cutlass.Int32,
               per_row: cutlass.Int32, e_sn: cutlass.Int32, e_se: cutlass.Int32,
               e_wide: cutlass.Int32, every: cutlass.Int32, first_on: cutlass.Int32,
               f_sn: cutlass.Int32, f_wide: cutlass.Int32, dest_rows: cutlass.Int32,
               dest_min: cutlass.Int32, side_slots: cutlass.Int32, side_base: cutlass.Int32,
               chunk_shift: cutlass.Int32, in_place: cutlass.Int32, shifted: cutlass.Int32):
        i32 = cutlass.Int32
        NT = self.threads
        tid, _, _ = cute.arch.thread_idx()
        n, _, _ = cute.arch.block_idx()
        smem = utils.SmemAllocator()
        st = smem.allocate(self.shared_storage)
        sKey = st.key.get_tensor(cute.make_layout((MAX_ENTRIES,)))
        sDest = st.dest.get_tensor(cute.make_layout((MAX_ENTRIES,)))
        P = row_segments
        E = per_row
        cmask = (i32(1) << chunk_shift) - 1
        start = mCuSeq[n * P]
        length = mCuSeq[n * P + P] - start
        live, _, _, _ = self._slots(mRIdx, mWIdx, mHasInit, mErr, n, idx, i32(0))
        first = every
        if first_on != 0:
            first, _ = self._word(mFirst, n * f_sn, f_wide)
        # the row's grid starts sigma tokens before it (shifted; 0 otherwise)
        sigma = i32(0)
        if shifted != 0:
            sigma = (i32(0) - first) & cmask
        # K1's chunk table for the side slots as pairs (constant; this row's share)
        for i in cutlass.range(tid, E, NT):
            k = n * E + i
            mK1Chunks[2 * k] = k
            mK1Chunks[2 * k + 1] = k + 1

        # ---- each entry: valid?, its key and destination --------------------------------
        for e in cutlass.range(tid, E, NT):
            key = i32(-1)
            dest = n * E + e
            o, ok = self._word(mEntries, n * e_sn + e * e_se, e_wide)
            if every != 0:
                dest = o
                o = first + e * every
                if ok == 0 or dest >= dest_rows:  # never followed, and reported
                    ok = i32(0)
                    mErr[E_WRITE] = i32(1)
                if dest < dest_min:  # -1 (and the null slot): skipped
                    ok = i32(0)
            if live != 0 and ok != 0 and o >= 1 and o <= length:
                u = o + sigma  # (from the grid's start)
                q = u >> chunk_shift
                r = u & cmask
                if o == length:  # the sequence's final state: after its last chunk
                    q = (u + cmask) >> chunk_shift
                    r = i32(0)
                if shifted != 0:  # (every boundary ends a chunk: n is a multiple of 64)
                    r = i32(0)
                key = (q << 6) + r
            sKey[e] = key
            sDest[e] = dest
        cute.arch.sync_threads()

        # ---- ranks, K2 rows, tables and side slots ----------------------------------------
        stride = E + 1
        for e in cutlass.range(tid, E, NT):
            key = sKey[e]
            if key >= 0:
                q = key >> 6
                r = key & 63
                # the K2 row: the last segment starting before chunk q (the first for q = 0)
                j = i32(0)
                cj = i32(0)
                for jj in cutlass.range(1, P):
                    c = self._seg_chunk(mCuSeq, n * P + jj, start, chunk_shift)
                    if c < q:
                        j = jj
                        cj = c
                rank = i32(0)
                before = i32(0)
                for f in cutlass.range(E):
                    kf = sKey[f]
                    if kf >= 0:
                        if kf < key or (kf == key and f < e):
                            rank = rank + 1
                        if j > 0 and (kf >> 6) <= cj:
                            before = before + 1
                code = sDest[e]
                if r != 0:
                    k = cute.arch.atomic_add(mSideCu.iterator + 2 * side_slots, i32(1))
                    t0 = start + (q << chunk_shift)
                    mSideCu[2 * k] = t0
                    mSideCu[2 * k + 1] = t0 + r
                    mSideChunk[k] = side_base + k
                    mSideWrite[k] = code
                    if in_place != 0:  # an fp32 destination holds the state between
                        mSideRead[k] = code
                    else:
                        mSideRead[k] = k
                        code = -(k + 1)
                at = (n * P + j) * stride + rank - before
                mCkAt[at] = q - cj
                mCkTo[at] = code
        # each K2 row's end mark, after its entries
        for jj in cutlass.range(tid, P, NT):
            lo = i32(-1)
            if jj > 0:
                lo = self._seg_chunk(mCuSeq, n * P + jj, start, chunk_shift)
            hi = i32(2147483647)
            if jj < P - 1:
                hi = self._seg_chunk(mCuSeq, n * P + jj + 1, start, chunk_shift)
            count = i32(0)
            for f in cutlass.range(E):
                kf = sKey[f]
                if kf >= 0:
                    qf = kf >> 6
                    if qf > lo and qf <= hi:
                        count = count + 1
            mCkAt[(n * P + jj) * stride + count] = i32(-1)
