"""Serving against a state pool: `decode`, `verify`, `commit` and `recurrent`, each checks
(kda_cute.checks.step: metadata, on the host, no sync, to a StepProblem) -> a
step plan (kda_cute.plans.step) -> run, one token-step kernel launch; what the checks and the
plan concluded is kept in kda_cute's one memo by the arguments' metadata; and `check_errors`,
what the kernels found. The contract:
docs/serving.md.

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

from . import declare, errors, launch, memo
from .checks import err, flag, has_address
from .checks import step as step_checks
from .checks.step import BF16, Checked, verify_style
from .plans import device_info
from .plans.step import step_plan
from .problem import StepCall
from .specs.step import StepConfig

_HOST = ("config", "stream", "bind")  # what the torch.library ops cannot take


def _plan(c: Checked, dev):
    """The step's plan, from what its checks concluded; the arguments behind its error words
    noted for their reports."""
    plan = step_plan(c.problem, c.options, device_info(dev))
    errors.note(dev, c.problem.form.split()[0], c.names)
    return plan


def _entry(kind: str, check, tensors: tuple, scalars: tuple, out=None, like=None, plan=None):
    """A call of `kind`: its plan, scale, lower bound and a dict for launch.again (the resolved
    steps of this metadata's calls, by their tensors' addresses), kept in the memo by the
    arguments' metadata and made on a miss by `check(*tensors, *scalars)` and a plan for the
    first tensor's device (`plan(checked, device)`, None: the step's); then `out`: where None,
    the one the checks allocated (a miss) or a new bf16 one like `like`. A dry run only checks:
    no plan."""
    if declare.dry():
        return None, None, None, None, check(*tensors, *scalars).out
    key = memo.key(kind, tensors, scalars)
    hit = memo.recall(key)
    if hit is None:
        c = check(*tensors, *scalars)
        made = (plan or _plan)(c, tensors[0].device)
        hit = memo.remember(key, (made, c.scale, c.lower_bound, {}))
        out = c.out
    if out is None and like is not None:
        out = torch.empty(like.shape, dtype=BF16, device=like.device)
    return (*hit, out)


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


def _launch(plan, call, dev, stream, bind, keep, result):
    """Bind the step (returns the Bound) or run it (returns `result`); an eager call has read
    the error words in _again just before."""
    if bind:
        errors.raise_pending(dev)
        return launch.bind(plan, call, None, stream)
    launch.run(plan, call, None, stream, keep)
    return result


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
    tensors = (q, k, v, g, beta, state, state_indices, out, output_state_indices,
               has_initial_state, A_log, dt_bias)
    plan, scale, lb, again, out = _entry(
        "decode", step_checks.decode, tensors,
        (scale, lower_bound, gate, qk_l2norm, beta_sigmoid, null_slot, config), out, v)
    if plan is not None and not bind:  # a call like an earlier one (metadata by the key)
        addresses = _addresses(*tensors[:7], out, *tensors[8:])  # the out written
        if _again(again, addresses, q.device, stream):
            return out
    _aligned(("q", q), ("k", k), ("v", v), ("g", g), ("out", out), ("state", state))
    if plan is None:  # a dry run: its checks only
        return out
    wi = output_state_indices if output_state_indices is not None else state_indices
    hi = None if has_initial_state is None else has_initial_state.view(torch.int8)
    call = StepCall(q, k, v, g, beta, out, A_log, dt_bias, state, state, None, state_indices,
                    wi, None, None, hi, scale, lb)
    return _launch(plan, call, q.device, stream, bind, None if bind else (again, addresses), out)


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
    plan, scale, lb, again, out = _entry(
        "verify", step_checks.verify, tensors,
        (scale, lower_bound, gate, qk_l2norm, beta_sigmoid, null_slot, config), out, v)
    if plan is not None and not bind:  # a call like an earlier one (metadata by the key)
        addresses = _addresses(*tensors[:13], out, *tensors[14:])  # the out written
        if _again(again, addresses, q.device, stream):
            return out
    _aligned(("q", q), ("k", k), ("v", v), ("g", g), ("out", out), ("state", state),
             ("intermediate_states", intermediate_states))
    if plan is None:  # a dry run: its checks only
        return out
    if ssm_state_indices is not None:
        dst, ridx, widx = state, ssm_state_indices, ssm_state_indices
    else:
        dst, ridx, widx = intermediate_states, state_indices, intermediate_state_indices
    call = StepCall(q, k, v, g, beta, out, A_log, dt_bias, state, dst, cu_seqlens, ridx,
                    widx, num_accepted_tokens, retrieve_parent_token, None, scale, lb)
    return _launch(plan, call, q.device, stream, bind, None if bind else (again, addresses), out)


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
    plan, _, _, again, _ = _entry("commit", step_checks.commit, tensors, (null_slot,))
    if plan is not None and not bind:  # a call like an earlier one (metadata by the key)
        addresses = _addresses(*tensors)
        if _again(again, addresses, state.device, stream):
            return state
    _aligned(("state", state), ("intermediate_states", intermediate_states))
    if plan is None:  # a dry run: its checks only
        return state
    call = StepCall(None, None, None, None, None, None, None, None, intermediate_states, state,
                    None, intermediate_state_indices, state_indices, accepted_step, None, None,
                    1.0, None)
    keep = None if bind else (again, addresses)
    return _launch(plan, call, state.device, stream, bind, keep, state)


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
    plan, scale, lb, again, out = _entry(
        "recurrent", step_checks.recurrent, tensors,
        (scale, lower_bound, gate, qk_l2norm, beta_sigmoid, config), out, v)
    if plan is not None and not bind:  # a call like an earlier one (metadata by the key)
        addresses = _addresses(*tensors[:8], out, *tensors[9:])  # the out written
        if _again(again, addresses, q.device, stream):
            return out
    _aligned(("q", q), ("k", k), ("v", v), ("g", g), ("out", out),
             ("initial_state", initial_state), ("final_state", final_state))
    if plan is None:  # a dry run: its checks only
        return out
    call = StepCall(q, k, v, g, beta, out, A_log, dt_bias, initial_state, final_state,
                    cu_seqlens, None, None, None, None, None, scale, lb)
    return _launch(plan, call, q.device, stream, bind, None if bind else (again, addresses), out)


def check_errors(device=None, sync: bool = False) -> None:
    """Raise DeviceValueError if a serving kernel on `device` (None: the current one; an index,
    a torch.device or "cuda:N") found a bad value. sync=True waits for the device first (every
    call queued so far is covered); otherwise only kernels that have finished are."""
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:
            raise ValueError(f"device: expected a CUDA device, got {device!r}") from None
    if isinstance(device, torch.device) and device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device, got {device}")
    if device is not None and not isinstance(device, torch.device) and (
            isinstance(device, bool) or not isinstance(device, int) or device < 0):
        raise TypeError(f"device: expected None, a device index, a torch.device or 'cuda:N', "
                        f"got {device!r}")
    index = device.index if isinstance(device, torch.device) else device
    if index is not None and torch.cuda.is_available() and index >= torch.cuda.device_count():
        raise ValueError(f"device: expected one of the {torch.cuda.device_count()} CUDA "
                         f"devices, got {index}")
    if flag("sync", sync):
        torch.cuda.synchronize(errors._index(device))
    errors.raise_pending(device)

__all__ = ["check_errors", "commit", "decode", "recurrent", "verify", "verify_style"]
