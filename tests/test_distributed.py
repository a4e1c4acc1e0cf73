"""kda_cute.distributed's exchange on the CPU: each rank's message from its float64 summaries,
the all-gather over gloo (several processes), and the entry state folded from the messages,
against kda_cute.context_reference's entry states; the fwd's bad arguments."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kda_cute import context_reference as cp
from kda_cute import distributed as kd
from kda_cute.reference import preprocess
from kda_cute.testing import free_port, packed_batch

H, K, V = 2, 16, 16
GATE = dict(A_log=torch.tensor([0.3, -0.2]), dt_bias=torch.linspace(-1, 1, H * K),
            lower_bound=-0.05, gate="bounded")  # slow decays: the chain carries far


def _batch(lens, seed):
    return packed_batch(lens, H, K, V, seed)


def _messages(lens, ranks, seed):
    """Every rank's message as kd.message makes it from the float64 summaries of its pieces,
    and the model's entry states."""
    q, k, v, g, beta, cu, S0 = _batch(lens, seed)
    shards = cp.split(cu, ranks, align=32)
    _, kn, a, b = preprocess(q, k, g, beta, dtype=torch.float64, **GATE)
    vv = v.double()
    msgs = []
    for sh in shards:
        n = len(sh.seqs)
        A = torch.zeros(n, H, K, K, dtype=torch.float64)
        B = torch.zeros(n, H, V, K, dtype=torch.float64)
        for i in range(n):
            sl = slice(sh.start + sh.cu[i], sh.start + sh.cu[i + 1])
            A[i], B[i] = cp.summary(kn[:, sl], vv[:, sl], a[:, sl], b[:, sl])
        init = S0[sh.seqs[-1]] if n else None
        msgs.append(kd.message(A, B, sh.carry_in, n, init))
    sums = []
    for sh in shards:
        if sh.carry_out:
            sl = slice(sh.start + sh.cu[-2], sh.end)
            sums.append(cp.summary(kn[:, sl], vv[:, sl], a[:, sl], b[:, sl]))
        else:
            sums.append(None)
    return shards, msgs, cp.entry_states(shards, sums, S0)


@pytest.mark.parametrize("lens, ranks", [([700], 2), ([700], 5), ([100, 30, 570, 1], 3),
                                         ([64, 64, 64], 3), ([300, 5, 300], 8), ([40], 4)])
def test_entry_from_the_messages(lens, ranks):
    """The fold over the gathered messages gives the model's entry state on every rank whose
    first piece goes on from an earlier rank (through whole-shard middles, past sequences that
    end on a boundary, across empty shards)."""
    shards, msgs, want = _messages(lens, ranks, seed=ranks)
    A, B, fresh = kd.unpack(torch.cat(msgs), ranks, H, V, K)
    for sh in shards:
        if sh.carry_in:
            got = kd.entry_state(A, B, fresh, sh.rank)
            assert torch.allclose(got, want[sh.rank], rtol=1e-9, atol=1e-12), sh.rank


def test_a_fresh_piece_restarts_the_fold():
    """A wrong message before a fresh one leaves the ranks after it untouched; one after it
    moves them (a test that could not fail otherwise)."""
    shards, msgs, want = _messages([100, 600], 4, seed=5)
    A, B, fresh = kd.unpack(torch.cat(msgs), 4, H, V, K)
    last = shards[-1]
    assert last.carry_in
    starts = [sh.rank for sh in shards if sh.rank < last.rank and fresh[sh.rank] == 1]
    before = [r for r in range(last.rank) if r < max(starts)]
    B2 = B.clone()
    B2[before] += 1.0
    assert torch.allclose(kd.entry_state(A, B2, fresh, last.rank), want[last.rank],
                          rtol=1e-9, atol=1e-12)
    B2[max(starts)] += 1.0
    assert not torch.allclose(kd.entry_state(A, B2, fresh, last.rank), want[last.rank])


def _rank_main(rank, world, port, lens, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        shards, msgs, want = _messages(lens, world, seed=world)
        mine = msgs[rank]
        gathered = torch.empty(world * mine.numel(), dtype=mine.dtype)
        dist.all_gather_into_tensor(gathered, mine)
        A, B, fresh = kd.unpack(gathered, world, H, V, K)
        ok = True
        if shards[rank].carry_in:
            ok = torch.allclose(kd.entry_state(A, B, fresh, rank), want[rank], rtol=1e-9,
                                atol=1e-12)
        out[rank] = int(ok)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world, lens", [(2, [700]), (4, [100, 30, 570, 1])])
def test_exchange_over_gloo(world, lens):
    """Each process holds only its shard's summaries; the all-gather of the fixed-size
    messages and the fold give every rank the model's entry state."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as m:
        out = m.dict()
        mp.start_processes(_rank_main, args=(world, free_port(), lens, out), nprocs=world,
                           join=True, start_method="spawn")
        assert dict(out) == {r: 1 for r in range(world)}


def test_bad_carry_in_is_named():
    x = torch.zeros(1, 64, H, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="carry_in"):
        kd.fwd(x, x, x, x, x[..., 0], K ** -0.5, x, None, None, -5.0, None,
               torch.zeros(1, H, V, K), carry_in=1)


@pytest.mark.parametrize("kw, name", [
    (dict(carry_in=True, state_indices=torch.zeros(1, dtype=torch.int32)), "carry_out"),
    (dict(carry_in=False, position=64), "position"),
    (dict(carry_in=True, position=-1), "position"),
    (dict(carry_in=True, position=64.0), "position")])
def test_bad_pool_and_position_are_named(kw, name):
    """The pool form needs carry_out (which rank writes the slot); position is the shard's
    offset in a continued sequence."""
    x = torch.zeros(1, 64, H, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=name):
        kd.fwd(x, x, x, x, x[..., 0], K ** -0.5, x, None, None, -5.0, None,
               torch.zeros(1, H, V, K), **kw)
    with pytest.raises(ValueError, match=name):
        next(kd.shard_steps(x, x, x, x, x[..., 0], K ** -0.5, x, None, None, -5.0, None,
                            torch.zeros(1, H, V, K), rank=0, **kw))


def _pool_case(**over):
    x = torch.zeros(1, 64, H, K, dtype=torch.bfloat16)
    kw = dict(initial_state=torch.zeros(4, H, V, K), final_state=torch.zeros(4, H, V, K),
              state_indices=torch.zeros(1, dtype=torch.int32), carry_in=False, carry_out=False)
    kw.update(over)
    init, final = kw.pop("initial_state"), kw.pop("final_state")
    return (x, x, x, x, x[..., 0], K ** -0.5, x, None, None, -5.0, init, final), kw


@pytest.mark.parametrize("over, name", [
    (dict(initial_state=torch.zeros(4, H, V, K + 1)), "initial_state"),
    (dict(initial_state=torch.zeros(4, H, V, K, dtype=torch.float16)), "initial_state"),
    (dict(initial_state=None), "initial_state"),
    (dict(final_state=torch.zeros(4, H + 1, V, K)), "final_state"),
    (dict(state_indices=torch.zeros(2, dtype=torch.int32)), "state_indices"),
    (dict(state_indices=torch.zeros(1)), "state_indices"),
    (dict(output_state_indices=torch.zeros(3, dtype=torch.int64)), "output_state_indices"),
    (dict(has_initial_state=torch.ones(2, dtype=torch.bool)), "has_initial_state")])
def test_bad_pool_arguments_are_named_before_any_work(over, name):
    """The pool form's pools, index tables and flags are checked as kda_cute.fwd's pool form
    checks them, before the shard's summary runs (here on the CPU, where it could not)."""
    args, kw = _pool_case(**over)
    with pytest.raises((ValueError, TypeError), match=name):
        next(kd.shard_steps(*args, rank=0, **kw))
    with pytest.raises((ValueError, TypeError), match=name):
        kd.fwd(*args, **kw)


@pytest.mark.parametrize("over, name", [
    (dict(q=None), "q"), (dict(q=torch.zeros(64, H, K)), "q"), (dict(v="v"), "v"),
    (dict(cu_seqlens=[0, 64]), "cu_seqlens")])
def test_bad_shard_tensors_are_named(over, name):
    """What the shard's shapes are read from is checked first (a named error, not a crash)."""
    x = torch.zeros(1, 64, H, K, dtype=torch.bfloat16)
    a = {"q": x, "v": x, "cu_seqlens": None, **over}
    args = (a["q"], x, a["v"], x, x[..., 0], K ** -0.5, x, None, None, -5.0, None,
            torch.zeros(1, H, V, K), a["cu_seqlens"])
    with pytest.raises((ValueError, TypeError), match=name):
        next(kd.shard_steps(*args, rank=0, carry_in=False))
    with pytest.raises((ValueError, TypeError), match=name):
        kd.fwd(*args, carry_in=False)
