"""`kda-cute check` and `kda-cute bench`: the installed package's GPU self-test and a short
timing, with nothing but the package (no tests/ or bench/ folders, no DSL).

check: every shipped head dim, fixed length and varlen, both precisions, each gate form, fp32
and bf16 states, checkpoints, decode and verify against pools, each result against the float64
reference (kda_cute.reference), outputs poisoned first.
bench: CUDA-event medians after warm-up, a 256 MB buffer rewritten between calls so that every
timed call starts with a cold L2; a forward's tokens per second and a decode step's compulsory
bytes (touched slots read and written, the token rows) per second. The project's benchmark
with its peers is bench/ in the repository.
"""

from __future__ import annotations

import statistics

import torch

from . import testing
from .api import fwd
from .reference import rel_err
from .serving import decode, verify

STATE_TOL = {torch.float32: testing.STATE_TOL, torch.bfloat16: testing.STATE_TOL_BF16}


def _prefill_cases():
    for K in (64, 128, 256):
        for label, shape in (("B2 T1000", dict(B=2, T=1000)),
                             ("varlen [300,0,1700]", dict(seqlens=[300, 0, 1700]))):
            for precision in ("fast", "precise"):
                yield f"prefill K{K} {label} {precision}", dict(H=4, K=K, **shape), \
                    dict(precision=precision)
    for gate in ("unbounded", "none"):
        yield f"prefill K128 B1 T700 gate {gate}", dict(B=1, T=700, H=4, K=128, gate=gate), {}
    yield "prefill K128 bf16 state in place", dict(B=2, T=500, H=4, K=128,
                                                   state_dtype=torch.bfloat16), \
        dict(final_dtype=None, in_place=True)


def _prefill(shape, kw) -> tuple[float, float]:
    # (in place: state_err is the updated initial state's)
    res = testing.errors(testing.make_inputs(seed=7, **shape), **kw)
    return res["out_err"], res["state_err"]


def _checkpoints() -> tuple[float, float]:
    """Checkpoints at offsets against the reference of each prefix."""
    inp = testing.make_inputs(B=1, T=600, H=4, K=128, seed=8)
    offs = torch.tensor([[1, 257, 600]], device="cuda")
    ck = torch.full((1, 3, 4, 128, 128), float("nan"), device="cuda")
    out = torch.full_like(inp["v"], float("nan"))
    fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["scale"], out, inp["A_log"],
        inp["dt_bias"], inp["lower_bound"], inp["initial_state"], None,
        checkpoint_state=ck, checkpoint_offsets=offs)
    worst = 0.0
    for i, t in enumerate((1, 257, 600)):
        pre = {n: (x[:, :t] if isinstance(x, torch.Tensor) and x.dim() >= 3 and
                   n not in ("initial_state",) else x) for n, x in inp.items()}
        _, ref_s = testing.reference(pre)
        worst = max(worst, rel_err(ck[:, i], ref_s))
    ref_o, _ = testing.reference(inp)
    return rel_err(out, ref_o), worst


def _decode(K, dtype) -> tuple[float, float]:
    run, inp, pool, idx, out = _decode_runner(16, 8, K, dtype, slots=48, seed=K + 1)
    start = pool[idx.long()].clone()
    run()
    ref_o, ref_s = testing.reference(dict(inp, initial_state=start))
    return rel_err(out, ref_o), rel_err(pool[idx.long()], ref_s)


def _verify() -> tuple[float, float]:
    """Style (a), 4 tokens a row, the state after every token to its own slot."""
    N, T, H, K, slots = 4, 4, 8, 128, 40
    inp = testing.make_inputs(B=N, T=T, H=H, K=K, seed=21)
    pool = torch.randn(slots, H, K, K, device="cuda")
    sidx = torch.randperm(slots, device="cuda")[:N * T].view(N, T).to(torch.int32)
    start = pool[sidx[:, 0].long()].clone()
    out = torch.full_like(inp["v"], float("nan"))
    verify(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, ssm_state_indices=sidx,
           out=out, A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"])
    ref_o, ref_s = testing.reference(dict(inp, initial_state=start))
    return rel_err(out, ref_o), rel_err(pool[sidx[:, -1].long()], ref_s)


def check(echo=print) -> bool:
    """The self-test; True when every case is within its bounds (and finite)."""
    ok, why = testing.cuda_ready()
    if not ok:
        echo(f"kda-cute check: cannot run: {why}")
        return False
    cases = [(name, (lambda s=shape, k=kw: _prefill(s, k)),
              STATE_TOL[shape.get("state_dtype", torch.float32)])
             for name, shape, kw in _prefill_cases()]
    cases.append(("checkpoints K128 offsets 1, 257, 600", _checkpoints,
                  STATE_TOL[torch.float32]))
    for K in (64, 128, 256):
        for dt in (torch.float32, torch.bfloat16):
            cases.append((f"decode K{K} {str(dt)[6:]} pool", (lambda K=K, dt=dt: _decode(K, dt)),
                          STATE_TOL[dt]))
    cases.append(("verify K128 4 tokens a row", _verify, STATE_TOL[torch.float32]))
    good = True
    echo(f"{'case':44s} {'out err':>9s} {'state err':>9s}")
    for name, run, state_tol in cases:
        try:
            o, s = run()
            passed = o < testing.OUT_TOL and s < state_tol  # NaN compares False: a failure
            detail = f"{o:9.2e} {s:9.2e}"
        except Exception as e:  # a case that raises is a failure, the others still run
            passed, detail = False, f"raised {type(e).__name__}: {e}"
        good &= passed
        echo(f"{name:44s} {detail}  {'OK' if passed else 'FAIL'}")
    torch.cuda.synchronize()
    echo("all passed" if good else "FAILED")
    return good


# ------------------------------------------------------------------------------ bench
def _median_ms(fn, iters=30, warmup=5) -> float:
    """Median GPU ms of `fn` between CUDA events, every call after an L2 flush, all calls
    queued before one sync (the host runs ahead, as in a model, so a call's host time is not
    counted where the GPU is the bottleneck)."""
    flush = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for a, b in events:
        flush.zero_()  # evicts L2 (the buffer is larger than it)
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def _fwd_runner(shape):
    inp = testing.make_inputs(seed=1, **shape)
    out = torch.empty_like(inp["v"])
    final = torch.empty_like(inp["initial_state"])

    def run():
        fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["scale"], out,
            inp["A_log"], inp["dt_bias"], inp["lower_bound"], inp["initial_state"], final,
            inp["cu_seqlens"])

    return run, inp["q"].shape[0] * inp["q"].shape[1]


def _decode_runner(N, H, K, dtype, slots, seed):
    """A decode step of N rows on `slots` random slots of a random pool, its output poisoned:
    (run, inputs, pool, slot indices, out)."""
    inp = testing.make_inputs(B=N, T=1, H=H, K=K, seed=seed)
    pool = torch.randn(slots, H, K, K, device="cuda").to(dtype)
    idx = torch.randperm(slots, device="cuda")[:N].to(torch.int32)
    out = torch.full_like(inp["v"], float("nan"))

    def run():
        decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, idx, out=out,
               A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"])

    return run, inp, pool, idx, out


def bench(echo=print) -> list[dict]:
    """A short timing of the forward and of decode; the rows it printed."""
    ok, why = testing.cuda_ready()
    if not ok:
        echo(f"kda-cute bench: cannot run: {why}")
        return []
    rows = []
    echo(f"{'case':40s} {'ms':>8s}  rate")
    for name, shape in (("prefill B1 T8192 H64 K128", dict(B=1, T=8192, H=64, K=128)),
                        ("prefill varlen mix H64 K128",
                         dict(seqlens=[2048, 512, 3000, 100, 2532], H=64, K=128)),
                        ("prefill B8 T1024 H32 K128", dict(B=8, T=1024, H=32, K=128))):
        run, tokens = _fwd_runner(shape)
        ms = _median_ms(run)
        rows.append(dict(case=name, ms=ms, mtok_per_s=tokens / ms / 1e3))
        echo(f"{name:40s} {ms:8.3f}  {tokens / ms / 1e3:6.1f} M tokens/s")
    K = 128
    for N, H, dt in ((256, 32, torch.float32), (256, 32, torch.bfloat16), (8, 32, torch.float32)):
        name = f"decode N{N} H{H} K{K} {str(dt)[6:]} pool"
        run, _, pool, _, _ = _decode_runner(N, H, K, dt, slots=4 * N, seed=2)
        nbytes = 2 * N * H * K * K * pool.element_size() + N * H * (4 * K + K + 1) * 2
        ms = _median_ms(run)
        rows.append(dict(case=name, ms=ms, gbps=nbytes / ms / 1e6))
        echo(f"{name:40s} {ms:8.3f}  {nbytes / ms / 1e6:6.0f} GB/s (compulsory bytes)")
    return rows
