"""Decode, persistent (sm_90a): single-token plans (a row has at most one token; plans.step
picks this kernel for no other), each CTA walking tiles bid, bid + grid, .. of the
(V / BV, H, rows) tiles over the shared rows of kernels/step_rows.py.

Before a tile's row loop the CTA looks up the next tile's slots and issues its staging into the
other half of its shared memory, so its reads stay in flight while it computes. Per tile, what
the one-tile kernel (kernels/kda_step_sm90.py) does for its first token.

Each thread reads back only what it staged itself, so the halves need no barrier: the next
tile's copies (or zeros) go to the half the previous tile was read from, and every value read
from it there fed that tile's row loop, which comes before them in program order (in-order
issue: the reads have returned before the copies are issued).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils as utils

from kda_cute.specs.step import WRITE_ALL, WRITE_LAST
from kernels.step_rows import (
    SRC_STAGE,
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


class KdaStepPersistSm90(StepRows):
    def _launch(self, ins, grid, modes, stream):
        # the grid (CTAs per SM x SMs, at most one per tile) is the plan's
        self.kernel(*ins, grid, *modes).launch(
            grid=(grid.num_rows, 1, 1), block=(self.threads, 1, 1), smem=self.smem_bytes,
            stream=stream, **self._occupancy())

    # ---------------------------------------------------------------- device
    def _mine_at(self, area, buf, tidx):
        """This thread's elements of half `buf` (0 or 1) of a two-tile staging area."""
        n_el = self.BV * self.K
        off = cute.assume(buf * n_el, divby=n_el)  # keeps the 16-byte alignment of the copies
        return self._mine(cute.make_tensor(area.iterator + off, cute.make_layout(n_el)), tidx)

    @cute.jit
    def _zero_stage(self, stage):
        """Zeros over this thread's staging area, for a row that starts from zeros (each
        thread reads back only what it wrote: no barrier)."""
        z = cute.make_rmem_tensor((self.VEC,), self.pdt)
        z.fill(0.0)
        for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
            for j in cutlass.range_constexpr(self.NJ):
                stage[None, j, r].store(z.load())

    @cute.jit
    def _pipe_issue(self, t, buf, area, raw, bias, tiles, num_heads, ins, modes, thread,
                    sizes):
        """Tile t's row setup (nothing past the last tile), its write row (-1: none), its
        token's loads (q, k, g into raw's rq, rk, rg, the gate's constants into bias; nothing
        waits for them here) and its start state staged into half `buf` (zeros there for a row
        that starts from zeros); one commit group either way. ins: the kernel's tensor records
        (tk, gp, st, tab); modes: its mode records (seqs, rd, acc, starts, wr, gate); thread:
        (tidx, grp, sub); sizes: (tokens, pool slots, dst rows). Returns (bos, length, pad,
        wrow, beta and v as loaded, A_log)."""
        i32 = cutlass.Int32
        NVB = self.V // self.BV
        tk, gp, st, tab = ins
        seqs, rd, acc, starts, wr, gate = modes
        tidx, grp, sub = thread
        num_tokens, slots, dst_rows = sizes
        bos, length, pad, slot, start, wrow = i32(0), i32(0), i32(1), i32(-1), i32(0), i32(-1)
        b_raw, vals, a_log = cutlass.BFloat16(0.0), cutlass.BFloat16(0.0), cutlass.Float32(0.0)
        if t < tiles:
            vb = t % NVB
            h = (t // NVB) % num_heads
            n = t // (NVB * num_heads)
            lead = self._lead(tidx, vb, h)
            bos, length = self._row_tokens(tab, seqs, n, lead, num_tokens)
            w_lo, w_hi = i32(-1), i32(-1)
            if length > 0:  # in flight through the slot lookup
                b_raw, vals, w_lo, w_hi = self._token_loads(
                    raw, tk, tab.write_index, bos, i32(0), n, h, vb, grp, sub,
                    self._writes(wr.mode, i32(0), length), wr)
                a_log = self._gate_consts(bias, gp, h, sub, gate)
            pad, _, slot, start = self._row_slot(tab, rd, acc, starts, n, lead, slots)
            if pad == 0 and length > 0:
                if wr.mode == WRITE_ALL or wr.mode == WRITE_LAST:
                    wrow = self._write_row_of(w_lo, w_hi, tab.errors, i32(0), lead, dst_rows,
                                              wr, starts.w_null)
                stage = self._mine_at(area, buf, tidx)
                if start != 0:
                    self._stage_rows(stage, st.pool, slot, h, vb, grp, sub)
                else:
                    self._zero_stage(stage)
        cute.arch.cp_async_commit_group()
        return bos, length, pad, wrow, b_raw, vals, a_log

    @cute.kernel
    def kernel(self, tk: Tokens, gp: GateParams, st: States, tab: Tables, grid: Grid,
               seqs: Seqs, rd: Read, acc: Accepted, starts: Starts, wr: Write, par: Parents,
               gate: Gate):
        f32, i32 = cutlass.Float32, cutlass.Int32
        NVB, n_el = self.V // self.BV, self.BV * self.K
        num_heads = grid.num_heads
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        nb, _, _ = cute.arch.grid_dim()
        grp = tidx // self.TPR
        sub = tidx - grp * self.TPR
        num_tokens = tk.q.shape[0]
        slots = st.pool.shape[0]
        dst_rows = st.dst.shape[0]
        tiles = NVB * num_heads * grid.num_rows
        smem = utils.SmemAllocator()
        shared = smem.allocate(self.shared_storage)
        area = shared.stage.get_tensor(cute.make_layout(2 * n_el))
        qv = cute.make_rmem_tensor((self.NC,), f32)
        kv = cute.make_rmem_tensor((self.NC,), f32)
        dv = cute.make_rmem_tensor((self.NC,), f32)
        bias = cute.make_rmem_tensor((self.NC,), f32)
        x = cute.make_rmem_tensor((self.NC,), f32)

        rq, rk, rg = self._raw_tensor(), self._raw_tensor(), self._raw_tensor()
        raw = (rq, rk, rg)
        ins = (tk, gp, st, tab)
        modes = (seqs, rd, acc, starts, wr, gate)
        thread = (tidx, grp, sub)
        sizes = (num_tokens, slots, dst_rows)

        # the first tile's slots, staging and loads
        bos, length, pad, wrow, b_raw, vals, a_log = self._pipe_issue(
            bid, i32(0), area, raw, bias, tiles, num_heads, ins, modes, thread, sizes)
        buf = i32(0)
        for t in cutlass.range(bid, tiles, nb):
            vb = t % NVB
            h = (t // NVB) % num_heads
            tok, live, wr_t = bos, length, wrow
            if pad != 0:
                live = i32(0)
            # this tile's loads (issued before the previous tile's rows) into registers
            beta, kq, v_now = f32(0.0), f32(0.0), f32(0.0)
            if live > 0:
                self._raw_cols(qv, rq)
                self._raw_cols(kv, rk)
                self._raw_cols(dv, rg)
                v_now = vals.to(f32)
                beta, kq = self._token_math(qv, kv, dv, b_raw, bias, cute.math.exp(a_log), gate)
            # the next tile's slots, staging (into the other half) and loads
            zeros = length > 0 and pad != 0
            bos, length, pad, wrow, b_raw, vals, a_log = self._pipe_issue(
                t + nb, 1 - buf, area, raw, bias, tiles, num_heads, ins, modes, thread, sizes)
            cute.arch.cp_async_wait_group(1)  # this tile's staged rows have landed
            if zeros:
                self._zero_outputs(tk.out, tok, h, vb, grp, sub)
            elif live > 0:
                stage = self._mine_at(area, buf, tidx)
                for r in cutlass.range(self.R, unroll=self.U, unroll_full=self.U == 0):
                    self._row(x, SRC_STAGE, stage, stage, r, (qv, kv, dv, beta, kq, v_now),
                              (tk.out, st.dst), tok, h, vb, grp, sub, wr_t)
            buf = 1 - buf
        cute.arch.cp_async_wait_group(0)  # nothing in flight when the CTA exits
