"""The replay form's float64 model (kda_cute.replay_reference) against the float64 token loop:
decode through folds, output-only verify, commit as a cursor move with the fold at the next
decode, flush, padding rows. CPU only."""

from __future__ import annotations

import torch

from kda_cute import replay_reference as rr
from kda_cute.reference import kda_reference

H, K, V, L = 2, 8, 6, 8
GATE = dict(lower_bound=-5.0, gate="bounded")


def _inputs(N, T, seed):
    g = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=g).to(torch.bfloat16)

    return dict(q=rnd(N, T, H, K), k=rnd(N, T, H, K), v=rnd(N, T, H, V), g=rnd(N, T, H, K),
                beta=rnd(N, T, H))


def _gate():
    g = torch.Generator().manual_seed(7)
    return dict(GATE, A_log=torch.randn(H, generator=g) * 0.5,
                dt_bias=torch.randn(H * K, generator=g) * 0.5)


def _loop(x, S0, gate, n):
    """The token loop over row n's tokens from state S0 [H, V, K]: (out [T, H, V], state)."""
    out, S = kda_reference(*(x[m][n:n + 1] for m in ("q", "k", "v", "g", "beta")),
                           initial_state=S0[None], **gate)
    return out[0], S[0]


def _close(a, b, tol=1e-12):
    assert (a - b).abs().max() <= tol * max(1.0, b.abs().max()), (a - b).abs().max()


def test_decode_through_folds_is_the_token_loop():
    gate = _gate()
    state = torch.randn(5, H, V, K, dtype=torch.float64)
    S0 = state.clone()
    ring = rr.Ring.empty(5, H, K, V, L)
    idx = torch.tensor([3, -1, 0])
    x = _inputs(3, 11, seed=1)
    window = 4
    for t in range(11):
        step = {m: x[m][:, t:t + 1] for m in x}
        o = rr.decode(state, ring, idx, **step, window=window, **gate)
        assert (o[1] == 0).all()
        for n in (0, 2):
            ref, S = _loop({m: x[m][:, :t + 1] for m in x}, S0[idx[n]], gate, n)
            _close(o[n, 0], ref[t])
            s = int(idx[n])
            assert int(ring.cursor[s]) == (t + 1) % window
            if (t + 1) % window == 0:  # the fold wrote the state after this token
                _close(state[s], S)
    assert torch.equal(state[[1, 2, 4]], S0[[1, 2, 4]])  # slots no row reads


def test_verify_commit_then_decode_folds_past_the_window():
    """Drafts from cursor 2; two of four accepted (commit: cursor 4 >= window - 1); the next
    decode folds the four entries and its token into the checkpoint."""
    gate = _gate()
    state = torch.randn(2, H, V, K, dtype=torch.float64)
    S0 = state.clone()
    ring = rr.Ring.empty(2, H, K, V, L)
    idx = torch.tensor([1])
    first, drafts, after = _inputs(1, 2, 2), _inputs(1, 4, 3), _inputs(1, 1, 4)
    window = 4
    rr.decode(state, ring, idx, **{m: first[m][:, :1] for m in first}, window=window, **gate)
    rr.decode(state, ring, idx, **{m: first[m][:, 1:] for m in first}, window=window, **gate)
    before = state.clone()
    o = rr.verify(state, ring, idx, **drafts, **gate)
    assert torch.equal(state, before) and int(ring.cursor[1]) == 2
    whole = {m: torch.cat([first[m], drafts[m]], 1) for m in first}
    ref, _ = _loop(whole, S0[1], gate, 0)
    _close(o[0], ref[2:])
    rr.commit(ring, idx, torch.tensor([2]))
    assert int(ring.cursor[1]) == 4
    o = rr.decode(state, ring, idx, **after, window=window, **gate)
    seq = {m: torch.cat([first[m], drafts[m][:, :2], after[m]], 1) for m in first}
    ref, S = _loop(seq, S0[1], gate, 0)
    _close(o[0, 0], ref[-1])
    _close(state[1], S)
    assert int(ring.cursor[1]) == 0


def test_flush_makes_the_checkpoint_the_state():
    gate = _gate()
    state = torch.randn(2, H, V, K, dtype=torch.float64)
    S0 = state.clone()
    ring = rr.Ring.empty(2, H, K, V, L)
    idx = torch.tensor([0])
    x = _inputs(1, 3, 5)
    for t in range(3):
        rr.decode(state, ring, idx, **{m: x[m][:, t:t + 1] for m in x}, window=L, **gate)
    rr.flush(state, ring, idx)
    _, S = _loop(x, S0[0], gate, 0)
    _close(state[0], S)
    assert int(ring.cursor[0]) == 0
