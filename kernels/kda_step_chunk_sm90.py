"""Verify as one chunk a tile (sm_90a): a row's tokens (at most cfg.chunk; no tree parents, no
commit: the plan's choice) against a state pool on the tensor cores, over the shared rows of
kernels/step_rows.py; one tile a CTA, or (cfg.persist) each CTA walking its tiles.

A tile stages its start state row-major (rows KP apart) and prepares its tokens (norms, decays,
write rows) one a group (_chunk_issue, _chunk_prep); then the tokens' products among themselves
and with the start state on mma.sync (_chunk_products, _chunk_mma), one lane a row solving the
row's deltas and outputs, and the states after each token to their write rows (_chunk_rows).
Three CTA barriers a tile.

The persistent form walks tiles bid, bid + grid, .. as kernels/kda_step_persist_sm90.py does:
before a tile's products and rows it stages the next tile into the other half and issues that
tile's token loads (after its own prepared tokens are stored: they share the registers); a CTA
barrier after the rows frees the half and the prepared tokens' area.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.nvgpu import warp as warp_mma

from kernels.common import tf32_rna, tf32_trunc
from kernels.step_rows import (
    E_LEN,
    Accepted,
    Gate,
    GateParams,
    Grid,
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


class KdaStepChunkSm90(StepRows):
    def _launch(self, ins, grid, modes, stream):
        if self.cfg.persist:
            # the grid (CTAs per SM x SMs, at most one per tile) is the plan's
            self.kernel_pipe(*ins, grid, *modes).launch(
                grid=(grid.num_rows, 1, 1), block=(self.threads, 1, 1), smem=self.smem_bytes,
                stream=stream, **self._occupancy())
            return
        self.kernel(*ins, *modes).launch(
            grid=(self.V // self.BV, grid.num_heads, grid.num_rows), block=(self.threads, 1, 1),
            smem=self.smem_bytes, stream=stream, **self._occupancy())

    # ---------------------------------------------------------------- device
    @cute.jit
    def _stage_tile(self, tile, src: cute.Tensor, row, h, vb, grp, sub):
        """cp.async this thread's columns of its R rows of src[row, h] into the row-major tile
        (committed by the caller)."""
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                   self.pdt, num_bits_per_copy=128)
        for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
            rho = grp + self.G * r
            vecs = self._row_vecs(src, row, h, vb * self.BV + rho)
            dst = cute.logical_divide(tile[rho, None], cute.make_layout(self.VEC))
            for j in cutlass.range_constexpr(self.NJ):
                cute.copy(atom, vecs[None, sub + self.TPR * j], dst[None, sub + self.TPR * j])

    @cute.jit
    def _zero_tile(self, tile, grp, sub):
        """Zeros over this thread's columns of its R rows of the row-major tile."""
        z = cute.make_rmem_tensor((self.VEC,), self.pdt)
        z.fill(0.0)
        for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
            dst = cute.logical_divide(tile[grp + self.G * r, None], cute.make_layout(self.VEC))
            for j in cutlass.range_constexpr(self.NJ):
                dst[None, sub + self.TPR * j].store(z.load())

    @cute.jit
    def _chunk_products(self, areas, ta, tb, bh, bl, live_len, grp, sub):
        """Group t (< chunk) makes token t's row of A (A[t][i] = sum kn_t kn_i prod_{s=i+1..t}
        d_s, i < t) and B (B[t][i] = sum qn_t kn_i prod_{s=i+1..t} d_s, i <= t; B[t][t] = k . q)
        and its operand columns kn_t D_t (column t) and qn_t D_t (column chunk + t), D_t =
        prod_{s <= t} d_s, split into hi and lo planes (bf16 for a bf16 pool, tf32 values in
        fp32 words for an fp32 one); zeros past the row's `live_len` tokens. Every lane of a
        group runs every shuffle (the conditions are selects)."""
        f32, NC, CH, VEC, pdt = cutlass.Float32, self.NC, self.CH, self.VEC, self.pdt
        tq, tk, td, tv, ts, tw = areas
        t = grp
        live = t < live_len
        kn = cute.make_rmem_tensor((NC,), f32)
        qn = cute.make_rmem_tensor((NC,), f32)
        d = cute.make_rmem_tensor((NC,), f32)
        ki = cute.make_rmem_tensor((NC,), f32)
        cum = cute.make_rmem_tensor((NC,), f32)
        r = cute.make_rmem_tensor((NC,), f32)
        self._tok_get(tk, t, sub, kn)
        self._tok_get(tq, t, sub, qn)
        cum.fill(1.0)
        r.fill(1.0)
        for s in cutlass.range_constexpr(CH):
            self._tok_get(td, s, sub, d)
            use = s <= t
            for c in cutlass.range_constexpr(NC):
                cum[c] = cum[c] * f32(cutlass.select_(use, d[c], f32(1.0)))
        if sub == 0:
            for i in cutlass.range_constexpr(CH):
                ta[t * CH + i] = f32(0.0)
                tb[t * CH + i] = f32(0.0)
        for ii in cutlass.range_constexpr(CH - 1):
            i = t - 1 - ii
            ok = i >= 0
            ic = cutlass.max(i, 0)
            self._tok_get(td, ic + 1, sub, d)
            self._tok_get(tk, ic, sub, ki)
            pa = f32(0.0)
            pb = f32(0.0)
            for c in cutlass.range_constexpr(NC):
                r[c] = r[c] * f32(cutlass.select_(ok, d[c], f32(1.0)))
                w = ki[c] * r[c]
                pa = pa + kn[c] * w
                pb = pb + qn[c] * w
            pa = self._lanes_sum(pa)
            pb = self._lanes_sum(pb)
            if sub == 0 and ok and live:
                ta[t * CH + ic] = pa
                tb[t * CH + ic] = pb
        if sub == 0 and live:
            tb[t * CH + t] = ts[2 * t + 1]
        # the columns as 16-byte vectors: hi and lo of k D and of q D
        fr = [cute.make_rmem_tensor((VEC,), pdt) for _ in range(4)]
        rows = [cute.logical_divide(pl[row, None], cute.make_layout(VEC))
                for pl, row in ((bh, t), (bl, t), (bh, CH + t), (bl, CH + t))]
        for j in cutlass.range_constexpr(self.NJ):
            for e in cutlass.range_constexpr(VEC):
                xk = f32(cutlass.select_(live, kn[j * VEC + e] * cum[j * VEC + e], f32(0.0)))
                xq = f32(cutlass.select_(live, qn[j * VEC + e] * cum[j * VEC + e], f32(0.0)))
                if cutlass.const_expr(pdt is f32):
                    hk = tf32_rna(xk)
                    hq = tf32_rna(xq)
                    fr[0][e] = hk
                    fr[1][e] = xk - hk  # exact; the MMA reads its top 19 bits
                    fr[2][e] = hq
                    fr[3][e] = xq - hq
                else:
                    hk = xk.to(pdt)
                    hq = xq.to(pdt)
                    fr[0][e] = hk
                    fr[1][e] = (xk - hk.to(f32)).to(pdt)
                    fr[2][e] = hq
                    fr[3][e] = (xq - hq.to(f32)).to(pdt)
            for f, dst in zip(fr, rows, strict=True):
                dst[None, sub + self.TPR * j].store(f.load())

    @cute.jit
    def _chunk_mma(self, tile, bh, bl, tp, warp, lane):
        """Rows 16 warp .. + 15 of the start state times the operand planes, into one fp32
        accumulator a column tile: every token's k . S0 and q . S0 products, into tp (column-
        major: tp[column (BV + 4) + row]). A bf16 state is an exact operand (m16n8k16: S hi +
        S lo); an fp32 state is split into tf32 hi and lo in registers (m16n8k8: S_hi hi +
        S_hi lo + S_lo hi, the products to about fp32's precision: modelled in float64, the states
        come as near float64 as the fp32 token loop's; docs/notes/step.md, "The chunked tile")."""
        f32, K, KP, NP = cutlass.Float32, self.K, self.KP, self.NP
        is_f32 = self.pdt is f32
        op_t = cutlass.TFloat32 if is_f32 else cutlass.BFloat16
        KT = 8 if is_f32 else 16  # the MMA's k
        mma = cute.make_tiled_mma(warp_mma.MmaTF32Op((16, 8, 8)) if is_f32 else
                                  warp_mma.MmaF16BF16Op(op_t, f32, (16, 8, 16)))
        thr = mma.get_slice(lane)
        c_shape = thr.partition_shape_C((16, 8))
        accs = [cute.make_rmem_tensor(c_shape, f32) for _ in range(NP // 8)]
        for acc in accs:
            acc.fill(0.0)
        row0 = 16 * warp
        for kt in cutlass.range_constexpr(K // KT):
            va = cute.make_tensor(tile.iterator + row0 * KP + KT * kt,
                                  cute.make_layout((16, KT), stride=(KP, 1)))
            pa = thr.partition_A(va)
            fa = cute.make_rmem_tensor(pa.shape, op_t)
            fl = cute.make_rmem_tensor(pa.shape, op_t)  # an fp32 state's lo part
            if cutlass.const_expr(is_f32):
                xa = cute.make_rmem_tensor(pa.shape, f32)
                xa.store(pa.load())
                for e in cutlass.range_constexpr(cute.size(xa)):
                    # hi truncated (one AND; the planes' hi are rounded): with lo, the
                    # products lose 2^-20 of |S| instead of 2^-21
                    hi = tf32_trunc(xa[e])
                    fa[e] = hi
                    fl[e] = xa[e] - hi  # exact; the MMA reads its top 19 bits
            else:
                fa.store(pa.load())
            for nt in cutlass.range_constexpr(NP // 8):
                fbs = []
                for plane in (bh, bl):
                    vb_ = cute.make_tensor(plane.iterator + nt * 8 * KP + KT * kt,
                                           cute.make_layout((8, KT), stride=(KP, 1)))
                    pb = thr.partition_B(vb_)
                    fb = cute.make_rmem_tensor(pb.shape, op_t)
                    if cutlass.const_expr(is_f32):
                        fb.store(pb.load().to(op_t))
                    else:
                        fb.store(pb.load())
                    cute.gemm(mma, accs[nt], fa, fb, accs[nt])
                    fbs.append(fb)
                if cutlass.const_expr(is_f32):
                    cute.gemm(mma, accs[nt], fl, fbs[0], accs[nt])
        cC = thr.partition_C(cute.make_identity_tensor((16, 8)))
        for nt in cutlass.range_constexpr(NP // 8):
            for e in cutlass.range_constexpr(cute.size(cC)):
                i, jj = cC[e]
                tp[(nt * 8 + jj) * (self.BV + 4) + row0 + i] = accs[nt][e]

    def _chunk_setup(self):
        """The chunked kernel's shared memory (its storage, the prepared tokens' areas, the
        staging area) and registers (a token's raw loads; its gate constants, q, k, decay and
        a row's state, fp32)."""
        smem = utils.SmemAllocator()
        shared = smem.allocate(self.shared_storage)
        halves = 2 if self.cfg.persist else 1
        area = shared.stage.get_tensor(cute.make_layout(halves * self.BV * self.KP))
        regs = [cute.make_rmem_tensor((self.NC,), cutlass.Float32) for _ in range(5)]
        return (shared, self._tok_areas(shared), area, self._raw_tensor(), self._raw_tensor(),
                self._raw_tensor(), cute.make_rmem_tensor((self.NVP,), cutlass.BFloat16), *regs)

    def _chunk_tile(self, area, buf):
        """Half `buf` (0 or 1) of the chunked kernel's staging area, as the row-major tile."""
        n_el = self.BV * self.KP
        layout = cute.make_layout((self.BV, self.K), stride=(self.KP, 1))
        if isinstance(buf, int):
            return cute.make_tensor(area.iterator + buf * n_el, layout)
        off = cute.assume(buf * n_el, divby=n_el)  # keeps the 16-byte alignment of the copies
        return cute.make_tensor(area.iterator + off, layout)

    @cute.jit
    def _chunk_issue(self, ok, vb, h, n, tile, regs, ins, modes, tidx, grp, sub):
        """Tile (vb, h, n) of the chunked kernel (nothing where not `ok`): its row's tokens and
        read slot (bad values flagged, the row then padding), its start state staged into
        `tile` (zeros for a row that starts from zeros, or is padding), one commit group either
        way; the head's gate constants into bias and, in the preparing groups (grp < chunk),
        their token's loads into rq, rk, rg, rv. Nothing waits for the loads here. Returns
        (bos, the row's live tokens (0 for padding), its tokens, beta as loaded, the words of
        the token's write entry, A_log). regs: (rq, rk, rg, rv, bias); ins: the kernel's tensor
        records (tk, gp, st, tab); modes: its mode records (seqs, rd, acc, starts, wr, gate)."""
        rq, rk, rg, rv, bias = regs
        tk, gp, st, tab = ins
        seqs, rd, acc, starts, wr, gate = modes
        i32 = cutlass.Int32
        bos, length, live_len = i32(0), i32(0), i32(0)
        b_raw, w_lo, w_hi, a_log = cutlass.BFloat16(0.0), i32(-1), i32(-1), cutlass.Float32(0.0)
        if ok:
            lead = self._lead(tidx, vb, h)
            bos, length = self._row_tokens(tab, seqs, n, lead, tk.q.shape[0])
            pad, _, slot, start = self._row_slot(tab, rd, acc, starts, n, lead, st.pool.shape[0])
            if length > self.CH:  # the plan bounds max_tokens by the chunk: never taken
                self._flag(tab.errors, E_LEN, lead)
                pad = i32(1)
            if pad == 0 and start != 0 and length > 0:
                self._stage_tile(tile, st.pool, slot, h, vb, grp, sub)
            else:
                self._zero_tile(tile, grp, sub)
            if pad == 0:
                live_len = length
            a_log = self._gate_consts(bias, gp, h, sub, gate)
            if grp < self.CH and live_len > 0:
                tt = cutlass.min(grp, live_len - 1)
                b_raw, w_lo, w_hi = self._prep_issue(
                    (rq, rk, rg), rv, tk, tab.write_index, bos + tt, tt, n, h, vb, sub,
                    self._writes(wr.mode, tt, live_len), wr)
        cute.arch.cp_async_commit_group()
        return bos, live_len, length, b_raw, w_lo, w_hi, a_log

    @cute.jit
    def _chunk_prep(self, areas, live_len, loads, regs, a_log, mErr: cute.Tensor, at, dst_rows,
                    wr: Write, starts: Starts, gate: Gate):
        """The preparing groups: group g's token (the row's g-th; a group past the row's last
        token works on that one again without storing it) from its loads (_chunk_issue: rq,
        rk, rg, rv, beta as loaded, its write entry's words) into prepared slot g. regs: (qv,
        kv, dv, bias); at: (vb, h, grp, sub)."""
        vb, h, grp, sub = at
        qv, kv, dv, bias = regs
        if grp < self.CH and live_len > 0:
            tt = cutlass.min(grp, live_len - 1)
            lead_p = cutlass.Int32(0)  # reports a prepared token's bad write entry
            if sub == 0 and vb == 0 and h == 0:
                lead_p = cutlass.Int32(1)
            self._prep_store(areas, grp, loads, (qv, kv, dv, bias, cute.math.exp(a_log)), mErr,
                             tt, grp < live_len, lead_p, sub,
                             self._writes(wr.mode, tt, live_len), dst_rows, wr, starts.w_null,
                             gate)

    @cute.jit
    def _chunk_rows(self, tile, shared, areas, bos, live_len, length, x, dv, kv,
                    mOut: cute.Tensor, mDst: cute.Tensor, vb, h, tidx, grp, sub):
        """A staged and prepared tile (after a CTA barrier): the tokens' products among
        themselves and the operand planes (_chunk_products), every token's products with the
        start state (_chunk_mma), the rows' solves (one lane a row: the deltas over the row's
        products in tp, read by that lane alone; the outputs) and the states after each token,
        each to its write row; a padding row's outputs zeros. Two CTA barriers (after the
        caller's). The rows' products tp are column-major, columns BV + 4 apart, so that the
        MMA's stores and the solving lanes' reads (rows G apart) take distinct banks."""
        f32 = cutlass.Float32
        K, NC, CH, NP, VEC = self.K, self.NC, self.CH, self.NP, self.VEC
        ta = shared.ta.get_tensor(cute.make_layout(CH * CH))
        tb = shared.tb.get_tensor(cute.make_layout(CH * CH))
        bh = shared.bh.get_tensor(cute.make_layout((NP, K), stride=(self.KP, 1)))
        bl = shared.bl.get_tensor(cute.make_layout((NP, K), stride=(self.KP, 1)))
        BVP = self.BV + 4  # tp's column stride
        tp = shared.tp.get_tensor(cute.make_layout(BVP * NP))
        if grp < CH:
            self._chunk_products(areas, ta, tb, bh, bl, live_len, grp, sub)
        if cutlass.const_expr(NP > 2 * CH):  # the planes' columns past 2 chunk: zeros
            for i in cutlass.range(tidx, (NP - 2 * CH) * K, self.threads):
                bh[2 * CH + i // K, i % K] = self.pdt(0.0)
                bl[2 * CH + i // K, i % K] = self.pdt(0.0)
        cute.arch.sync_threads()
        warp = tidx // 32
        self._chunk_mma(tile, bh, bl, tp, warp, tidx - 32 * warp)
        cute.arch.sync_threads()

        tq, tk, td, tv, ts, tw = areas
        if live_len > 0 and sub < self.R:  # lanes sub < R of a group: its R rows
            rho = grp + self.G * sub
            v_idx = vb * self.BV + rho
            dl = cute.make_rmem_tensor((CH,), f32)
            for t in cutlass.range_constexpr(CH):
                acc = f32(0.0)
                if t < live_len:
                    acc = tv[t * self.BV + rho] - tp[t * BVP + rho]
                    for i in cutlass.range_constexpr(t):
                        acc = acc - dl[i] * ta[t * CH + i]
                    acc = ts[2 * t] * acc
                dl[t] = acc
            for t in cutlass.range_constexpr(CH):
                if t < live_len:
                    o = tp[(CH + t) * BVP + rho]
                    for i in cutlass.range_constexpr(t + 1):
                        o = o + dl[i] * tb[t * CH + i]
                    mOut[bos + t, h * self.V + v_idx] = o.to(cutlass.BFloat16)
            for t in cutlass.range_constexpr(CH):  # over the row's P (read above)
                tp[t * BVP + rho] = dl[t]
        cute.arch.sync_warp()  # a group's rows are its warp's
        for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
            rho = grp + self.G * r
            v_idx = vb * self.BV + rho
            if live_len == 0:
                for t in cutlass.range(length):
                    if sub == 0:
                        mOut[bos + t, h * self.V + v_idx] = f32(0.0).to(cutlass.BFloat16)
            else:
                src = cute.logical_divide(tile[rho, None], cute.make_layout(VEC))
                for j in cutlass.range_constexpr(self.NJ):
                    y = src[None, sub + self.TPR * j].load().to(f32)
                    for e in cutlass.range_constexpr(VEC):
                        x[j * VEC + e] = y[e]
                for t in cutlass.range_constexpr(CH):
                    if t < live_len:
                        self._tok_get(td, t, sub, dv)
                        self._tok_get(tk, t, sub, kv)
                        u = tp[t * BVP + rho]
                        for c in cutlass.range_constexpr(NC):
                            x[c] = x[c] * dv[c] + u * kv[c]
                        wrow = tw[t]
                        if wrow >= 0:
                            self._put(x, self._row_vecs(mDst, wrow, h, v_idx), sub, self.pdt)

    @cute.kernel
    def kernel(self, tk: Tokens, gp: GateParams, st: States, tab: Tables, seqs: Seqs, rd: Read,
               acc: Accepted, starts: Starts, wr: Write, par: Parents, gate: Gate):
        """One tile a CTA (the tokens' tree parents, par, are never set for this kernel)."""
        tidx, _, _ = cute.arch.thread_idx()
        vb, h, n = cute.arch.block_idx()
        grp = tidx // self.TPR
        sub = tidx - grp * self.TPR
        shared, areas, area, rq, rk, rg, rv, bias, qv, kv, dv, x = self._chunk_setup()
        regs = (rq, rk, rg, rv, bias)
        ins = (tk, gp, st, tab)
        modes = (seqs, rd, acc, starts, wr, gate)
        tile = self._chunk_tile(area, 0)
        bos, live_len, length, b_raw, w_lo, w_hi, a_log = self._chunk_issue(
            True, vb, h, n, tile, regs, ins, modes, tidx, grp, sub)
        self._chunk_prep(areas, live_len, (rq, rk, rg, rv, b_raw, w_lo, w_hi), (qv, kv, dv, bias),
                         a_log, tab.errors, (vb, h, grp, sub), st.dst.shape[0], wr, starts, gate)
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        self._chunk_rows(tile, shared, areas, bos, live_len, length, x, dv, kv, tk.out, st.dst,
                         vb, h, tidx, grp, sub)

    @cute.kernel
    def kernel_pipe(self, tk: Tokens, gp: GateParams, st: States, tab: Tables, grid: Grid,
                    seqs: Seqs, rd: Read, acc: Accepted, starts: Starts, wr: Write,
                    par: Parents, gate: Gate):
        """Each CTA walks tiles bid, bid + grid, .. (the module's docstring)."""
        NVB = self.V // self.BV
        num_heads = grid.num_heads
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nb, _, _ = cute.arch.grid_dim()
        grp = tidx // self.TPR
        sub = tidx - grp * self.TPR
        tiles = NVB * num_heads * grid.num_rows
        shared, areas, area, rq, rk, rg, rv, bias, qv, kv, dv, x = self._chunk_setup()
        regs = (rq, rk, rg, rv, bias)
        ins = (tk, gp, st, tab)
        modes = (seqs, rd, acc, starts, wr, gate)
        bos, live_len, length, b_raw, w_lo, w_hi, a_log = self._chunk_issue(
            bid < tiles, bid % NVB, (bid // NVB) % num_heads, bid // (NVB * num_heads),
            self._chunk_tile(area, 0), regs, ins, modes, tidx, grp, sub)
        buf = cutlass.Int32(0)
        for t in cutlass.range(bid, tiles, nb):
            vb = t % NVB
            h = (t // NVB) % num_heads
            self._chunk_prep(areas, live_len, (rq, rk, rg, rv, b_raw, w_lo, w_hi),
                             (qv, kv, dv, bias), a_log, tab.errors, (vb, h, grp, sub),
                             st.dst.shape[0], wr, starts, gate)
            u = t + nb
            bos2, live2, len2, b_raw2, w_lo2, w_hi2, a_log2 = self._chunk_issue(
                u < tiles, u % NVB, (u // NVB) % num_heads, u // (NVB * num_heads),
                self._chunk_tile(area, 1 - buf), regs, ins, modes, tidx, grp, sub)
            cute.arch.cp_async_wait_group(1)  # this tile's staged rows have landed
            cute.arch.sync_threads()
            self._chunk_rows(self._chunk_tile(area, buf), shared, areas, bos, live_len,
                             length, x, dv, kv, tk.out, st.dst, vb, h, tidx, grp, sub)
            cute.arch.sync_threads()  # the half and the prepared tokens' area are free
            bos, live_len, length, b_raw, w_lo, w_hi, a_log = (
                bos2, live2, len2, b_raw2, w_lo2, w_hi2, a_log2)
            buf = 1 - buf
        cute.arch.cp_async_wait_group(0)  # nothing in flight when the CTA exits
