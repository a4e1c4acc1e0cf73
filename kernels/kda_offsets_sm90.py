"""A varlen forward's offsets on the GPU (sm_90a): cu_seqlens checked and copied, and the
workspace's chunk slots computed, in one launch with no host sync (kda_cute.specs.offsets).

One CTA; each thread takes entries tid, tid + threads, ... . An entry is bad when the first is
not 0, one is below its predecessor or above T, or an int64 one is outside int32's range (the
high word not zero). The threads' findings meet in one shared word between two barriers; then
every entry is written: as given with its chunk slot cu // chunk + s, or, where any entry was
bad, 0 with slot s (every sequence empty: K1 and K2 read and write no token of the batch) and
the error word set (kda_cute.errors), so nothing downstream follows a bad offset.
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
        wide: cutlass.Int32,  # 1: mCuIn holds int64 entries (word pairs)
        entries: cutlass.Int32,  # N + 1
        tokens: cutlass.Int32,  # T
        chunk_shift: cutlass.Int32,  # log2 of the chunk
        stream,
    ):
        @cute.struct
        class SharedStorage:
            bad: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, 1], 16]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        self.kernel(mCuIn, mCuSeq, mCuChunk, mErr, wide, entries, tokens, chunk_shift).launch(
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

    @cute.kernel
    def kernel(self, mCuIn: cute.Tensor, mCuSeq: cute.Tensor, mCuChunk: cute.Tensor,
               mErr: cute.Tensor, wide: cutlass.Int32, entries: cutlass.Int32,
               tokens: cutlass.Int32, chunk_shift: cutlass.Int32):
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
            mCuChunk[i] = (v >> chunk_shift) + i
        if any_bad != 0:
            if tid == 0:
                mErr[E_PREFILL_CU] = i32(1)
