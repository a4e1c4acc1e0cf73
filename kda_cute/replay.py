"""Replay-style serving: a pool of checkpoints and a ring of the tokens since each slot's
checkpoint, so that a decode step reads the checkpoint and the ring instead of reading and
writing the whole state (kda_cute.specs.replay has the math; docs/serving.md the engines'
calls beside these).

- `new_ring(state, entries)`: the ring of a pool (`Ring`, a mapping of its tensors: pass it
  as `**ring`);
- `replay_decode`: a token a row; appends (k, u, G) at the row's cursor, or, at cursor
  c >= window - 1, folds the ring into the checkpoint (cursor 0);
- `replay_verify`: 1 to 16 drafts a row, output-only: their entries go past the cursor, which
  does not move; the checkpoint is not written;
- `replay_commit`: each row's cursor moved over its accepted drafts (the next decode folds
  when the window is past full);
- `replay_flush`: each row's ring folded into its checkpoint (cursor 0): before a prefix-cache
  boundary, and before the prefill (kda_cute.fwd's pool form) reads and writes the slot.

Each call checks its arguments' metadata on the host (no sync) -> a replay plan
(kda_cute.plans.replay) -> one kernel launch, as the serving calls (kda_cute.serving): slot
indices int32 or int64, an index < 0 padding (null_slot=0: 0 too), bad slots, cursors and
counts reported by the kernels and raised by the next call or `check_errors`, grids that depend
on shapes only (CUDA graphs replay with changing indices, cursors and counts), bind=True for a
Bound. Head dims K = V = 128.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from . import declare, errors, serving
from .checks import flag
from .checks import replay as replay_checks
from .plans import device_info
from .plans.replay import replay_plan
from .problem import ReplayCall
from .serving import _addresses, _again, _aligned, _launch
from .specs.replay import ReplayConfig

_HOST = ("config", "stream", "bind")
_RING_WRITES = ("ring_k", "ring_r", "ring_u", "ring_g", "cursor", "tickets")


@dataclass
class Ring(Mapping):
    """A pool's ring, a (slot, head) L entries: keys [slots, H, L, K] bf16 as given, their
    inverse norms [slots, H, L] fp32, corrections u [slots, H, L, V] fp16 or fp32, running
    log-decays G [slots, H, L, K] fp32; cursors [slots] int32 (the live entries), tickets
    [slots] int32 (zeros between calls). A mapping of the calls' argument names: `**ring`."""

    ring_k: Tensor
    ring_r: Tensor
    ring_u: Tensor
    ring_g: Tensor
    cursor: Tensor
    tickets: Tensor

    def __getitem__(self, name):
        if name not in _RING_WRITES:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self):
        return iter(_RING_WRITES)

    def __len__(self) -> int:
        return len(_RING_WRITES)

    @property
    def entries(self) -> int:
        return self.ring_k.shape[2]


def new_ring(state: Tensor, entries: int = 16, u_dtype: torch.dtype = torch.float16) -> Ring:
    """The empty ring (cursors 0) of the pool `state` [slots, H, V, K]: `entries` (8, 16 or
    32) a (slot, head), at least the window plus a verify's drafts."""
    if not isinstance(state, Tensor) or state.dim() != 4:
        raise ValueError(f"state: expected a pool [slots, H, V, K], got "
                         f"{getattr(state, 'shape', type(state).__name__)}")
    if entries not in (8, 16, 32):
        raise ValueError(f"entries: expected 8, 16 or 32, got {entries!r}")
    if u_dtype not in (torch.float16, torch.float32):
        raise ValueError(f"u_dtype: expected torch.float16 or torch.float32, got {u_dtype}")
    P, H, V, K = state.shape
    d, L = state.device, entries
    z = torch.zeros
    return Ring(z(P, H, L, K, dtype=torch.bfloat16, device=d), z(P, H, L, device=d),
                z(P, H, L, V, dtype=u_dtype, device=d), z(P, H, L, K, device=d),
                z(P, dtype=torch.int32, device=d), z(P, dtype=torch.int32, device=d))


def _entry(kind: str, check, tensors: tuple, scalars: tuple, out=None, like=None):
    """serving._entry with the replay plan."""
    return serving._entry(kind, check, tensors, scalars, out, like,
                          lambda c, dev: _plan(kind, c, dev))


def _plan(kind: str, c, dev):
    """The call's plan, from what its checks concluded; the arguments behind its error words
    noted for their reports."""
    plan = replay_plan(c.problem, c.options, device_info(dev))
    errors.note(dev, kind, c.names)
    return plan


def _ring_aligned(ring_k, ring_r, ring_u, ring_g) -> None:
    _aligned(("ring_k", ring_k), ("ring_r", ring_r), ("ring_u", ring_u), ("ring_g", ring_g))


@declare.op("replay_decode", writes=("state", "out", *_RING_WRITES), host_only=_HOST,
            out_like="v", returns="out")
def replay_decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                  ring_k: Tensor, ring_r: Tensor, ring_u: Tensor, ring_g: Tensor,
                  cursor: Tensor, tickets: Tensor, state_indices: Tensor | None = None, *,
                  window: int | None = None, out: Tensor | None = None,
                  A_log: Tensor | None = None, dt_bias: Tensor | None = None,
                  scale: float | None = None, lower_bound: float | None = None,
                  gate: str = "bounded", qk_l2norm: bool = True, beta_sigmoid: bool = True,
                  null_slot: int | None = None, config: ReplayConfig | None = None,
                  stream=None, bind: bool = False):
    """One token a row against the checkpoints `state` [slots, H, V, K] (fp32 or bf16) and
    their ring (`**ring`); returns `out`.

    q, k, g [B, 1, H, K] or [B, H, K] bf16, v, beta, out as kda_cute.decode; state_indices [B]
    (None: row n uses slot n). Row n at its slot's cursor c: below window - 1 its token's
    (k, u, G) go to entry c and the cursor to c + 1; from window - 1 (window: None, the
    ring's entries) the state after its token is written as the slot's checkpoint and the
    cursor goes to 0. A cursor outside [0, entries) is reported (state_indices) and its row is
    padding. Gate options, null_slot, stream and bind as kda_cute.decode."""
    if bind.__class__ is not bool:
        bind = flag("bind", bind)
    ring = (ring_k, ring_r, ring_u, ring_g, cursor, tickets)
    tensors = (q, k, v, g, beta, state, *ring, state_indices, out, A_log, dt_bias)
    plan, scale, lb, again, out = _entry(
        "replay_decode", replay_checks.decode, tensors,
        (window, scale, lower_bound, gate, qk_l2norm, beta_sigmoid, null_slot, config), out, v)
    if plan is not None and not bind:
        addresses = _addresses(*tensors[:13], out, A_log, dt_bias)
        if _again(again, addresses, q.device, stream):
            return out
    _aligned(("q", q), ("k", k), ("v", v), ("g", g), ("out", out), ("state", state))
    _ring_aligned(ring_k, ring_r, ring_u, ring_g)
    if plan is None:  # a dry run: its checks only
        return out
    # (the write slot is the read one: a fold writes the checkpoint back)
    call = ReplayCall(q, k, v, g, beta, out, A_log, dt_bias, state, state, None, state_indices,
                      state_indices, None, None, None, scale, lb, *ring)
    keep = None if bind else (again, addresses)
    return _launch(plan, call, q.device, stream, bind, keep, out)


@declare.op("replay_verify", writes=("out", "ring_k", "ring_r", "ring_u", "ring_g"),
            host_only=_HOST, out_like="v", returns="out")
def replay_verify(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                  ring_k: Tensor, ring_r: Tensor, ring_u: Tensor, ring_g: Tensor,
                  cursor: Tensor, tickets: Tensor, state_indices: Tensor, *,
                  cu_seqlens: Tensor | None = None, out: Tensor | None = None,
                  A_log: Tensor | None = None, dt_bias: Tensor | None = None,
                  scale: float | None = None, lower_bound: float | None = None,
                  gate: str = "bounded", qk_l2norm: bool = True, beta_sigmoid: bool = True,
                  null_slot: int | None = None, config: ReplayConfig | None = None,
                  stream=None, bind: bool = False):
    """Output-only verify of 1 to 16 drafts a row; returns `out`.

    Tokens [N, T, H, K] (T <= 16), or packed [1, T, H, K] / [T, H, K] with cu_seqlens [N+1]
    (ragged rows of 0 to 16 drafts). Row n reads its slot state_indices[n]'s checkpoint and
    its c live entries, runs its drafts from there and writes their outputs and their entries
    at c, c + 1, ...; the checkpoint and the cursor are not written (replay_commit moves the
    cursor over the accepted ones). A row whose drafts would pass the ring's entries is
    reported and is padding (zero outputs)."""
    if bind.__class__ is not bool:
        bind = flag("bind", bind)
    ring = (ring_k, ring_r, ring_u, ring_g, cursor, tickets)
    tensors = (q, k, v, g, beta, state, *ring, state_indices, cu_seqlens, out, A_log, dt_bias)
    plan, scale, lb, again, out = _entry(
        "replay_verify", replay_checks.verify, tensors,
        (scale, lower_bound, gate, qk_l2norm, beta_sigmoid, null_slot, config), out, v)
    if plan is not None and not bind:
        addresses = _addresses(*tensors[:14], out, A_log, dt_bias)
        if _again(again, addresses, q.device, stream):
            return out
    _aligned(("q", q), ("k", k), ("v", v), ("g", g), ("out", out), ("state", state))
    _ring_aligned(ring_k, ring_r, ring_u, ring_g)
    if plan is None:
        return out
    call = ReplayCall(q, k, v, g, beta, out, A_log, dt_bias, state, state, cu_seqlens,
                      state_indices, None, None, None, None, scale, lb, *ring)
    keep = None if bind else (again, addresses)
    return _launch(plan, call, q.device, stream, bind, keep, out)


@declare.op("replay_commit", writes=("cursor",), host_only=_HOST, returns="cursor")
def replay_commit(ring_k: Tensor, ring_r: Tensor, ring_u: Tensor, ring_g: Tensor,
                  cursor: Tensor, tickets: Tensor, state_indices: Tensor,
                  num_accepted_tokens: Tensor, *, null_slot: int | None = None,
                  config: ReplayConfig | None = None, stream=None, bind: bool = False):
    """After replay_verify: cursor[state_indices[n]] += num_accepted_tokens[n] ([N] int32 or
    int64), in place; returns `cursor`. A count below 0, or one that would move the cursor
    past entries - 1, is reported (num_accepted_tokens) and that cursor stays; padding rows
    are skipped. No state is touched: the next replay_decode folds if the window is past
    full."""
    if bind.__class__ is not bool:
        bind = flag("bind", bind)
    tensors = (ring_k, ring_r, ring_u, ring_g, cursor, tickets, state_indices,
               num_accepted_tokens)
    plan, _, _, again, _ = _entry("replay_commit", replay_checks.commit, tensors,
                                  (null_slot, config))
    if plan is not None and not bind:
        addresses = _addresses(*tensors)
        if _again(again, addresses, cursor.device, stream):
            return cursor
    if plan is None:
        return cursor
    # a commit reads no state: its pool is the cursors' stand-in (the call's device)
    call = ReplayCall(None, None, None, None, None, None, None, None, cursor, None, None,
                      state_indices, None, num_accepted_tokens, None, None, 1.0, None,
                      *tensors[:6])
    keep = None if bind else (again, addresses)
    return _launch(plan, call, cursor.device, stream, bind, keep, cursor)


@declare.op("replay_flush", writes=("state", "cursor", "tickets"), host_only=_HOST,
            returns="state")
def replay_flush(state: Tensor, ring_k: Tensor, ring_r: Tensor, ring_u: Tensor,
                 ring_g: Tensor, cursor: Tensor, tickets: Tensor, state_indices: Tensor, *,
                 null_slot: int | None = None, config: ReplayConfig | None = None,
                 stream=None, bind: bool = False):
    """Each row's ring folded into its checkpoint: state[state_indices[n]] becomes the slot's
    state after its live entries and its cursor 0; rows of an empty ring and padding rows are
    untouched. In place; returns `state`."""
    if bind.__class__ is not bool:
        bind = flag("bind", bind)
    tensors = (state, ring_k, ring_r, ring_u, ring_g, cursor, tickets, state_indices)
    plan, _, _, again, _ = _entry("replay_flush", replay_checks.flush, tensors,
                                  (null_slot, config))
    if plan is not None and not bind:
        addresses = _addresses(*tensors)
        if _again(again, addresses, state.device, stream):
            return state
    _aligned(("state", state))
    _ring_aligned(ring_k, ring_r, ring_u, ring_g)
    if plan is None:
        return state
    call = ReplayCall(None, None, None, None, None, None, None, None, state, state, None,
                      state_indices, None, None, None, None, 1.0, None, *tensors[1:7])
    keep = None if bind else (again, addresses)
    return _launch(plan, call, state.device, stream, bind, keep, state)


__all__ = ["Ring", "new_ring", "replay_commit", "replay_decode", "replay_flush",
           "replay_verify"]
