"""Context parallelism's arithmetic in float64 (the model its kernels and the distributed helper
are tested against): a batch of sequences packed along T, split into R contiguous shards of
tokens, one a rank.

A token maps the state affinely, S -> S A_t + b_t v_t kn_t^T with A_t = diag(e^(a_t))
(I - b_t kn_t kn_t^T) (K x K, acting on the key side of S [V, K]), so a run of tokens does too:
S -> S A + B. A rank whose last piece of tokens continues a sequence on the next rank summarises
that piece from a zero entry (its transition A [H, K, K] and bias B [H, V, K]); the summaries
are all-gathered (a fixed size a rank, independent of the shard's length); each rank composes
the entry state of its first piece from the pieces of that sequence on the ranks before it
(the first of them from the sequence's initial state), then runs its shard from there. Every
other piece is a whole sequence inside one rank and needs nothing from the others.

- `split`: the shards of a batch (`Shard`: its token range, its pieces as local cu_seqlens, the
  sequence its first piece continues and whether its last piece goes on).
- `summary`: a piece's (A, B) from a zero entry.
- `entry_states`: each rank's entry state of its first piece from every rank's summary.
- `forward`: the whole model, shard by shard; equal to kda_cute.reference.kda_reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import _token_loop, preprocess


@dataclass(frozen=True)
class Shard:
    """Rank r's tokens [start, end) of the packed batch: its pieces' local offsets (cu,
    from 0 to end - start), each piece's sequence (seqs), whether its first piece continues a
    sequence begun on an earlier rank (carry_in) and whether its last piece goes on to a later
    one (carry_out)."""
    rank: int
    start: int
    end: int
    cu: tuple[int, ...]
    seqs: tuple[int, ...]
    carry_in: bool
    carry_out: bool


def split(cu_seqlens, ranks: int, align: int = 64) -> list[Shard]:
    """`ranks` contiguous shards of the tokens of a batch packed by cu_seqlens (a sequence of
    N + 1 offsets), their boundaries multiples of `align` tokens (the last at the end), as even
    as that allows; a shard may hold no token."""
    cu = [int(x) for x in cu_seqlens]
    T = cu[-1]
    if ranks < 1:
        raise ValueError(f"ranks: expected >= 1, got {ranks}")
    bounds = [0] + [min(T, -(-(T * r // ranks) // align) * align) for r in range(1, ranks)] + [T]
    shards = []
    for r in range(ranks):
        s, e = bounds[r], bounds[r + 1]
        pieces, seqs = [0], []
        for n in range(len(cu) - 1):
            a, b = max(cu[n], s), min(cu[n + 1], e)
            if a < b:
                pieces.append(b - s)
                seqs.append(n)
        carry_in = bool(seqs) and cu[seqs[0]] < s
        carry_out = bool(seqs) and cu[seqs[-1] + 1] > e
        shards.append(Shard(r, s, e, tuple(pieces), tuple(seqs), carry_in, carry_out))
    return shards


def _prepared(q, k, v, g, beta, gate: dict):
    """Per token (qn, kn, a, b) float64 and v float64, [1, T, H, *]."""
    qn, kn, a, b = preprocess(q, k, g, beta, dtype=torch.float64, **gate)
    return qn, kn, v.to(torch.float64), a, b


def summary(kn, v, a, b):
    """A run of tokens' affine map from a zero entry: kn, a [1, L, H, K], v [1, L, H, V],
    b [1, L, H] (float64) -> (A [H, K, K], B [H, V, K]) with exit = entry A + B."""
    H, K = kn.shape[2], kn.shape[3]
    A = torch.eye(K, dtype=torch.float64).expand(H, K, K).clone()
    B = torch.zeros(H, v.shape[-1], K, dtype=torch.float64)
    for t in range(kn.shape[1]):
        k = kn[0, t]
        eye = torch.eye(K, dtype=torch.float64)
        At = torch.exp(a[0, t])[:, :, None] * (
            eye - b[0, t, :, None, None] * k[:, :, None] * k[:, None, :])
        A = A @ At
        B = B @ At + b[0, t, :, None, None] * v[0, t, :, :, None] * k[:, None, :]
    return A, B


def forward(q, k, v, g, beta, cu_seqlens, ranks: int, *, initial_state=None, scale=None,
            align: int = 64, **gate):
    """The batch (q, k, g [1, T, H, K], v [1, T, H, V], beta [1, T, H]) run as `ranks` shards:
    each rank's summary, the entry states, each shard from them. Returns (out [1, T, H, V],
    final states [N, H, V, K], float64), as kda_reference's."""
    K = q.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    qn, kn, vv, a, b = _prepared(q, k, v, g, beta, gate)
    shards = split(cu_seqlens, ranks, align)
    cu = [int(x) for x in cu_seqlens]
    N, H, V = len(cu) - 1, q.shape[2], v.shape[-1]
    S0 = torch.zeros(N, H, V, K, dtype=torch.float64) if initial_state is None else \
        initial_state.to(torch.float64)
    summaries = []
    for sh in shards:  # the last piece's summary where it goes on (its own tokens only)
        if sh.carry_out:
            t0 = sh.start + sh.cu[-2]
            sl = slice(t0, sh.end)
            summaries.append(summary(kn[:, sl], vv[:, sl], a[:, sl], b[:, sl]))
        else:
            summaries.append(None)
    entries = entry_states(shards, summaries, S0)
    out = torch.zeros(1, cu[-1], H, V, dtype=torch.float64)
    final = S0.clone()
    for sh, entry in zip(shards, entries, strict=True):
        for i, n in enumerate(sh.seqs):
            t0, t1 = sh.start + sh.cu[i], sh.start + sh.cu[i + 1]
            start = entry if i == 0 and sh.carry_in else S0[n]
            sl = slice(t0, t1)
            o, S = _token_loop(qn[:, sl], kn[:, sl], vv[:, sl], a[:, sl], b[:, sl], start[None],
                               scale)
            out[:, sl] = o
            final[n] = S[0]
    return out, final


def entry_states(shards: list[Shard], summaries: list, S0) -> list:
    """Each rank's entry state [H, V, K] for its first piece (None where that piece begins its
    sequence): the sequence's initial state (S0 [N, H, V, K]) through the summary of each
    earlier rank's last piece, which is that sequence's (summaries[r]: rank r's (A, B), None
    where its last piece goes on nowhere)."""
    out = []
    for sh in shards:
        if not sh.carry_in:
            out.append(None)
            continue
        n = sh.seqs[0]
        S = S0[n].clone()
        for prev in shards[:sh.rank]:
            if prev.seqs and prev.seqs[-1] == n:
                A, B = summaries[prev.rank]
                S = S @ A + B
        out.append(S)
    return out
