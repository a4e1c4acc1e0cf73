"""Replay verify, output-only (sm_90a): 1 to `ring` draft tokens a row against a checkpoint pool
and its ring (kda_cute.specs.replay), in chunk form, over the replay step's shared pieces
(kernels/kda_replay_sm90.py) and the rows of kernels/step_rows.py.

With G_t the drafts' running log-decay (continuing the ring's), G_ref the last ring entry's
(0: an empty ring), and every entry j (the ring's c, then the drafts before t) a key
w_j = r_j k_j e^(G_t - G_j), draft t's correction and output are

    u_t = beta_t (v_t - S_c e^(G_t) kn_t - sum_(j < c+t) u_j (w_j . kn_t))
    o_t = S_c e^(G_t) qn_t + sum_(j <= c+t) u_j (w_j . qn_t)

so the checkpoint's products with every draft are independent of one another: a CTA reads its
rows of S_c once, into registers, and takes all of them together (the checkpoint scaled by
e^(G_ref), the drafts' vectors by e^(G_t - G_ref), and the ring's keys by e^(G_ref - G_j), each
factor at most 1; two drafts' pair by e^(G_t - G_s) directly). In steps, CTA barriers between:
- a warp a draft: its q, k, g loaded, normed, its log-decay; v of the tile's rows; the ring's c
  entries staged by cp.async;
- a thread a column: G_t (and the drafts' G, raw keys and inverse norms appended to the ring
  in memory by the head's first tile), the ring's keys and the drafts' vectors rescaled;
- a warp an entry of each draft: the products w_j . kn_t and w_j . qn_t;
- every thread its rows: the checkpoint's products with each draft, reduced over a row's 32
  lanes so that each lane ends with one of its group's 32 sums;
- a thread a row: the corrections and outputs draft by draft (each u to the ring: every tile
  its rows).
The checkpoint, the cursors and the entries below c are not written: a commit moves the cursor
over the accepted drafts. A row of more than 16 drafts, or whose drafts would pass the ring's end
(c + tokens > ring), is reported (tokens per row) and is padding.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils
from cutlass.cute.nvgpu import warp as warp_mma

from kda_cute.specs.replay import MAX_DRAFTS
from kernels.common import tf32_rna, tf32_trunc
from kernels.kda_replay_sm90 import KdaReplaySm90, Ring
from kernels.step_rows import (
    E_LEN,
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
    def __init__(self, cfg):
        super().__init__(cfg)
        # a warp a row group, and its 32 lanes end with one of the group's 2R sums each
        assert self.TPR == 32 and 2 * self.R == 32 and self.BV <= self.threads, cfg
        self.D = cfg.drafts or min(self.L, MAX_DRAFTS)  # the drafts' areas
        self.MMA = cfg.mma
        if self.MMA:  # a warp 16 rows (row grp + G i its MMA row i); k steps of KT columns
            assert self.BV == 16 * self.G and self.D % 4 == 0 and self.K % 32 == 0, cfg
            self.KT = 8 if self.pdt is cutlass.Float32 else 16

    def _shared_storage(self):
        """The ring's entries (keys, log-decays then rescaled keys, inverse norms, the tile's
        rows of u), the drafts' normed k and q, their rescaled vectors (first their
        log-decays), G_ref, the entries' products, v, beta and the checkpoint's products."""
        A, MR, f32 = cute.struct.Align, cute.struct.MemRange, cutlass.Float32
        L, D, K, BV = self.L, self.D, self.K, self.BV
        fields = {"rk": A[MR[cutlass.BFloat16, L * K], 128], "rg": A[MR[f32, L * K], 128],
                  "rr": A[MR[f32, L], 128], "ru": A[MR[self.udt, L * BV], 128],
                  "kn": A[MR[f32, D * K], 128], "qn": A[MR[f32, D * K], 128],
                  **({"xkq": A[MR[f32, 2 * D * K], 128]} if self.MMA else
                     {"xk": A[MR[f32, D * K], 128], "xq": A[MR[f32, D * K], 128]}),
                  "gref": A[MR[f32, K], 128], "ab": A[MR[f32, 2 * L * D], 128],
                  "vv": A[MR[f32, D * BV], 128], "bt": A[MR[f32, D], 128],
                  "sk": A[MR[f32, 2 * D * BV], 128]}
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def _verify_areas(self, shared):
        L, D, K, BV = self.L, self.D, self.K, self.BV

        def grid(area, n, m):
            return area.get_tensor(cute.make_layout((n, m), stride=(m, 1)))

        if cutlass.const_expr(self.MMA):  # (the q vectors D K after the k ones: one operand)
            xkq = shared.xkq.get_tensor(cute.make_layout(2 * D * K))
            xk = cute.make_tensor(xkq.iterator, cute.make_layout((D, K), stride=(K, 1)))
            xq = cute.make_tensor(xkq.iterator + D * K, cute.make_layout((D, K), stride=(K, 1)))
        else:
            xk, xq = grid(shared.xk, D, K), grid(shared.xq, D, K)
        return (grid(shared.rk, L, K), grid(shared.rg, L, K),
                shared.rr.get_tensor(cute.make_layout(L)), grid(shared.ru, L, BV),
                grid(shared.kn, D, K), grid(shared.qn, D, K), xk,
                xq, shared.gref.get_tensor(cute.make_layout(K)),
                shared.ab.get_tensor(cute.make_layout((2, L, D), stride=(L * D, D, 1))),
                grid(shared.vv, D, BV), shared.bt.get_tensor(cute.make_layout(D)),
                shared.sk.get_tensor(cute.make_layout((2, D, BV), stride=(D * BV, BV, 1))))

    def _cols_of(self, area, t, sub):
        """This thread's columns of row t of a (D, K) fp32 area as [e, j] (VEC-vectors)."""
        K, VEC = self.K, self.VEC
        off = cute.assume(t * K + sub * VEC, divby=VEC)
        return cute.make_tensor(area.iterator + off, cute.make_layout(
            (VEC, self.NJ), stride=(1, self.TPR * VEC)))

    @cute.jit
    def _prep_drafts(self, areas, tk: Tokens, gp: GateParams, bos, length, c, h, vb, grp, sub,
                     tidx, gate: Gate):
        """A warp a draft: k and q normed, the log-decay (into xk), the raw key and inverse
        norm into the ring's next entries, beta, k . q (the draft's own product); v of the
        tile's rows."""
        f32 = cutlass.Float32
        rk_s, _, rr_s, _, kn_s, qn_s, xk_s, _, _, ab_s, vv_s, bt_s, _ = areas
        NC, NW, BV = self.NC, self.threads // 32, self.BV
        bias = cute.make_rmem_tensor((NC,), f32)
        a_exp = cute.math.exp(self._gate_consts(bias, gp, h, sub, gate))
        rq, rk, rg = self._raw_tensor(), self._raw_tensor(), self._raw_tensor()
        qv = cute.make_rmem_tensor((NC,), f32)
        kv = cute.make_rmem_tensor((NC,), f32)
        dv = cute.make_rmem_tensor((NC,), f32)
        for t in cutlass.range(grp, length, NW):
            tok = bos + t
            b_raw = tk.beta[tok, h]
            self._head_raw(rq, tk.q, tok, h, sub)
            self._head_raw(rk, tk.k, tok, h, sub)
            self._head_raw(rg, tk.g, tok, h, sub)
            self._raw_cols(qv, rq)
            self._raw_cols(kv, rk)
            self._raw_cols(dv, rg)
            rkn, kq = self._norms(qv, kv, gate)
            self._log_decays(dv, bias, a_exp, gate, False)
            beta = b_raw.to(f32)
            if gate.beta_sigmoid != 0:
                beta = cute.arch.rcp_approx(1.0 + cute.math.exp(-beta, fastmath=True))
            for q in cutlass.range_constexpr(NC):
                d = self._col(q, sub)
                kn_s[t, d] = kv[q]
                qn_s[t, d] = qv[q]
                xk_s[t, d] = dv[q]
                rk_s[c + t, d] = rk[q % self.VEC, q // self.VEC]
            if sub == 0:
                rr_s[c + t] = rkn
                bt_s[t] = beta
                ab_s[1, c + t, t] = kq
        for i in cutlass.range(tidx, length * BV, self.threads):
            t = i // BV
            rho = i - t * BV
            vv_s[t, rho] = tk.v[bos + t, h * self.V + vb * BV + rho].to(f32)

    @cute.jit
    def _columns(self, areas, ring: Ring, slot, h, vb, c, length, tidx, keep):
        """A thread a column: G_ref, the drafts' G (appended to the ring in memory with their
        raw keys and inverse norms by the head's first tile, where `keep`), the ring's keys
        rescaled in place of their log-decays, the drafts' vectors in place of theirs."""
        f32 = cutlass.Float32
        rk_s, rg_s, rr_s, _, kn_s, qn_s, xk_s, xq_s, gref_s, _, _, _, _ = areas
        K = self.K
        first = keep != 0 and vb == 0
        for i in cutlass.range_constexpr(-(-K // self.threads)):
            d = tidx + self.threads * i
            if d < K:
                gr = f32(0.0)
                if c > 0:
                    gr = rg_s[c - 1, d]
                gref_s[d] = gr
                g = gr
                for t in cutlass.range(length):
                    g = g + xk_s[t, d]
                    rg_s[c + t, d] = g
                    e = cute.math.exp(g - gr, fastmath=True)
                    xk_s[t, d] = e * kn_s[t, d]
                    xq_s[t, d] = e * qn_s[t, d]
                    if first:
                        ring.g[slot, h, c + t, d] = g
                        ring.k[slot, h, c + t, d] = rk_s[c + t, d]
                for j in cutlass.range(c):
                    rg_s[j, d] = rk_s[j, d].to(f32) * rr_s[j] * cute.math.exp(
                        gr - rg_s[j, d], fastmath=True)
        if first:
            for t in cutlass.range(tidx, length, self.threads):
                ring.r[slot, h, c + t] = rr_s[c + t]

    @cute.jit
    def _pairs(self, areas, c, length, grp, sub):
        """A warp an entry of each draft: (w_j . kn_t, w_j . qn_t) into ab[0 / 1, j, t] for
        j < c + t (columns sub + 32 i a lane)."""
        f32 = cutlass.Float32
        _, rg_s, _, _, kn_s, qn_s, xk_s, xq_s, _, ab_s, _, _, _ = areas
        NW = self.threads // 32
        for t in cutlass.range(length):
            for j in cutlass.range(grp, c + t, NW):
                pa = f32(0.0)
                pb = f32(0.0)
                if j < c:  # a ring entry: its rescaled key against the draft's vectors
                    for i in cutlass.range_constexpr(self.K // 32):
                        d = sub + 32 * i
                        w = rg_s[j, d]
                        pa = pa + w * xk_s[t, d]
                        pb = pb + w * xq_s[t, d]
                else:  # an earlier draft s: its normed key decayed to t
                    s = j - c
                    for i in cutlass.range_constexpr(self.K // 32):
                        d = sub + 32 * i
                        w = kn_s[s, d] * cute.math.exp(rg_s[c + t, d] - rg_s[j, d],
                                                       fastmath=True)
                        pa = pa + w * kn_s[t, d]
                        pb = pb + w * qn_s[t, d]
                for k in cutlass.range_constexpr(5):
                    pa = pa + cute.arch.shuffle_sync_bfly(pa, offset=1 << k)
                    pb = pb + cute.arch.shuffle_sync_bfly(pb, offset=1 << k)
                if sub == 0:
                    ab_s[0, j, t] = pa
                    ab_s[1, j, t] = pb

    @cute.jit
    def _state_products(self, areas, raw, length, grp, sub):
        """Every thread its R rows of the checkpoint (raw, as loaded) scaled by e^(G_ref),
        against each draft's vectors: the row sums reduced over the row's 32 lanes, lane l
        ending with sum l of the group's 2R (its k products, then its q products), into
        sk[0 / 1, t, row]."""
        f32, NC, R, VEC = cutlass.Float32, self.NC, self.R, self.VEC
        _, _, _, _, _, _, xk_s, xq_s, gref_s, _, _, _, sk_s = areas
        x = cute.make_rmem_tensor((NC * R,), f32)
        for q in cutlass.range_constexpr(NC):
            er = cute.math.exp(gref_s[self._col(q, sub)], fastmath=True)
            for r in cutlass.range_constexpr(R):
                x[q + NC * r] = raw[q % VEC, q // VEC, r].to(f32) * er
        xkv = cute.make_rmem_tensor((NC,), f32)
        xqv = cute.make_rmem_tensor((NC,), f32)
        sums = cute.make_rmem_tensor((2 * R,), f32)
        kind = sub // R
        rho = grp + self.G * (sub - R * kind)
        for t in cutlass.range(length):
            ck = self._cols_of(xk_s, t, sub)
            cq = self._cols_of(xq_s, t, sub)
            for j in cutlass.range_constexpr(self.NJ):
                yk = ck[None, j].load()
                yq = cq[None, j].load()
                for e in cutlass.range_constexpr(VEC):
                    xkv[j * VEC + e] = yk[e]
                    xqv[j * VEC + e] = yq[e]
            for r in cutlass.range_constexpr(R):
                pa = f32(0.0)
                pb = f32(0.0)
                for q in cutlass.range_constexpr(NC):
                    pa = pa + x[q + NC * r] * xkv[q]
                    pb = pb + x[q + NC * r] * xqv[q]
                sums[r] = pa
                sums[R + r] = pb
            n = 2 * R
            for k in cutlass.range_constexpr(5):
                o = 16 >> k
                half = n >> (k + 1)
                hi = (sub & o) != 0
                for i in cutlass.range_constexpr(half):
                    keep = f32(cutlass.select_(hi, sums[i + half], sums[i]))
                    send = f32(cutlass.select_(hi, sums[i], sums[i + half]))
                    sums[i] = keep + cute.arch.shuffle_sync_bfly(send, offset=o)
            sk_s[kind, t, rho] = sums[0]

    # ------------------------------------------------ the products on mma.sync (cfg.mma)
    def _mma_atom(self):
        """(the tiled MMA, its operand type): m16n8k8 tf32 for an fp32 checkpoint (split into
        hi and lo), m16n8k16 bf16 for a bf16 one (exact)."""
        f32 = cutlass.Float32
        if cutlass.const_expr(self.pdt is f32):
            return cute.make_tiled_mma(warp_mma.MmaTF32Op((16, 8, 8))), cutlass.TFloat32
        return (cute.make_tiled_mma(warp_mma.MmaF16BF16Op(cutlass.BFloat16, f32, (16, 8, 16))),
                cutlass.BFloat16)

    def _k_mode(self, s):
        """(shape, stride, column offset) of k step s's k mode: the MMA's k index of a lane's
        operand values mapped to adjacent head columns, and a lane's columns over the steps
        of a 32-column block contiguous (the products are sums over the columns, so any one
        mapping serves A and B alike): m16n8k8's k tig and tig + 4 to columns 8 tig + 2 s' +
        (0, 1), m16n8k16's 2 tig + (0, 1) and 2 tig + 8 + (0, 1) to 8 tig + 4 s' + (0 .. 3)."""
        per = 32 // self.KT  # k steps a block
        if cutlass.const_expr(self.KT == 8):
            return (4, 2), (8, 1), 32 * (s // per) + 2 * (s % per)
        return (2, 4, 2), (1, 8, 2), 32 * (s // per) + 4 * (s % per)

    def _mma_frags(self):
        """A lane's A operands, one fragment a k step (the checkpoint's values as loaded)."""
        mma, _ = self._mma_atom()
        shape = mma.get_slice(0).partition_shape_A((16, self.KT))
        return [cute.make_rmem_tensor(shape, self.pdt) for _ in range(self.K // self.KT)]

    @cute.jit
    def _mma_load(self, pool: cute.Tensor, frags, slot, h, vb, grp, lane):
        """The warp's 16 rows of the checkpoint (row grp + G i its MMA row i) into the lane's
        fragments, straight from memory."""
        mma, _ = self._mma_atom()
        thr = mma.get_slice(lane)
        base = pool[slot, h, vb * self.BV + grp, None].iterator
        for s in cutlass.range_constexpr(self.K // self.KT):
            shape, stride, off = self._k_mode(s)
            view = cute.make_tensor(base + off, cute.make_layout(
                (16, shape), stride=(self.G * self.K, stride)))
            frags[s].store(thr.partition_A(view).load())

    @cute.jit
    def _mma_products(self, areas, frags, length, grp, lane):
        """The checkpoint's products with each draft's vectors on mma.sync, into sk[0 / 1, t,
        row]: n tile i the columns [k of drafts 4i .. 4i + 3, q of the same], as many tiles
        as the row's drafts need. e^(G_ref) column by column into an fp32 checkpoint's values,
        split into tf32 hi and lo as the vectors are (hi hi + hi lo + lo hi: about fp32's
        products); for a bf16 one into the vectors (the checkpoint an exact operand), split
        into bf16 hi and lo."""
        f32, K, D, KT = cutlass.Float32, self.K, self.D, self.KT
        _, _, _, _, _, _, xk_s, _, gref_s, _, _, _, sk_s = areas
        mma, op_t = self._mma_atom()
        thr = mma.get_slice(lane)
        is_f32 = self.pdt is f32
        steps = K // KT
        # e^(G_ref) column by column: into an fp32 checkpoint's values (split below), else
        # kept for each k step's B values (the same columns in every n tile)
        egs = []
        for s in cutlass.range_constexpr(steps):
            shape, stride, off = self._k_mode(s)
            rows = 16 if is_f32 else 8
            gview = cute.make_tensor(gref_s.iterator + off, cute.make_layout(
                (rows, shape), stride=(0, stride)))
            pg = thr.partition_A(gview) if is_f32 else thr.partition_B(gview)
            eg = cute.make_rmem_tensor(pg.shape, f32)
            eg.store(pg.load())
            for e in cutlass.range_constexpr(cute.size(eg)):
                eg[e] = cute.math.exp(eg[e], fastmath=True)
            if cutlass.const_expr(is_f32):
                for e in cutlass.range_constexpr(cute.size(eg)):
                    frags[s][e] = frags[s][e] * eg[e]
            else:
                egs.append(eg)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((16, 8)), f32)
        cC = thr.partition_C(cute.make_identity_tensor((16, 8)))
        for nt in cutlass.range(-(-length // 4)):
            acc.fill(0.0)
            for s in cutlass.range_constexpr(steps):
                shape, stride, off = self._k_mode(s)
                bview = cute.make_tensor(xk_s.iterator + 4 * nt * K + off, cute.make_layout(
                    ((4, 2), shape), stride=((K, D * K), stride)))
                pb = thr.partition_B(bview)
                xb = cute.make_rmem_tensor(pb.shape, f32)
                xb.store(pb.load())
                bh = cute.make_rmem_tensor(pb.shape, op_t)
                bl = cute.make_rmem_tensor(pb.shape, op_t)
                for e in cutlass.range_constexpr(cute.size(xb)):
                    if cutlass.const_expr(is_f32):
                        b = xb[e]
                        hb = tf32_rna(b)
                        bh[e] = hb
                        bl[e] = b - hb  # exact; the MMA reads its top 19 bits
                    else:
                        b = xb[e] * egs[s][e]
                        hb = b.to(cutlass.BFloat16)
                        bh[e] = hb
                        bl[e] = (b - hb.to(f32)).to(cutlass.BFloat16)
                if cutlass.const_expr(is_f32):
                    fa = cute.make_rmem_tensor(frags[s].shape, op_t)
                    fl = cute.make_rmem_tensor(frags[s].shape, op_t)
                    for e in cutlass.range_constexpr(cute.size(fa)):
                        x = frags[s][e]
                        hi = tf32_trunc(x)
                        fa[e] = hi
                        fl[e] = x - hi
                    cute.gemm(mma, acc, fa, bh, acc)
                    cute.gemm(mma, acc, fa, bl, acc)
                    cute.gemm(mma, acc, fl, bh, acc)
                else:
                    cute.gemm(mma, acc, frags[s], bh, acc)
                    cute.gemm(mma, acc, frags[s], bl, acc)
            for e in cutlass.range_constexpr(cute.size(acc)):
                i, n = cC[e]
                t = 4 * nt + n % 4
                if t < length:
                    sk_s[n // 4, t, grp + self.G * i] = acc[e]

    @cute.jit
    def _rows(self, areas, tk: Tokens, ring: Ring, bos, length, c, slot, h, vb, tidx, keep):
        """A thread a row: draft by draft, u (to the shared ring for the next drafts, and to
        the ring in memory where `keep`) and the output."""
        f32, BV = cutlass.Float32, self.BV
        _, _, _, ru_s, _, _, _, _, _, ab_s, vv_s, bt_s, sk_s = areas
        if tidx < BV:
            rho = tidx
            for t in cutlass.range(length):
                p = vv_s[t, rho] - sk_s[0, t, rho]
                o = sk_s[1, t, rho]
                for j in cutlass.range(c + t):
                    uj = ru_s[j, rho].to(f32)
                    p = p - uj * ab_s[0, j, t]
                    o = o + uj * ab_s[1, j, t]
                u = bt_s[t] * p
                o = o + u * ab_s[1, c + t, t]
                tk.out[bos + t, h * self.V + vb * BV + rho] = o.to(cutlass.BFloat16)
                uq = u.to(self.udt)
                ru_s[c + t, rho] = uq
                if keep != 0:
                    ring.u[slot, h, c + t, vb * BV + rho] = uq

    @cute.kernel
    def kernel(self, tk: Tokens, gp: GateParams, st: States, tab: Tables, ring: Ring,
               seqs: Seqs, rd: Read, acc: Accepted, starts: Starts, wr: Write, par: Parents,
               gate: Gate, window: cutlass.Int32):
        """Every draft of the row (window: unused, no fold here)."""
        i32 = cutlass.Int32
        L = self.L
        tidx, _, _ = cute.arch.thread_idx()
        vb, h, n = cute.arch.block_idx()
        grp = tidx // self.TPR
        sub = tidx - grp * self.TPR
        lead = self._lead(tidx, vb, h)
        bos, length, pad, slot, start, c = self._ring_row(
            (tk, st, tab, ring), (seqs, rd, acc, starts), n, lead)
        if pad == 0 and (c + length > L or length > self.D):  # past the ring's end or tile
            self._flag(tab.errors, E_LEN, lead)
            pad = i32(1)
        if pad != 0:
            for t in cutlass.range(length):
                self._zero_outputs(tk.out, bos + t, h, vb, grp, sub)
        else:
            shared = utils.SmemAllocator().allocate(self.shared_storage)
            areas = self._verify_areas(shared)
            rk_s, rg_s, rr_s, ru_s = areas[:4]
            keep = i32(0)  # a row without a slot appends nothing
            if slot >= 0:
                keep = i32(1)
            if cutlass.const_expr(self.MMA):
                raw = self._mma_frags()
                for f in raw:
                    f.fill(0.0)
            else:
                raw = cute.make_rmem_tensor(cute.make_layout((self.VEC, self.NJ, self.R)),
                                            self.pdt)
                raw.fill(0.0)
            if start != 0:
                self._stage_ring(ring, (rk_s, rg_s, rr_s, ru_s), slot, h, vb, c, tidx)
                if cutlass.const_expr(self.MMA):
                    self._mma_load(st.pool, raw, slot, h, vb, grp, sub)
                else:
                    for r in cutlass.range_constexpr(self.R):
                        vecs = self._row_vecs(st.pool, slot, h, vb * self.BV + grp + self.G * r)
                        for j in cutlass.range_constexpr(self.NJ):
                            raw[None, j, r].store(vecs[None, sub + self.TPR * j].load())
            cute.arch.cp_async_commit_group()
            self._prep_drafts(areas, tk, gp, bos, length, c, h, vb, grp, sub, tidx, gate)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            self._columns(areas, ring, slot, h, vb, c, length, tidx, keep)
            cute.arch.sync_threads()
            self._pairs(areas, c, length, grp, sub)
            if cutlass.const_expr(self.MMA):
                self._mma_products(areas, raw, length, grp, sub)
            else:
                self._state_products(areas, raw, length, grp, sub)
            cute.arch.sync_threads()
            self._rows(areas, tk, ring, bos, length, c, slot, h, vb, tidx, keep)
