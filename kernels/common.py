"""Helpers shared by the kernel classes (trace time only)."""

import re
from dataclasses import dataclass, fields

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

from kda_cute.abi import GATE_PARAM_DTYPES
from kda_cute.specs.recur import INDEX_DENSE, INDEX_POOL
from kda_cute.specs.step import ERRORS

E_READ, E_WRITE = 3, 4  # the error words of a bad read / write slot (specs.step.ERRORS)
E_NONFINITE = 7  # a forward's state became non-finite (K2)
assert ERRORS[E_NONFINITE].startswith("precision")
assert ERRORS[E_READ].startswith("state_indices") and ERRORS[E_WRITE].startswith("output")

LOG2E = 1.4426950408889634  # log2(e): K1's column passes carry G in base 2
# the factored phase B needs every |G_i - r| and |r| of a chunk's column within this (natural
# units): e^80 ~ 5.5e34, so each factor and product stays a normal fp32
FACTOR_LIMIT = 80.0

@dataclass
class Record:
    """A kernel argument made of named fields (tensors, copy atoms, scalars): the kernel takes
    it as one parameter and the DSL flattens it into the fields' values in field order, so its
    launch parameters are those the fields would be one by one."""

    def __extract_mlir_values__(self):
        values, self._counts = [], []
        for f in fields(self):
            v = cutlass.extract_mlir_values(getattr(self, f.name))
            values += v
            self._counts.append(len(v))
        return values

    def values(self) -> tuple:
        """The fields' values in order (not copied, unlike dataclasses.astuple)."""
        return tuple(getattr(self, f.name) for f in fields(self))

    def __new_from_mlir_values__(self, values):
        kw = {}
        for f, n in zip(fields(self), self._counts, strict=True):
            kw[f.name] = cutlass.new_from_mlir_values(getattr(self, f.name), values[:n])
            values = values[n:]
        return type(self)(**kw)


_GBASIS = re.compile(r'tma_gbasis = <"\(([^)]*)\):\(([^)]*)\)">')
_BITS = re.compile(r"copy_bits = (\d+)")


def tma_meta(name: str, atom, dtype: str, swizzle: int = 0, inner_mode: int | None = None) -> dict:
    """What a compiled TMA load expects of its descriptor, read back from the atom's type: the box
    per global mode, innermost first (mode 1 of our row-major rank-2 views unless `inner_mode`
    says otherwise), its byte count and the smem swizzle span in bytes.
    The manifest records it and the ABI test compares it with what the launcher encodes."""
    text = str(atom.type)
    m, bits = _GBASIS.search(text), _BITS.search(text)
    if not m or not bits:
        raise ValueError(f"{name}: unrecognised TMA atom type {text}")
    sizes = [int(x) for x in m.group(1).split(",")]
    modes = [int(b.split("@")[1]) for b in m.group(2).split(",")]
    box = {mode: size for size, mode in zip(sizes, modes, strict=True)}
    rank = max(modes) + 1
    inner = rank - 1 if inner_mode is None else inner_mode
    order = [inner] + [i for i in reversed(range(rank)) if i != inner]
    return {"name": name, "dtype": dtype, "rank": rank,
            "box": [box.get(i, 1) for i in order],
            "bytes": int(bits.group(1)) // 8, "swizzle": swizzle}


def swizzle_bytes(layout) -> int:
    """The swizzle span in bytes of a swizzled 16-bit smem layout (its Swizzle<B, 4, 3> has
    2^B 16-byte units per row of the pattern); 0 for a plain layout."""
    m = re.search(r"S<(\d+),(\d+),(\d+)>", str(getattr(layout, "inner", "")))
    return 0 if m is None or int(m.group(1)) == 0 else 16 << int(m.group(1))


class TileCopy:
    """One TMA tile load (trace time): the `tile` of the global view at `coord` into smem `sX`,
    completing on mbarrier `bar`. Called by a whole warp: the copy elects its own lane."""

    @cute.jit
    def _tile_copy(self, tma, tX, sX, coord, tile, bar):
        tXs, tXg = self._tma_tiles(tma, tX, sX, coord, tile)
        cute.copy(tma, tXg, tXs, tma_bar_ptr=bar)

    @cute.jit
    def _tile_store(self, tma, tX, sX, coord, tile):
        """One TMA tile store: smem `sX` to the `tile` of the global view at `coord` (commit and
        wait on the bulk async-groups are the caller's). Called by a whole warp, like a load."""
        tXs, tXg = self._tma_tiles(tma, tX, sX, coord, tile)
        cute.copy(tma, tXs, tXg)

    @cute.jit
    def _tma_tiles(self, tma, tX, sX, coord, tile):
        """(smem, global) sides of one TMA tile: smem `sX` and the `tile` of the global view at
        `coord` (of the tile's rank: 2, or 3 for K2's checkpoint maps)."""
        n = len(tile)
        gX = cute.local_tile(cute.domain_offset(coord, tX), tile, (0,) * n)
        return cpasync.tma_partition(
            tma, 0, cute.make_layout(1), cute.group_modes(sX, 0, n), cute.group_modes(gX, 0, n))


class ChunkTileLoader(TileCopy):
    """The K2 load side shared by its variants: one chunk's K1 workspace tiles and v tile, TMA'd
    into buffer c % stages on that buffer's mbarrier. Needs self.C, K, V, BV, stages, tx_bytes."""

    def _make_loads(self, mKg, mQg, mKd, mAw, mMq, mGl, mV):
        """Host side: the seven TMA atoms (plain row-major smem tiles), their manifest records and
        the bytes one chunk's loads complete on its barrier."""
        C, K, BV = self.C, self.K, self.BV
        l_ck = cute.make_layout((C, K), stride=(K, 1))
        l_cc = cute.make_layout((C, C), stride=(C, 1))
        l_1k = cute.make_layout((1, K), stride=(K, 1))
        l_cv = cute.make_layout((C, BV), stride=(BV, 1))
        specs = (("kg", mKg, l_ck, (C, K), "float32"), ("qg", mQg, l_ck, (C, K), "float32"),
                 ("kd", mKd, l_ck, (C, K), "float32"), ("aw", mAw, l_cc, (C, C), "float32"),
                 ("mq", mMq, l_cc, (C, C), "float32"), ("gl", mGl, l_1k, (1, K), "float32"),
                 ("v", mV, l_cv, (C, BV), "bfloat16"))
        atoms, self.tma_meta = [], []
        for name, m, layout, tile, dtype in specs:
            atom, tX = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), m, layout,
                                                   tile)
            atoms += [atom, tX]
            self.tma_meta.append(tma_meta(name, atom, dtype))
        self.tx_bytes = (3 * C * K + 2 * C * C + K) * 4 + C * BV * 2
        return tuple(atoms), (l_ck, l_cc, l_1k, l_cv)

    @cute.jit
    def _issue(self, c, bos, chunk_id, loads, head_cols, tma_gl, tGl, sGl, gl_col,
               tma_v, tV, sV, v_col, full):
        """Warp 0 loads chunk c (one lane arms the barrier; the copies elect their own lane, so
        the whole warp must reach them): K1's tiles of workspace chunk `chunk_id`, v's at the
        sequence's token t0."""
        s = c % self.stages
        t0 = bos + c * self.C
        bar = full + s
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(bar, self.tx_bytes)
        for (tma, tX, sX, cols, rows), col in zip(loads, head_cols, strict=True):
            self._tile_copy(tma, tX, sX[None, None, s], (chunk_id * self.C, col), (rows, cols),
                            bar)
        self._tile_copy(tma_gl, tGl, sGl[None, None, s], (chunk_id, gl_col), (1, self.K), bar)
        self._tile_copy(tma_v, tV, sV[None, None, s], (t0, v_col), (self.C, self.BV), bar)


PARAM_F32, PARAM_BF16, PARAM_F16 = (GATE_PARAM_DTYPES[n]
                                    for n in ("float32", "bfloat16", "float16"))


@cute.jit
def gate_param(m: cute.Tensor, i, dtype: cutlass.Int32) -> cutlass.Float32:
    """Element i of a gate parameter (A_log, dt_bias) in the dtype it is held in: `m` is
    declared fp32, `dtype` (abi.GATE_PARAM_DTYPES) says how to read it; 0 reads 0."""
    return gate_param16(m, i, dtype, gate_param32(m, i, dtype))


@cute.jit
def gate_param32(m: cute.Tensor, i, dtype: cutlass.Int32) -> cutlass.Float32:
    """Element i of an fp32 gate parameter, else 0: the load alone on the fp32 path (a 16-bit
    parameter is read after, by gate_param16, behind one branch off that path)."""
    x = cutlass.Float32(0.0)
    if dtype == PARAM_F32:
        x = m[i]
    return x


@cute.jit
def gate_param16(m: cute.Tensor, i, dtype: cutlass.Int32, x: cutlass.Float32
                 ) -> cutlass.Float32:
    """Element i of a bf16 or fp16 gate parameter, else x. A 16-bit view assumes only its
    element's alignment (a caller's view may start at any element)."""
    if dtype == PARAM_BF16:
        x = _view16(m, cutlass.BFloat16)[i].to(cutlass.Float32)
    elif dtype == PARAM_F16:
        x = _view16(m, cutlass.Float16)[i].to(cutlass.Float32)
    return x


def halves(*dtypes):
    """Whether any of the gate parameters' dtype codes is a 16-bit one (codes 2, 3: their
    bitwise or exceeds fp32's 1)."""
    acc = dtypes[0]
    for d in dtypes[1:]:
        acc = acc | d
    return acc > PARAM_F32


def _view16(m: cute.Tensor, dtype) -> cute.Tensor:
    ptr = cute.make_ptr(dtype, m.iterator.toint(), cute.AddressSpace.gmem, assumed_align=2)
    return cute.make_tensor(ptr, m.layout)


class StateSlots:
    """The pool form of the prefill's states (K2, the combine): which rows a sequence reads
    and writes, from the run-time arguments of kda_cute.specs.recur.INDEX_SCALARS."""

    @cute.jit
    def _word(self, t: cute.Tensor, off, wide):
        """Entry `off` of an index table: (value, ok). An int64 table (wide) is read as word
        pairs; ok is 0 when the high word is not the low word's sign extension."""
        v = t[off]
        ok = cutlass.Int32(1)
        if wide != 0:
            v = t[2 * off]
            hi = t[2 * off + 1]
            if hi != (v >> 31):
                ok = cutlass.Int32(0)
        return v, ok

    @cute.jit
    def _slots(self, mRIdx: cute.Tensor, mWIdx: cute.Tensor, mHasInit: cute.Tensor,
               mErr: cute.Tensor, seq, idx, lead):
        """Sequence `seq`'s (live, read row, write row, init). live 0: a padding row (an index
        below null_min) or one with a bad index (>= slots, or an int64 one out of int32's
        range: the argument's error word is set by the `lead` thread, INDEX_POOL only); it
        reads and writes no state and its outputs are zeros. init 0: has_init says the row
        starts from zeros. Dense states: row `seq` both ways."""
        mode, row_div, slots, r_sn, r_wide, w_on, w_sn, w_wide, hi_on, null_min = idx
        i32 = cutlass.Int32
        row = seq // row_div
        live = i32(1)
        rs = seq
        ws = seq
        init = i32(1)
        if mode != INDEX_DENSE:
            s, ok = self._word(mRIdx, row * r_sn, r_wide)
            w = s
            okw = ok
            if w_on != 0:
                w, okw = self._word(mWIdx, row * w_sn, w_wide)
            if ok == 0 or s >= slots:
                live = i32(0)
                if mode == INDEX_POOL and lead != 0:
                    mErr[E_READ] = i32(1)
            if okw == 0 or w >= slots:
                live = i32(0)
                if mode == INDEX_POOL and lead != 0 and w_on != 0:
                    mErr[E_WRITE] = i32(1)
            if s < null_min or w < null_min:
                live = i32(0)
            if mode == INDEX_POOL:
                rs = s
                ws = w
        if hi_on != 0:
            if mHasInit[row] == 0:
                init = i32(0)
        return live, rs, ws, init

    @cute.jit
    def _report(self, mRIdx: cute.Tensor, mWIdx: cute.Tensor, mHasInit: cute.Tensor,
                mErr: cute.Tensor, seqs, idx):
        """The bad indices of sequences `seqs` (range arguments) into the error words, by the
        calling thread alone, before the kernel's main work: a store under a thread's own
        condition inside the warp-specialised loops makes ptxas treat the producer's loop
        state as divergent (an elect loop around every TMA load)."""
        if idx[0] == INDEX_POOL:
            for seq in cutlass.range(seqs[0], seqs[1], seqs[2]):
                self._slots(mRIdx, mWIdx, mHasInit, mErr, seq, idx, cutlass.Int32(1))

    @cute.jit
    def _zero_rows(self, mOut: cute.Tensor, bos, eos, h, v0, tidx, nthreads: cutlass.Constexpr):
        """A padding row's outputs: zeros in columns v0 .. v0 + BV - 1 of its tokens (mOut
        (T, H, V)), by `nthreads` threads. The row runs no chunk: it needs no pipeline."""
        BV = self.BV
        for e in cutlass.range(tidx, (eos - bos) * BV, nthreads):
            t = e // BV
            mOut[bos + t, h, v0 + e - t * BV] = cutlass.BFloat16(0.0)


@dsl_user_op
def trap(*, loc=None, ip=None):
    """Abort the kernel (the launch fails with an error instead of hanging)."""
    llvm.inline_asm(None, [], "trap;", "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def bits_f32(x, *, loc=None, ip=None) -> cutlass.Float32:
    """An int32's bits as an fp32 value (no conversion)."""
    v = cutlass.Int32(x).ir_value(loc=loc, ip=ip)
    return cutlass.Float32(llvm.bitcast(T.f32(), v, loc=loc, ip=ip))


@dsl_user_op
def f32_bits(x, *, loc=None, ip=None) -> cutlass.Int32:
    """An fp32 value's bits as an int32 (no conversion)."""
    v = cutlass.Float32(x).ir_value(loc=loc, ip=ip)
    return cutlass.Int32(llvm.bitcast(T.i32(), v, loc=loc, ip=ip))


@dsl_user_op
def pack_bf16x2(a, b, *, loc=None, ip=None) -> cutlass.Int32:
    """bf16(a) in the low half and bf16(b) in the high half of one word (round to nearest
    even): one cvt.rn.bf16x2.f32 for the two."""
    va = cutlass.Float32(a).ir_value(loc=loc, ip=ip)
    vb = cutlass.Float32(b).ir_value(loc=loc, ip=ip)
    return cutlass.Int32(llvm.inline_asm(
        T.i32(), [va, vb], "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


@dsl_user_op
def absmax_bf16x2(a, b, *, loc=None, ip=None) -> cutlass.Int32:
    """Lane by lane max(|a|, |b|) of two bf16 pairs (the sign bits xored: mask them off for the
    magnitude): one max.xorsign.abs.bf16x2."""
    va = cutlass.Int32(a).ir_value(loc=loc, ip=ip)
    vb = cutlass.Int32(b).ir_value(loc=loc, ip=ip)
    return cutlass.Int32(llvm.inline_asm(
        T.i32(), [va, vb], "max.xorsign.abs.bf16x2 $0, $1, $2;", "=r,r,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


@dsl_user_op
def sync_threads_or(x, *, loc=None, ip=None) -> cutlass.Int32:
    """A barrier over the whole CTA (barrier 0, every thread arriving) that returns 1 in every
    thread if x != 0 in any of them, else 0 (bar.red.or)."""
    v = cutlass.Int32(x).ir_value(loc=loc, ip=ip)
    return cutlass.Int32(llvm.inline_asm(
        T.i32(), [v],
        "{ .reg .pred p, q; setp.ne.s32 p, $1, 0; bar.red.or.pred q, 0, p; "
        "selp.s32 $0, 1, 0, q; }", "=r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip))


@dsl_user_op
def bulk_store(gaddr, saddr, nbytes, *, loc=None, ip=None):
    """`nbytes` (a multiple of 16, both addresses 16-byte aligned) from shared memory at saddr to
    global memory at gaddr, by the bulk copy engine into the calling thread's current bulk
    async-group (cp.async.bulk; commit and wait are the caller's)."""
    g = cutlass.Int64(gaddr).ir_value(loc=loc, ip=ip)
    sa = cutlass.Int32(saddr).ir_value(loc=loc, ip=ip)
    n = cutlass.Int32(nbytes).ir_value(loc=loc, ip=ip)
    llvm.inline_asm(None, [g, sa, n],
                    "cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;", "l,r,r",
                    has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def tf32_rna(x, *, loc=None, ip=None) -> cutlass.Float32:
    """x rounded to tf32 (to nearest, ties away: cvt.rna.tf32.f32), as the fp32 value whose low
    13 mantissa bits are zero: x - tf32_rna(x) is exact, and a tf32 MMA reads the value as is."""
    v = cutlass.Float32(x).ir_value(loc=loc, ip=ip)
    return bits_f32(cutlass.Int32(llvm.inline_asm(
        T.i32(), [v], "cvt.rna.tf32.f32 $0, $1;", "=r,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc, ip=ip)), loc=loc, ip=ip)


def tf32_trunc(x) -> cutlass.Float32:
    """x truncated to tf32 (its low 13 mantissa bits cleared: one AND), as the fp32 value:
    x - tf32_trunc(x) is exact, the lo part of a 3xTF32 split."""
    return bits_f32(f32_bits(x) & cutlass.Int32(-8192))


def bf16x2_lo(w) -> cutlass.Float32:
    """The low bf16 of a word, as fp32 (exact: a shift)."""
    return bits_f32(w << 16)


def bf16x2_hi(w) -> cutlass.Float32:
    """The high bf16 of a word, as fp32 (exact: a mask)."""
    return bits_f32(w & -65536)


def bf16x2(w) -> tuple:
    """Both bf16 of a word, as fp32: (low, high), the element order in memory."""
    return bf16x2_lo(w), bf16x2_hi(w)
