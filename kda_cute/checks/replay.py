"""The replay calls' checks (kda_cute.replay: decode, verify, flush, commit): the token step's
checks for the tokens, pool and tables (kda_cute.checks.step), and the ring's tensors, to a
ReplayProblem (kda_cute.problem) the replay plan is made from. Each raises ValueError /
TypeError naming the argument the caller passed. Values the host cannot see without a sync
(slots, cursors, counts) are checked by the kernels (kda_cute.errors)."""

from __future__ import annotations

import torch

from ..problem import ReplayForm, ReplayProblem, StepOptions, StepProblem, TokenStrides
from ..problem import StepNulls as Nulls
from ..problem import StepRead as Read
from ..problem import StepWords as Words
from ..problem import StepWrite as Write
from ..specs.replay import MAX_DRAFTS, ReplayConfig
from ..specs.replay import supports as replay_supports
from ..specs.step import E_ACCEPTED, E_CU, E_CU_ROWS, E_READ, WRITE_NONE
from ..step_ladder import REPLAY_RINGS, select_replay
from . import step as step_checks
from .base import (
    _dtype_name,
    err,
    gate_params,
    on_cuda,
    pool,
    scalars,
    tensor,
)
from .base import index_table as _index
from .base import index_words as _words
from .base import is_wide as _wide
from .base import null_min as _null

F32, BF16, I32 = torch.float32, torch.bfloat16, torch.int32
U_DTYPES = (torch.float16, torch.float32)
RING = ("ring_k", "ring_r", "ring_u", "ring_g", "cursor", "tickets")


def _entries(name, t, dtypes, slots, H, L, D, dev):
    """A ring tensor [slots, H, L(, D)] of one of `dtypes`, each slot's entries dense (the
    slot stride free: a multiple of 16 bytes, at least a slot's elements): its slot stride."""
    tensor(name, t, dtypes, 3 if D is None else 4, dev)
    inner = (H, L) if D is None else (H, L, D)
    want = (slots, *inner)
    if tuple(t.shape) != want:
        raise err(name, f"shape {want}", tuple(t.shape))
    dense = (L, 1) if D is None else (L * D, D, 1)
    if t.stride()[1:] != dense:
        raise err(name, f"each slot's entries dense (strides (..., {', '.join(map(str, dense))}))",
                  f"strides {tuple(t.stride())}")
    n = H * L * (1 if D is None else D)
    s = t.stride(0) if slots > 1 else n
    div = 16 // t.element_size()
    if s % div or s < n:
        raise err(name, f"a slot stride >= {n} and a multiple of {div} elements", s)
    return s


def ring(ring_k, ring_r, ring_u, ring_g, cursor, tickets, slots, H, K, V, dev):
    """The ring's tensors against a pool of `slots` slots: (its entries L, u's dtype name,
    the slot strides sRK, sRR, sRU, sRG)."""
    tensor("ring_k", ring_k, (BF16,), 4, dev)
    L = ring_k.shape[2]
    if L not in REPLAY_RINGS:
        raise err("ring_k", f"[slots, H, L, K] with L (entries a slot and head) one of "
                  f"{REPLAY_RINGS}", f"shape {tuple(ring_k.shape)}")
    sk = _entries("ring_k", ring_k, (BF16,), slots, H, L, K, dev)
    sr = _entries("ring_r", ring_r, (F32,), slots, H, L, None, dev)
    su = _entries("ring_u", ring_u, U_DTYPES, slots, H, L, V, dev)
    sg = _entries("ring_g", ring_g, (F32,), slots, H, L, K, dev)
    for name, t in (("cursor", cursor), ("tickets", tickets)):
        tensor(name, t, (I32,), 1, dev, (slots,))
        if slots > 1 and t.stride(0) != 1:
            raise err(name, "a contiguous tensor", f"strides {tuple(t.stride())}")
    return L, _dtype_name(ring_u.dtype), sk, sr, su, sg


def window_of(window, L: int) -> int:
    """The window (None: the ring's entries): an int in [1, L]."""
    if window is None:
        return L
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= L:
        raise err("window", f"an int in [1, {L}] (the ring's entries)", repr(window))
    return window


def _config(p: StepProblem, form: ReplayForm, config) -> ReplayConfig:
    """The call's tile: a given ReplayConfig of the call's mode, ring and pool, or REPLAY's."""
    if config is None:
        cfg = select_replay(p.K, p.V, p.pool, form.mode, form.ring,
                            p.max_tokens if form.mode == "verify" else 1)
        if cfg is None:
            raise err("q", "head dims K = V = 128 for the replay calls", f"K={p.K}, V={p.V}")
        return cfg
    if not isinstance(config, ReplayConfig):
        raise TypeError(f"config: expected a ReplayConfig or None, got {type(config).__name__}")
    want = (form.mode, form.ring, form.u_dtype)
    got = (config.mode, config.ring, config.u_dtype)
    if form.mode == "verify" and p.max_tokens > (config.drafts or min(config.ring, 16)):
        raise err("config", f"a verify tile of at least {p.max_tokens} drafts a row",
                  config.name)
    if got != want or (form.mode != "commit" and (
            config.head_dim_k, config.head_dim_v, config.pool) != (p.K, p.V, p.pool)):
        raise err("config", f"a {form.mode} tile of ring {form.ring}, u {form.u_dtype}, "
                  f"({p.K}, {p.V}) and a {p.pool} pool", config.name)
    ok, why = replay_supports(config)
    if not ok:
        raise err("config", "a supported replay tile", why)
    return config


def _done(p: StepProblem, mode: str, ring_t: tuple, window, opts, config, dev, scale, lb,
          out=None, **names):
    """The ReplayProblem and its tile, as step_checks.Checked (problem: a ReplayProblem;
    options: the StepOptions with the tile as config)."""
    L, u, *strides = ring_t
    form = ReplayForm(mode, L, u, window_of(window, L) if mode == "decode" else L, *strides)
    cfg = _config(p, form, config)
    on_cuda(dev, "ring_k")
    words = {"cu": (E_CU,), "rows": (E_CU_ROWS,), "accepted": (E_ACCEPTED,),
             "read": (E_READ,)}
    named = tuple((i, arg) for role, arg in names.items() if arg is not None
                  for i in words[role])
    return step_checks.Checked(ReplayProblem(p, form), StepOptions(
        opts.gate, opts.qk_l2norm, opts.beta_sigmoid, cfg), scale, lb, out, named)


def decode(q, k, v, g, beta, state, ring_k, ring_r, ring_u, ring_g, cursor, tickets,
           state_indices, out, A_log, dt_bias, window, scale, lower_bound, gate, qk_l2norm,
           beta_sigmoid, null_slot, config):
    """replay decode's checks: a token a row, the row's slot read for its checkpoint and ring,
    the checkpoint written where the row folds."""
    c = step_checks.decode(q, k, v, g, beta, state, state_indices, out, None, None, A_log,
                           dt_bias, scale, lower_bound, gate, qk_l2norm, beta_sigmoid,
                           null_slot, None)
    p = c.problem
    rt = ring(ring_k, ring_r, ring_u, ring_g, cursor, tickets, state.shape[0], p.H, p.K, p.V,
              q.device)
    read = "state_indices (or its cursor)" if state_indices is not None else "cursor"
    return _done(p, "decode", rt, window, c.options, config, q.device, c.scale,
                 c.lower_bound, c.out, read=read)


def verify(q, k, v, g, beta, state, ring_k, ring_r, ring_u, ring_g, cursor, tickets,
           state_indices, cu_seqlens, out, A_log, dt_bias, scale, lower_bound, gate,
           qk_l2norm, beta_sigmoid, null_slot, config):
    """replay verify's checks: 1 to 16 drafts a row ([N, T] or packed by cu_seqlens), the
    row's slot read; nothing but the outputs and the ring's entries past the cursor written."""
    opts = step_checks.step_options(gate, qk_l2norm, beta_sigmoid, None)
    tk = step_checks._Tokens(q, k, v, g, beta, out)
    dev, H, K, V = tk.dev, tk.H, tk.K, tk.V
    ss = pool("state", state, H, V, K, dev)
    N, fixed = step_checks._seqs(q, cu_seqlens, dev, "N")
    r = _index("state_indices", state_indices, (N,), dev)
    a, b = gate_params(A_log, dt_bias, opts.gate, H, K, dev)
    scale, lb = scalars(scale, lower_bound, opts.gate, K)
    rt = ring(ring_k, ring_r, ring_u, ring_g, cursor, tickets, state.shape[0], H, K, V, dev)
    most = min(MAX_DRAFTS, rt[0])  # a row's drafts fit the ring past its cursor
    if fixed > most:
        raise err("q", f"at most {most} drafts a row for a ring of {rt[0]} entries", fixed)
    p = StepProblem(
        "verify", N, tk.rows, H, K, V, _dtype_name(state.dtype), state.shape[0], ss,
        state.shape[0], ss, tk.strides, fixed, _wide(cu_seqlens) == 1,
        most if fixed < 0 else fixed,
        Read(1, r_sn=r[0], r_st=0, r_wide=_wide(state_indices), r_mul=1, r_add=0),
        step_checks._NO_ACCEPTED, False,
        Write(WRITE_NONE, w_sn=0, w_st=0, w_wide=0, w_mul=1, w_add=0), step_checks._NO_PARENT,
        Nulls(r_null=_null(null_slot), w_null=0), a, b,
        Words(NCU=_words(cu_seqlens), NRI=_words(state_indices), NWI=0, NAC=0, NPA=0, NHI=0))
    cu = None if cu_seqlens is None else "cu_seqlens"
    return _done(p, "verify", rt, None, opts, config, dev, scale, lb, tk.out, cu=cu,
                 rows=f"{cu or 'q'} (drafts a row: at most {MAX_DRAFTS}, within ring_k's "
                 "entries past the row's cursor)", read="state_indices (or its cursor)")


def _ring_only(mode, state, ring_k, ring_r, ring_u, ring_g, cursor, tickets, state_indices,
               num_accepted_tokens, null_slot, config):
    """flush's and commit's checks: no token; the rows' slots (and a commit's counts)."""
    if mode == "flush":
        tensor("state", state, (F32, BF16))
        if state.dim() != 4:
            raise err("state", "a pool [slots, H, V, K]", tuple(state.shape))
        H, V, K = state.shape[1:]
        ss = pool("state", state, H, V, K, state.device)
        slots, dev, pdt = state.shape[0], state.device, _dtype_name(state.dtype)
    else:  # the ring's own shapes
        tensor("ring_k", ring_k, (BF16,), 4)
        tensor("ring_u", ring_u, U_DTYPES, 4)
        slots, H, _, K = ring_k.shape
        V = ring_u.shape[-1]
        ss, dev, pdt = H * V * K, ring_k.device, "float32"
    rt = ring(ring_k, ring_r, ring_u, ring_g, cursor, tickets, slots, H, K, V, dev)
    r = _index("state_indices", state_indices, (None,), dev)
    N = state_indices.shape[0]
    acc = step_checks._NO_ACCEPTED
    nac = 0
    if mode == "commit":
        _index("num_accepted_tokens", num_accepted_tokens, (N,), dev)
        acc = acc._replace(acc_wide=_wide(num_accepted_tokens))
        nac = _words(num_accepted_tokens)
    p = StepProblem(
        mode, N, 0, H, K, V, pdt, slots, ss, slots, ss,
        TokenStrides(H * K, H * K, H * K, H * V, H * V, H), 1, False, 1,
        Read(1, r_sn=r[0], r_st=0, r_wide=_wide(state_indices), r_mul=1, r_add=0), acc, False,
        Write(WRITE_NONE, w_sn=0, w_st=0, w_wide=0, w_mul=1, w_add=0), step_checks._NO_PARENT,
        Nulls(r_null=_null(null_slot), w_null=0), 0, 0,
        Words(NCU=0, NRI=_words(state_indices), NWI=0, NAC=nac, NPA=0, NHI=0))
    names = dict(read="state_indices (or its cursor)")
    if mode == "commit":
        names["accepted"] = "num_accepted_tokens (the cursor past the ring's entries)"
    return _done(p, mode, rt, None, StepOptions("none"), config, dev, 1.0, None, **names)


def flush(state, ring_k, ring_r, ring_u, ring_g, cursor, tickets, state_indices, null_slot,
          config):
    return _ring_only("flush", state, ring_k, ring_r, ring_u, ring_g, cursor, tickets,
                      state_indices, None, null_slot, config)


def commit(ring_k, ring_r, ring_u, ring_g, cursor, tickets, state_indices,
           num_accepted_tokens, null_slot, config):
    return _ring_only("commit", None, ring_k, ring_r, ring_u, ring_g, cursor, tickets,
                      state_indices, num_accepted_tokens, null_slot, config)
