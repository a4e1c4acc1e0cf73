"""fla's call forms: `chunk_kda` (the prefill) and `fused_recurrent_kda_fwd` (decode and verify
against a pool, or the dense forward token by token), with fla's argument names, defaults and
state layouts. Each is made of the declared calls (kda_cute.fwd, verify, recurrent): it
allocates and copies what fla's form needs around them, torch.compile traces through it into
their ops, and its `.check` is its dry run (what the fla backend's verifiers ask).
"""

from __future__ import annotations

import torch

from . import checks, declare, errors
from .api import fwd
from .checks import INDEX_DTYPES, POOL_DTYPES, err, flag, tensor
from .checks.step import BF16
from .serving import recurrent, verify


@declare.composite
def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, safe_gate=False, lower_bound=None, A_log=None,
              dt_bias=None, state_v_first=False, cu_seqlens=None, workspace=None,
              precision="fast", state_indices=None, output_state_indices=None,
              has_initial_state=None, null_slot=None, **kwargs):
    """fla-compatible forward: returns (o, final_state or None).

    State layout is [N, H, K, V] unless state_v_first=True ([N, H, V, K], the kernels' own).
    has_initial_state: [N] bool, sequences marked False start from zeros.
    The pool form (as `fwd`'s): with state_indices, initial_state is the pool [slots, H, V, K]
    (state_v_first=True: a K-first pool cannot be updated in place), read at state_indices and
    written in place at output_state_indices (default: state_indices); the pool is returned as
    the final state when output_final_state.
    The gate is bounded when use_gate_in_kernel and (safe_gate or lower_bound is set), unbounded
    when use_gate_in_kernel alone, and taken as the log-space decay otherwise. precision:
    "fast" or "precise", as in `fwd`.
    """
    unsupported = sorted(k_ for k_, v_ in kwargs.items() if v_ not in (None, False))
    if unsupported:
        raise ValueError(f"chunk_kda: unsupported options {unsupported}")
    for name, t in (("q", q), ("v", v)):
        checks.tensor(name, t, (torch.bfloat16,), 4)
    for name, t in (("initial_state", initial_state), ("cu_seqlens", cu_seqlens)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    K = q.shape[-1]
    if scale is None:
        scale = K ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise checks.err("scale", "a finite positive float", repr(scale))
    (output_final_state, use_gate_in_kernel, safe_gate, state_v_first, use_qk_l2norm_in_kernel,
     use_beta_sigmoid_in_kernel) = (checks.flag(n, v) for n, v in (
         ("output_final_state", output_final_state), ("use_gate_in_kernel", use_gate_in_kernel),
         ("safe_gate", safe_gate), ("state_v_first", state_v_first),
         ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
         ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel)))
    if use_gate_in_kernel:
        gate = "bounded" if (safe_gate or lower_bound is not None) else "unbounded"
        if gate == "bounded" and lower_bound is None:
            raise checks.err("lower_bound", "a float in [-5, 0) with safe_gate", None)
    else:
        gate = "none"
    if state_indices is not None and not state_v_first:
        raise checks.err("state_v_first", "True with state_indices (the pool [slots, H, V, K] is "
                         "updated in place; a K-first pool cannot be)", state_v_first)
    if initial_state is not None and not state_v_first:
        checks.tensor("initial_state", initial_state, (torch.float32, torch.bfloat16), 4)
    if output_final_state and cu_seqlens is not None and state_indices is None:
        checks.tensor("cu_seqlens", cu_seqlens, checks.INDEX_DTYPES, 1)
        if cu_seqlens.numel() < 1:
            raise checks.err("cu_seqlens", "N+1 >= 1 offsets", "none")
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=torch.bfloat16, device=q.device)
    s0 = s1 = initial_state  # (a pool is read and written in place)
    if s0 is not None and not state_v_first:  # (a contiguous V-first copy)
        s0 = s0.transpose(-1, -2).contiguous()
    if state_indices is None:
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        s1 = torch.empty(N, q.shape[2], v.shape[-1], K, dtype=torch.float32,
                         device=q.device) if output_final_state else None
    fwd(q, k, v, g, beta, float(scale), out, A_log, dt_bias, lower_bound, s0, s1, cu_seqlens,
        workspace, gate=gate, qk_l2norm=use_qk_l2norm_in_kernel,
        beta_sigmoid=use_beta_sigmoid_in_kernel, precision=precision,
        state_indices=state_indices, output_state_indices=output_state_indices,
        has_initial_state=has_initial_state, null_slot=null_slot)
    if state_indices is not None:  # (the pool is the final state)
        s1 = initial_state if output_final_state else None
    elif s1 is not None and not state_v_first:
        s1 = s1.transpose(-1, -2).contiguous()
    return out, s1


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
    N = q.shape[0] if cu_seqlens is None else checks.step._cu(cu_seqlens, q.device)
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


check_chunk_kda = chunk_kda.check
check_fused_recurrent_kda_fwd = fused_recurrent_kda_fwd.check

__all__ = ["check_chunk_kda", "check_fused_recurrent_kda_fwd", "chunk_kda",
           "fused_recurrent_kda_fwd"]
