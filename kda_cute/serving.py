"""Serving against a state pool: `decode`, `verify`, `commit` and fla's `fused_recurrent_kda_fwd`,
each checks (metadata, on the host, no sync) -> a StepProblem -> a step plan -> run, one
token-step kernel launch (kda_cute.plans.step). The contract: docs/serving.md.

The pool is `state[slots, H, V, K]` (fp32 or bf16, the slot stride free, each slot's [H, V, K]
dense). Slot indices are int32 or int64; an index < 0 is padding, and with null_slot=0 index 0
is padding too: a padding row reads and writes no state and its outputs are zeros. Values the
host cannot see without a sync (indices past the pool, offsets out of order, counts out of
range) are never followed: the row is treated as padding and the next serving call on the
device, or `check_errors()`, raises DeviceValueError naming the argument (kda_cute.errors).
Grids depend on shapes only, so a CUDA graph captured once stays correct when the indices,
lengths and counts it reads change between replays.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import declare, errors, launch
from .checks import (
    INDEX_DTYPES,
    POOL_DTYPES,
    _dtype_name,
    err,
    flag,
    flags,
    gate_params,
    has_address,
    tensor,
)
from .checks import index_table as _index
from .checks import index_words as _words
from .checks import is_wide as _wide
from .checks import null_min as _null
from .checks import pool as _pool
from .plans import device_info
from .plans.step import step_config, step_plan
from .problem import StepCall, StepOptions, StepProblem
from .specs.step import (
    STEP_GATES,
    WRITE_ALL,
    WRITE_LAST,
    WRITE_NONE,
    WRITE_START,
    StepConfig,
    supports,
)

BF16 = torch.bfloat16
_HOST = ("config", "stream", "bind")  # what the torch.library ops cannot take
ROW_DIV = 8  # token strides in elements (abi.SYM_DIV of sQ .. sO)


# ------------------------------------------------------------------------------- checks
def _rows(name, t, D, H=None, dev=None):
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
    tensor("beta", t, (BF16,), None, dev)
    if tuple(t.shape) != (*lead, H):
        raise err("beta", f"shape {(*lead, H)}", tuple(t.shape))
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


def _opts(gate, qk_l2norm, beta_sigmoid, config) -> StepOptions:
    if not isinstance(gate, str) or gate not in STEP_GATES:
        raise err("gate", f"one of {sorted(STEP_GATES)}", repr(gate))
    if config is not None and not isinstance(config, StepConfig):
        raise TypeError(f"config: expected a StepConfig or None, got {type(config).__name__}")
    return StepOptions(gate, flag("qk_l2norm", qk_l2norm),
                       flag("beta_sigmoid", beta_sigmoid), config)


def _scalars(scale, lower_bound, gate, K):
    if scale is None:
        scale = K ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0 \
            or scale == float("inf"):
        raise err("scale", "a finite positive float", repr(scale))
    if gate == "bounded":
        if not isinstance(lower_bound, (int, float)) or not -5.0 <= lower_bound < 0.0:
            raise err("lower_bound", "a float in [-5, 0) for the bounded gate", repr(lower_bound))
    elif lower_bound is not None and (isinstance(lower_bound, bool)
                                      or not isinstance(lower_bound, (int, float))):
        raise err("lower_bound", "a float or None", repr(lower_bound))
    return float(scale), (float(lower_bound) if lower_bound is not None else None)


class _Tokens:
    """The checked token tensors of a decode / verify call."""

    def __init__(self, q, k, v, g, beta, out):
        tensor("q", q, (BF16,))
        self.dev = dev = q.device
        H, K = q.shape[-2], q.shape[-1]
        self.rows, sq = _rows("q", q, K, None, dev)
        sk_sg = []
        for name, t in (("k", k), ("g", g)):
            sk_sg.append(_rows(name, t, K, H, dev)[1])
            if tuple(t.shape) != tuple(q.shape):
                raise err(name, f"shape {tuple(q.shape)}", tuple(t.shape))
        tensor("v", v, (BF16,), q.dim(), dev)
        if tuple(v.shape[:-1]) != tuple(q.shape[:-1]):
            raise err("v", f"shape {(*q.shape[:-1], 'V')}", tuple(v.shape))
        V = v.shape[-1]
        _, sv = _rows("v", v, V, H, dev)
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
            _, so = _rows("out", out, V, H, dev)
        self.H, self.K, self.V = H, K, V
        self.strides = (sq, *sk_sg, sv, so, sb)
        self.out = out


def _config(p: StepProblem, opts: StepOptions):
    cfg = step_config(p, opts)
    if cfg is None:
        raise err("q/state", "head dims K == V in (64, 128, 256) with an fp32 or bf16 pool",
                  f"K={p.K}, V={p.V}, pool {p.pool}")
    ok, why = supports(cfg)
    if not ok or (cfg.head_dim_k, cfg.head_dim_v, cfg.pool) != (p.K, p.V, p.pool):
        raise err("config", f"a StepConfig for K={p.K}, V={p.V}, pool {p.pool}",
                  why or cfg.name)
    return cfg


def _planned(p: StepProblem, opts: StepOptions, dev, what="q"):
    """The step's plan, once its config and device are checked (a dry run: the checks alone,
    no plan, no device query)."""
    _config(p, opts)
    if dev.type != "cuda":
        raise err(what, "a CUDA tensor", f"one on {dev}")
    return None if declare.dry() else step_plan(p, opts, device_info(dev))


def _scratch(inter, state, H, V, K, dev):
    """The verify scratch [R, S_max, H, V, K] in the pool's dtype: (R, S_max, its step stride);
    its rows are read and written as R * S_max state rows."""
    _pool("intermediate_states", inter, H, V, K, dev, ndim=5)
    if inter.dtype != state.dtype:
        raise err("intermediate_states", f"the pool's dtype {_dtype_name(state.dtype)}",
                  _dtype_name(inter.dtype))
    R, S_max = inter.shape[:2]
    if R > 1 and inter.stride(0) != S_max * inter.stride(1):
        raise err("intermediate_states", "row stride == S_max * step stride",
                  f"strides {tuple(inter.stride())}")
    return R, S_max, inter.stride(1) if S_max > 1 or R > 1 else H * V * K


def _cu(cu_seqlens, dev):
    tensor("cu_seqlens", cu_seqlens, INDEX_DTYPES, 1, dev)
    if cu_seqlens.numel() < 1 or not cu_seqlens.is_contiguous():
        raise err("cu_seqlens", "a contiguous tensor of N+1 >= 1 offsets",
                  f"shape {tuple(cu_seqlens.shape)}")
    return cu_seqlens.numel() - 1


# metadata the checks passed, by each argument's dtype, shape, strides and device and the
# call's scalars and options: a serving loop's repeated call skips straight to its plan
_memo: dict[tuple, tuple] = {}
_MEMO_MAX = 256


def _meta(t):
    if isinstance(t, torch.Tensor):
        try:
            return t.dtype, t.shape, t.stride(), t.device
        except RuntimeError:  # no strides (a sparse tensor, in some torch versions): checked
            return t.dtype, t.shape, t.layout, t.device
    return t if t is None or isinstance(t, (bool, int, float, str)) else (type(t), id(t))


def _typed(*values) -> tuple:
    """A memo key's scalars and options with their types: True is not 1 (a bool scale is
    refused, 1 is not), False not 0 (null_slot=False is refused, 0 is not)."""
    return (*values, *map(type, values))


def _recall(key):
    """The memo's entry for `key`, or None (also for a key holding an unhashable value: a
    list given for a scalar, refused by the checks or not read)."""
    try:
        return _memo.get(key)
    except TypeError:
        return None


def _remember(key, *value):
    """The memo's entry for `key`: `value` and a dict for launch.again (the resolved steps of
    this metadata's calls, by their tensors' addresses); not kept for an unhashable key."""
    hit = (*value, {})
    try:
        hash(key)
    except TypeError:
        return hit
    # the oldest entry dropped when full: a batch size that changes every step stays remembered
    launch.remember(_memo, _MEMO_MAX, key, hit)
    return hit


def _addresses(*tensors) -> tuple:
    return tuple(0 if t is None else t.data_ptr() for t in tensors)


def _again(cache: dict, addresses: tuple, dev, stream) -> bool:
    """launch.again for an eager call, after what earlier calls' kernels reported."""
    errors.raise_pending(dev)
    return launch.again(cache, addresses, dev, stream)


def _aligned(*named) -> None:
    """The tensors' bases are 16-byte aligned (read every call: addresses change)."""
    for name, t in named:
        if has_address(t) and t.data_ptr() % 16:
            raise err(name, "a 16-byte aligned base address", t.data_ptr())


def _launch(plan, call, dev, stream, bind, keep=None):
    errors.raise_pending(dev)
    if bind:
        return launch.bind(plan, call, None, stream)
    launch.run(plan, call, None, stream, keep)
    return None


def clear() -> None:
    _memo.clear()


# ---------------------------------------------------------------------------------- API
@declare.op("decode", writes=("state", "out"), host_only=_HOST, out_like="v", returns="out")
def decode(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
           state_indices: Tensor | None = None, *, out: Tensor | None = None,
           output_state_indices: Tensor | None = None, has_initial_state: Tensor | None = None,
           A_log: Tensor | None = None, dt_bias: Tensor | None = None,
           scale: float | None = None, lower_bound: float | None = None, gate: str = "bounded",
           qk_l2norm: bool = True, beta_sigmoid: bool = True, null_slot: int | None = None,
           config: StepConfig | None = None, stream=None, bind: bool = False):
    """One token per sequence against the pool; returns `out`.

    q, k, g: [B, 1, H, K] or [B, H, K] bf16 (row-strided views of one projection allowed);
    v: the same with V; beta: [B, 1, H] or [B, H] bf16 (logits when beta_sigmoid); out: like v,
    or packed [B, H*V] (allocated when None). state: the pool [slots, H, V, K], fp32 or bf16.
    state_indices: [B] int32/int64 slots read (None: row n uses slot n); output_state_indices:
    [B] slots written (default: the read ones, in place). has_initial_state: [B] bool, rows
    marked False start from zeros. Gate options as `kda_cute.fwd`; null_slot=0 makes index 0
    padding too. Row n reads slot state_indices[n] and writes the state after its token to
    its write slot; a padding row (index < 0) reads and writes nothing and outputs zeros.
    stream: a torch.cuda.Stream (None: the current one). bind=True returns a kda_cute.Bound
    that launches this step again on the same tensors, checking nothing (every serving
    function takes stream and bind).
    """
    if bind.__class__ is not bool:
        bind = flag("bind", bind)
    if declare.dry():
        _decode_plan(q, k, v, g, beta, state, state_indices, out, output_state_indices,
                     has_initial_state, A_log, dt_bias, scale, lower_bound, gate, qk_l2norm,
                     beta_sigmoid, null_slot, config)
        _aligned(("q", q), ("k", k), ("v", v), ("g", g), ("out", out), ("state", state))
        return out
    key = ("decode", *map(_meta, (q, k, v, g, beta, state, state_indices, out,
                                   output_state_indices, has_initial_state, A_log, dt_bias)),
           *_typed(scale, lower_bound, gate, qk_l2norm, beta_sigmoid, null_slot, config))
    hit = _recall(key)
    if hit is None:
        hit = _remember(key, *_decode_plan(q, k, v, g, beta, state, state_indices, out,
                                          output_state_indices, has_initial_state, A_log,
                                          dt_bias, scale, lower_bound, gate, qk_l2norm,
                                          beta_sigmoid, null_slot, config))
    plan, scale, lb, again = hit
    if out is None:
        out = torch.empty(v.shape, dtype=BF16, device=v.device)
    if not bind:  # a call like an earlier one (metadata by the key, the addresses here)
        addresses = _addresses(q, k, v, g, beta, out, A_log, dt_bias, state, state_indices,
                               output_state_indices, has_initial_state)
        if _again(again, addresses, q.device, stream):
            return out
    _aligned(("q", q), ("k", k), ("v", v), ("g", g), ("out", out), ("state", state))
    wi = output_state_indices if output_state_indices is not None else state_indices
    hi = None if has_initial_state is None else has_initial_state.view(torch.int8)
    call = StepCall(q, k, v, g, beta, out, A_log, dt_bias, state, state, None, state_indices,
                    wi, None, None, hi, scale, lb)
    bound = _launch(plan, call, q.device, stream, bind, None if bind else (again, addresses))
    return bound if bind else out


def _decode_plan(q, k, v, g, beta, state, state_indices, out, output_state_indices,
                 has_initial_state, A_log, dt_bias, scale, lower_bound, gate, qk_l2norm,
                 beta_sigmoid, null_slot, config):
    """decode's checks: (plan, scale, lower bound); in a dry run the plan is None."""
    opts = _opts(gate, qk_l2norm, beta_sigmoid, config)
    tk = _Tokens(q, k, v, g, beta, out)
    dev, H, K, V, B = tk.dev, tk.H, tk.K, tk.V, tk.rows
    if q.dim() == 4 and q.shape[1] != 1:
        raise err("q", "one token per row ([B, 1, H, K]); see verify for more", tuple(q.shape))
    ss = _pool("state", state, H, V, K, dev)
    null = _null(null_slot)
    # an absent table is the launcher's ramp 0, 1, ..: stride 1
    r = _index("state_indices", state_indices, (B,), dev) if state_indices is not None else (1,)
    wi = output_state_indices if output_state_indices is not None else state_indices
    w = _index("output_state_indices", wi, (B,), dev) if output_state_indices is not None else r
    if has_initial_state is not None:
        flags("has_initial_state", has_initial_state, B, dev)
    a, b = gate_params(A_log, dt_bias, opts.gate, H, K, dev)
    scale, lb = _scalars(scale, lower_bound, opts.gate, K)
    pool = "float32" if state.dtype == torch.float32 else "bfloat16"
    if state_indices is None and state.shape[0] < B:
        raise err("state", f"at least B = {B} slots without state_indices", state.shape[0])
    p = StepProblem(
        "decode", B, B, H, K, V, pool, state.shape[0], ss, state.shape[0], ss, tk.strides,
        1, False, 1, (1, r[0], 0, _wide(state_indices), 1, 0), (0, 0, 1, 0, 1),
        has_initial_state is not None, (WRITE_LAST, w[0], 0, _wide(wi), 1, 0), (0, 0, 0, 0),
        (null, null), a, b,
        (0, _words(state_indices), _words(wi), 0, 0,
         0 if has_initial_state is None else B))
    return _planned(p, opts, dev), scale, lb


@declare.op("verify", writes=("state", "out"), host_only=_HOST, out_like="v", returns="out",
            forms={"verify": (("state", "out"), lambda a: a["ssm_state_indices"] is not None),
                   "verify_scratch": (("intermediate_states", "out"), None)})
def verify(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, *,
           cu_seqlens: Tensor | None = None, ssm_state_indices: Tensor | None = None,
           num_accepted_tokens: Tensor | None = None, state_indices: Tensor | None = None,
           intermediate_states: Tensor | None = None,
           intermediate_state_indices: Tensor | None = None,
           retrieve_parent_token: Tensor | None = None, out: Tensor | None = None,
           A_log: Tensor | None = None, dt_bias: Tensor | None = None,
           scale: float | None = None, lower_bound: float | None = None, gate: str = "bounded",
           qk_l2norm: bool = True, beta_sigmoid: bool = True, null_slot: int | None = None,
           config: StepConfig | None = None, stream=None, bind: bool = False):
    """Multi-token verify (speculative decoding) against the pool; returns `out`.

    Tokens: q, k, g [N, T, H, K] (T = 1 + S per row), or packed [1, T, H, K] / [T, H, K] with
    cu_seqlens [N+1] (rows of 0 .. 1 + S tokens). Two styles:
    (a) vLLM / fla: ssm_state_indices [N, 1+S]; row n starts from slot
        ssm_state_indices[n, num_accepted_tokens[n] - 1] (entry 0 without num_accepted_tokens)
        and writes the state after token t to slot ssm_state_indices[n, t] (entries < 0, or
        0 with null_slot=0, are skipped); the start slot is read before any is written.
    (b) SGLang / FlashInfer: the pool is read only, row n starts from slot state_indices[n];
        the state after token t goes to intermediate_states[intermediate_state_indices[n], t]
        ([R, S_max, H, V, K], the pool's dtype; indices default to n); `commit` then copies
        the accepted step into the pool. retrieve_parent_token [N, T]: token t starts from the
        state after token parent (-1: the row's start state), not from t - 1's.
    """
    if bind.__class__ is not bool:
        bind = flag("bind", bind)
    tensors = (q, k, v, g, beta, state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
               state_indices, intermediate_states, intermediate_state_indices,
               retrieve_parent_token, out, A_log, dt_bias)
    if declare.dry():
        _verify_plan(*tensors, scale, lower_bound, gate, qk_l2norm, beta_sigmoid, null_slot,
                     config)
        _aligned(("q", q), ("k", k), ("v", v), ("g", g), ("out", out), ("state", state),
                 ("intermediate_states", intermediate_states))
        return out
    key = ("verify", *map(_meta, tensors),
           *_typed(scale, lower_bound, gate, qk_l2norm, beta_sigmoid, null_slot, config))
    hit = _recall(key)
    if hit is None:
        hit = _remember(key, *_verify_plan(*tensors, scale, lower_bound, gate, qk_l2norm,
                                          beta_sigmoid, null_slot, config))
    plan, scale, lb, again = hit
    if out is None:
        out = torch.empty(v.shape, dtype=BF16, device=v.device)
    if not bind:  # a call like an earlier one (metadata by the key, the addresses here)
        addresses = _addresses(*tensors[:13], out, A_log, dt_bias)
        if _again(again, addresses, q.device, stream):
            return out
    _aligned(("q", q), ("k", k), ("v", v), ("g", g), ("out", out), ("state", state),
             ("intermediate_states", intermediate_states))
    if ssm_state_indices is not None:
        dst, ridx, widx = state, ssm_state_indices, ssm_state_indices
    else:
        dst, ridx, widx = intermediate_states, state_indices, intermediate_state_indices
    call = StepCall(q, k, v, g, beta, out, A_log, dt_bias, state, dst, cu_seqlens, ridx,
                    widx, num_accepted_tokens, retrieve_parent_token, None, scale, lb)
    bound = _launch(plan, call, q.device, stream, bind, None if bind else (again, addresses))
    return bound if bind else out


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


def _verify_plan(q, k, v, g, beta, state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                 state_indices, intermediate_states, intermediate_state_indices,
                 retrieve_parent_token, out, A_log, dt_bias, scale, lower_bound, gate,
                 qk_l2norm, beta_sigmoid, null_slot, config):
    """verify's checks: (plan, scale, lower bound); in a dry run the plan is None."""
    opts = _opts(gate, qk_l2norm, beta_sigmoid, config)
    tk = _Tokens(q, k, v, g, beta, out)
    dev, H, K, V = tk.dev, tk.H, tk.K, tk.V
    ss = _pool("state", state, H, V, K, dev)
    null = _null(null_slot)
    if cu_seqlens is not None:
        N = _cu(cu_seqlens, dev)
        if q.dim() == 4 and q.shape[0] != 1:
            raise err("q", "batch size 1 when cu_seqlens is given", tuple(q.shape))
        fixed, per_row = -1, None
    else:
        if q.dim() != 4:
            raise err("q", "[N, T, H, K] without cu_seqlens", tuple(q.shape))
        N, fixed = q.shape[0], q.shape[1]
        per_row = fixed
    pool = "float32" if state.dtype == torch.float32 else "bfloat16"
    hi_words = 0
    par = (0, 0, 0, 0)
    npa = 0
    if verify_style(ssm_state_indices, num_accepted_tokens, state_indices,
                    intermediate_states, retrieve_parent_token,
                    intermediate_state_indices) == "a":
        st = _index("ssm_state_indices", ssm_state_indices, (N, None), dev)
        S1 = ssm_state_indices.shape[1]
        if per_row is not None and per_row > S1:
            raise err("q", f"at most {S1} tokens per row (ssm_state_indices' entries)", per_row)
        acc = (0, 0, 1, 0, S1)
        if num_accepted_tokens is not None:
            _index("num_accepted_tokens", num_accepted_tokens, (N,), dev)
            acc = (1, _wide(num_accepted_tokens), 1, 0, S1)
        read = (1, st[0], st[1], _wide(ssm_state_indices), 1, 0)
        write = (WRITE_ALL, st[0], st[1], _wide(ssm_state_indices), 1, 0)
        dst, ds, drows, form = state, ss, state.shape[0], "verify"
        ridx = widx = ssm_state_indices
        max_tokens, nulls = S1, (null, null)
    else:
        r = _index("state_indices", state_indices, (N,), dev)
        R, S_max, ds = _scratch(intermediate_states, state, H, V, K, dev)
        if per_row is not None and per_row > S_max:
            raise err("q", f"at most {S_max} tokens per row (intermediate_states' steps)",
                      per_row)
        if intermediate_state_indices is not None:
            w = _index("intermediate_state_indices", intermediate_state_indices, (N,), dev)
        else:
            if R < N:
                raise err("intermediate_states", f"at least N = {N} rows without "
                          "intermediate_state_indices", R)
            w = (1,)  # the ramp
        max_tokens = S_max
        if retrieve_parent_token is not None:
            pt = _index("retrieve_parent_token", retrieve_parent_token, (N, None), dev)
            max_tokens = min(S_max, retrieve_parent_token.shape[1])
            if per_row is not None and per_row > retrieve_parent_token.shape[1]:
                raise err("retrieve_parent_token", f"at least {per_row} entries per row",
                          tuple(retrieve_parent_token.shape))
            par = (1, pt[0], pt[1], _wide(retrieve_parent_token))
            npa = _words(retrieve_parent_token)
        acc = (0, 0, 1, 0, 1)
        read = (1, r[0], 0, _wide(state_indices), 1, 0)
        write = (WRITE_ALL, w[0], 0, _wide(intermediate_state_indices), S_max, 1)
        dst, drows, form = intermediate_states, R * S_max, "verify scratch"
        ridx, widx = state_indices, intermediate_state_indices
        nulls = (null, 0)
    a, b = gate_params(A_log, dt_bias, opts.gate, H, K, dev)
    scale, lb = _scalars(scale, lower_bound, opts.gate, K)
    p = StepProblem(
        form, N, tk.rows, H, K, V, pool, state.shape[0], ss, drows, ds, tk.strides, fixed,
        _wide(cu_seqlens) == 1, max_tokens, read, acc, False, write, par, nulls, a, b,
        (_words(cu_seqlens), _words(ridx), _words(widx), _words(num_accepted_tokens), npa,
         hi_words))
    del dst, ridx, widx  # the call's, chosen again each call
    return _planned(p, opts, dev), scale, lb


@declare.op("commit", writes=("state",), host_only=("stream", "bind"), returns="state")
def commit(state: Tensor, intermediate_states: Tensor, state_indices: Tensor,
           accepted_step: Tensor, intermediate_state_indices: Tensor | None = None, *,
           null_slot: int | None = None, stream=None, bind: bool = False):
    """After a style-(b) verify: state[state_indices[n]] = intermediate_states[
    intermediate_state_indices[n], accepted_step[n]] (indices default to n); a row whose step
    is < 0, or whose slot is padding, is skipped. In place; returns `state`."""
    if bind.__class__ is not bool:
        bind = flag("bind", bind)
    tensors = (state, intermediate_states, state_indices, accepted_step,
               intermediate_state_indices)
    if declare.dry():
        _commit_plan(*tensors, null_slot)
        _aligned(("state", state), ("intermediate_states", intermediate_states))
        return state
    key = ("commit", *map(_meta, tensors), *_typed(null_slot))
    hit = _recall(key)
    if hit is None:
        hit = _remember(key, _commit_plan(*tensors, null_slot))
    plan, again = hit
    if not bind:  # a call like an earlier one (metadata by the key, the addresses here)
        addresses = _addresses(*tensors)
        if _again(again, addresses, state.device, stream):
            return state
    _aligned(("state", state), ("intermediate_states", intermediate_states))
    call = StepCall(None, None, None, None, None, None, None, None, intermediate_states, state,
                    None, intermediate_state_indices, state_indices, accepted_step, None, None,
                    1.0, None)
    bound = _launch(plan, call, state.device, stream, bind, None if bind else (again, addresses))
    return bound if bind else state


def _commit_plan(state, intermediate_states, state_indices, accepted_step,
                 intermediate_state_indices, null_slot):
    """commit's checks and plan (None in a dry run)."""
    tensor("state", state, POOL_DTYPES)
    dev = state.device
    if state.dim() != 4:
        raise err("state", "a pool [slots, H, V, K]", tuple(state.shape))
    H, V, K = state.shape[1:]
    ss = _pool("state", state, H, V, K, dev)
    R, S_max, ds = _scratch(intermediate_states, state, H, V, K, dev)
    tensor("state_indices", state_indices, INDEX_DTYPES, 1, dev)
    N = state_indices.shape[0]
    w = _index("state_indices", state_indices, (N,), dev)
    _index("accepted_step", accepted_step, (N,), dev)
    if intermediate_state_indices is not None:
        r = _index("intermediate_state_indices", intermediate_state_indices, (N,), dev)
    else:
        if R < N:
            raise err("intermediate_states", f"at least N = {N} rows without "
                      "intermediate_state_indices", R)
        r = (1,)  # the ramp
    null = _null(null_slot)
    pool = "float32" if state.dtype == torch.float32 else "bfloat16"
    p = StepProblem(
        "commit", N, 0, H, K, V, pool, R * S_max, ds, state.shape[0], ss,
        (H * K, H * K, H * K, H * V, H * V, H), 0, False, 0,
        (1, r[0], 0, _wide(intermediate_state_indices), S_max, 1),
        (1, _wide(accepted_step), 0, 1, S_max), False,
        (WRITE_START, w[0], 0, _wide(state_indices), 1, 0), (0, 0, 0, 0), (0, null),
        False, False,
        (0, _words(intermediate_state_indices), _words(state_indices), _words(accepted_step),
         0, 0))
    return _planned(p, StepOptions(gate="none"), dev, "state")


# fla's fused_recurrent_kda_fwd arguments, all of which are honoured or refused
_FLA_ARGS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "scale",
             "output_final_state", "inplace_final_state", "state_v_first", "cu_seqlens",
             "ssm_state_indices", "num_accepted_tokens", "use_qk_l2norm_in_kernel",
             "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
             "lower_bound", "out")


@declare.composite
def fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None,
                            scale=None, output_final_state=False, inplace_final_state=True,
                            state_v_first=False, cu_seqlens=None, ssm_state_indices=None,
                            num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                            use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                            allow_neg_eigval=False, lower_bound=None, out=None, **kwargs):
    """fla's `fused_recurrent_kda_fwd` with its argument names and defaults; returns (out,
    final_state). With ssm_state_indices, initial_state is the pool ([slots, H, V, K] with
    state_v_first=True) updated in place: the state after token t of row n goes to slot
    ssm_state_indices[n, t] (1-D indices: one token per row), the start slot chosen by
    num_accepted_tokens. Without, the states are dense [N, H, V, K] (final_state is
    initial_state, updated in place, when inplace_final_state). Refused (ValueError): any
    other keyword, allow_neg_eigval, headwise beta, GVA (v's heads != q's), a K-first pool
    (state_v_first=False) updated in place or through indices."""
    if kwargs:
        raise TypeError(f"fused_recurrent_kda_fwd: unknown arguments {sorted(kwargs)}")
    (output_final_state, inplace_final_state, state_v_first, use_gate_in_kernel,
     allow_neg_eigval, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel) = (
        flag(n, v) for n, v in (
            ("output_final_state", output_final_state),
            ("inplace_final_state", inplace_final_state), ("state_v_first", state_v_first),
            ("use_gate_in_kernel", use_gate_in_kernel), ("allow_neg_eigval", allow_neg_eigval),
            ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
            ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel)))
    if allow_neg_eigval:
        raise err("allow_neg_eigval", "False (not supported)", True)
    tensor("q", q, (BF16,), 4)
    tensor("v", v, (BF16,), 4)
    if v.shape[2] != q.shape[2]:
        raise err("v", f"{q.shape[2]} heads as q (GVA is not supported)", v.shape[2])
    tensor("beta", beta, (BF16,))
    if beta.dim() == v.dim():
        raise err("beta", "one value per head [B, T, H] (headwise beta is not supported)",
                  tuple(beta.shape))
    if use_gate_in_kernel:
        gate = "bounded" if lower_bound is not None else "unbounded"
    else:
        gate = "none"
    H, K = q.shape[2], q.shape[3]
    if scale is None:
        scale = K ** -0.5
    if out is None:
        out = torch.zeros_like(v)
    kw = dict(A_log=A_log, dt_bias=dt_bias, scale=scale, lower_bound=lower_bound, gate=gate,
              qk_l2norm=use_qk_l2norm_in_kernel, beta_sigmoid=use_beta_sigmoid_in_kernel)
    if ssm_state_indices is not None:
        if initial_state is None:
            raise err("initial_state", "the state pool with ssm_state_indices", None)
        if not state_v_first:
            raise err("state_v_first", "True: the pool is [slots, H, V, K] (K-first pools are "
                      "not supported)", False)
        if not inplace_final_state:
            raise err("inplace_final_state", "True with ssm_state_indices", False)
        tensor("ssm_state_indices", ssm_state_indices, INDEX_DTYPES)
        if ssm_state_indices.dim() not in (1, 2):
            raise err("ssm_state_indices", "[N] (a token a row) or [N, 1+S]",
                      f"shape {tuple(ssm_state_indices.shape)}")
        idx = ssm_state_indices if ssm_state_indices.dim() == 2 else \
            ssm_state_indices.unsqueeze(1)
        try:
            verify(q, k, v, g, beta, initial_state, cu_seqlens=cu_seqlens,
                   ssm_state_indices=idx, num_accepted_tokens=num_accepted_tokens, out=out, **kw)
        except (ValueError, TypeError) as e:
            # verify's pool is the caller's initial_state: the error names what was passed
            if str(e).startswith("state:") and not isinstance(e, errors.DeviceValueError):
                raise type(e)("initial_state" + str(e)[len("state"):]) from None
            raise
        return out, initial_state
    if num_accepted_tokens is not None:
        raise err("num_accepted_tokens", "None without ssm_state_indices", "a tensor")
    s0 = initial_state
    if s0 is not None and not state_v_first:
        if inplace_final_state:
            raise err("state_v_first", "True to update initial_state in place", False)
        tensor("initial_state", s0, POOL_DTYPES, 4)
        s0 = s0.transpose(-1, -2).contiguous()
    N = q.shape[0] if cu_seqlens is None else _cu(cu_seqlens, q.device)
    if inplace_final_state:
        if initial_state is None:
            raise err("initial_state", "a tensor with inplace_final_state=True", None)
        s1 = s0
    elif output_final_state:
        # fla's final state is fp32: a bf16 initial state is read through an fp32 copy (the
        # kernel reads and writes one dtype)
        if isinstance(s0, torch.Tensor) and s0.dtype == BF16:
            tensor("initial_state", s0, POOL_DTYPES, 4)
            s0 = s0.float()
        s1 = torch.empty(N, H, v.shape[-1], K, dtype=torch.float32, device=q.device)
    else:
        s1 = None
    recurrent(q, k, v, g, beta, s0, s1, cu_seqlens=cu_seqlens, out=out, **kw)
    if s1 is not None and not state_v_first and not inplace_final_state:
        s1 = s1.transpose(-1, -2).contiguous()
    return out, s1


@declare.op("recurrent", writes=("final_state", "out"), host_only=_HOST, out_like="v",
            returns="out", inplace=("initial_state", "final_state"))
def recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
              initial_state: Tensor | None = None, final_state: Tensor | None = None, *,
              cu_seqlens: Tensor | None = None, out: Tensor | None = None,
              A_log: Tensor | None = None, dt_bias: Tensor | None = None,
              scale: float | None = None, lower_bound: float | None = None,
              gate: str = "bounded", qk_l2norm: bool = True, beta_sigmoid: bool = True,
              config: StepConfig | None = None, stream=None, bind: bool = False):
    """The dense forward token by token (no pool): initial_state / final_state [N, H, V, K] of
    one dtype (either may be None; they may be the same tensor). For short sequences, where
    the chunked prefill's K1 does not pay off; returns `out`."""
    if bind.__class__ is not bool:
        bind = flag("bind", bind)
    tensors = (q, k, v, g, beta, initial_state, final_state, cu_seqlens, out, A_log, dt_bias)
    if declare.dry():
        out = _recurrent_plan(*tensors, scale, lower_bound, gate, qk_l2norm, beta_sigmoid,
                              config)[3]
        _aligned(("q", q), ("k", k), ("v", v), ("g", g), ("out", out),
                 ("initial_state", initial_state), ("final_state", final_state))
        return out
    key = ("recurrent", *map(_meta, tensors),
           *_typed(scale, lower_bound, gate, qk_l2norm, beta_sigmoid, config))
    hit = _recall(key)
    made = None  # the out the checks allocated (out None), on a first call
    if hit is None:
        plan, sc, lb, made = _recurrent_plan(*tensors[:9], A_log, dt_bias, scale, lower_bound,
                                             gate, qk_l2norm, beta_sigmoid, config)
        hit = _remember(key, plan, sc, lb)
    plan, scale, lb, again = hit
    if out is None:
        out = made if made is not None else torch.empty(v.shape, dtype=BF16, device=v.device)
    if not bind:  # a call like an earlier one (metadata by the key, the addresses here)
        addresses = _addresses(*tensors[:8], out, A_log, dt_bias)
        if _again(again, addresses, q.device, stream):
            return out
    _aligned(("q", q), ("k", k), ("v", v), ("g", g), ("out", out),
             ("initial_state", initial_state), ("final_state", final_state))
    call = StepCall(q, k, v, g, beta, out, A_log, dt_bias, initial_state, final_state,
                    cu_seqlens, None, None, None, None, None, scale, lb)
    bound = _launch(plan, call, q.device, stream, bind, None if bind else (again, addresses))
    return bound if bind else out


def _recurrent_plan(q, k, v, g, beta, initial_state, final_state, cu_seqlens, out, A_log,
                    dt_bias, scale, lower_bound, gate, qk_l2norm, beta_sigmoid, config,
                    ):
    """recurrent's checks: (plan, scale, lower bound, out); dry: the checks alone (plan
    None)."""
    opts = _opts(gate, qk_l2norm, beta_sigmoid, config)
    tk = _Tokens(q, k, v, g, beta, out)
    dev, H, K, V = tk.dev, tk.H, tk.K, tk.V
    if cu_seqlens is not None:
        N = _cu(cu_seqlens, dev)
        fixed = -1
        if q.dim() == 4 and q.shape[0] != 1:
            raise err("q", "batch size 1 when cu_seqlens is given", tuple(q.shape))
    else:
        if q.dim() != 4:
            raise err("q", "[B, T, H, K] without cu_seqlens", tuple(q.shape))
        N, fixed = q.shape[0], q.shape[1]
    s0s = s1s = H * V * K
    dt = None
    for name, t in (("initial_state", initial_state), ("final_state", final_state)):
        if t is None:
            continue
        s = _pool(name, t, H, V, K, dev)
        if t.shape[0] != N:
            raise err(name, f"[N={N}, H, V, K]", tuple(t.shape))
        if dt is not None and t.dtype != dt:
            raise err(name, f"the dtype of initial_state ({_dtype_name(dt)})",
                      _dtype_name(t.dtype))
        dt = t.dtype
        if name == "initial_state":
            s0s = s
        else:
            s1s = s
    a, b = gate_params(A_log, dt_bias, opts.gate, H, K, dev)
    scale, lb = _scalars(scale, lower_bound, opts.gate, K)
    pool = "bfloat16" if dt == torch.bfloat16 else "float32"
    n0 = N if initial_state is not None else 0
    n1 = N if final_state is not None else 0
    p = StepProblem(
        "recurrent", N, tk.rows, H, K, V, pool, n0, s0s, n1, s1s, tk.strides, fixed,
        _wide(cu_seqlens) == 1, 2 ** 31 - 1, (int(n0 > 0), 1, 0, 0, 1, 0), (0, 0, 1, 0, 1),
        False, (WRITE_LAST if n1 else WRITE_NONE, 1, 0, 0, 1, 0), (0, 0, 0, 0), (0, 0), a, b,
        (_words(cu_seqlens), 0, 0, 0, 0, 0))
    return _planned(p, opts, dev), scale, lb, tk.out


check_errors = errors.check_errors
check_fused_recurrent_kda_fwd = fused_recurrent_kda_fwd.check

__all__ = ["check_errors", "check_fused_recurrent_kda_fwd", "commit", "decode",
           "fused_recurrent_kda_fwd", "recurrent", "verify"]
