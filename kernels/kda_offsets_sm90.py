"""A varlen forward's offsets on the GPU (sm_90a): cu_seqlens checked and copied, and the
workspace's chunk slots computed, in one launch with no host sync (kda_cute.specs.offsets).

One CTA; each thread takes entries tid, tid + threads, ... . An entry is bad when the first is
not 0, one is below its predecessor or above T, or an int64 one is outside int32's range (the
high word not zero). The threads' findings meet in one shared word between two barriers; then
every entry is written: as given with its chunk slot cu // chunk + s, or, where any entry was
bad, 0 with slot s (every sequence empty: K1 and K2 read and write no token of the batch) and
the error word set (kda_cute.errors), so nothing downstream follows a bad offset.

Shifted (a forward whose every-n checkpoints start at per-row first boundaries: each row's chunk
grid starts sigma = (C - first % C) % C tokens before the row, so that every boundary ends a
chunk): K1's table splits each row n in two, [bos, min(bos + f, eos)) (f = first % C; the row's
partial first chunk, at slot bos // C + 2n) and the rest (from slot bos // C + 2n + 1), and
K2's cu_chunks holds chunk0 * C + sigma, chunk0 the slot of the row's first chunk (an empty row
and f = 0: no partial first chunk, sigma 0). The slots between rows hold no tokens.

Segments (segments = P > 0, a varlen forward's K2 over P segments a sequence): each sequence's
chunks in P runs of ceil(chunks / P), their cu_seqlens and first chunk slots, so that K2 runs
them as N P sequences (kda_cute.segments).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils

from kda_cute.specs.offsets import E_PREFILL_CU, OffsetsConfig


class KdaOffsetsSm90:
    def __init__(self, cfg: OffsetsConfig):
        self.cfg = cfg
        self.threads = cfg.threads
        self.smem_bytes = 0
        self.tma_meta = []

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        mCuIn: cute.Tensor,  # (N + 1 or 2 (N + 1),) int32 words: the caller's cu_seqlens
        mCuSeq: cute.Tensor,  # (N + 1,) int32: the checked copy
        mCuChunk: cute.Tensor,  # (N + 1,) int32: each sequence's first chunk slot
        mErr: cute.Tensor,  # (8,) int32: the error words
        mFirst: cute.Tensor,  # shifted: the rows' first boundaries (int32 words)
        mCu1: cute.Tensor,  # shifted: K1's cu_seqlens, (2N + 1,) int32
        mCc1: cute.Tensor,  # shifted: K1's cu_chunks, (2N + 1,) int32
        wide: cutlass.Int32,  # 1: mCuIn holds int64 entries (word pairs)
        entries: cutlass.Int32,  # N + 1
        tokens: cutlass.Int32,  # T
        chunk_shift: cutlass.Int32,  # log2 of the chunk
        shifted: cutlass.Int32,
        f_sn: cutlass.Int32,  # mFirst's row stride (entries)
        f_wide: cutlass.Int32,  # 1: int64 entries
        mSegCu: cute.Tensor,  # segments: the segments' cu_seqlens, (N P + 1,) int32
        mSegCc: cute.Tensor,  # segments: each segment's first chunk slot, (N P + 1,) int32
        segments: cutlass.Int32,  # P segments a sequence; 0: none
        stream,
    ):
        @cute.struct
        class SharedStorage:
            bad: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 1], 16]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        self.kernel(mCuIn, mCuSeq, mCuChunk, mErr, mFirst, mCu1, mCc1, wide, entries, tokens,
                    chunk_shift, shifted, f_sn, f_wide, mSegCu, mSegCc, segments).launch(
            grid=(1, 1, 1), block=(self.threads, 1, 1), smem=self.smem_bytes, stream=stream)

    # ---------------------------------------------------------------- device
    @cute.jit
    def _entry(self, mCuIn: cute.Tensor, i, wide):
        """Entry i: (its low word, 1 if it is an int32 value)."""
        v = mCuIn[i]
        ok = cutlass.Int32(1)
        if wide != 0:
            v = mCuIn[2 * i]
            if mCuIn[2 * i + 1] != 0 or v < 0:
                ok = cutlass.Int32(0)
        return v, ok

    @cute.jit
    def _shifted(self, mCuIn: cute.Tensor, mCuChunk: cute.Tensor, mFirst: cute.Tensor,
                 mCu1: cute.Tensor, mCc1: cute.Tensor, i, v, any_bad, wide, entries,
                 chunk_shift, f_sn, f_wide):
        """Entry i's share of the shifted tables (v: its checked offset). Only first's low word
        is read: f = first % C is its low bits whatever its width or sign (the checkpoints
        kernel reads the same word)."""
        i32 = cutlass.Int32
        cmask = (i32(1) << chunk_shift) - 1
        base = (v >> chunk_shift) + 2 * i
        mCu1[2 * i] = v
        mCc1[2 * i] = base
        if i + 1 < entries:
            e, _ = self._entry(mCuIn, i + 1, wide)
            if any_bad != 0:
                e = i32(0)
            # (an int64 entry's low word: word 2 i f_sn of the int32 view)
            f = mFirst[(1 + f_wide) * i * f_sn] & cmask
            if e == v:
                f = i32(0)
            mCu1[2 * i + 1] = cutlass.min(v + f, e)
            mCc1[2 * i + 1] = base + 1
            chunk0 = base
            if f == 0:
                chunk0 = base + 1
            mCuChunk[i] = (chunk0 << chunk_shift) + ((i32(0) - f) & cmask)
        else:
            mCuChunk[i] = base << chunk_shift

    @cute.jit
    def _segments(self, mCuIn: cute.Tensor, mSegCu: cute.Tensor, mSegCc: cute.Tensor, i, v,
                  any_bad, wide, entries, chunk_shift, P):
        """Entry i's share of the segments' tables (v: its checked offset): sequence i's chunks
        in P runs of ceil(chunks / P) (trailing ones may be empty), each run's end token at
        i P + j + 1 and its first chunk slot at i P + j; entry 0 and the last slot by the
        first and last entries (kda_cute.segments.varlen_tables)."""
        i32 = cutlass.Int32
        c0 = (v >> chunk_shift) + i  # sequence i's first chunk slot (cu_chunks)
        if i == 0:
            mSegCu[0] = v
        if i + 1 < entries:
            e, _ = self._entry(mCuIn, i + 1, wide)
            if any_bad != 0:
                e = i32(0)
            n = e - v
            nc = (n + (i32(1) << chunk_shift) - 1) >> chunk_shift
            per = (nc + P - 1) // P
            for j in cutlass.range(P):
                a = cutlass.min(j * per, nc)
                b = cutlass.min(a + per, nc)
                mSegCc[i * P + j] = c0 + a
                mSegCu[i * P + j + 1] = v + cutlass.min(b << chunk_shift, n)
        else:
            mSegCc[i * P] = c0

    @cute.kernel
    def kernel(self, mCuIn: cute.Tensor, mCuSeq: cute.Tensor, mCuChunk: cute.Tensor,
               mErr: cute.Tensor, mFirst: cute.Tensor, mCu1: cute.Tensor, mCc1: cute.Tensor,
               wide: cutlass.Int32, entries: cutlass.Int32, tokens: cutlass.Int32,
               chunk_shift: cutlass.Int32, shifted: cutlass.Int32, f_sn: cutlass.Int32,
               f_wide: cutlass.Int32, mSegCu: cute.Tensor, mSegCc: cute.Tensor,
               segments: cutlass.Int32):
        i32 = cutlass.Int32
        tid, _, _ = cute.arch.thread_idx()
        smem = utils.SmemAllocator()
        st = smem.allocate(self.shared_storage)
        sBad = st.bad.get_tensor(cute.make_layout((1,)))
        if tid == 0:
            sBad[0] = i32(0)
        cute.arch.sync_threads()
        bad = i32(0)
        for i in cutlass.range(tid, entries, self.threads):
            v, ok = self._entry(mCuIn, i, wide)
            if ok == 0 or v < 0 or v > tokens:
                bad = i32(1)
            if i == 0:
                if v != 0:
                    bad = i32(1)
            else:
                u, _ = self._entry(mCuIn, i - 1, wide)
                if v < u:
                    bad = i32(1)
        if bad != 0:
            sBad[0] = i32(1)  # every writer writes 1
        cute.arch.sync_threads()
        any_bad = sBad[0]
        for i in cutlass.range(tid, entries, self.threads):
            v, _ = self._entry(mCuIn, i, wide)
            if any_bad != 0:
                v = i32(0)
            mCuSeq[i] = v
            if shifted != 0:
                self._shifted(mCuIn, mCuChunk, mFirst, mCu1, mCc1, i, v, any_bad, wide,
                              entries, chunk_shift, f_sn, f_wide)
            else:
                mCuChunk[i] = (v >> chunk_shift) + i
            if segments > 0:
                self._segments(mCuIn, mSegCu, mSegCc, i, v, any_bad, wide, entries,
                               chunk_shift, segments)
        if any_bad != 0:
            if tid == 0:
                mErr[E_PREFILL_CU] = i32(1)
