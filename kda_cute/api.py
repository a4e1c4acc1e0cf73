"""The prefill's public entry point `fwd` (FlashKDA's low-level call; fla's `chunk_kda` is made
of it, kda_cute.fla_forms), in three steps: checks (kda_cute.checks) -> plan (kda_cute.plans)
-> run (kda_cute.launch); and what a plan says of a problem (`describe`, `schedule`).

Every input is checked on the host before anything is launched; a bad input raises ValueError /
TypeError naming the argument, what was expected and what was got. A call does no host sync
except the optional check of cu_seqlens' values. A serving loop with fixed buffers binds the
plan once instead (`kda_cute.bind`) and calls it each step.
"""

from __future__ import annotations

from torch import Tensor

from . import checks, declare, errors, ladder, launch, memo, plans
from .checks import validate
from .ladder import FwdConfig
from .plans import device_info, workspace_bytes
from .problem import Call, Options, Problem


@declare.op("fwd", writes=("out", "final_state", "workspace", "checkpoint_state"),
            host_only=("config",), inplace=("initial_state", "final_state"))
def fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, out: Tensor,
        A_log: Tensor | None, dt_bias: Tensor | None, lower_bound: float | None,
        initial_state: Tensor | None = None, final_state: Tensor | None = None,
        cu_seqlens: Tensor | None = None, workspace: Tensor | None = None, *,
        gate: str = "bounded", qk_l2norm: bool = True, beta_sigmoid: bool = True,
        check_seqlens: bool = False, config: FwdConfig | None = None, segments: int | None = None,
        precision: str = "fast", state_indices: Tensor | None = None,
        output_state_indices: Tensor | None = None, has_initial_state: Tensor | None = None,
        null_slot: int | None = None, checkpoint_state: Tensor | None = None,
        checkpoint_offsets: Tensor | None = None, checkpoint_slots: Tensor | None = None,
        checkpoint_every: int | None = None, checkpoint_first: Tensor | None = None) -> None:
    """KDA forward, FlashKDA's low-level call: writes `out` and `final_state` in place.

    q, k, g: [B, T, H, K] bf16; v, out: [B, T, H, V] bf16; beta: [B, T, H] bf16 (logits when
    beta_sigmoid); A_log: [H] and dt_bias: [H, K] (or [H*K]), each fp32, bf16 or fp16 (read as
    held) or None; lower_bound in [-5, 0) for the bounded gate. gate: "bounded" (FlashKDA /
    Kimi-K3), "unbounded" (-exp(A_log) softplus(g + dt_bias), Kimi-Linear) or "none" (g is
    already the log-space decay). initial_state / final_state: [N, H, V, K] fp32 or bf16, may
    be the same tensor. cu_seqlens: [N+1] int64/int32 with B == 1, non-decreasing from 0 to at
    most T: checked on the device (no host sync; a bad batch runs no tokens and raises
    kda_cute.DeviceValueError by the next forward or serving call, or by
    `kda_cute.check_errors()`); check_seqlens=True checks the values on the host first too (a
    host sync, skipped in CUDA-graph capture). workspace: optional caller-owned uint8 CUDA
    tensor (see `workspace_bytes`).
    config: a FwdConfig to use instead of the ladder's choice (kernel development, sweeps).
    precision: the ladder's choice between "fast" (K2's products on fp16 operands: fp32 state
    within ~4e-4 of float64; where values or states of ~4e4 and more overflow them, the state
    rows that did are redone on the device with each row scaled by a power of two per chunk,
    so any finite bf16 values are in range) and "precise" (the state's products on fp16
    operands with the state scaled per row, the rest on bf16 hi/lo: no less accurate than
    fast anywhere, ~5e-6 state error, bf16's range; ~1.35x fast's time). A forward whose
    state becomes non-finite all the same (inf / NaN inputs) is reported: DeviceValueError
    naming `precision` by the next forward or serving call, or by `kda_cute.check_errors()`.
    segments: K2's segments per sequence (kda_cute.segments; K == V; varlen: dense states);
    None chooses from the grid's size, 1 turns them off. Where K2's grid is small and not
    split, K2 runs alongside K1 (`describe`; KDA_CUTE_ALONGSIDE=0 turns that off).
    has_initial_state: [N] bool, sequences marked False start from zeros whatever their
    initial state holds.
    The pool form (docs/serving.md): with state_indices [N] (int32 or int64), initial_state is
    a state pool [slots, H, V, K] (fp32 or bf16, the slot stride free) that sequence n reads at
    slot state_indices[n], and final_state the pool it writes (the same tensor for an update in
    place, or None to only read) at slot output_state_indices[n] (default: state_indices[n]).
    An index < 0 is padding, and index 0 too with null_slot=0: a padding sequence reads and
    writes no state and its outputs are zeros. An index past the pool is never followed (the
    sequence is treated as padding) and raised as kda_cute.DeviceValueError by the next pool or
    serving call, or by `kda_cute.check_errors()`.
    Checkpoints (docs/serving.md): the state after given tokens of each sequence, written by the
    same forward, each equal to the final state of a forward of that prefix alone (bit for bit
    where both run the same schedule). checkpoint_offsets [N, C] (int32 / int64; an offset
    outside 1..len, -1 say, is unused) writes checkpoint_state [N, C, H, V, K] (fp32 or bf16;
    unused ones untouched); or checkpoint_slots [N, M] with checkpoint_every (a multiple of 64)
    writes the state every checkpoint_every tokens, from offset checkpoint_first[n] (default
    checkpoint_every) on, the i-th into pool slot checkpoint_slots[n, i] of checkpoint_state
    [slots, H, V, K] (-1 skips; a slot past the pool is never written and is raised like a bad
    state index). With checkpoint_first each row's chunk grid starts at its first boundary's
    phase, so every boundary ends a chunk: the same schedule as a forward of the prefix with the
    same checkpoint_first (outputs and states within rounding of a forward without it). A
    padding row writes none. Tensor-core forwards only.
    A repeated call with tensors of the same metadata reuses the checks and the plan; `bind`
    skips the rest too.
    """
    opts = checks.options(gate, qk_l2norm, beta_sigmoid, segments, config, precision)
    call = Call(q, k, v, g, beta, out, A_log, dt_bias, initial_state, final_state, cu_seqlens,
                scale, lower_bound, state_indices, output_state_indices, has_initial_state,
                null_slot, checkpoint_state, checkpoint_offsets, checkpoint_slots,
                checkpoint_every, checkpoint_first)
    p = checks.forward(call, opts, check_seqlens)
    if declare.dry():  # (the workspace's size is checked with the plan)
        return
    errors.raise_pending(q.device)
    launch.run(plans.plan(p, opts, device_info(q.device)), call, workspace)


def config_for(p: Problem, config: FwdConfig | None = None, precision: str = "fast"
               ) -> FwdConfig:
    """The forward config for problem `p`: `config` as given (checked), or the ladder's for
    `precision` ("fast" or "precise": ladder.select_config)."""
    return ladder.config_for(p, checks.options(config=config, precision=precision))


def schedule(p: Problem, cfg: FwdConfig, device, segments=None) -> str:
    """How a forward of problem `p` with config `cfg` runs K2 on `device` (an index or a
    DeviceInfo): "alongside", "segments P" or "serial" (`describe` says more)."""
    dev = device if isinstance(device, plans.DeviceInfo) else device_info(device)
    return str(plans.plan(p, Options(config=cfg, segments=segments), dev).schedule)


def describe(p: Problem, options: Options | None = None, device=None) -> str:
    """In words: what a forward of problem `p` runs on `device` (an index, a DeviceInfo, or
    None: an H200)."""
    dev = (plans.H200 if device is None else device if isinstance(device, plans.DeviceInfo)
           else device_info(device))
    return plans.plan(p, options, dev).describe()


def clear_caches() -> None:
    """Forget the plans and checked metadata, and drop the device tensors the launcher keeps
    (offsets, zeros and identities, the segments' scratch states): the next calls make them
    again. Constants that a captured CUDA graph reads stay (pinned for the process: the graph
    may replay any time); a captured call's scratch belongs to its graph's memory pool."""
    plans.clear()
    memo.clear()
    errors.forget()
    launch.clear()


__all__ = ["clear_caches", "config_for", "describe", "fwd",
           "schedule", "validate", "workspace_bytes"]
