"""kda-cute as a backend of fla (flash-linear-attention, fla-core >= 0.6): `fla.ops.kda.chunk_kda`
and `fused_recurrent_kda_fwd` (decode and verify) dispatch here, ahead of FlashKDA's backend.

    import kda_cute.integrations.fla as kda_fla
    kda_fla.register()          # or KDA_CUTE_FLA=1 in the environment, then `import kda_cute`

fla calls each backend's verifier with the caller's arguments as given (positional stay
positional); the verifiers here read metadata only (shapes, dtypes, strides, devices, flags:
no host sync) and return (ok, reason). A call they turn down (grad enabled on tensors that
require it, allow_neg_eigval, context parallel, intermediate states, GVA, head dims other than
64 / 128 / 256, ...) goes on to the next backend, and fla logs the reason once on the
"fla.backends" logger at INFO. FLA_KDA_CUTE=0 turns the backend off.

Accepted beyond fla's own rules: bf16 initial states, int32 cu_seqlens, the deprecated
`transpose_state_layout` (as `state_v_first`), dt_bias flattened to [H*K], and A_log None with
lower_bound (the gate lower_bound * sigmoid(g + dt_bias), fla's reading of it).
"""

from __future__ import annotations

import torch

from .. import api, checks, serving
from ..problem import Call

try:
    import fla
    from fla.backends import BaseBackend
    from fla.backends import register as _fla_register
except ImportError as e:  # fla < 0.6 has no fla.backends
    raise ImportError(f"kda_cute.integrations.fla needs fla-core >= 0.6 (fla.backends): {e}"
                      ) from None

PRIORITY = 2  # FlashKDA's backend is 3; lower goes first
ENV_VAR = "FLA_KDA_CUTE"
HEAD_DIMS = (64, 128, 256)
# chunk_kda keywords that change nothing here (fla's own scheduling and recompute options)
_IGNORED = frozenset({"chunk_size"})
_zeros: dict[tuple, torch.Tensor] = {}


class Reject(Exception):
    """A call the backend turns down, with fla's reason."""


def _grad(*tensors) -> None:
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in tensors):
        raise Reject("kda-cute is forward only: grad is enabled and an input requires grad")


def _unit_A_log(H: int, dev) -> torch.Tensor:
    """A_log = 0 (exp(A_log) = 1): fla's bounded gate without A_log."""
    key = (H, dev)
    t = _zeros.get(key)
    if t is None:
        t = _zeros[key] = torch.zeros(H, dtype=torch.float32, device=dev)
    return t


def _common(q, v, A_log, dt_bias):
    """Checks and argument forms both entries share: (A_log, dt_bias as [H, K])."""
    if not isinstance(q, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise Reject("q and v must be tensors")
    if q.device.type != "cuda":
        raise Reject(f"kda-cute runs on CUDA tensors, q is on {q.device}")
    if q.dim() not in (3, 4) or v.dim() != q.dim():
        raise Reject(f"q and v must be [B, T, H, D], got {tuple(q.shape)}, {tuple(v.shape)}")
    H, K, V = q.shape[-2], q.shape[-1], v.shape[-1]
    if v.shape[-2] != H:
        raise Reject(f"GVA is not supported (v has {v.shape[-2]} heads, q {H})")
    if K != V or K not in HEAD_DIMS:
        raise Reject(f"head dims K == V in {HEAD_DIMS} only, got K={K}, V={V}")
    if dt_bias is not None and dt_bias.dim() == 1 and dt_bias.numel() == H * K:
        dt_bias = dt_bias.view(H, K)
    return A_log, dt_bias


def _chunk_args(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, safe_gate=False,
                lower_bound=None, disable_recompute=False, return_intermediate_states=False,
                state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None,
                use_graph=False, max_num_seqs=None, **kwargs) -> dict:
    """fla chunk_kda's arguments as kda_cute.chunk_kda's, checked on their metadata."""
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise Reject("transpose_state_layout and state_v_first both given")
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    unknown = sorted(set(kwargs) - _IGNORED)
    if unknown:
        raise Reject(f"unsupported arguments {unknown}")
    if allow_neg_eigval:
        raise Reject("allow_neg_eigval=True is not supported")
    if cp_context is not None:
        raise Reject("context parallel (cp_context) is not supported")
    if return_intermediate_states:
        raise Reject("return_intermediate_states=True is not supported")
    _grad(q, k, v, g, beta, initial_state, A_log, dt_bias)
    A_log, dt_bias = _common(q, v, A_log, dt_bias)
    K = q.shape[-1]
    gate = "none"
    if use_gate_in_kernel:
        if lower_bound is None and safe_gate:
            raise Reject("safe_gate needs lower_bound")
        gate = "bounded" if lower_bound is not None else "unbounded"
        if A_log is None:
            if gate == "unbounded":
                raise Reject("the unbounded gate needs A_log")
            A_log = _unit_A_log(q.shape[-2], q.device)
    s0 = initial_state
    if s0 is not None and not state_v_first:
        # K-first [N, H, K, V]: copied to V-first by the call; here its metadata alone
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        if (not isinstance(s0, torch.Tensor) or tuple(s0.shape) != (N, q.shape[-2], K, K)
                or s0.dtype not in (torch.float32, torch.bfloat16) or s0.device != q.device):
            raise Reject(f"initial_state must be [N={N}, H, K, V] float32 or bfloat16 on "
                         f"{q.device}")
        s0 = None
    scale = K ** -0.5 if scale is None else scale
    opts = checks.options(gate, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel)
    try:
        # v stands for the output the call allocates (its metadata: [B, T, H, V] bf16 rows)
        checks.forward(Call(q, k, v, g, beta, v, A_log, dt_bias, s0, None, cu_seqlens,
                            float(scale), lower_bound, None, None, None, None, None, None, None,
                            None, None), opts, memory=False)
    except (ValueError, TypeError) as e:
        raise Reject(str(e)) from None
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
    """fla fused_recurrent_kda_fwd's arguments, checked on what kda-cute refuses."""
    if kwargs:
        raise Reject(f"unsupported arguments {sorted(kwargs)}")
    if allow_neg_eigval:
        raise Reject("allow_neg_eigval=True is not supported")
    _grad(q, k, v, g, beta, initial_state, A_log, dt_bias)
    A_log, dt_bias = _common(q, v, A_log, dt_bias)
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.dtype != torch.bfloat16:
            raise Reject(f"{name} must be bfloat16, got {t.dtype}")
    if beta.dim() == v.dim():
        raise Reject("headwise beta is not supported")
    if initial_state is not None and initial_state.dtype not in (torch.float32, torch.bfloat16):
        raise Reject(f"initial_state must be float32 or bfloat16, got {initial_state.dtype}")
    if (ssm_state_indices is not None or (inplace_final_state and initial_state is not None)) \
            and not state_v_first:
        raise Reject("a state updated in place must be V-first (state_v_first=True)")
    if use_gate_in_kernel and A_log is None:
        if lower_bound is None:
            raise Reject("the unbounded gate needs A_log")
        A_log = _unit_A_log(q.shape[-2], q.device)
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias,
                initial_state=initial_state, scale=scale, output_final_state=output_final_state,
                inplace_final_state=inplace_final_state, state_v_first=state_v_first,
                cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
                num_accepted_tokens=num_accepted_tokens,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_gate_in_kernel=use_gate_in_kernel,
                use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, lower_bound=lower_bound,
                out=out)


def _verdict(args_of, *args, **kwargs) -> tuple[bool, str | None]:
    try:
        args_of(*args, **kwargs)
    except Reject as e:
        return False, str(e)
    return True, None


class KdaCuteBackend(BaseBackend):
    """kda-cute's forward (chunk_kda) and serving step (fused_recurrent_kda_fwd) for fla."""

    backend_type = "kda_cute"
    package_name = "kda_cute"
    env_var = ENV_VAR
    default_enable = True
    priority = PRIORITY

    def chunk_kda_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
        return _verdict(_chunk_args, *args, **kwargs)

    def chunk_kda(self, *args, **kwargs):
        return api.chunk_kda(**_chunk_args(*args, **kwargs))

    def fused_recurrent_kda_fwd_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
        return _verdict(_recurrent_args, *args, **kwargs)

    def fused_recurrent_kda_fwd(self, *args, **kwargs):
        return serving.fused_recurrent_kda_fwd(**_recurrent_args(*args, **kwargs))


_registered = False


def register() -> type[KdaCuteBackend]:
    """Register the backend with fla (once; later calls do nothing): for `chunk_kda` and for
    the "kda" operations (`fused_recurrent_kda_fwd`). Returns the backend class."""
    global _registered
    if not _registered:
        from fla.ops.kda.chunk import chunk_kda
        _fla_register(chunk_kda)(KdaCuteBackend)
        _fla_register("kda")(KdaCuteBackend)
        _registered = True
    return KdaCuteBackend


__all__ = ["ENV_VAR", "PRIORITY", "KdaCuteBackend", "Reject", "register"]
FLA_VERSION = getattr(fla, "__version__", "unknown")
