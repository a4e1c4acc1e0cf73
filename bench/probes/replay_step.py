"""Probe (issue 59): the replay decode step in the CuTe DSL (kernels/kda_replay_sm90.py, the
tiles of kda_cute.step_ladder.REPLAY) against kda_cute.decode: right through folds, and its time
beside decode's at the issue's shapes.

    python3 bench/probes/replay_step.py [--quick] [--out P]

The kernel is launched directly (kda_cute.launch.driver, the arguments of
kda_cute.specs.replay.args); the serving functions do not call it yet. Checks: outputs every
step and the checkpoint after every fold, against decode on the same tokens from one pool
(both bf16 outputs; fp32 or bf16 states). Times: CUDA graphs, the L2 flushed before every
launch, cursors spread over the window (each replay moves them) and a full ring, median of
the launches.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.py (see bench/README.md)
import bench  # noqa: E402
import kda_cute  # noqa: E402
from kda_cute.launch import driver  # noqa: E402
from kda_cute.specs import args_for  # noqa: E402
from kda_cute.step_ladder import REPLAY, REPLAY_VARIANTS  # noqa: E402

K = V = 128
LB = -5.0


class Ring:
    """A checkpoint pool's ring: k [slots, H, L, K] bf16, r [slots, H, L] fp32, u [slots, H, L,
    V] fp16, G [slots, H, L, K] fp32; the cursors and the tickets [slots] int32."""

    def __init__(self, pool, L):
        slots, H = pool.shape[:2]
        d = pool.device
        self.pool, self.L = pool, L
        self.k = torch.zeros(slots, H, L, K, dtype=torch.bfloat16, device=d)
        self.r = torch.zeros(slots, H, L, dtype=torch.float32, device=d)
        self.u = torch.zeros(slots, H, L, V, dtype=torch.float16, device=d)
        self.g = torch.zeros(slots, H, L, K, dtype=torch.float32, device=d)
        self.cursor = torch.zeros(slots, dtype=torch.int32, device=d)
        self.tickets = torch.zeros(slots, dtype=torch.int32, device=d)


def launcher(cfg, x, idx, ring: Ring, out, window=None, accepted=None):
    """The step's launch as a function of no arguments (its parameter block packed once);
    accepted: a commit's counts."""
    N, H = idx.shape[0], ring.pool.shape[1]
    Tk = x["q"].shape[1]  # tokens a row
    T = N * Tk
    q, k, g, v = (x[n].view(T, -1) for n in ("q", "k", "g", "v"))
    beta, o = x["beta"].view(T, H), out.view(T, H * V)
    dev = idx.device
    dummy = torch.zeros(8, dtype=torch.int32, device=dev)
    err = torch.zeros(8, dtype=torch.int32, device=dev)
    pool = ring.pool
    syms = {"T": T, "H": H, "HK": H * K, "HV": H * V, "sQ": q.stride(0), "sK": k.stride(0),
            "sG": g.stride(0), "sV": v.stride(0), "sB": beta.stride(0), "sO": o.stride(0),
            "P": pool.shape[0], "sP": pool.stride(0), "PD": pool.shape[0],
            "sPD": pool.stride(0), "NCU": 8, "NRI": N, "NWI": 8, "NAC": 8, "NPA": 8, "NHI": 8,
            "sRK": ring.k.stride(0), "sRR": ring.r.stride(0), "sRU": ring.u.stride(0),
            "sRG": ring.g.stride(0)}
    ptr = {"q": q, "k": k, "g": g, "v": v, "beta": beta, "out": o, "A_log": x["A_log"],
           "dt_bias": x["dt_bias"], "pool": pool, "dst": pool, "cu_seqlens": dummy,
           "read_index": idx, "write_index": dummy,
           "accepted": dummy if accepted is None else accepted, "parent": dummy,
           "has_init": dummy, "errors": err, "ring_k": ring.k, "ring_r": ring.r,
           "ring_u": ring.u, "ring_g": ring.g, "cursor": ring.cursor,
           "tickets": ring.tickets}
    scal = {"num_rows": N, "num_heads": H, "fixed_len": Tk, "cu_wide": 0, "max_tokens": Tk,
            "read_mode": 1, "r_sn": 1, "r_st": 0, "r_wide": 0, "r_mul": 1, "r_add": 0,
            "acc_on": 0, "acc_wide": 0, "acc_base": 0, "acc_skip": 0, "max_sel": 1, "hi_on": 0,
            "r_null": 0, "w_null": 0, "write_mode": 0, "w_sn": 0, "w_st": 0, "w_wide": 0,
            "w_mul": 1, "w_add": 0, "parent_on": 0, "p_sn": 0, "p_st": 0, "p_wide": 0,
            "gate": 1, "a_log_dtype": 1, "dt_bias_dtype": 1, "qk_l2norm": 1,
            "beta_sigmoid": 1, "scale": K ** -0.5, "lower_bound": LB,
            "window": window or cfg.ring}
    names = tuple(a.name for a in args_for(cfg))
    vals = tuple(ptr[n].data_ptr() if n in ptr else scal[n] for n in names)
    kern = driver.get_kernel(cfg, "sm_90a")
    smem = kern.manifest["dynamic_smem_bytes"]
    f = kern.function(dev.index or 0, smem)
    arr = kern.packed(names, vals, tuple(sorted(syms.items())))
    grid = (1, 1, N) if cfg.mode == "commit" else (V // cfg.block_v, H, N)
    keep = (x, idx, ring, out, dummy, err, q, k, g, v, beta, o, accepted)

    def run():
        kern.launch(f, grid, arr, torch.cuda.current_stream().cuda_stream, smem)
    run.keep, run.err = keep, err
    return run


def tokens(N, H, gen, T=1):
    def rnd(*s):
        return torch.randn(*s, generator=gen, device="cuda").to(torch.bfloat16)
    return dict(q=rnd(N, T, H, K), k=rnd(N, T, H, K), g=rnd(N, T, H, K), v=rnd(N, T, H, V),
                beta=rnd(N, T, H))


def _pool(cfg, slots, H, gen):
    """A pool of `slots` random states in the tile's dtype."""
    dtype = torch.float32 if cfg.pool == "float32" else torch.bfloat16
    return torch.empty(slots, H, V, K, dtype=dtype, device="cuda").normal_(0, 0.3, generator=gen)


def _gate(H, gen):
    return dict(A_log=torch.randn(H, generator=gen, device="cuda") * 0.5,
                dt_bias=torch.randn(H * K, generator=gen, device="cuda") * 0.5)


def _fill(ring: Ring, gen):
    """Every entry of the ring random (its log-decays falling by 0.5 an entry)."""
    ring.k.normal_(generator=gen)
    ring.r.fill_(K ** -0.5)
    ring.u.normal_(0, 0.1, generator=gen)
    ring.g.copy_(torch.arange(1, ring.L + 1, device="cuda").view(1, 1, -1, 1) * -0.5)


def _rel(a, b) -> float:
    """|a - b| / |b| in float64, infinite where not a number."""
    e = ((a.double() - b.double()).norm() / b.double().norm()).item()
    return e if e == e else float("inf")


def _run(run) -> int:
    """Launch, wait, and the sum of the error words it set."""
    run()
    torch.cuda.synchronize()
    return int(run.err.abs().sum())


def long_run(cfg, N, H, steps, marks=(64, 512, 4096)):
    """The replay step over `steps` tokens against the float64 token loop (the state kept in
    float64 beside it): the largest output error up to each mark, and the fp32 checkpoint's
    after each fold."""
    from kda_cute.reference import preprocess

    gen = torch.Generator(device="cuda").manual_seed(N + steps)
    pool = _pool(cfg, N, H, gen)
    idx = torch.arange(N, dtype=torch.int32, device="cuda")
    gate = _gate(H, gen)
    ring = Ring(pool.clone(), cfg.ring)
    S = pool.double()
    out_err, state_err, by_mark = 0.0, 0.0, {}
    for t in range(steps):
        x = dict(tokens(N, H, gen), **gate)
        o = torch.empty(N, 1, H, V, dtype=torch.bfloat16, device="cuda")
        launcher(cfg, x, idx, ring, o)()
        qn, kn, a, b = preprocess(x["q"], x["k"], x["g"], x["beta"], A_log=gate["A_log"],
                                  dt_bias=gate["dt_bias"], lower_bound=LB)
        S = S * torch.exp(a[:, 0])[:, :, None, :]
        kt = kn[:, 0, :, :, None]
        err = x["v"][:, 0].double() - (S @ kt).squeeze(-1)
        S = S + b[:, 0, :, None, None] * err[..., None] * kt.transpose(-1, -2)
        ref = K ** -0.5 * (S @ qn[:, 0, :, :, None]).squeeze(-1)
        out_err = max(out_err, _rel(o[:, 0], ref))
        if t % cfg.ring == cfg.ring - 1:
            state_err = max(state_err, _rel(ring.pool, S))
        if t + 1 in marks:
            by_mark[t + 1] = {"out": out_err, "state": state_err}
    return {"config": cfg.name, "N": N, "H": H, "steps": steps, "long_run": by_mark}


def check_verify(cfg, N, H, first, then):
    """Output-only verify against decode token by token: `first` drafts from an empty ring,
    the cursor moved over them (a commit), `then` drafts more; the checkpoint untouched; then
    drafts past the ring's end reported (tokens per row) with zero outputs."""
    gen = torch.Generator(device="cuda").manual_seed(N + H + first)
    pool = _pool(cfg, 2 * N, H, gen)
    idx = torch.randperm(2 * N, generator=gen, device="cuda")[:N].to(torch.int32)
    idx[::8] = -1
    gate = _gate(H, gen)
    ring = Ring(pool.clone(), cfg.ring)
    before = ring.pool.clone()
    res = {"config": cfg.name, "N": N, "H": H, "drafts": [first, then], "out_vs_decode": 0.0}
    errs = 0
    for T, at in ((first, 0), (then, first)):
        ring.cursor[idx[idx >= 0].long()] = at
        x = dict(tokens(N, H, gen, T), **gate)
        o = torch.full((N, T, H, V), float("nan"), dtype=torch.bfloat16, device="cuda")
        errs += _run(launcher(cfg, x, idx, ring, o))
        for t in range(T):
            o_ref = kda_cute.decode(x["q"][:, t], x["k"][:, t], x["v"][:, t], x["g"][:, t],
                                    x["beta"][:, t], pool, idx, lower_bound=LB, **gate)
            res["out_vs_decode"] = max(res["out_vs_decode"], _rel(o[:, t], o_ref))
    res["error_words"] = errs
    res["checkpoint_untouched"] = bool(torch.equal(ring.pool, before))
    ring.cursor[idx[idx >= 0].long()] = cfg.ring - 2
    x = dict(tokens(N, H, gen, 3), **gate)
    o = torch.full((N, 3, H, V), float("nan"), dtype=torch.bfloat16, device="cuda")
    run = launcher(cfg, x, idx, ring, o)
    _run(run)
    res["past_the_end_reported"] = bool(run.err[1] != 0) and bool((o == 0).all())
    return res


def timed_verify(cfg, N, H, T, iters, flush):
    """Output-only verify of T drafts a row (cursor 4 of a full ring) against kda_cute.verify
    writing a state a token into a slot a token (its style (a)), both graphed."""
    gen = torch.Generator(device="cuda").manual_seed(5 * N + T)
    slots = N * T + N
    pool = _pool(cfg, slots, H, gen)
    sidx = torch.randperm(slots, generator=gen, device="cuda")[:N * T].view(N, T).to(
        torch.int32).contiguous()
    idx = sidx[:, 0].contiguous()
    acc = torch.randint(1, T + 1, (N,), device="cuda", dtype=torch.int32)
    x = dict(tokens(N, H, gen, T), **_gate(H, gen))
    out = torch.empty(N, T, H, V, dtype=torch.bfloat16, device="cuda")
    ring = Ring(pool.clone(), cfg.ring)
    _fill(ring, gen)
    ring.cursor.fill_(4)

    def kda():
        kda_cute.verify(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, ssm_state_indices=sidx,
                        num_accepted_tokens=acc, out=out, lower_bound=LB, A_log=x["A_log"],
                        dt_bias=x["dt_bias"])

    rep = launcher(cfg, x, idx, ring, out)
    row = {"config": cfg.name, "N": N, "H": H, "T": T}
    row["verify_ms"] = bench.time_flushed(bench.graphed(kda), iters, flush)
    row["replay_ms"] = bench.time_flushed(bench.graphed(rep), iters, flush)
    row["speedup"] = row["verify_ms"] / row["replay_ms"]
    return row


def check(cfg, N, H, steps, window=None):
    """Replay against kda_cute.decode over `steps` tokens from one pool (every eighth row
    padding), folding every `window` tokens; then a bad cursor is reported and its row is
    padding."""
    L = cfg.ring
    gen = torch.Generator(device="cuda").manual_seed(N + H + L)
    pool = _pool(cfg, 2 * N, H, gen)
    idx = torch.randperm(2 * N, generator=gen, device="cuda")[:N].to(torch.int32)
    idx[::8] = -1
    live = idx >= 0
    W = window or L
    gate = _gate(H, gen)
    ring = Ring(pool.clone(), L)
    out_err, state_err, errs = 0.0, 0.0, 0
    for t in range(steps):
        x = dict(tokens(N, H, gen), **gate)
        o_ref = kda_cute.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, idx,
                                lower_bound=LB, **gate)
        o = torch.full_like(o_ref, float("nan"))
        errs += _run(launcher(cfg, x, idx, ring, o, W))
        out_err = max(out_err, _rel(o, o_ref))
        if t % W == W - 1:
            state_err = max(state_err, _rel(ring.pool[idx[live].long()],
                                            pool[idx[live].long()]))
    cur = ring.cursor[idx[live].long()]
    res = {"config": cfg.name, "N": N, "H": H, "window": W, "steps": steps,
           "out_vs_decode": out_err, "state_vs_decode": state_err, "error_words": errs,
           "cursors_ok": bool((cur == steps % W).all()),
           "tickets_zero": bool((ring.tickets == 0).all())}
    # a cursor past the ring: the read slot's error word, the row's outputs zeros
    ring.cursor[idx[1].long()] = L
    o = torch.full_like(o_ref, float("nan"))
    run = launcher(cfg, dict(tokens(N, H, gen), **gate), idx, ring, o, W)
    _run(run)
    res["bad_cursor_reported"] = bool(run.err[3] != 0) and bool((o[1] == 0).all())
    return res


def check_flush_commit(step_cfg, flush_cfg, commit_cfg, N, H, steps):
    """Decode steps with no fold (the window the ring), then a flush: the checkpoint against
    kda_cute.decode's state, the cursors and tickets zero; then a commit of random counts (one
    past the ring reported, its cursor kept; padding rows untouched)."""
    L = step_cfg.ring
    gen = torch.Generator(device="cuda").manual_seed(3 * N + H)
    pool = _pool(step_cfg, 2 * N, H, gen)
    idx = torch.randperm(2 * N, generator=gen, device="cuda")[:N].to(torch.int32)
    idx[::8] = -1
    live = idx[idx >= 0].long()
    gate = _gate(H, gen)
    ring = Ring(pool.clone(), L)
    errs = 0
    for _ in range(steps):
        x = dict(tokens(N, H, gen), **gate)
        o = kda_cute.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, idx,
                            lower_bound=LB, **gate)
        errs += _run(launcher(step_cfg, x, idx, ring, torch.empty_like(o), L))
    before = ring.pool.clone()
    errs += _run(launcher(flush_cfg, x, idx, ring, torch.empty_like(o), L))
    res = {"config": flush_cfg.name, "N": N, "H": H, "steps": steps,
           "flushed_vs_decode": _rel(ring.pool[live], pool[live]),
           "flushed_cursors_zero": bool((ring.cursor == 0).all()),
           "tickets_zero": bool((ring.tickets == 0).all())}
    pad = torch.ones(2 * N, dtype=torch.bool, device="cuda")
    pad[live] = False
    res["padding_slots_untouched"] = bool(torch.equal(ring.pool[pad], before[pad]))
    # an empty ring: a second flush changes nothing
    again = ring.pool.clone()
    errs += _run(launcher(flush_cfg, x, idx, ring, torch.empty_like(o), L))
    res["empty_flush_untouched"] = bool(torch.equal(ring.pool, again))
    c0 = torch.randint(0, L // 2, (2 * N,), generator=gen, device="cuda").to(torch.int32)
    acc = torch.randint(0, L // 2, (N,), generator=gen, device="cuda").to(torch.int32)
    acc[1] = L  # past the ring: reported, its cursor kept
    ring.cursor.copy_(c0)
    run = launcher(commit_cfg, x, idx, ring, torch.empty_like(o), L, accepted=acc)
    errs += _run(run) - int(run.err[2])
    want = c0.clone()
    ok = torch.arange(N, device="cuda") != 1
    rows = (idx >= 0) & ok
    want[idx[rows].long()] += acc[rows]
    res["commit_cursors"] = bool(torch.equal(ring.cursor, want))
    res["commit_past_ring_reported"] = bool(run.err[2] != 0)
    res["error_words"] = errs
    return res


def timed(cfg, N, H, iters, flush, bw, window=None):
    """Replay decode beside kda_cute.decode (window: the fold's, None the ring's)."""
    L = cfg.ring
    gen = torch.Generator(device="cuda").manual_seed(7 * N + H)
    slots = 4 * N
    pool = _pool(cfg, slots, H, gen)
    idx = torch.randperm(slots, generator=gen, device="cuda")[:N].to(torch.int32)
    x = dict(tokens(N, H, gen), **_gate(H, gen))
    out = torch.empty(N, 1, H, V, dtype=torch.bfloat16, device="cuda")
    ring = Ring(pool.clone(), L)
    _fill(ring, gen)
    ring.cursor.copy_(torch.randint(0, L, (slots,), generator=gen, device="cuda"))

    def kda():
        kda_cute.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, idx, out=out,
                        lower_bound=LB, A_log=x["A_log"], dt_bias=x["dt_bias"])

    rep = launcher(cfg, x, idx, ring, out, window)
    es = pool.element_size()
    tok = 3 * K * 2 + 2 * V * 2 + 2
    entry = 2 * K + 4 + 2 * V + 4 * K
    today = N * H * (2 * es * V * K + tok)
    replay = N * H * (es * V * K * (1 + 1 / L) + entry * ((L - 2) / 2 + (L - 1) / L) + tok)
    row = {"config": cfg.name, "N": N, "H": H, "pool": cfg.pool, "L": L, "window": window or L,
           "decode_bytes": today, "replay_bytes": replay}
    row["decode_ms"] = bench.time_flushed(bench.graphed(kda), iters, flush)
    row["replay_ms"] = bench.time_flushed(bench.graphed(rep), iters, flush)
    row["bytes_ratio"] = replay / today
    row["time_ratio"] = row["replay_ms"] / row["decode_ms"]
    row["decode_pct"] = 100 * today / bw * 1e3 / row["decode_ms"]
    row["replay_pct"] = 100 * replay / bw * 1e3 / row["replay_ms"]
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("replay_step.json"))
    ap.add_argument("--parts", default="long,verify,check,times",
                    help="comma-separated: long, verify (checks and times), check, times")
    a = ap.parse_args(argv)
    res = {"device": torch.cuda.get_device_name(), "checks": [], "times": []}
    steps = [c for c in REPLAY + REPLAY_VARIANTS if c.mode == "decode"]
    verifies = [c for c in REPLAY + REPLAY_VARIANTS if c.mode == "verify" and c.ring >= 16]
    parts = set(a.parts.split(","))
    for cfg in [c for c in steps if c.pool == "float32" and c.block_v == 64 and "long" in parts]:
        try:
            r = long_run(cfg, 8, 4, 512 if a.quick else 4096)
        except Exception as e:  # reported, not fatal
            r = {"config": cfg.name, "error": repr(e)[:300]}
        print(json.dumps(r), flush=True)
        res["checks"].append(r)
    for cfg in [c for c in verifies if "verify" in parts]:
        try:
            r = check_verify(cfg, 64, 8, *((5, 8) if cfg.ring < 32 else (16, 16))
                             if not cfg.drafts else (cfg.drafts // 2, cfg.drafts))
        except Exception as e:  # reported, not fatal
            r = {"config": cfg.name, "error": repr(e)[:300]}
        print(json.dumps(r), flush=True)
        res["checks"].append(r)
    if "verify" in parts or "check" in parts:
        by = {c.mode: c for c in REPLAY if c.pool == "float32" and c.ring == 16}
        try:
            r = check_flush_commit(by["decode"], by["flush"], by["commit"], 64, 8, 11)
        except Exception as e:  # reported, not fatal
            r = {"config": by["flush"].name, "error": repr(e)[:300]}
        print(json.dumps(r), flush=True)
        res["checks"].append(r)
    for cfg in [c for c in steps if "check" in parts]:
        for window in dict.fromkeys((cfg.ring, max(2, cfg.ring // 2))):
            try:
                r = check(cfg, 64, 8, 3 * window + 3, window)
            except Exception as e:  # reported, not fatal: the next config still runs
                r = {"config": cfg.name, "error": repr(e)[:300]}
            print(json.dumps(r), flush=True)
            res["checks"].append(r)
    bw = bench.copy_bandwidth()
    res["copy_TBps"] = bw / 1e12
    flush = bench.flusher()
    shapes = [(64, 32), (256, 32), (1024, 32), (256, 12), (256, 96), (8, 32)]
    if a.quick:
        shapes = [(256, 32)]
    for N, T in [(N, T) for N in (64, 256) for T in (2, 4, 8, 16)]:
        for cfg in [c for c in verifies if 4 + T <= c.ring and T <= (c.drafts or 16)
                    and ("verify" in parts or "vtimes" in parts)]:
            try:
                r = timed_verify(cfg, N, 32, T, 30, flush)
            except Exception as e:  # reported, not fatal
                r = {"config": cfg.name, "N": N, "T": T, "error": repr(e)[:300]}
            print(json.dumps(r), flush=True)
            res["times"].append(r)
    shipped = [c for c in REPLAY if c.mode == "decode" and c.ring in (8, 16)]
    for N, H in shapes:
        for cfg in [c for c in steps if "times" in parts] + [
                c for c in shipped if "shipped" in parts]:
            try:
                r = timed(cfg, N, H, 50, flush, bw, 8 if "shipped" in parts else None)
            except Exception as e:  # reported, not fatal
                r = {"config": cfg.name, "N": N, "H": H, "error": repr(e)[:300]}
            print(json.dumps(r), flush=True)
            res["times"].append(r)
    for N, H in [(8, 32), (16, 32), (32, 32)] if "small" in parts else []:
        for cfg in [c for c in REPLAY if c.mode == "decode" and c.ring == 8]:
            for window in (1, 4):
                try:
                    r = timed(cfg, N, H, 50, flush, bw, window)
                except Exception as e:  # reported, not fatal
                    r = {"config": cfg.name, "N": N, "H": H, "error": repr(e)[:300]}
                print(json.dumps(r), flush=True)
                res["times"].append(r)
    a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
