"""Context parallelism's float64 model (kda_cute.context_reference), on the CPU: the shards a
batch splits into, the pieces' summaries, the entry states, and the whole sharded forward
against the float64 token loop; then the exchange itself over torch.distributed (gloo, several
processes), each rank holding only its shard and the gathered summaries."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kda_cute import context_reference as cp
from kda_cute.reference import kda_reference, preprocess
from kda_cute.testing import packed_batch

H, K, V = 2, 16, 8
GATE = dict(A_log=torch.tensor([0.3, -0.2]), dt_bias=torch.linspace(-1, 1, H * K),
            lower_bound=-5.0, gate="bounded")


def _batch(lens, seed=0):
    return packed_batch(lens, H, K, V, seed)


def test_split_covers_the_tokens_in_aligned_shards():
    cu = [0, 100, 130, 700, 701]
    for ranks in (1, 2, 3, 4, 8):
        shards = cp.split(cu, ranks, align=64)
        assert [s.rank for s in shards] == list(range(ranks))
        assert shards[0].start == 0 and shards[-1].end == 701
        for a, b in zip(shards, shards[1:], strict=False):
            assert a.end == b.start and (a.end % 64 == 0 or a.end == 701)
            # a piece goes on exactly where the next non-empty rank picks it up
        for sh in shards:
            assert sh.cu[0] == 0 and sh.cu[-1] == sh.end - sh.start
            assert len(sh.cu) == len(sh.seqs) + 1
            assert all(x < y for x, y in zip(sh.cu, sh.cu[1:], strict=False))
        held = [(n, sh.start + sh.cu[i], sh.start + sh.cu[i + 1])
                for sh in shards for i, n in enumerate(sh.seqs)]
        for n in range(4):  # every sequence's tokens exactly once, in order
            pieces = [(a, b) for m, a, b in held if m == n]
            assert pieces[0][0] == cu[n] and pieces[-1][1] == cu[n + 1]
            assert all(p[1] == q[0] for p, q in zip(pieces, pieces[1:], strict=False))
    two = cp.split(cu, 2, align=64)
    assert two[0].end == 384 and two[0].carry_out and two[1].carry_in
    assert two[0].seqs == (0, 1, 2) and two[1].seqs == (2, 3) and not two[1].carry_out
    with pytest.raises(ValueError, match="ranks"):
        cp.split(cu, 0)


def test_summary_is_the_affine_map_of_the_run():
    q, k, v, g, beta, cu, S0 = _batch([40])
    qn, kn, a, b = preprocess(q, k, g, beta, dtype=torch.float64, **GATE)
    A, B = cp.summary(kn, v.double(), a, b)
    _, S = kda_reference(q, k, v, g, beta, initial_state=S0, **GATE)
    assert torch.allclose(S[0], S0[0] @ A + B, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("lens, ranks", [([700], 2), ([700], 5), ([100, 30, 570, 1], 3),
                                         ([64, 64, 64], 3), ([300, 5, 300], 8)])
@pytest.mark.parametrize("lower_bound", [-5.0, -0.02], ids=["fast", "slow"])
def test_sharded_forward_is_the_token_loop(lens, ranks, lower_bound):
    """Slowly decaying states carry the initial state and every earlier rank's tokens to the
    last rank, so each entry state counts there."""
    gate = {**GATE, "lower_bound": lower_bound}
    q, k, v, g, beta, cu, S0 = _batch(lens, seed=ranks)
    o, S = cp.forward(q, k, v, g, beta, cu, ranks, initial_state=S0, align=32, **gate)
    o_ref, S_ref = kda_reference(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu, **gate)
    assert torch.allclose(o, o_ref, rtol=1e-9, atol=1e-11)
    assert torch.allclose(S, S_ref, rtol=1e-9, atol=1e-11)


def test_a_wrong_summary_changes_the_later_ranks():
    """The entry states depend on every earlier rank's summary (a test that could not fail
    otherwise): a perturbed summary moves the states of the ranks after it."""
    q, k, v, g, beta, cu, S0 = _batch([96], seed=3)
    shards = cp.split(cu, 3, align=32)
    slow = {**GATE, "lower_bound": -0.1}  # a state that remembers across a rank's tokens
    qn, kn, a, b = preprocess(q, k, g, beta, dtype=torch.float64, **slow)
    sums = []
    for sh in shards:
        sl = slice(sh.start + sh.cu[-2], sh.end)
        sums.append(cp.summary(kn[:, sl], v.double()[:, sl], a[:, sl], b[:, sl])
                    if sh.carry_out else None)
    good = cp.entry_states(shards, sums, S0)
    A, B = sums[0]
    d = torch.full_like(B, 1e-3)
    bad = cp.entry_states(shards, [(A, B + d), *sums[1:]], S0)
    assert good[0] is None and torch.allclose(bad[1] - good[1], d, rtol=1e-9, atol=0)
    # carried through rank 1's transition
    moved = bad[2] - good[2]
    assert moved.abs().max() > 0
    assert torch.allclose(moved, d @ sums[1][0], rtol=1e-6, atol=1e-15)


def _rank_main(rank, world, port, lens, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        q, k, v, g, beta, cu, S0 = _batch(lens, seed=11)
        shards = cp.split(cu, world, align=32)
        sh = shards[rank]
        qn, kn, a, b = preprocess(q, k, g, beta, dtype=torch.float64, **GATE)
        vv = v.double()
        # this rank's summary of its last piece (identity / zero where it goes on nowhere):
        # one fixed-size message a rank
        A = torch.eye(K, dtype=torch.float64).expand(H, K, K).clone()
        B = torch.zeros(H, V, K, dtype=torch.float64)
        if sh.carry_out:
            sl = slice(sh.start + sh.cu[-2], sh.end)
            A, B = cp.summary(kn[:, sl], vv[:, sl], a[:, sl], b[:, sl])
        As = [torch.empty_like(A) for _ in range(world)]
        Bs = [torch.empty_like(B) for _ in range(world)]
        dist.all_gather(As, A)
        dist.all_gather(Bs, B)
        sums = [(As[r], Bs[r]) if shards[r].carry_out else None for r in range(world)]
        entry = cp.entry_states(shards, sums, S0)[rank]
        from kda_cute.reference import _token_loop
        outs = []
        for i, n in enumerate(sh.seqs):
            sl = slice(sh.start + sh.cu[i], sh.start + sh.cu[i + 1])
            start = entry if i == 0 and sh.carry_in else S0[n]
            o, S = _token_loop(qn[:, sl], kn[:, sl], vv[:, sl], a[:, sl], b[:, sl],
                               start[None], K ** -0.5)
            outs.append(o)
        o = torch.cat(outs, 1) if outs else torch.zeros(1, 0, H, V, dtype=torch.float64)
        torch.save({"rank": rank, "out": o}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_the_exchange_over_gloo(tmp_path, world):
    """`world` processes, each its shard alone: its summary all-gathered, its entry state
    composed, its outputs the float64 token loop's for its tokens."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lens = [150, 20, 300, 7]
    mp.start_processes(_rank_main, args=(world, port, lens, str(tmp_path)), nprocs=world,
                       join=True, start_method="spawn")
    q, k, v, g, beta, cu, S0 = _batch(lens, seed=11)
    o_ref, _ = kda_reference(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu, **GATE)
    got = torch.cat([torch.load(tmp_path / f"rank{r}.pt")["out"] for r in range(world)], 1)
    assert torch.allclose(got, o_ref, rtol=1e-9, atol=1e-11)
