"""The replay form's semantics in float64 (the model its kernels and calls are tested against):
a checkpoint pool and, per slot, a ring of the tokens since the checkpoint.

A slot's state after its checkpoint S_c and its c ring entries is

    S = S_c diag(e^G) + sum_j u_j (r_j k_j e^(G - G_j))^T

(G the running log-decay since the checkpoint, k_j the key as given, r_j its inverse norm, u_j
its correction), so a token's output and correction come from S_c and the ring without the
state being written. The ring tensors have the kernels' layout (kda_cute.specs.replay.args):
keys [slots, H, L, K], inverse norms [slots, H, L], corrections [slots, H, L, V], log-decays
[slots, H, L, K], cursors [slots]; here all float64 (int64 cursors).

- `decode`: a token a row; at cursor c >= window - 1 the state after it becomes the checkpoint
  (cursor 0), else it is appended at c (cursor c + 1).
- `verify`: T drafts a row, appended at c, c + 1, ..; outputs only (no checkpoint, no cursor).
- `commit`: the cursor moves over the accepted drafts (a fold waits for the next decode).
- `flush`: the checkpoint becomes the state, the ring empty.
A negative slot is a padding row: zero outputs, nothing read or written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import preprocess


@dataclass
class Ring:
    """A ring of `length` entries a (slot, head), float64."""
    k: torch.Tensor
    r: torch.Tensor
    u: torch.Tensor
    g: torch.Tensor
    cursor: torch.Tensor

    @classmethod
    def empty(cls, slots: int, H: int, K: int, V: int, length: int) -> Ring:
        f64 = torch.float64
        return cls(torch.zeros(slots, H, length, K, dtype=f64),
                   torch.zeros(slots, H, length, dtype=f64),
                   torch.zeros(slots, H, length, V, dtype=f64),
                   torch.zeros(slots, H, length, K, dtype=f64),
                   torch.zeros(slots, dtype=torch.int64))


def _keys(ring: Ring, s: int, c: int, G: torch.Tensor) -> torch.Tensor:
    """The c live entries' keys decayed to G: [H, c, K]."""
    return ring.k[s, :, :c] * ring.r[s, :, :c, None] * torch.exp(G[:, None] - ring.g[s, :, :c])


def _last_g(ring: Ring, s: int, c: int) -> torch.Tensor:
    """The running log-decay [H, K] of slot s after its c entries (zeros: none)."""
    return ring.g[s, :, c - 1].clone() if c > 0 else torch.zeros_like(ring.g[s, :, 0])


def _state(state, ring: Ring, s: int, c: int, G: torch.Tensor) -> torch.Tensor:
    """The state [H, V, K] of slot s after its c entries, at running log-decay G [H, K]."""
    S = state[s].to(torch.float64) * torch.exp(G)[:, None, :]
    return S + torch.einsum("hjv,hjk->hvk", ring.u[s, :, :c], _keys(ring, s, c, G))


def _tokens(q, k, g, beta, gate):
    """Per token (qn scaled, kn, a, b) in float64 and k's inverse norms: [N, T, H, *]."""
    K = q.shape[-1]
    scale = gate.pop("scale", None) or K ** -0.5
    qn, kn, a, b = preprocess(q, k, g, beta, **gate)
    r = kn.norm(dim=-1) / k.to(torch.float64).norm(dim=-1)
    return qn * scale, kn, a, b, r


def _step(state, ring: Ring, s: int, c: int, G, qn, kn, v, b):
    """One token at cursor c (G already its running log-decay): (output [H, V], u [H, V])."""
    S = _state(state, ring, s, c, G)
    u = b[:, None] * (v - torch.einsum("hvk,hk->hv", S, kn))
    S = S + u[:, :, None] * kn[:, None, :]
    return torch.einsum("hvk,hk->hv", S, qn), u, S


def _append(ring: Ring, s: int, e: int, k, r, u, G) -> None:
    ring.k[s, :, e] = k.to(torch.float64)
    ring.r[s, :, e] = r
    ring.u[s, :, e] = u
    ring.g[s, :, e] = G


def _run(state, ring: Ring, idx, q, k, v, g, beta, gate, fold_window=None):
    """Every row's tokens from its cursor: with fold_window (decode), the fold at cursor
    >= fold_window - 1; without (verify), drafts appended, nothing else written."""
    N, T, H, _ = q.shape
    qn, kn, a, b, r = _tokens(q, k, g, beta, dict(gate))
    out = torch.zeros(N, T, H, v.shape[-1], dtype=torch.float64)
    L = ring.k.shape[2]
    for n in range(N):
        s = int(idx[n])
        if s < 0:
            continue
        c = int(ring.cursor[s])
        if c < 0 or c >= L or (fold_window is None and c + T > L):
            raise ValueError(f"slot {s}: cursor {c} and {T} tokens do not fit a ring of {L}")
        G = _last_g(ring, s, c)
        for t in range(T):
            G = G + a[n, t]
            o, u, S = _step(state, ring, s, c + t, G, qn[n, t], kn[n, t],
                            v[n, t].to(torch.float64), b[n, t])
            out[n, t] = o
            if fold_window is not None and c + t >= fold_window - 1:
                state[s] = S.to(state.dtype)
                ring.cursor[s] = 0
            else:
                _append(ring, s, c + t, k[n, t], r[n, t], u, G)
                if fold_window is not None:
                    ring.cursor[s] = c + t + 1
    return out


def decode(state, ring: Ring, idx, q, k, v, g, beta, *, window: int, **gate):
    """One token a row (q, k, g [N, 1, H, K], v [N, 1, H, V], beta [N, 1, H]) against the
    checkpoint pool `state` [slots, H, V, K] (written at a fold) and `ring`; returns the
    outputs [N, 1, H, V] float64. gate: preprocess's options and `scale`."""
    return _run(state, ring, idx, q, k, v, g, beta, gate, fold_window=window)


def verify(state, ring: Ring, idx, q, k, v, g, beta, **gate):
    """T drafts a row, appended past each row's cursor; outputs only [N, T, H, V]."""
    return _run(state, ring, idx, q, k, v, g, beta, gate)


def commit(ring: Ring, idx, accepted) -> None:
    """Each row's cursor moved over its accepted drafts."""
    for n, s in enumerate(idx.tolist()):
        if s >= 0:
            ring.cursor[s] += int(accepted[n])


def flush(state, ring: Ring, idx) -> None:
    """Each row's checkpoint becomes its state, its ring empty."""
    for s in idx.tolist():
        if s < 0:
            continue
        c = int(ring.cursor[s])
        state[s] = _state(state, ring, s, c, _last_g(ring, s, c)).to(state.dtype)
        ring.cursor[s] = 0
