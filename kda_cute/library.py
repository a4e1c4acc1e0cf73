"""torch.library custom ops, so that torch.compile (fullgraph included) and the graphs it builds
take kda-cute's kernels as opaque nodes:

    torch.ops.kda_cute.fwd            out, final_state, checkpoint_state, workspace written
    torch.ops.kda_cute.fwd_inplace    the same with one state read and written (`state`)
    torch.ops.kda_cute.decode         state pool and out written
    torch.ops.kda_cute.verify         style (a): state pool and out written
    torch.ops.kda_cute.verify_scratch style (b): intermediate_states and out written
    torch.ops.kda_cute.commit         state pool written
    torch.ops.kda_cute.recurrent      out, final_state written
    torch.ops.kda_cute.recurrent_inplace  out and one state read and written

Each schema names what it writes (`mutates_args`), and a state read and written in place is one
in/out tensor (an op may not take two aliasing arguments when one is written). The ops return
nothing: their outputs are the caller's tensors. Their fakes run the metadata checks of the
eager call (kda_cute.checks, the serving checks with dry=True), so a bad shape, dtype or option
raises while tracing, naming the argument, and never touch data.

The public functions (`kda_cute.fwd`, `chunk_kda`, `decode`, `verify`, `commit`,
`fused_recurrent_kda_fwd`, `recurrent`) call these ops only while torch.compile traces them
(`torch.compiler.is_compiling()`); eagerly they run their own body, so an eager call pays no
dispatcher cost. The functions below are those traced forms: they allocate what the eager call
would (torch.empty, which the graph records) and call the op.
"""

from __future__ import annotations

import torch
from torch import Tensor

NAMESPACE = "kda_cute"


class _NoHint(Exception):
    pass


def _hint(x):
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        h = x.node.hint
        if h is None:  # unbacked: nothing to check against until it runs
            raise _NoHint
        return type(h)(h)
    return x


def _symbolic(x) -> bool:
    if isinstance(x, Tensor):
        return any(isinstance(d, torch.SymInt) for d in (*x.shape, *x.stride()))
    return isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _metadata_check(check):
    """A fake's metadata check. Under dynamic shapes it runs on stand-ins of the example sizes
    (meta tensors: sizes, strides and dtypes are all the checks read) rather than adding
    guards; the eager checks of the real call see every actual shape."""
    def run(*args):
        if not any(_symbolic(a) for a in args):
            return check(*args)
        try:
            concrete = tuple(
                torch.empty_strided([_hint(d) for d in a.shape], [_hint(d) for d in a.stride()],
                                    dtype=a.dtype, device="meta") if isinstance(a, Tensor)
                else _hint(a) for a in args)
        except _NoHint:
            return None
        return check(*concrete)
    return run


def _not_traced(**named) -> None:
    """Options a traced call cannot take: a config object, a stream, a bound plan."""
    for name, value in named.items():
        if value not in (None, False):
            raise ValueError(f"{name}: expected {'False' if name == 'bind' else 'None'} under "
                             f"torch.compile (the ops take tensors and scalars only), got "
                             f"{value!r}")


# ------------------------------------------------------------------------------ the forward
def _fwd_kwargs(gate, qk_l2norm, beta_sigmoid, check_seqlens, segments, precision,
                state_indices, output_state_indices, has_initial_state, null_slot,
                checkpoint_state, checkpoint_offsets, checkpoint_slots, checkpoint_every,
                checkpoint_first):
    return dict(gate=gate, qk_l2norm=qk_l2norm, beta_sigmoid=beta_sigmoid,
                check_seqlens=check_seqlens, segments=segments, precision=precision,
                state_indices=state_indices, output_state_indices=output_state_indices,
                has_initial_state=has_initial_state, null_slot=null_slot,
                checkpoint_state=checkpoint_state, checkpoint_offsets=checkpoint_offsets,
                checkpoint_slots=checkpoint_slots, checkpoint_every=checkpoint_every,
                checkpoint_first=checkpoint_first)


@_metadata_check
def _fwd_fake(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state,
              final_state, cu_seqlens, gate, qk_l2norm, beta_sigmoid, segments, precision,
              state_indices, output_state_indices, has_initial_state, null_slot,
              checkpoint_state, checkpoint_offsets, checkpoint_slots, checkpoint_every,
              checkpoint_first) -> None:
    from . import checks
    from .problem import Call
    opts = checks.options(gate, qk_l2norm, beta_sigmoid, segments, None, precision)
    call = Call(q, k, v, g, beta, out, A_log, dt_bias, initial_state, final_state, cu_seqlens,
                scale, lower_bound, state_indices, output_state_indices, has_initial_state,
                null_slot, checkpoint_state, checkpoint_offsets, checkpoint_slots,
                checkpoint_every, checkpoint_first)
    checks.forward(call, opts, memory=False, cuda=q.device.type != "meta")


@torch.library.custom_op(f"{NAMESPACE}::fwd", device_types="cuda",
                         mutates_args=("out", "final_state", "workspace", "checkpoint_state"))
def _fwd_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
            out: Tensor, A_log: Tensor | None, dt_bias: Tensor | None,
            lower_bound: float | None, initial_state: Tensor | None,
            final_state: Tensor | None, cu_seqlens: Tensor | None, workspace: Tensor | None,
            gate: str, qk_l2norm: bool, beta_sigmoid: bool, check_seqlens: bool,
            segments: int | None, precision: str, state_indices: Tensor | None,
            output_state_indices: Tensor | None, has_initial_state: Tensor | None,
            null_slot: int | None, checkpoint_state: Tensor | None,
            checkpoint_offsets: Tensor | None, checkpoint_slots: Tensor | None,
            checkpoint_every: int | None, checkpoint_first: Tensor | None) -> None:
    from .api import fwd
    fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state,
        cu_seqlens, workspace, **_fwd_kwargs(
            gate, qk_l2norm, beta_sigmoid, check_seqlens, segments, precision, state_indices,
            output_state_indices, has_initial_state, null_slot, checkpoint_state,
            checkpoint_offsets, checkpoint_slots, checkpoint_every, checkpoint_first))


@_fwd_op.register_fake
def _(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state, final_state,
      cu_seqlens, workspace, gate, qk_l2norm, beta_sigmoid, check_seqlens, segments,
      precision, state_indices, output_state_indices, has_initial_state, null_slot,
      checkpoint_state, checkpoint_offsets, checkpoint_slots, checkpoint_every,
      checkpoint_first):
    _fwd_fake(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state,
              final_state, cu_seqlens, gate, qk_l2norm, beta_sigmoid, segments, precision,
              state_indices, output_state_indices, has_initial_state, null_slot,
              checkpoint_state, checkpoint_offsets, checkpoint_slots, checkpoint_every,
              checkpoint_first)


@torch.library.custom_op(f"{NAMESPACE}::fwd_inplace", device_types="cuda",
                         mutates_args=("out", "state", "workspace", "checkpoint_state"))
def _fwd_inplace_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                    out: Tensor, A_log: Tensor | None, dt_bias: Tensor | None,
                    lower_bound: float | None, state: Tensor, cu_seqlens: Tensor | None,
                    workspace: Tensor | None, gate: str, qk_l2norm: bool, beta_sigmoid: bool,
                    check_seqlens: bool, segments: int | None, precision: str,
                    state_indices: Tensor | None, output_state_indices: Tensor | None,
                    has_initial_state: Tensor | None, null_slot: int | None,
                    checkpoint_state: Tensor | None, checkpoint_offsets: Tensor | None,
                    checkpoint_slots: Tensor | None, checkpoint_every: int | None,
                    checkpoint_first: Tensor | None) -> None:
    from .api import fwd
    fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, state, state, cu_seqlens,
        workspace, **_fwd_kwargs(
            gate, qk_l2norm, beta_sigmoid, check_seqlens, segments, precision, state_indices,
            output_state_indices, has_initial_state, null_slot, checkpoint_state,
            checkpoint_offsets, checkpoint_slots, checkpoint_every, checkpoint_first))


@_fwd_inplace_op.register_fake
def _(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, state, cu_seqlens, workspace,
      gate, qk_l2norm, beta_sigmoid, check_seqlens, segments, precision, state_indices,
      output_state_indices, has_initial_state, null_slot, checkpoint_state, checkpoint_offsets,
      checkpoint_slots, checkpoint_every, checkpoint_first):
    _fwd_fake(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, state, state,
              cu_seqlens, gate, qk_l2norm, beta_sigmoid, segments, precision, state_indices,
              output_state_indices, has_initial_state, null_slot, checkpoint_state,
              checkpoint_offsets, checkpoint_slots, checkpoint_every, checkpoint_first)


def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None,
        final_state=None, cu_seqlens=None, workspace=None, *, gate="bounded", qk_l2norm=True,
        beta_sigmoid=True, check_seqlens=False, config=None, segments=None, precision="fast",
        state_indices=None, output_state_indices=None, has_initial_state=None,
        null_slot=None, checkpoint_state=None, checkpoint_offsets=None, checkpoint_slots=None,
        checkpoint_every=None, checkpoint_first=None):
    """kda_cute.fwd as torch.compile traces it: one op, in place where the state is."""
    _not_traced(config=config)
    rest = _fwd_kwargs(gate, qk_l2norm, beta_sigmoid, check_seqlens, segments, precision,
                       state_indices, output_state_indices, has_initial_state, null_slot,
                       checkpoint_state, checkpoint_offsets, checkpoint_slots, checkpoint_every,
                       checkpoint_first)
    scale = float(scale)
    lower_bound = None if lower_bound is None else float(lower_bound)
    if initial_state is not None and final_state is initial_state:
        _fwd_inplace_op(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound,
                        initial_state, cu_seqlens, workspace, **rest)
    else:
        _fwd_op(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state,
                final_state, cu_seqlens, workspace, **rest)


# ------------------------------------------------------------------------------ serving
def _step_scalars(scale, lower_bound):
    return (None if scale is None else float(scale),
            None if lower_bound is None else float(lower_bound))


@torch.library.custom_op(f"{NAMESPACE}::decode", device_types="cuda",
                         mutates_args=("state", "out"))
def _decode_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
               state_indices: Tensor | None, out: Tensor, output_state_indices: Tensor | None,
               has_initial_state: Tensor | None, A_log: Tensor | None, dt_bias: Tensor | None,
               scale: float | None, lower_bound: float | None, gate: str, qk_l2norm: bool,
               beta_sigmoid: bool, null_slot: int | None) -> None:
    from .serving import decode
    decode(q, k, v, g, beta, state, state_indices, out=out,
           output_state_indices=output_state_indices, has_initial_state=has_initial_state,
           A_log=A_log, dt_bias=dt_bias, scale=scale, lower_bound=lower_bound, gate=gate,
           qk_l2norm=qk_l2norm, beta_sigmoid=beta_sigmoid, null_slot=null_slot)


@_decode_op.register_fake
def _(q, k, v, g, beta, state, state_indices, out, output_state_indices, has_initial_state,
      A_log, dt_bias, scale, lower_bound, gate, qk_l2norm, beta_sigmoid, null_slot):
    _decode_fake(q, k, v, g, beta, state, state_indices, out, output_state_indices,
                 has_initial_state, A_log, dt_bias, scale, lower_bound, gate, qk_l2norm,
                 beta_sigmoid, null_slot)


@_metadata_check
def _decode_fake(*args):
    from .serving import _decode_plan
    _decode_plan(*args, None, dry=True)


def decode(q, k, v, g, beta, state, state_indices=None, *, out=None, output_state_indices=None,
           has_initial_state=None, A_log=None, dt_bias=None, scale=None, lower_bound=None,
           gate="bounded", qk_l2norm=True, beta_sigmoid=True, null_slot=None, config=None,
           stream=None, bind=False):
    """kda_cute.decode as torch.compile traces it."""
    _not_traced(config=config, stream=stream, bind=bind)
    if out is None:
        out = torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)
    scale, lower_bound = _step_scalars(scale, lower_bound)
    _decode_op(q, k, v, g, beta, state, state_indices, out, output_state_indices,
               has_initial_state, A_log, dt_bias, scale, lower_bound, gate, qk_l2norm,
               beta_sigmoid, null_slot)
    return out


@_metadata_check
def _verify_fake(q, k, v, g, beta, state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                 state_indices, intermediate_states, intermediate_state_indices,
                 retrieve_parent_token, out, A_log, dt_bias, scale, lower_bound, gate,
                 qk_l2norm, beta_sigmoid, null_slot):
    from .serving import _verify_plan
    _verify_plan(q, k, v, g, beta, state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                 state_indices, intermediate_states, intermediate_state_indices,
                 retrieve_parent_token, out, A_log, dt_bias, scale, lower_bound, gate,
                 qk_l2norm, beta_sigmoid, null_slot, None, dry=True)


def _verify_eager(q, k, v, g, beta, state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                  state_indices, intermediate_states, intermediate_state_indices,
                  retrieve_parent_token, out, A_log, dt_bias, scale, lower_bound, gate,
                  qk_l2norm, beta_sigmoid, null_slot):
    from .serving import verify
    verify(q, k, v, g, beta, state, cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices,
           num_accepted_tokens=num_accepted_tokens, state_indices=state_indices,
           intermediate_states=intermediate_states,
           intermediate_state_indices=intermediate_state_indices,
           retrieve_parent_token=retrieve_parent_token, out=out, A_log=A_log, dt_bias=dt_bias,
           scale=scale, lower_bound=lower_bound, gate=gate, qk_l2norm=qk_l2norm,
           beta_sigmoid=beta_sigmoid, null_slot=null_slot)


@torch.library.custom_op(f"{NAMESPACE}::verify", device_types="cuda",
                         mutates_args=("state", "out"))
def _verify_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
               cu_seqlens: Tensor | None, ssm_state_indices: Tensor,
               num_accepted_tokens: Tensor | None, out: Tensor, A_log: Tensor | None,
               dt_bias: Tensor | None, scale: float | None, lower_bound: float | None,
               gate: str, qk_l2norm: bool, beta_sigmoid: bool, null_slot: int | None) -> None:
    _verify_eager(q, k, v, g, beta, state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                  None, None, None, None, out, A_log, dt_bias, scale, lower_bound, gate,
                  qk_l2norm, beta_sigmoid, null_slot)


@_verify_op.register_fake
def _(q, k, v, g, beta, state, cu_seqlens, ssm_state_indices, num_accepted_tokens, out, A_log,
      dt_bias, scale, lower_bound, gate, qk_l2norm, beta_sigmoid, null_slot):
    _verify_fake(q, k, v, g, beta, state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                 None, None, None, None, out, A_log, dt_bias, scale, lower_bound, gate,
                 qk_l2norm, beta_sigmoid, null_slot)


@torch.library.custom_op(f"{NAMESPACE}::verify_scratch", device_types="cuda",
                         mutates_args=("intermediate_states", "out"))
def _verify_scratch_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                       state: Tensor, cu_seqlens: Tensor | None, state_indices: Tensor,
                       intermediate_states: Tensor, intermediate_state_indices: Tensor | None,
                       retrieve_parent_token: Tensor | None, out: Tensor,
                       A_log: Tensor | None, dt_bias: Tensor | None, scale: float | None,
                       lower_bound: float | None, gate: str, qk_l2norm: bool,
                       beta_sigmoid: bool, null_slot: int | None) -> None:
    _verify_eager(q, k, v, g, beta, state, cu_seqlens, None, None, state_indices,
                  intermediate_states, intermediate_state_indices, retrieve_parent_token, out,
                  A_log, dt_bias, scale, lower_bound, gate, qk_l2norm, beta_sigmoid, null_slot)


@_verify_scratch_op.register_fake
def _(q, k, v, g, beta, state, cu_seqlens, state_indices, intermediate_states,
      intermediate_state_indices, retrieve_parent_token, out, A_log, dt_bias, scale,
      lower_bound, gate, qk_l2norm, beta_sigmoid, null_slot):
    _verify_fake(q, k, v, g, beta, state, cu_seqlens, None, None, state_indices,
                 intermediate_states, intermediate_state_indices, retrieve_parent_token, out,
                 A_log, dt_bias, scale, lower_bound, gate, qk_l2norm, beta_sigmoid, null_slot)


def verify(q, k, v, g, beta, state, *, cu_seqlens=None, ssm_state_indices=None,
           num_accepted_tokens=None, state_indices=None, intermediate_states=None,
           intermediate_state_indices=None, retrieve_parent_token=None, out=None, A_log=None,
           dt_bias=None, scale=None, lower_bound=None, gate="bounded", qk_l2norm=True,
           beta_sigmoid=True, null_slot=None, config=None, stream=None, bind=False):
    """kda_cute.verify as torch.compile traces it: style (a) writes the pool, style (b) the
    scratch alone (the pool only read)."""
    _not_traced(config=config, stream=stream, bind=bind)
    if out is None:
        out = torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)
    scale, lower_bound = _step_scalars(scale, lower_bound)
    from .serving import verify_style
    if verify_style(ssm_state_indices, num_accepted_tokens, state_indices, intermediate_states,
                    retrieve_parent_token, intermediate_state_indices) == "a":
        _verify_op(q, k, v, g, beta, state, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                   out, A_log, dt_bias, scale, lower_bound, gate, qk_l2norm, beta_sigmoid,
                   null_slot)
    else:
        _verify_scratch_op(q, k, v, g, beta, state, cu_seqlens, state_indices,
                           intermediate_states, intermediate_state_indices,
                           retrieve_parent_token, out, A_log, dt_bias, scale, lower_bound, gate,
                           qk_l2norm, beta_sigmoid, null_slot)
    return out


@torch.library.custom_op(f"{NAMESPACE}::commit", device_types="cuda", mutates_args=("state",))
def _commit_op(state: Tensor, intermediate_states: Tensor, state_indices: Tensor,
               accepted_step: Tensor, intermediate_state_indices: Tensor | None,
               null_slot: int | None) -> None:
    from .serving import commit
    commit(state, intermediate_states, state_indices, accepted_step,
           intermediate_state_indices, null_slot=null_slot)


@_commit_op.register_fake
def _(state, intermediate_states, state_indices, accepted_step, intermediate_state_indices,
      null_slot):
    _commit_fake(state, intermediate_states, state_indices, accepted_step,
                 intermediate_state_indices, null_slot)


@_metadata_check
def _commit_fake(*args):
    from .serving import _commit_plan
    _commit_plan(*args, dry=True)


def commit(state, intermediate_states, state_indices, accepted_step,
           intermediate_state_indices=None, *, null_slot=None, stream=None, bind=False):
    """kda_cute.commit as torch.compile traces it."""
    _not_traced(stream=stream, bind=bind)
    _commit_op(state, intermediate_states, state_indices, accepted_step,
               intermediate_state_indices, null_slot)
    return state


def _recurrent_eager(q, k, v, g, beta, initial_state, final_state, cu_seqlens, out, A_log,
                     dt_bias, scale, lower_bound, gate, qk_l2norm, beta_sigmoid):
    from .serving import recurrent
    recurrent(q, k, v, g, beta, initial_state, final_state, cu_seqlens=cu_seqlens, out=out,
              A_log=A_log, dt_bias=dt_bias, scale=scale, lower_bound=lower_bound, gate=gate,
              qk_l2norm=qk_l2norm, beta_sigmoid=beta_sigmoid)


@_metadata_check
def _recurrent_fake(q, k, v, g, beta, initial_state, final_state, cu_seqlens, out, A_log,
                    dt_bias, scale, lower_bound, gate, qk_l2norm, beta_sigmoid):
    from .serving import _recurrent_plan
    _recurrent_plan(q, k, v, g, beta, initial_state, final_state, cu_seqlens, out, A_log,
                    dt_bias, scale, lower_bound, gate, qk_l2norm, beta_sigmoid, None, dry=True)


@torch.library.custom_op(f"{NAMESPACE}::recurrent", device_types="cuda",
                         mutates_args=("final_state", "out"))
def _recurrent_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  initial_state: Tensor | None, final_state: Tensor | None,
                  cu_seqlens: Tensor | None, out: Tensor, A_log: Tensor | None,
                  dt_bias: Tensor | None, scale: float | None, lower_bound: float | None,
                  gate: str, qk_l2norm: bool, beta_sigmoid: bool) -> None:
    _recurrent_eager(q, k, v, g, beta, initial_state, final_state, cu_seqlens, out, A_log,
                     dt_bias, scale, lower_bound, gate, qk_l2norm, beta_sigmoid)


@_recurrent_op.register_fake
def _(q, k, v, g, beta, initial_state, final_state, cu_seqlens, out, A_log, dt_bias, scale,
      lower_bound, gate, qk_l2norm, beta_sigmoid):
    _recurrent_fake(q, k, v, g, beta, initial_state, final_state, cu_seqlens, out, A_log,
                    dt_bias, scale, lower_bound, gate, qk_l2norm, beta_sigmoid)


@torch.library.custom_op(f"{NAMESPACE}::recurrent_inplace", device_types="cuda",
                         mutates_args=("state", "out"))
def _recurrent_inplace_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                          state: Tensor, cu_seqlens: Tensor | None, out: Tensor,
                          A_log: Tensor | None, dt_bias: Tensor | None, scale: float | None,
                          lower_bound: float | None, gate: str, qk_l2norm: bool,
                          beta_sigmoid: bool) -> None:
    _recurrent_eager(q, k, v, g, beta, state, state, cu_seqlens, out, A_log, dt_bias, scale,
                     lower_bound, gate, qk_l2norm, beta_sigmoid)


@_recurrent_inplace_op.register_fake
def _(q, k, v, g, beta, state, cu_seqlens, out, A_log, dt_bias, scale, lower_bound, gate,
      qk_l2norm, beta_sigmoid):
    _recurrent_fake(q, k, v, g, beta, state, state, cu_seqlens, out, A_log, dt_bias, scale,
                    lower_bound, gate, qk_l2norm, beta_sigmoid)


def recurrent(q, k, v, g, beta, initial_state=None, final_state=None, *, cu_seqlens=None,
              out=None, A_log=None, dt_bias=None, scale=None, lower_bound=None, gate="bounded",
              qk_l2norm=True, beta_sigmoid=True, config=None, stream=None, bind=False):
    """kda_cute.serving.recurrent as torch.compile traces it."""
    _not_traced(config=config, stream=stream, bind=bind)
    if out is None:
        out = torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)
    scale, lower_bound = _step_scalars(scale, lower_bound)
    if initial_state is not None and final_state is initial_state:
        _recurrent_inplace_op(q, k, v, g, beta, initial_state, cu_seqlens, out, A_log, dt_bias,
                              scale, lower_bound, gate, qk_l2norm, beta_sigmoid)
    else:
        _recurrent_op(q, k, v, g, beta, initial_state, final_state, cu_seqlens, out, A_log,
                      dt_bias, scale, lower_bound, gate, qk_l2norm, beta_sigmoid)
    return out


OPS = ("fwd", "fwd_inplace", "decode", "verify", "verify_scratch", "commit", "recurrent",
       "recurrent_inplace")

__all__ = ["NAMESPACE", "OPS", "commit", "decode", "fwd", "recurrent", "verify"]
