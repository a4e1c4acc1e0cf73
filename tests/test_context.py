"""Context parallelism's calls (kda_cute.context): bad arguments on the CPU; on the GPU, each
shard's summary against the float64 model, and R ranks simulated on one GPU (every shard's
summary in turn, the entry states composed, every shard finished) against the float64 loop and
the one-GPU forward."""

from __future__ import annotations

import pytest
import torch

import kda_cute
from kda_cute import distributed as kd
from kda_cute.context import combine, context_finish, context_summary
from kda_cute.reference import kda_reference, rel_err
from kda_cute.testing import OUT_TOL, STATE_TOL

H, K = 2, 128
SCALE = K ** -0.5
BF, F32 = torch.bfloat16, torch.float32


def _gate(dev, seed):
    gen = torch.Generator(device=dev).manual_seed(seed)
    return dict(A_log=torch.randn(H, generator=gen, device=dev) * 0.5,
                dt_bias=torch.randn(H * K, generator=gen, device=dev) * 0.5, lower_bound=-5.0)


def _tokens(T, dev, seed):
    gen = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, device=dev).to(BF)
    return rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, H)


def test_bad_summary_outputs_are_named():
    q, k, v, g, beta = _tokens(128, "cpu", 0)
    good = torch.zeros(1, H, K, K)
    for name, bad in (("bias", torch.zeros(1, H, K, K + 1)), ("bias", good.to(BF)),
                      ("transition", torch.zeros(2, H, K, K)), ("transition", None)):
        outs = {"transition": good, "bias": good, name: bad}
        with pytest.raises(ValueError, match=name):
            context_summary(q, k, v, g, beta, SCALE, None, None, -5.0, outs["transition"],
                            outs["bias"])
    with pytest.raises(ValueError, match="initial_state"):
        context_finish(q, k, v, g, beta, SCALE, torch.empty_like(v), None, None, -5.0,
                       torch.zeros(1, H, K, K + 1), good,
                       workspace=torch.empty(0, dtype=torch.uint8))


def test_combine_chains_the_pieces():
    gen = torch.Generator().manual_seed(1)
    A = torch.randn(3, H, 4, 4, generator=gen, dtype=torch.float64) * 0.5
    B = torch.randn(3, H, 5, 4, generator=gen, dtype=torch.float64)
    S0 = torch.randn(H, 5, 4, generator=gen, dtype=torch.float64)
    want = S0
    for i in range(3):
        want = want @ A[i] + B[i]
    assert torch.allclose(combine(A.float(), B.float(), S0.float()), want.float(), atol=1e-5)
    assert torch.allclose(combine(A.float(), B.float()), (((B[0] @ A[1]) + B[1]) @ A[2] + B[2])
                          .float(), atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("T, segments", [(1024, None), (2000, 1), (4096, 4)])
def test_summary_against_float64(T, segments):
    """One sequence's (transition, bias) against the float64 loop's states after its tokens:
    from zero, and from the identity with v = 0."""
    dev = "cuda"
    q, k, v, g, beta = _tokens(T, dev, T)
    gate = _gate(dev, T)
    A = torch.full((1, H, K, K), float("nan"), device=dev)
    B = torch.full((1, H, K, K), float("nan"), device=dev)
    context_summary(q, k, v, g, beta, SCALE, gate["A_log"], gate["dt_bias"],
                    gate["lower_bound"], A, B, segments=segments)
    kda_cute.check_errors(sync=True)
    # the float64 loop's final states: from zero (the bias), and with v = 0 from the identity
    # (the transition: K == V)
    cpu = dict(scale=SCALE, A_log=gate["A_log"].cpu(), dt_bias=gate["dt_bias"].cpu(),
               lower_bound=-5.0)
    x = [t.cpu() for t in (q, k, v, g, beta)]
    _, wB = kda_reference(*x, **cpu)
    x[2] = torch.zeros_like(x[2])
    eye = torch.eye(K, dtype=torch.float64).expand(1, H, K, K)
    _, wA = kda_reference(*x, initial_state=eye, **cpu)
    wA, wB = wA[0], wB[0]
    assert torch.isfinite(A).all() and torch.isfinite(B).all()
    assert rel_err(A[0].cpu(), wA) < STATE_TOL and rel_err(B[0].cpu(), wB) < STATE_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_ranks_in_turn(ranks):
    """One sequence over `ranks` shards of whole chunks, each rank's summary in turn, each
    rank's message and entry state as kda_cute.distributed makes them (the same arithmetic as
    the distributed run), each shard finished from it: the outputs and the final state against
    the float64 loop, and against the one-GPU forward."""
    dev, T = "cuda", 4096
    q, k, v, g, beta = _tokens(T, dev, ranks)
    gate = _gate(dev, ranks)
    gp = (gate["A_log"], gate["dt_bias"], gate["lower_bound"])
    S0 = torch.randn(1, H, K, K, device=dev) * 0.3
    bounds = [T * r // ranks // 64 * 64 for r in range(ranks)] + [T]
    shard = [tuple(x[:, a:b] for x in (q, k, v, g, beta))
             for a, b in zip(bounds, bounds[1:], strict=False)]
    msgs, spaces = [], []
    for r, x in enumerate(shard):  # every rank's summary and message, in rank order
        A, B = torch.empty(1, H, K, K, device=dev), torch.empty(1, H, K, K, device=dev)
        spaces.append(context_summary(*x, SCALE, *gp, A, B))
        msgs.append(kd.message(A, B, r > 0, 1, S0[0] if r == 0 else None))
    As, Bs, fresh = kd.unpack(torch.cat(msgs), ranks, H, K, K)  # the all-gather's result
    out = torch.full_like(v, float("nan"))
    final = torch.empty(1, H, K, K, device=dev)
    for r, x in enumerate(shard):
        entry = S0 if r == 0 else kd.entry_state(As, Bs, fresh, r)[None].contiguous()
        o = torch.empty_like(x[2])
        context_finish(*x, SCALE, o, *gp, entry, final, workspace=spaces[r])
        out[:, bounds[r]:bounds[r + 1]] = o
    kda_cute.check_errors(sync=True)
    ref_o, ref_s = kda_reference(*(t.cpu() for t in (q, k, v, g, beta)), scale=SCALE,
                                 initial_state=S0.cpu(), A_log=gp[0].cpu(),
                                 dt_bias=gp[1].cpu(), lower_bound=gp[2])
    assert rel_err(out.cpu(), ref_o) < OUT_TOL and rel_err(final.cpu(), ref_s) < STATE_TOL
    one_o, one_s = torch.empty_like(v), torch.empty(1, H, K, K, device=dev)
    kda_cute.fwd(q, k, v, g, beta, SCALE, one_o, *gp, S0.clone(), one_s)
    torch.cuda.synchronize()
    print(f"ranks {ranks}: vs one GPU out {rel_err(out, one_o):.2e} state "
          f"{rel_err(final, one_s):.2e}")
    assert rel_err(final, one_s) < 1e-5 and rel_err(out, one_o) < 1e-5


def _two_shards(x, gp, S0, bounds, outs, finals, spaces=None):
    """Two ranks' shards in turn (summaries, messages, entry, finishes); returns the
    workspaces (made on the first call)."""
    shard = [tuple(t[:, a:b] for t in x) for a, b in zip(bounds, bounds[1:], strict=False)]
    A, B = torch.empty(2, 1, H, K, K, device=S0.device), torch.empty(2, 1, H, K, K,
                                                                       device=S0.device)
    spaces = spaces or [None, None]
    msgs = []
    for r in range(2):
        spaces[r] = context_summary(*shard[r], SCALE, *gp, A[r], B[r], workspace=spaces[r])
        msgs.append(kd.message(A[r], B[r], r > 0, 1, S0[0] if r == 0 else None))
    As, Bs, fresh = kd.unpack(torch.cat(msgs), 2, H, K, K)
    entry = kd.entry_state(As, Bs, fresh, 1)[None].contiguous()
    context_finish(*shard[0], SCALE, outs[0], *gp, S0, finals[0], workspace=spaces[0])
    context_finish(*shard[1], SCALE, outs[1], *gp, entry, finals[1], workspace=spaces[1])
    return spaces


@pytest.mark.gpu
def test_ranks_in_a_cuda_graph():
    """Two shards' summaries, the entry's fold and the finishes captured in one CUDA graph and
    replayed on new tokens written into the captured tensors: bit for bit the eager run's."""
    dev, T = "cuda", 2048
    bounds = [0, 1024, T]
    x = [t.clone() for t in _tokens(T, dev, 7)]
    gate = _gate(dev, 7)
    gp = (gate["A_log"], gate["dt_bias"], gate["lower_bound"])
    S0 = torch.randn(1, H, K, K, device=dev) * 0.3
    outs = [torch.empty(1, 1024, H, K, device=dev, dtype=BF) for _ in range(2)]
    finals = [torch.empty(1, H, K, K, device=dev) for _ in range(2)]
    spaces = _two_shards(x, gp, S0, bounds, outs, finals)  # plans, workspaces, warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _two_shards(x, gp, S0, bounds, outs, finals, spaces)
    for seed in (8, 9):
        for t, new in zip(x, _tokens(T, dev, seed), strict=True):
            t.copy_(new)
        for o in outs + finals:
            o.fill_(float("nan"))
        graph.replay()
        got = [o.clone() for o in outs + finals]
        eo = [torch.empty_like(o) for o in outs]
        ef = [torch.empty_like(f) for f in finals]
        _two_shards(x, gp, S0, bounds, eo, ef)
        kda_cute.check_errors(sync=True)
        for a, b in zip(got, eo + ef, strict=True):
            assert torch.isfinite(a.float()).all() and torch.equal(a, b)
