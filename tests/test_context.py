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


def _in_turn(shards, **kw):
    """kda_cute.distributed.shard_steps of every rank in turn on one device: each rank's
    message, their concatenation (the all-gather's result), each rank finished from it."""
    steps = [kd.shard_steps(*args, rank=r, **kw, **own) for r, (args, own) in enumerate(shards)]
    gathered = torch.cat([next(s) for s in steps])
    for s in steps:
        with pytest.raises(StopIteration):
            s.send(gathered)


def _bits(t):
    return t.view(torch.int32 if t.dtype == F32 else torch.int16)


@pytest.mark.gpu
@pytest.mark.parametrize("ranks, dtype", [(2, F32), (3, F32), (3, BF)])
def test_pool_form_in_turn(ranks, dtype):
    """A packed batch (a padding sequence among them) split over `ranks` shards in the pool
    form, each rank its own copy of the pool in which the slots it must not read hold NaN:
    the rank holding a sequence's first token reads its slot, the one holding its last writes
    it, nothing else is read or written. Bit for bit the dense form's run from the slots'
    states (the same shards in turn), and the float64 loop's."""
    from kda_cute import context_reference as cp
    dev = "cuda"
    lens = [700, 1500, 96, 1800]
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    T = cu[-1]
    x = _tokens(T, dev, ranks)
    gate = _gate(dev, ranks)
    gp = (gate["A_log"], gate["dt_bias"], gate["lower_bound"])
    slots = torch.tensor([5, 2, -1, 7], device=dev)  # sequence 2 padding
    pool = torch.randn(9, H, K, K, device=dev).mul_(0.3).to(dtype)
    init = torch.where((slots >= 0).view(-1, 1, 1, 1), pool[slots.clamp(min=0)].float(), 0.0)
    shards = cp.split(cu, ranks, align=64)
    first = {n: min(r for r, sh in enumerate(shards) if n in sh.seqs) for n in range(len(lens))}
    last = {n: max(r for r, sh in enumerate(shards) if n in sh.seqs) for n in range(len(lens))}
    pools, work, dense = [], [], []
    for r, sh in enumerate(shards):
        mine = pool.clone()
        for n in range(len(lens)):  # a slot this rank must not read: poisoned
            if slots[n] >= 0 and first[n] != r:
                mine[slots[n]] = float("nan")
        seqs = list(sh.seqs)
        toks = [t[:, sh.start:sh.end] for t in x]
        lcu = torch.tensor(sh.cu, dtype=torch.int32, device=dev)
        pools.append(mine)
        flags = dict(carry_in=sh.carry_in, carry_out=sh.carry_out)
        work.append(((*toks, SCALE, torch.full_like(toks[2], float("nan")), *gp, mine, mine,
                      lcu), dict(flags, state_indices=slots[seqs].to(torch.int32))))
        dense.append(((*toks, SCALE, torch.full_like(toks[2], float("nan")), *gp,
                       init[seqs].clone(), torch.empty(len(seqs), H, K, K, device=dev), lcu),
                      flags))
    before = [p.clone() for p in pools]
    _in_turn(work)
    _in_turn(dense)
    kda_cute.check_errors(sync=True)
    live = torch.cat([torch.arange(cu[n], cu[n + 1]) for n in range(len(lens)) if slots[n] >= 0])
    out = torch.cat([w[0][6] for w in work], dim=1)
    assert torch.equal(out[:, live], torch.cat([w[0][6] for w in dense], dim=1)[:, live])
    for n, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        r = last[n]
        want = dense[r][0][11][list(shards[r].seqs).index(n)].to(dtype)
        assert torch.equal(_bits(pools[r][s]), _bits(want)), n
        for o in range(ranks):  # every other rank's copy of the slot untouched
            if o != r:
                assert torch.equal(_bits(pools[o][s]), _bits(before[o][s])), (n, o)
    untouched = [s for s in range(9) if s not in slots.tolist()]
    for r in range(ranks):
        assert torch.equal(_bits(pools[r][untouched]), _bits(before[r][untouched]))
    ref_o, ref_s = kda_reference(*(t.cpu() for t in x), scale=SCALE, initial_state=init.cpu(),
                                 A_log=gp[0].cpu(), dt_bias=gp[1].cpu(), lower_bound=gp[2],
                                 cu_seqlens=torch.tensor(cu))
    assert rel_err(out[:, live].cpu(), ref_o[:, live]) < OUT_TOL
    for n in (n for n in range(len(lens)) if first[n] < last[n]):  # over several ranks
        assert rel_err(pools[last[n]][slots[n]].float().cpu(), ref_s[n]) < (
            STATE_TOL if dtype == F32 else 1e-2), n
    assert any(first[n] < last[n] for n in range(len(lens)))


@pytest.mark.gpu
@pytest.mark.parametrize("ranks, form", [(2, "every"), (4, "every"), (3, "offsets")])
def test_checkpoints_on_absolute_positions(ranks, form):
    """One sequence over `ranks` fixed-length shards, checkpoints on positions counted from the
    sequence's start (every 512 from 300, so mid-chunk; or given offsets), each rank writing
    those in its shard into its own slots: every checkpoint written once, equal to the one-GPU
    forward's (1e-5) and the float64 loop's state at that position; the outputs and the final
    state as the one-GPU forward's."""
    dev, T, E, F = "cuda", 4096, 512, 300
    x = _tokens(T, dev, 10 + ranks)
    gate = _gate(dev, ranks)
    gp = (gate["A_log"], gate["dt_bias"], gate["lower_bound"])
    S0 = torch.randn(1, H, K, K, device=dev) * 0.3
    marks = (list(range(F, T + 1, E)) if form == "every"
             else [1, 63, 64, 1000, 1025, 2047, 3001, 4096])
    bounds = [T * r // ranks // 64 * 64 for r in range(ranks)] + [T]
    M = len(marks)
    ck = torch.full((M + 1, H, K, K), float("nan"), device=dev)
    work = []
    for r in range(ranks):
        a, b = bounds[r], bounds[r + 1]
        own = [i for i, m in enumerate(marks) if a < m <= b]
        kw = dict(carry_in=r > 0, position=a, checkpoint_state=ck)
        if form == "every":
            kw.update(checkpoint_every=E, checkpoint_first=torch.tensor([F], device=dev),
                      checkpoint_slots=torch.tensor([own + [-1]], dtype=torch.int32,
                                                    device=dev))
        else:  # every mark to every rank: those in its shard written, at their columns
            kw.update(checkpoint_offsets=torch.tensor([marks], device=dev),
                      checkpoint_state=torch.full((1, M, H, K, K), float("nan"), device=dev))
        toks = [t[:, a:b] for t in x]
        out = torch.full_like(toks[2], float("nan"))
        work.append(((*toks, SCALE, out, *gp, S0 if r == 0 else S0.clone(),
                      torch.empty(1, H, K, K, device=dev)), kw))
    _in_turn(work)
    kda_cute.check_errors(sync=True)
    out = torch.cat([w[0][6] for w in work], dim=1)
    final = work[-1][0][-1]
    if form == "offsets":  # mark i from the rank whose shard holds it; NaN elsewhere
        got = torch.full((M, H, K, K), float("nan"), device=dev)
        for r, (_, kw) in enumerate(work):
            mine = kw["checkpoint_state"][0]
            for i, m in enumerate(marks):
                if bounds[r] < m <= bounds[r + 1]:
                    got[i] = mine[i]
                else:
                    assert torch.isnan(mine[i]).all(), (r, m)
    else:
        got = ck[:M]
    one_o, one_s = torch.empty_like(x[2]), torch.empty(1, H, K, K, device=dev)
    one_ck = torch.full((1, M, H, K, K), float("nan"), device=dev)
    kda_cute.fwd(*x, SCALE, one_o, *gp, S0.clone(), one_s, checkpoint_state=one_ck,
                 checkpoint_offsets=torch.tensor([marks], device=dev))
    torch.cuda.synchronize()
    assert torch.isfinite(got).all()
    assert rel_err(got, one_ck[0]) < 1e-5
    assert rel_err(out, one_o) < 1e-5 and rel_err(final, one_s) < 1e-5
    if form == "every":
        assert torch.isnan(ck[M]).all()  # the slot past the marks untouched
    xs = [t.cpu() for t in x]
    for i in (0, M // 2, M - 1):
        m = marks[i]
        _, want = kda_reference(*(t[:, :m] for t in xs), scale=SCALE,
                                initial_state=S0.cpu(), A_log=gp[0].cpu(),
                                dt_bias=gp[1].cpu(), lower_bound=gp[2])
        assert rel_err(got[i].cpu(), want[0]) < STATE_TOL, m


@pytest.mark.gpu
def test_pool_form_in_a_cuda_graph():
    """Two ranks' shard_steps in the pool form with checkpoints captured in one CUDA graph,
    replayed with new tokens, new slots and a new initial pool written into the captured
    tensors: bit for bit the eager run's (pools, outputs and checkpoints)."""
    dev, T, E = "cuda", 2048, 256
    x = [t.clone() for t in _tokens(T, dev, 21)]
    gate = _gate(dev, 21)
    gp = (gate["A_log"], gate["dt_bias"], gate["lower_bound"])
    bounds = [0, 1088, T]
    idx = torch.tensor([3], dtype=torch.int32, device=dev)
    ck_slots = [torch.tensor([[0, 1, 2, 3, -1]], dtype=torch.int32, device=dev),
                torch.tensor([[4, 5, 6, 7, -1]], dtype=torch.int32, device=dev)]
    first = torch.tensor([100], device=dev)

    def run(pools, outs, cks):
        work = []
        for r in range(2):
            a, b = bounds[r], bounds[r + 1]
            work.append(((*(t[:, a:b] for t in x), SCALE, outs[r], *gp, pools[r], pools[r]),
                         dict(carry_in=r > 0, carry_out=r == 0, state_indices=idx,
                              position=a, checkpoint_state=cks[r], checkpoint_every=E,
                              checkpoint_first=first, checkpoint_slots=ck_slots[r])))
        _in_turn(work)

    def fresh(seed):
        gen = torch.Generator(device=dev).manual_seed(seed)
        p = torch.randn(6, H, K, K, generator=gen, device=dev) * 0.3
        return ([p.clone(), p.clone()],
                [torch.full((1, b - a, H, K), float("nan"), device=dev, dtype=BF)
                 for a, b in zip(bounds, bounds[1:], strict=False)],
                [torch.full((9, H, K, K), float("nan"), device=dev) for _ in range(2)])

    pools, outs, cks = fresh(1)
    run(pools, outs, cks)  # plans, warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(pools, outs, cks)
    for seed, slot in ((2, 5), (3, 0)):
        for t, new in zip(x, _tokens(T, dev, seed), strict=True):
            t.copy_(new)
        idx.fill_(slot)
        p2, o2, c2 = fresh(seed)
        for a, b in zip(pools + outs + cks, p2 + o2 + c2, strict=True):
            a.copy_(b)
        graph.replay()
        got = [t.clone() for t in pools + outs + cks]
        run(p2, o2, c2)
        kda_cute.check_errors(sync=True)
        assert torch.isfinite(got[1][slot]).all() and torch.isfinite(got[2].float()).all()
        for a, b in zip(got, p2 + o2 + c2, strict=True):
            assert torch.equal(_bits(a) if a.dtype == F32 else a, _bits(b) if b.dtype == F32
                               else b)


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 3])
def test_varlen_checkpoints_in_turn(ranks):
    """A packed batch over `ranks` shards with checkpoints every 256 tokens from 100 of each
    sequence (mid-chunk), every piece writing those in it into its rank's own pool (NaN
    elsewhere): each checkpoint written once, by the rank holding its position, equal to the
    float64 loop's state there; the outputs and final states as the float64 loop's."""
    from kda_cute import context_reference as cp
    dev, E, F = "cuda", 256, 100
    lens = [1300, 2500, 800]
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    x = _tokens(cu[-1], dev, 30 + ranks)
    gate = _gate(dev, ranks)
    gp = (gate["A_log"], gate["dt_bias"], gate["lower_bound"])
    S0 = torch.randn(len(lens), H, K, K, device=dev) * 0.3
    marks = {n: list(range(F, lens[n] + 1, E)) for n in range(len(lens))}
    slot = {}
    for n in range(len(lens)):
        for i in range(len(marks[n])):
            slot[n, i] = len(slot)
    shards = cp.split(cu, ranks, align=64)
    work = []
    for sh in shards:
        rows = []
        for j, n in enumerate(sh.seqs):
            a = sh.start - cu[n] if j == 0 and sh.carry_in else 0  # the piece's offset
            b = min(sh.end, cu[n + 1]) - cu[n]
            rows.append([slot[n, i] for i, m in enumerate(marks[n]) if a < m <= b])
        M = max(1, *(len(r) for r in rows))
        table = torch.tensor([r + [-1] * (M - len(r)) for r in rows], dtype=torch.int32,
                             device=dev)
        toks = [t[:, sh.start:sh.end] for t in x]
        seqs = list(sh.seqs)
        work.append(((*toks, SCALE, torch.full_like(toks[2], float("nan")), *gp,
                      S0[seqs].clone(), torch.empty(len(seqs), H, K, K, device=dev),
                      torch.tensor(sh.cu, dtype=torch.int32, device=dev)),
                     dict(carry_in=sh.carry_in,
                          position=sh.start - cu[seqs[0]] if sh.carry_in else 0,
                          checkpoint_state=torch.full((len(slot), H, K, K), float("nan"),
                                                      device=dev),
                          checkpoint_every=E, checkpoint_slots=table,
                          checkpoint_first=torch.full((len(seqs),), F, device=dev))))
    _in_turn(work)
    kda_cute.check_errors(sync=True)
    got = torch.full((len(slot), H, K, K), float("nan"))
    for (n, i), s in slot.items():
        m = cu[n] + marks[n][i]
        r = next(r for r, sh in enumerate(shards) if sh.start < m <= sh.end)
        got[s] = work[r][1]["checkpoint_state"][s].cpu()
        for o in range(ranks):  # written by that rank alone
            if o != r:
                assert torch.isnan(work[o][1]["checkpoint_state"][s]).all(), (n, i, o)
    xs = [t.cpu() for t in x]
    for (n, i), s in slot.items():
        a, m = cu[n], cu[n] + marks[n][i]
        _, want = kda_reference(*(t[:, a:m] for t in xs), scale=SCALE,
                                initial_state=S0[n:n + 1].cpu(), A_log=gp[0].cpu(),
                                dt_bias=gp[1].cpu(), lower_bound=gp[2])
        assert rel_err(got[s], want[0]) < STATE_TOL, (n, i)
    out = torch.cat([w[0][6] for w in work], dim=1)
    ref_o, ref_s = kda_reference(*xs, scale=SCALE, initial_state=S0.cpu(), A_log=gp[0].cpu(),
                                 dt_bias=gp[1].cpu(), lower_bound=gp[2],
                                 cu_seqlens=torch.tensor(cu))
    assert rel_err(out.cpu(), ref_o) < OUT_TOL
    for n in range(len(lens)):
        r = max(r for r, sh in enumerate(shards) if n in sh.seqs)
        final = work[r][0][11][list(shards[r].seqs).index(n)]
        assert rel_err(final.cpu(), ref_s[n]) < STATE_TOL, n


@pytest.mark.parametrize("arg", ["q", "v", "cu_seqlens"])
def test_bad_shapes_source_is_named(arg):
    """q, v and cu_seqlens, whose shapes size the summary's outputs, are checked first."""
    q, k, v, g, beta = _tokens(64, "cpu", 0)
    a = {"q": q, "v": v, "cu_seqlens": None, arg: "bad"}
    good = torch.zeros(1, H, K, K)
    with pytest.raises((ValueError, TypeError), match=arg):
        context_summary(a["q"], k, a["v"], g, beta, SCALE, None, None, -5.0, good, good,
                        a["cu_seqlens"])
    with pytest.raises((ValueError, TypeError), match=arg):
        context_finish(a["q"], k, a["v"], g, beta, SCALE, torch.empty_like(v), None, None,
                       -5.0, good, good, a["cu_seqlens"],
                       workspace=torch.empty(0, dtype=torch.uint8))
