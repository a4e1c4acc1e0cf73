"""kda-cute as a backend of fla (flash-linear-attention, fla-core >= 0.6): `fla.ops.kda.chunk_kda`
and `fused_recurrent_kda_fwd` (decode and verify) dispatch here, ahead of FlashKDA's backend.

    import kda_cute.integrations.fla as kda_fla
    kda_fla.register()          # or KDA_CUTE_FLA=1 in the environment, then `import kda_cute`

fla calls each backend's verifier with the caller's arguments as given (positional stay
positional), then its implementation. The verifiers here run the implementation's own checks
(kda_cute.fla_forms.check_chunk_kda, check_fused_recurrent_kda_fwd: metadata and
addresses only, no host sync, no launch), so a call they accept is one the implementation
runs; they return (ok, reason), the reason naming the argument the caller passed. A verdict is
kept by the arguments' metadata (dtypes, shapes, strides, devices, base alignment, flags), so a
repeated call costs a lookup. A call they turn down (grad enabled on tensors that require it,
allow_neg_eigval, context parallel, intermediate states, GVA, head dims other than 64 / 128 /
256, fp16 or fp32 q / k / v / g / beta, a device other than Hopper, ...) goes on to the next
backend, and fla logs the reason once on the "fla.backends" logger at INFO. FLA_KDA_CUTE=0
turns the backend off.

Accepted beyond fla's own rules: bf16 initial states, int32 cu_seqlens, the deprecated
`transpose_state_layout` (as `state_v_first`), dt_bias flattened to [H*K], A_log and dt_bias in
fp32, bf16 or fp16 (a model cast with `.to(torch.bfloat16)`), and A_log None with lower_bound
(the gate lower_bound * sigmoid(g + dt_bias), fla's reading of it).
"""

from __future__ import annotations

import functools

import torch

from .. import checks, fla_forms, memo
from ..plans.device import ready
from ..specs import HEAD_DIMS

try:
    from fla.backends import BaseBackend
    from fla.backends import register as _fla_register
except ImportError as e:  # fla < 0.6 has no fla.backends
    raise ImportError(f"kda_cute.integrations.fla needs fla-core >= 0.6 (fla.backends): {e}"
                      ) from None

PRIORITY = 2  # FlashKDA's backend is 3; lower goes first
ENV_VAR = "FLA_KDA_CUTE"
# chunk_kda keywords that change nothing here (fla's own scheduling and recompute options)
_IGNORED = frozenset({"chunk_size"})


class Reject(Exception):
    """A call the backend turns down, with fla's reason: "argument: expected ..., got ..."
    naming the argument the caller passed, as the call's own checks do."""


def _reject(name: str, expected: str, got) -> Reject:
    return Reject(f"{name}: expected {expected}, got {got}")


def _common(**tensors) -> None:
    """Both entries' rules on their tensors: none requires grad while grad is enabled; q and v
    alike in rank, heads and head dims (dt_bias [H*K] is taken as [H, K] by the call's checks)."""
    if torch.is_grad_enabled():
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise _reject(name, "no tensor that requires grad while grad is enabled "
                              "(kda-cute is forward only)", "one that does")
    q, v = tensors["q"], tensors["v"]
    for name, t in (("q", q), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise _reject(name, "a torch.Tensor", type(t).__name__)
        if t.dim() not in (3, 4) or t.dim() != q.dim():
            raise _reject(name, f"[B, T, H, D] or [T, H, D] as q ({q.dim()}-d)",
                          f"shape {tuple(t.shape)}")
    H, K, V = q.shape[-2], q.shape[-1], v.shape[-1]
    if v.shape[-2] != H:
        raise _reject("v", f"{H} heads as q (GVA is not supported)", v.shape[-2])
    if K not in HEAD_DIMS:
        raise _reject("q", f"head dims K == V in {HEAD_DIMS}", f"K={K}")
    if V != K:
        raise _reject("v", f"head dims K == V in {HEAD_DIMS}", f"K={K}, V={V}")


def _chunk_args(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
                lower_bound=None, disable_recompute=False, return_intermediate_states=False,
                state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None,
                use_graph=False, max_num_seqs=None, **kwargs) -> dict:
    """fla chunk_kda's arguments as kda_cute.chunk_kda's, after fla's own rules that kda-cute
    does not follow (the call's checks come after, in the verdict)."""
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    state_v_first = checks.flag("state_v_first", state_v_first)
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise _reject("transpose_state_layout", "None with state_v_first=True (both "
                          "given)", kwargs["transpose_state_layout"])
        state_v_first = checks.flag("transpose_state_layout", kwargs.pop("transpose_state_layout"))
    unknown = sorted(set(kwargs) - _IGNORED)
    if unknown:
        raise _reject(unknown[0], "an argument of fla's chunk_kda (unsupported arguments "
                      f"{unknown})", repr(kwargs[unknown[0]])[:40])
    # (fla's options kda-cute does not have; the gate's rules are the call's own checks)
    for name, x in (("allow_neg_eigval", allow_neg_eigval),
                    ("return_intermediate_states", return_intermediate_states)):
        if checks.flag(name, x):
            raise _reject(name, f"False ({name}=True is not supported)", True)
    if cp_context is not None:
        raise _reject("cp_context", "None (context parallel is not supported)",
                      type(cp_context).__name__)
    _common(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, A_log=A_log,
            dt_bias=dt_bias)
    return dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_gate_in_kernel=use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, safe_gate=safe_gate,
                lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias,
                state_v_first=state_v_first, cu_seqlens=cu_seqlens)


def _recurrent_args(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                    output_final_state=False, inplace_final_state=True, state_v_first=False,
                    cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                    use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                    out=None, **kwargs) -> dict:
    """fla fused_recurrent_kda_fwd's arguments as kda_cute's, after fla's own rules that
    kda-cute does not follow (the call's checks come after, in the verdict)."""
    if kwargs:
        unknown = sorted(kwargs)
        raise _reject(unknown[0], "an argument of fla's fused_recurrent_kda_fwd (unsupported "
                      f"arguments {unknown})", repr(kwargs[unknown[0]])[:40])
    _common(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, A_log=A_log,
            dt_bias=dt_bias)
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                initial_state=initial_state, scale=scale, output_final_state=output_final_state,
                inplace_final_state=inplace_final_state, state_v_first=state_v_first,
                cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
                num_accepted_tokens=num_accepted_tokens,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_gate_in_kernel=use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, out=out)


def _device(args, kwargs) -> None:
    """The device of q (a real tensor: a FakeTensor has none to ask) runs kda-cute's cubins."""
    q = kwargs.get("q", args[0] if args else None)
    if isinstance(q, torch.Tensor) and q.device.type == "cuda" and checks.has_address(q):
        ok, why = _ready(q.device)
        if not ok:
            raise _reject("q", "a tensor on a device kda-cute runs on", f"{q.device}: {why}")


_ready = functools.lru_cache(maxsize=16)(ready)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _meta(x):
    """What a verdict depends on of an argument: memo.meta's, and a tensor's type, requires_grad
    and base alignment (None: no address to read, a FakeTensor's or a sparse tensor's)."""
    if type(x) in _PLAIN and x.layout is torch.strided:  # a tensor with memory, the common case
        return x.dtype, x.shape, x.stride(), x.device, x.requires_grad, x.data_ptr() & 15
    if not isinstance(x, torch.Tensor):
        return memo.meta(x)
    try:
        align = x.data_ptr() & 15 if checks.has_address(x) else None
    except RuntimeError:  # no storage (a sparse tensor): checked, and refused
        align = None
    return type(x), memo.meta(x), x.requires_grad, align


def _verdict(check, as_call, args, kwargs) -> tuple[bool, str | None]:
    """The form's `check` of fla's arguments `as_call` maps, as fla's verdict (ok, reason)."""
    # (fla asks before every call: the verdict is kept in kda_cute's one memo)
    key = ("verdict", check, torch.is_grad_enabled(), *map(_meta, args), *kwargs,
           *map(_meta, kwargs.values()))
    hit = memo.recall(key)
    if hit is not None:
        return hit
    try:
        _device(args, kwargs)
        check(**as_call(*args, **kwargs))
        hit = (True, None)
    except (Reject, ValueError, TypeError) as e:  # fla's rules, or the call's own checks
        hit = (False, str(e))
    return memo.remember(key, hit)


class KdaCuteBackend(BaseBackend):
    """kda-cute's forward (chunk_kda) and serving step (fused_recurrent_kda_fwd) for fla."""

    backend_type = "kda_cute"
    package_name = "kda_cute"
    env_var = ENV_VAR
    default_enable = True
    priority = PRIORITY

    def chunk_kda_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
        return _verdict(fla_forms.check_chunk_kda, _chunk_args, args, kwargs)

    def chunk_kda(self, *args, **kwargs):
        return fla_forms.chunk_kda(**_chunk_args(*args, **kwargs))

    def fused_recurrent_kda_fwd_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
        return _verdict(fla_forms.check_fused_recurrent_kda_fwd, _recurrent_args, args, kwargs)

    def fused_recurrent_kda_fwd(self, *args, **kwargs):
        return fla_forms.fused_recurrent_kda_fwd(**_recurrent_args(*args, **kwargs))


@functools.cache
def register() -> type[KdaCuteBackend]:
    """Register the backend with fla (once; later calls do nothing): for `chunk_kda` and for
    the "kda" operations (`fused_recurrent_kda_fwd`). Returns the backend class."""
    from fla.ops.kda.chunk import chunk_kda
    _fla_register(chunk_kda)(KdaCuteBackend)
    _fla_register("kda")(KdaCuteBackend)
    return KdaCuteBackend


__all__ = ["ENV_VAR", "PRIORITY", "KdaCuteBackend", "Reject", "register"]
