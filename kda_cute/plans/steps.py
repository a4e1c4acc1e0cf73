"""A plan's vocabulary: where each kernel argument comes from (a source), and the steps a plan
lists (kernel launches, a memset, the few torch-side steps). Frozen data: a plan says what runs,
kda_cute.launch makes it run."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


# ---------------------------------------------------------------------------------- sources
@dataclass(frozen=True)
class Role:
    """A caller tensor's address, by its role in the Call (q, out, initial_state, ...)."""

    name: str


@dataclass(frozen=True)
class Plane:
    """An address in the workspace: a plane's (or a hi / lo half's) offset from its aligned
    base, in bytes."""

    name: str
    offset: int


@dataclass(frozen=True)
class Buffer:
    """A device tensor the launcher keeps. kind "zeros", "eye" (a stack of identities), "ramp"
    (0, 1, ...) and "segments" (a fixed-length batch's offsets as segments, `params` = (B, T,
    chunk, P, "cu_seqlens" or "cu_chunks")) are made once per device and never written; "scratch"
    (`params`: its use) is written within a forward, so there is one per device and stream."""

    kind: str
    shape: tuple
    dtype: torch.dtype
    params: tuple = ()


@dataclass(frozen=True)
class At:
    """An address `offset` bytes into a launcher Buffer."""

    buffer: Buffer
    offset: int = 0


@dataclass(frozen=True)
class Scalar:
    """A number fixed by the plan."""

    value: int | float


@dataclass(frozen=True)
class CallScalar:
    """A number from the Call (scale; lower_bound, 0 where None), as a float."""

    name: str


@dataclass(frozen=True)
class Errors:
    """The device's error words (kda_cute.errors): where a kernel reports bad index, length and
    count values. Also the address given for an index table a step does not read."""


# ------------------------------------------------------------------------------------ steps
@dataclass(frozen=True)
class Launch:
    """One kernel launch: `kernel` (a spec config), grid, dynamic shared memory to reserve (the
    kernel's own, or more to keep other CTAs off its SMs), whether it is the programmatic
    dependent of the stream's previous kernel, each parameter argument's source (in ABI order)
    and the dynamic dimensions (abi.SYM_WIDTH) its tensors are packed with."""

    name: str
    kernel: object
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    programmatic: bool
    args: tuple[str, ...]  # the kernel's parameter arguments, in ABI order
    sources: tuple  # each one's source
    syms: tuple[tuple[str, int], ...]

    def source(self, arg: str):
        return self.sources[self.args.index(arg)]

    def with_source(self, arg: str, src) -> Launch:
        """This launch with argument `arg` taken from `src` instead (tests and probes)."""
        i = self.args.index(arg)
        return replace(self, sources=self.sources[:i] + (src,) + self.sources[i + 1:])


@dataclass(frozen=True)
class Memset:
    """`count` 32-bit words at `target` set to `value`, on the stream."""

    name: str
    target: object
    value: int
    count: int


@dataclass(frozen=True)
class Copy:
    """dst.copy_(src) on the stream, each a Role or a Buffer (a bf16 state through an fp32
    buffer)."""

    name: str
    src: object
    dst: object


@dataclass(frozen=True)
class Fork:
    """The steps after it, up to the next Merge, run on the launcher's side stream, after the
    work enqueued on the call's stream so far (an event recorded there and waited for): work
    the steps after the Merge do not read runs beside them. A Join later makes the call's
    stream wait for it. `first`: the side stream of the greatest priority, so that its few
    blocks start beside a grid that fills the device rather than after it."""

    name: str
    first: bool = False


@dataclass(frozen=True)
class Merge:
    """The steps after it run on the call's stream again (nothing waited for)."""

    name: str


@dataclass(frozen=True)
class Join:
    """The call's stream waits for the side stream's work so far (an event)."""

    name: str


@dataclass(frozen=True)
class Plan:
    """A forward as it will run: its problem, options, config and device, the schedule chosen,
    the workspace it needs, and its steps in order."""

    problem: object
    options: object
    config: object
    device: object
    schedule: object  # plans.schedule.Schedule
    workspace_bytes: int
    steps: tuple
    # held alongside forwards of different streams in order (launch.streams)
    alongside: bool = False
    notes: tuple[str, ...] = field(default=(), compare=False)

    def launches(self) -> list[Launch]:
        return [s for s in self.steps if isinstance(s, Launch)]

    def step(self, name: str):
        (s,) = [s for s in self.steps if s.name == name]
        return s

    def only(self, *names: str) -> Plan:
        """The plan with only the named launches and memsets (its torch-side steps kept):
        e.g. `plan.only("K1")` runs K1 alone, for tests and probes."""
        keep = tuple(s for s in self.steps
                     if s.name in names or not isinstance(s, (Launch, Memset)))
        return replace(self, steps=keep)

    def without(self, *names: str) -> Plan:
        """The plan with the named steps left out (probes: a step's cost, timing only)."""
        return replace(self, steps=tuple(s for s in self.steps if s.name not in names))

    def edit(self, name: str, **changes) -> Plan:
        """The plan with step `name` replaced by `dataclasses.replace(step, **changes)` (tests
        and probes: a launch's smem or programmatic flag, a memset's value)."""
        return replace(self, steps=tuple(replace(s, **changes) if s.name == name else s
                                         for s in self.steps))

    def describe(self) -> str:
        """In words: what this plan runs."""
        p, o = self.problem, self.options
        notes = "".join(f"; {n}" for n in self.notes)
        if hasattr(p, "form"):  # a serving step
            lines = [f"KDA {p.form}: N={p.N} T={p.T} H={p.H} K={p.K} V={p.V}, {p.pool} pool of "
                     f"{p.slots} slots, {o.gate} gate{notes}"]
        else:
            states = "/".join("none" if d is None else str(d).replace("torch.", "")
                              for d in (p.state_in, p.state_out))
            lines = [f"KDA forward: B={p.B} T={p.T} H={p.H} K={p.K} V={p.V}, "
                     f"{'varlen, ' + str(p.N) + ' sequences' if p.varlen else 'fixed length'}, "
                     f"state in/out {states}, {o.precision} precision, {o.gate} gate",
                     f"schedule: {self.schedule}{notes}",
                     f"workspace: {self.workspace_bytes} bytes"]
        for i, s in enumerate(self.steps, 1):
            if isinstance(s, Launch):
                extra = " programmatic" if s.programmatic else ""
                lines.append(f"{i}. {s.name}: {s.kernel.name} grid {s.grid} block {s.block[0]} "
                             f"smem {s.smem}{extra}")
            elif isinstance(s, Memset):
                lines.append(f"{i}. {s.name}: memset {s.count} words to {s.value}")
            else:
                lines.append(f"{i}. {s.name}")
        return "\n".join(lines)
