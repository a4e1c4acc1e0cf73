"""Context parallelism's two calls a rank makes, as the segments schedule split at its combine
(docs/notes/context.md): a shard's summary, then its finish from the entry state the ranks'
summaries compose.

- The summary runs the segments plan up to its combine (K1; the value rows from zero, giving
  each segment's end state; the identity rows, giving each segment's state map) and then two
  launches of the combine kernel for every sequence of the shard: from a zero start over the
  ends, whose final state is the bias B (the sequence's state from zero), and from the identity
  over zero ends, whose final state is the transition A (the product of the maps). Both fp32,
  to the call's `bias` [N, H, V, K] and `transition` [N, H, K, K].
- The finish runs the rest: the combine from each sequence's initial state (the first one's
  the entry state) over the same ends and maps, then K2 from the start states: the outputs and
  the final states.

Between the two calls nothing is recomputed, so K1's outputs and the segments' ends, maps and
start states live in the caller's workspace (planes after K1's), not in the launcher's scratch:
one workspace a shard in flight. A varlen batch's offsets are built again by the finish (the
offsets kernel, from cu_seqlens: cheap and the same)."""

from __future__ import annotations

import functools
import math
from dataclasses import replace

from ..specs.recur import INDEX_DENSE, STATE_F32, STATE_NONE
from .launches import F32, index_values
from .prefill import SEGMENT_STATES
from .steps import At, Buffer, Errors, Launch, Memset, Plan, Plane, Role, Scalar
from .workspace import ALIGN


@functools.lru_cache(maxsize=64)
def context_plans(plan: Plan) -> tuple[Plan, Plan]:
    """(summary, finish) of a forward `plan` on the segments schedule (`Options(context=True)`
    plans one for any problem the segments take, one segment a sequence included)."""
    if plan.schedule.kind != "segments":
        raise ValueError(f"plan: expected the segments schedule, got {plan.schedule}")
    p = plan.problem
    N, H, K = p.N, p.H, p.K
    names = [s.name for s in plan.steps]
    at = names.index("combine")
    states = _segment_states(plan)
    base = plan.workspace_bytes - ALIGN  # K1's planes end here (aligned); ours follow

    # the buffers the finish reads after the summary wrote them: the segments' states, and
    # a checkpointed forward's tables (its preparation runs beside the summary's K1)
    homes, ws = {}, base
    for buf in (states, *_checkpoint_tables(plan.steps[:at], plan.steps[at:])):
        homes[buf] = ws
        ws += _aligned(math.prod(buf.shape) * buf.dtype.itemsize)

    def home(src):
        if isinstance(src, At) and src.buffer in homes:
            return Plane(" ".join(src.buffer.params), homes[src.buffer] + src.offset)
        return src

    steps = tuple(replace(s, sources=tuple(home(x) for x in s.sources))
                  if isinstance(s, Launch) else
                  replace(s, target=home(s.target)) if isinstance(s, Memset) else s
                  for s in plan.steps)
    ws += ALIGN
    # the summary's combines: every sequence's own (dense, no index tables), fp32 out
    dense = index_values(p, N, INDEX_DENSE, has_init=False)
    zeros = At(Buffer("zeros", (N * plan.schedule.segments, H, K, K), F32))
    eye = At(Buffer("eye", (N, H, K, K), F32))
    combine = steps[at]

    def summary_combine(name, ends, s0, code, out):
        c = combine
        for arg, src in {"ends": ends, "s0f": s0, "s0h": s0, "state_in": Scalar(code),
                         "state_out": Scalar(STATE_F32), "final": out, "final_h": out,
                         **dense}.items():
            if arg in c.args:
                c = c.with_source(arg, src)
        return replace(c, name=name)

    ends = combine.source("ends")
    bias = summary_combine("combine: bias", ends, Errors(), STATE_NONE, Role("bias"))
    transition = summary_combine("combine: transition", zeros, eye, STATE_F32,
                                 Role("transition"))
    offsets = tuple(s for s in steps[:at] if s.name == "offsets")
    summary = replace(plan, steps=steps[:at] + (bias, transition), workspace_bytes=ws,
                      notes=plan.notes + ("context summary",))
    finish = replace(plan, steps=offsets + steps[at:], workspace_bytes=ws,
                     notes=plan.notes + ("context finish",))
    return summary, finish


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _scratch_in(steps) -> set:
    return {x.buffer for s in steps
            for x in (s.sources if isinstance(s, Launch) else
                      (s.target,) if isinstance(s, Memset) else ())
            if isinstance(x, At) and x.buffer.kind == "scratch"}


def _checkpoint_tables(before, after) -> list[Buffer]:
    """The checkpoints' scratch tables steps `before` and `after` the split both address, in
    a fixed order (the preparation writes them before K1, K2 and its side run read them)."""
    both = _scratch_in(before) & _scratch_in(after)
    return sorted((b for b in both if b.params[:1] == ("checkpoints",)), key=lambda b: b.params)


def _segment_states(plan: Plan) -> Buffer:
    """The segments' ends / maps / starts buffer the plan's launches read."""
    found = {x.buffer for s in plan.launches() for x in s.sources
             if isinstance(x, At) and x.buffer.params == SEGMENT_STATES}
    (states,) = found
    return states
