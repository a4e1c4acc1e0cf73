"""Context parallelism's calls on one shard of a prefill (docs/notes/context.md): its summary,
and its finish from the entry state the ranks' summaries compose.

    ws = context_summary(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound,
                         transition, bias, cu_seqlens=cu)       # K1 and the segments' runs
    # ... the ranks' (transition, bias) exchanged; the entry states composed (combine) ...
    context_finish(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound,
                   initial_state, final_state, cu_seqlens=cu, workspace=ws)  # outputs, finals

Each sequence n of the shard maps a state S entering it to S transition[n] + bias[n]
(transition [N, H, K, K], bias [N, H, V, K], fp32: the state from zero, and the product of its
tokens' maps); `combine` chains them. The finish runs the same forward's remaining launches
from `initial_state` (fp32 [N, H, V, K], row n sequence n's entry state), so it takes the
summary's workspace and the same inputs. K == V (the identity rows reuse K2's config); dense
fp32 states. Checkpoints as kda_cute.fwd's: both calls take the same ones; the summary
prepares their tables beside K1, the finish writes them (a shard's rows run in segments, whose
chunk grids never shift to first boundaries: partial chunks take side runs).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor

from . import checks, errors, launch, plans, segments
from .checks import err
from .plans import device_info
from .plans.context import context_plans
from .problem import Call

F32 = torch.float32

# a forward's call with the summary's outputs beside it, by their roles in the plans
ContextCall = NamedTuple("ContextCall", [*Call.__annotations__.items(),
                                         ("transition", Tensor), ("bias", Tensor)])


def _plans(call: Call, gate, qk_l2norm, beta_sigmoid, segments, precision):
    opts = replace(checks.options(gate, qk_l2norm, beta_sigmoid, segments, None, precision),
                   context=True)
    p = checks.forward(call, opts)
    pl = plans.plan(p, opts, device_info(call.q.device))
    if pl.schedule.kind != "segments":
        raise err("q", "K == V and tokens (the summary's identity rows reuse K2's config)",
                  f"K={p.K}, V={p.V}, {p.B * p.T} tokens")
    return p, context_plans(pl)


def sequences(q: Tensor, cu_seqlens: Tensor | None, v=None) -> int:
    """The shard's sequences (pieces): q's batch, or cu_seqlens' entries less one (q, v where
    given, and cu_seqlens checked for what the shapes are read from: a named error)."""
    checks.tensor("q", q, (torch.bfloat16,), 4)
    if v is not None:
        checks.tensor("v", v, (torch.bfloat16,), 4)
    if cu_seqlens is not None:
        checks.tensor("cu_seqlens", cu_seqlens, checks.INDEX_DTYPES, 1)
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _state(name: str, t, like: Tensor, rows: int, K: int) -> None:
    H, V = like.shape[2], like.shape[3]
    want = (rows, H, V if name != "transition" else K, K)
    if not isinstance(t, Tensor) or t.dtype != F32 or tuple(t.shape) != want \
            or t.device != like.device or not t.is_contiguous():
        got = (f"{t.dtype} {list(t.shape)} on {t.device}" if isinstance(t, Tensor)
               else type(t).__name__)
        raise err(name, f"a contiguous fp32 tensor {list(want)} on {like.device}", got)


def context_summary(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                    A_log: Tensor | None, dt_bias: Tensor | None, lower_bound: float | None,
                    transition: Tensor, bias: Tensor, cu_seqlens: Tensor | None = None,
                    workspace: Tensor | None = None, out: Tensor | None = None, *,
                    gate: str = "bounded",
                    qk_l2norm: bool = True, beta_sigmoid: bool = True,
                    segments: int | None = None, precision: str = "fast",
                    checkpoint_state: Tensor | None = None,
                    checkpoint_offsets: Tensor | None = None,
                    checkpoint_slots: Tensor | None = None, checkpoint_every: int | None = None,
                    checkpoint_first: Tensor | None = None) -> Tensor:
    """Each sequence's summary of a shard: writes transition [N, H, K, K] and bias
    [N, H, V, K] (fp32) and returns the workspace (K1's outputs and the segments' states) that
    `context_finish` takes: the given one (uint8, at least the plan's bytes) or a new one.
    Inputs as `kda_cute.fwd`'s; `out`, where given, may be written with values the finish
    overwrites (a build without K2's output-free runs), else a scratch one is made.
    checkpoint_*: the finish's (their tables go into the workspace)."""
    N = sequences(q, cu_seqlens, v)
    _state("bias", bias, v, N, q.shape[-1])
    _state("transition", transition, v, N, q.shape[-1])
    # (the summary's problem is the finish's: dense fp32 states in and out, `bias` standing
    # in for them; its plan reads neither)
    if out is None:  # (the rescale run after the value rows may write outputs)
        out = torch.empty_like(v) if isinstance(v, Tensor) else v
    call = Call(q, k, v, g, beta, out, A_log, dt_bias, bias, bias, cu_seqlens, scale,
                lower_bound, None, None, None, None, checkpoint_state,
                checkpoint_offsets, checkpoint_slots, checkpoint_every, checkpoint_first)
    p, (summary, _) = _plans(call, gate, qk_l2norm, beta_sigmoid, segments, precision)
    if workspace is None:
        workspace = torch.empty(summary.workspace_bytes, dtype=torch.uint8, device=q.device)
    errors.raise_pending(q.device)
    launch.run(summary, ContextCall(*call, transition, bias), workspace)
    return workspace


def context_finish(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                   out: Tensor, A_log: Tensor | None, dt_bias: Tensor | None,
                   lower_bound: float | None, initial_state: Tensor, final_state: Tensor,
                   cu_seqlens: Tensor | None = None, *, workspace: Tensor,
                   gate: str = "bounded", qk_l2norm: bool = True, beta_sigmoid: bool = True,
                   segments: int | None = None, precision: str = "fast",
                   checkpoint_state: Tensor | None = None,
                   checkpoint_offsets: Tensor | None = None,
                   checkpoint_slots: Tensor | None = None, checkpoint_every: int | None = None,
                   checkpoint_first: Tensor | None = None) -> None:
    """The shard's forward from `initial_state` (fp32 [N, H, V, K]: row n sequence n's entry
    state) after `context_summary` with the same inputs and options, and its `workspace`:
    writes `out` and `final_state` (fp32 [N, H, V, K], may be initial_state), and the
    checkpoints (kda_cute.fwd's arguments, the summary's too)."""
    N = sequences(q, cu_seqlens, v)
    _state("initial_state", initial_state, v, N, q.shape[-1])
    _state("final_state", final_state, v, N, q.shape[-1])
    call = Call(q, k, v, g, beta, out, A_log, dt_bias, initial_state, final_state, cu_seqlens,
                scale, lower_bound, None, None, None, None, checkpoint_state,
                checkpoint_offsets, checkpoint_slots, checkpoint_every, checkpoint_first)
    p, (_, finish) = _plans(call, gate, qk_l2norm, beta_sigmoid, segments, precision)
    checks.workspace(workspace, finish.workspace_bytes, q.device)
    errors.raise_pending(q.device)
    launch.run(finish, ContextCall(*call, None, None), workspace)


def combine(transition: Tensor, bias: Tensor, entry: Tensor | None = None) -> Tensor:
    """The state after a chain of pieces, each mapping S to S transition[i] + bias[i]
    (transition [R, H, K, K], bias [R, H, V, K], in order): from `entry` [H, V, K] (None:
    zeros), in fp32 whatever torch's TF32 setting (segments.combine over one sequence)."""
    if bias.shape[0] == 0:
        return (torch.zeros(bias.shape[1:], dtype=F32, device=bias.device) if entry is None
                else entry.float())
    _, final = segments.combine(transition[None].float(), bias[None].float(),
                                None if entry is None else entry[None])
    return final[0]
