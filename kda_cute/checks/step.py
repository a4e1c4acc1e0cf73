"""A serving step's checks (decode, verify, commit, the dense token-by-token forward): the
arguments' metadata, on the host, no sync, to the StepProblem the step's plan is made from
(kda_cute.plans.step), its options and scalars. Each raises ValueError / TypeError naming the
argument the caller passed. Values the host cannot see without a sync (indices, lengths,
counts) are checked by the kernel (kda_cute.errors)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..ladder import config_for
from ..problem import StepAccepted as Accepted
from ..problem import StepNulls as Nulls
from ..problem import StepOptions, StepProblem, TokenStrides
from ..problem import StepParent as Parent
from ..problem import StepRead as Read
from ..problem import StepWords as Words
from ..problem import StepWrite as Write
from ..specs.step import (
    E_ACCEPTED,
    E_CU,
    E_CU_ROWS,
    E_PARENT,
    E_READ,
    E_WRITE,
    STEP_GATES,
    WRITE_ALL,
    WRITE_LAST,
    WRITE_NONE,
    WRITE_START,
    StepConfig,
)
from .base import (
    INDEX_DTYPES,
    POOL_DTYPES,
    _dtype_name,
    err,
    flag,
    flags,
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

BF16 = torch.bfloat16
ROW_DIV = 8  # token strides in elements (abi.SYM_DIV of sQ .. sO)
_NO_ACCEPTED = Accepted(0, acc_wide=0, acc_base=1, acc_skip=0, max_sel=1)
_NO_PARENT = Parent(0, p_sn=0, p_st=0, p_wide=0)


class Checked(NamedTuple):
    """What a step's checks conclude: its problem and options (its plan's key), the scale and
    lower bound as floats, and the out to write (the caller's, or one the checks allocated;
    None for a commit)."""

    problem: StepProblem
    options: StepOptions
    scale: float
    lower_bound: float | None
    out: torch.Tensor | None = None
    names: tuple = ()  # (error word, the argument behind it)s: kda_cute.errors.note


def _checked(p: StepProblem, opts: StepOptions, dev, scale, lb, out=None, what: str = "q",
             **names) -> Checked:
    """The step's config (the ladder's, or a given one that fits) and device, then its
    record; `names`: the tables the caller passed for the read / write slots, the accepted
    counts, the parents and the offsets (None: not given)."""
    config_for(p, opts)
    on_cuda(dev, what)
    words = {"cu": (E_CU, E_CU_ROWS), "accepted": (E_ACCEPTED,), "read": (E_READ,),
             "write": (E_WRITE,), "parent": (E_PARENT,)}
    named = tuple((i, arg) for role, arg in names.items() if arg is not None
                  for i in words[role])
    return Checked(p, opts, scale, lb, out, named)


def _given(name: str, t) -> str | None:
    return None if t is None else name


def token_rows(name, t, D, H=None, dev=None):
    """A token tensor [B, T, H, D] or [R, H, D]: (rows, token stride). With T == 1 the rows are
    the batch; rows may be strided views of one buffer (mixed_qkv)."""
    tensor(name, t, (BF16,), None, dev)
    if t.dim() not in (3, 4) or t.shape[-1] != D or (H is not None and t.shape[-2] != H):
        want = f"[B, T, {H if H is not None else 'H'}, {D}] or [T, H, {D}]"
        raise err(name, f"shape {want}", tuple(t.shape))
    h = t.shape[-2]
    if t.stride(-1) != 1 or (h > 1 and t.stride(-2) != D):
        raise err(name, f"the last two dims contiguous (strides (..., {D}, 1))",
                  f"strides {tuple(t.stride())}")
    if t.dim() == 4:
        B, T = t.shape[0], t.shape[1]
        if T == 1:
            rows, stride = B, t.stride(0)
        else:
            rows, stride = B * T, t.stride(1)
            if B > 1 and t.stride(0) != T * t.stride(1):
                raise err(name, "batch stride == T * token stride", f"strides {tuple(t.stride())}")
    else:
        rows, stride = t.shape[0], t.stride(0)
    if rows <= 1:
        stride = max(stride, h * D) + (-max(stride, h * D)) % ROW_DIV
    if rows > 1 and stride < h * D:
        raise err(name, f"a token stride >= H*D = {h * D} (rows must not overlap)",
                  f"strides {tuple(t.stride())}")
    if stride % ROW_DIV:
        raise err(name, f"a token stride that is a multiple of {ROW_DIV} elements", stride)
    return rows, stride


def _beta(t, rows, lead, H, dev):
    tensor("beta", t, (BF16,), None, dev, (*lead, H))
    if H > 1 and t.stride(-1) != 1:
        raise err("beta", "heads contiguous", f"strides {tuple(t.stride())}")
    if t.dim() == 3 and t.shape[1] == 1:
        return t.stride(0)
    if t.dim() == 3 and t.shape[0] > 1 and t.stride(0) != t.shape[1] * t.stride(1):
        raise err("beta", "batch stride == T * token stride", f"strides {tuple(t.stride())}")
    s = t.stride(-2)
    if rows > 1 and s < H:
        raise err("beta", f"a token stride >= H = {H}", f"strides {tuple(t.stride())}")
    return s if rows > 1 else H


def step_options(gate, qk_l2norm, beta_sigmoid, config) -> StepOptions:
    if not isinstance(gate, str) or gate not in STEP_GATES:
        raise err("gate", f"one of {sorted(STEP_GATES)}", repr(gate))
    if config is not None and not isinstance(config, StepConfig):
        raise TypeError(f"config: expected a StepConfig or None, got {type(config).__name__}")
    return StepOptions(gate, flag("qk_l2norm", qk_l2norm),
                       flag("beta_sigmoid", beta_sigmoid), config)


class _Tokens:
    """The checked token tensors of a decode / verify call."""

    def __init__(self, q, k, v, g, beta, out):
        tensor("q", q, (BF16,))
        self.dev = dev = q.device
        H, K = q.shape[-2], q.shape[-1]
        self.rows, sq = token_rows("q", q, K, None, dev)
        sk_sg = []
        for name, t in (("k", k), ("g", g)):
            sk_sg.append(token_rows(name, t, K, H, dev)[1])
            if tuple(t.shape) != tuple(q.shape):
                raise err(name, f"shape {tuple(q.shape)}", tuple(t.shape))
        tensor("v", v, (BF16,), q.dim(), dev)
        if tuple(v.shape[:-1]) != tuple(q.shape[:-1]):
            raise err("v", f"shape {(*q.shape[:-1], 'V')}", tuple(v.shape))
        V = v.shape[-1]
        _, sv = token_rows("v", v, V, H, dev)
        sb = _beta(beta, self.rows, tuple(q.shape[:-2]), H, dev)
        if out is None:
            out = torch.empty(v.shape, dtype=BF16, device=dev)
        else:
            tensor("out", out, (BF16,), None, dev)
            if tuple(out.shape) != tuple(v.shape) and tuple(out.shape) != (self.rows, H * V):
                raise err("out", f"shape {tuple(v.shape)} or {(self.rows, H * V)} (packed)",
                          tuple(out.shape))
        if out.dim() == 2:  # packed rows [T, H*V]
            if out.stride(1) != 1 or (self.rows > 1 and out.stride(0) < H * V) or \
                    out.stride(0) % ROW_DIV:
                raise err("out", f"rows of H*V = {H * V} contiguous elements, a row stride "
                          f"that is a multiple of {ROW_DIV}", f"strides {tuple(out.stride())}")
            so = out.stride(0) if self.rows > 1 else H * V + (-H * V) % ROW_DIV
        else:
            _, so = token_rows("out", out, V, H, dev)
        self.H, self.K, self.V = H, K, V
        self.strides = TokenStrides(sq, *sk_sg, sv, so, sb)
        self.out = out


def _scratch(inter, state, H, V, K, dev):
    """The verify scratch [R, S_max, H, V, K] in the pool's dtype: (R, S_max, its step stride);
    its rows are read and written as R * S_max state rows."""
    pool("intermediate_states", inter, H, V, K, dev, ndim=5)
    if inter.dtype != state.dtype:
        raise err("intermediate_states", f"the pool's dtype {_dtype_name(state.dtype)}",
                  _dtype_name(inter.dtype))
    R, S_max = inter.shape[:2]
    if R > 1 and inter.stride(0) != S_max * inter.stride(1):
        raise err("intermediate_states", "row stride == S_max * step stride",
                  f"strides {tuple(inter.stride())}")
    return R, S_max, inter.stride(1) if S_max > 1 or R > 1 else H * V * K


def _scratch_rows(intermediate_state_indices, R: int, N: int, dev) -> tuple:
    """The scratch row table's strides: intermediate_state_indices [N], or without it row n
    for sequence n (the launcher's ramp: stride 1), which needs R >= N rows."""
    if intermediate_state_indices is not None:
        return _index("intermediate_state_indices", intermediate_state_indices, (N,), dev)
    if R < N:
        raise err("intermediate_states", f"at least N = {N} rows without "
                  "intermediate_state_indices", R)
    return (1,)


def _cu(cu_seqlens, dev):
    tensor("cu_seqlens", cu_seqlens, INDEX_DTYPES, 1, dev)
    if cu_seqlens.numel() < 1 or not cu_seqlens.is_contiguous():
        raise err("cu_seqlens", "a contiguous tensor of N+1 >= 1 offsets",
                  f"shape {tuple(cu_seqlens.shape)}")
    return cu_seqlens.numel() - 1


def _seqs(q, cu_seqlens, dev, n: str) -> tuple[int, int]:
    """(sequences, tokens per row): cu_seqlens' N and -1 (packed rows, batch size 1), or
    q [n, T, H, K]'s."""
    if cu_seqlens is not None:
        N = _cu(cu_seqlens, dev)
        if q.dim() == 4 and q.shape[0] != 1:
            raise err("q", "batch size 1 when cu_seqlens is given", tuple(q.shape))
        return N, -1
    if q.dim() != 4:
        raise err("q", f"[{n}, T, H, K] without cu_seqlens", tuple(q.shape))
    return q.shape[0], q.shape[1]


def verify_style(ssm_state_indices, num_accepted_tokens, state_indices, intermediate_states,
                 retrieve_parent_token, intermediate_state_indices=None) -> str:
    """Which verify style the arguments ask for, "a" (ssm_state_indices) or "b" (state_indices
    with intermediate_states), or ValueError naming what mixes or lacks them."""
    if ssm_state_indices is not None:
        if state_indices is not None or intermediate_states is not None:
            raise err("ssm_state_indices", "not together with state_indices / "
                      "intermediate_states (two verify styles)", "both")
        if intermediate_state_indices is not None:
            raise err("intermediate_state_indices", "None in style a (ssm_state_indices)",
                      type(intermediate_state_indices).__name__)
        if retrieve_parent_token is not None:
            raise err("retrieve_parent_token", "tree drafts with intermediate_states (style b)",
                      "ssm_state_indices")
        return "a"
    if state_indices is None or intermediate_states is None:
        raise err("ssm_state_indices", "given (style a), or state_indices with "
                  "intermediate_states (style b)", None)
    if num_accepted_tokens is not None:
        raise err("num_accepted_tokens", "None in style b (commit takes the accepted step)",
                  "a tensor")
    return "b"


def decode(q, k, v, g, beta, state, state_indices, out, output_state_indices,
                 has_initial_state, A_log, dt_bias, scale, lower_bound, gate, qk_l2norm,
                 beta_sigmoid, null_slot, config):
    """decode's checks."""
    opts = step_options(gate, qk_l2norm, beta_sigmoid, config)
    tk = _Tokens(q, k, v, g, beta, out)
    dev, H, K, V, B = tk.dev, tk.H, tk.K, tk.V, tk.rows
    if q.dim() == 4 and q.shape[1] != 1:
        raise err("q", "one token per row ([B, 1, H, K]); see verify for more", tuple(q.shape))
    ss = pool("state", state, H, V, K, dev)
    null = _null(null_slot)
    # an absent table is the launcher's ramp 0, 1, ..: stride 1
    r = _index("state_indices", state_indices, (B,), dev) if state_indices is not None else (1,)
    wi = output_state_indices if output_state_indices is not None else state_indices
    w = _index("output_state_indices", wi, (B,), dev) if output_state_indices is not None else r
    if has_initial_state is not None:
        flags("has_initial_state", has_initial_state, B, dev)
    a, b = gate_params(A_log, dt_bias, opts.gate, H, K, dev)
    scale, lb = scalars(scale, lower_bound, opts.gate, K)
    if state_indices is None and state.shape[0] < B:
        raise err("state", f"at least B = {B} slots without state_indices", state.shape[0])
    p = StepProblem(
        "decode", B, B, H, K, V, _dtype_name(state.dtype), state.shape[0], ss, state.shape[0],
        ss, tk.strides, 1, False, 1,
        Read(1, r_sn=r[0], r_st=0, r_wide=_wide(state_indices), r_mul=1, r_add=0), _NO_ACCEPTED,
        has_initial_state is not None,
        Write(WRITE_LAST, w_sn=w[0], w_st=0, w_wide=_wide(wi), w_mul=1, w_add=0), _NO_PARENT,
        Nulls(r_null=null, w_null=null), a, b,
        Words(NCU=0, NRI=_words(state_indices), NWI=_words(wi), NAC=0, NPA=0,
              NHI=0 if has_initial_state is None else B))
    return _checked(p, opts, dev, scale, lb, tk.out, read=_given("state_indices", state_indices),
                    write=_given("output_state_indices", output_state_indices)
                    or _given("state_indices", state_indices))


def verify(q, k, v, g, beta, state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                 state_indices, intermediate_states, intermediate_state_indices,
                 retrieve_parent_token, out, A_log, dt_bias, scale, lower_bound, gate,
                 qk_l2norm, beta_sigmoid, null_slot, config):
    """verify's checks (either style)."""
    opts = step_options(gate, qk_l2norm, beta_sigmoid, config)
    tk = _Tokens(q, k, v, g, beta, out)
    dev, H, K, V = tk.dev, tk.H, tk.K, tk.V
    ss = pool("state", state, H, V, K, dev)
    null = _null(null_slot)
    N, fixed = _seqs(q, cu_seqlens, dev, "N")
    par = _NO_PARENT
    npa = 0
    if verify_style(ssm_state_indices, num_accepted_tokens, state_indices,
                    intermediate_states, retrieve_parent_token,
                    intermediate_state_indices) == "a":
        st = _index("ssm_state_indices", ssm_state_indices, (N, None), dev)
        S1 = ssm_state_indices.shape[1]
        if fixed > S1:
            raise err("q", f"at most {S1} tokens per row (ssm_state_indices' entries)", fixed)
        # the start slot: entry num_accepted_tokens[n] - 1 of the row's (entry 0 without)
        acc = Accepted(0, acc_wide=0, acc_base=1, acc_skip=0, max_sel=S1)
        if num_accepted_tokens is not None:
            _index("num_accepted_tokens", num_accepted_tokens, (N,), dev)
            acc = acc._replace(acc_on=1, acc_wide=_wide(num_accepted_tokens))
        wide = _wide(ssm_state_indices)
        read = Read(1, r_sn=st[0], r_st=st[1], r_wide=wide, r_mul=1, r_add=0)
        write = Write(WRITE_ALL, w_sn=st[0], w_st=st[1], w_wide=wide, w_mul=1, w_add=0)
        ds, drows, form = ss, state.shape[0], "verify"
        ridx = widx = ssm_state_indices
        max_tokens, nulls = S1, Nulls(r_null=null, w_null=null)
        names = dict(read="ssm_state_indices", write="ssm_state_indices",
                     accepted=_given("num_accepted_tokens", num_accepted_tokens))
    else:
        r = _index("state_indices", state_indices, (N,), dev)
        R, S_max, ds = _scratch(intermediate_states, state, H, V, K, dev)
        if fixed > S_max:
            raise err("q", f"at most {S_max} tokens per row (intermediate_states' steps)", fixed)
        w = _scratch_rows(intermediate_state_indices, R, N, dev)
        max_tokens = S_max
        if retrieve_parent_token is not None:
            pt = _index("retrieve_parent_token", retrieve_parent_token, (N, None), dev)
            max_tokens = min(S_max, retrieve_parent_token.shape[1])
            if fixed > retrieve_parent_token.shape[1]:
                raise err("retrieve_parent_token", f"at least {fixed} entries per row",
                          tuple(retrieve_parent_token.shape))
            par = Parent(1, p_sn=pt[0], p_st=pt[1], p_wide=_wide(retrieve_parent_token))
            npa = _words(retrieve_parent_token)
        acc = _NO_ACCEPTED
        read = Read(1, r_sn=r[0], r_st=0, r_wide=_wide(state_indices), r_mul=1, r_add=0)
        # the scratch row of token t: index * S_max + t
        write = Write(WRITE_ALL, w_sn=w[0], w_st=0, w_wide=_wide(intermediate_state_indices),
                      w_mul=S_max, w_add=1)
        drows, form = R * S_max, "verify scratch"
        ridx, widx = state_indices, intermediate_state_indices
        nulls = Nulls(r_null=null, w_null=0)
        names = dict(read="state_indices",
                     write=_given("intermediate_state_indices", intermediate_state_indices),
                     parent=_given("retrieve_parent_token", retrieve_parent_token))
    a, b = gate_params(A_log, dt_bias, opts.gate, H, K, dev)
    scale, lb = scalars(scale, lower_bound, opts.gate, K)
    p = StepProblem(
        form, N, tk.rows, H, K, V, _dtype_name(state.dtype), state.shape[0], ss, drows, ds,
        tk.strides, fixed, _wide(cu_seqlens) == 1, max_tokens, read, acc, False, write, par,
        nulls, a, b, Words(NCU=_words(cu_seqlens), NRI=_words(ridx), NWI=_words(widx),
                           NAC=_words(num_accepted_tokens), NPA=npa, NHI=0))
    return _checked(p, opts, dev, scale, lb, tk.out, cu=_given("cu_seqlens", cu_seqlens),
                    **names)


def commit(state, intermediate_states, state_indices, accepted_step,
                 intermediate_state_indices, null_slot):
    """commit's checks."""
    tensor("state", state, POOL_DTYPES)
    dev = state.device
    if state.dim() != 4:
        raise err("state", "a pool [slots, H, V, K]", tuple(state.shape))
    H, V, K = state.shape[1:]
    ss = pool("state", state, H, V, K, dev)
    R, S_max, ds = _scratch(intermediate_states, state, H, V, K, dev)
    w = _index("state_indices", state_indices, (None,), dev)
    N = state_indices.shape[0]
    _index("accepted_step", accepted_step, (N,), dev)
    r = _scratch_rows(intermediate_state_indices, R, N, dev)
    null = _null(null_slot)
    p = StepProblem(
        "commit", N, 0, H, K, V, _dtype_name(state.dtype), R * S_max, ds, state.shape[0], ss,
        TokenStrides(H * K, H * K, H * K, H * V, H * V, H), 0, False, 0,
        # the scratch row of the accepted step: index * S_max + step
        Read(1, r_sn=r[0], r_st=0, r_wide=_wide(intermediate_state_indices), r_mul=S_max,
             r_add=1),
        Accepted(1, acc_wide=_wide(accepted_step), acc_base=0, acc_skip=1, max_sel=S_max), False,
        Write(WRITE_START, w_sn=w[0], w_st=0, w_wide=_wide(state_indices), w_mul=1, w_add=0),
        _NO_PARENT, Nulls(r_null=0, w_null=null), False, False,
        Words(NCU=0, NRI=_words(intermediate_state_indices), NWI=_words(state_indices),
              NAC=_words(accepted_step), NPA=0, NHI=0))
    return _checked(p, StepOptions(gate="none"), dev, 1.0, None, what="state",
                    accepted="accepted_step", write="state_indices",
                    read=_given("intermediate_state_indices", intermediate_state_indices))


def recurrent(q, k, v, g, beta, initial_state, final_state, cu_seqlens, out, A_log, dt_bias,
              scale, lower_bound, gate, qk_l2norm, beta_sigmoid, config):
    """recurrent's checks (the out allocated where the caller passed none)."""
    opts = step_options(gate, qk_l2norm, beta_sigmoid, config)
    tk = _Tokens(q, k, v, g, beta, out)
    dev, H, K, V = tk.dev, tk.H, tk.K, tk.V
    N, fixed = _seqs(q, cu_seqlens, dev, "B")
    dt = None
    slot_strides = {}
    for name, t in (("initial_state", initial_state), ("final_state", final_state)):
        if t is None:
            continue
        slot_strides[name] = pool(name, t, H, V, K, dev)
        if t.shape[0] != N:
            raise err(name, f"[N={N}, H, V, K]", tuple(t.shape))
        if dt is not None and t.dtype != dt:
            raise err(name, f"the dtype of initial_state ({_dtype_name(dt)})",
                      _dtype_name(t.dtype))
        dt = t.dtype
    a, b = gate_params(A_log, dt_bias, opts.gate, H, K, dev)
    scale, lb = scalars(scale, lower_bound, opts.gate, K)
    pdt = "bfloat16" if dt == torch.bfloat16 else "float32"
    s0s, s1s = (slot_strides.get(n, H * V * K) for n in ("initial_state", "final_state"))
    n0 = N if initial_state is not None else 0
    n1 = N if final_state is not None else 0
    p = StepProblem(
        "recurrent", N, tk.rows, H, K, V, pdt, n0, s0s, n1, s1s, tk.strides, fixed,
        _wide(cu_seqlens) == 1, 2 ** 31 - 1,
        Read(int(n0 > 0), r_sn=1, r_st=0, r_wide=0, r_mul=1, r_add=0), _NO_ACCEPTED, False,
        Write(WRITE_LAST if n1 else WRITE_NONE, w_sn=1, w_st=0, w_wide=0, w_mul=1, w_add=0),
        _NO_PARENT, Nulls(r_null=0, w_null=0), a, b, Words(_words(cu_seqlens), 0, 0, 0, 0, 0))
    return _checked(p, opts, dev, scale, lb, tk.out, cu=_given("cu_seqlens", cu_seqlens))
