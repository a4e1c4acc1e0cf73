"""What a forward is asked to do, as metadata: the `Problem` (shapes, strides, dtypes, the state
form), the `Options` (how to run it: precision, gate form, schedule switches) and the `Call` (the
tensors and scalars of one call). A plan (kda_cute.plans) is a pure function of the first two
and the device; a run (kda_cute.launch) binds it to a `Call`.

The environment switches are read here, once, at import: `KDA_CUTE_ALONGSIDE=0` (K2 never runs
alongside K1) and `KDA_CUTE_WY=0|force` (K2's WY form never / wherever one is built). They are
only the defaults of `Options`; pass Options to override them per plan.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

STATE_DTYPES = (torch.float32, torch.bfloat16)
WY_MODES = ("auto", "off", "force")
ENV_ALONGSIDE = os.environ.get("KDA_CUTE_ALONGSIDE", "1") != "0"
ENV_WY = {"0": "off", "force": "force"}.get(os.environ.get("KDA_CUTE_WY", "1"), "auto")


@dataclass(frozen=True)
class Checkpoints:
    """A prefill's checkpoints (kda_cute.specs.checkpoints), as metadata. every 0: the
    offsets form (checkpoint_state [N, per_row, H, V, K], row n * per_row + e for
    checkpoint_offsets[n, e]); every > 0: boundaries every `every` tokens from each row's first
    (checkpoint_first[n], or `every`), the i-th written to pool slot checkpoint_slots[n, i] of
    checkpoint_state [slots, H, V, K]. dest_rows / dest_stride: the destination's rows and row
    stride (elements); the entries' and first table's row and entry strides (elements), int64
    flags and int32 words; dest_min: slots below are skipped (null_slot=0: 1)."""

    every: int
    per_row: int
    dest_rows: int
    dest_stride: int
    dtype: torch.dtype
    e_sn: int
    e_se: int
    e_wide: int
    e_words: int
    first_on: int = 0
    f_sn: int = 0
    f_wide: int = 0
    f_words: int = 0
    dest_min: int = 0
    fixed_grid: int = 0  # a context shard's: its rows' chunk grids never shift (segments)

    @property
    def aligned(self) -> bool:
        """Every boundary ends a chunk (the every-n form from its default first boundary, n a
        multiple of 64): no partial chunk, so no side slots or side runs."""
        return self.every > 0 and not self.first_on

    @property
    def shifts(self) -> bool:
        """The every-n form from first boundaries: a forward that runs its rows whole (every
        schedule but segments) shifts each row's chunk grid to its first boundary's phase, so
        that every boundary ends a chunk (kda_cute.specs.checkpoints); a context shard's run
        in segments, which never shift (fixed_grid)."""
        return self.every > 0 and bool(self.first_on) and not self.fixed_grid


class PoolForm(NamedTuple):
    """A prefill's pool form (states read from and written to pool slots), named as K2's and
    the combine's arguments (kda_cute.specs.recur.index_args) and symbols: the pool's slots and
    slot stride (elements), state_indices' entry stride and int64 flag, whether
    output_state_indices is given with its entry stride and int64 flag, the least index that
    is not padding, and the two tables' int32 words."""

    slots: int
    sS: int
    r_sn: int
    r_wide: int
    w_on: int
    w_sn: int
    w_wide: int
    null_min: int
    NRI: int
    NWI: int


@dataclass(frozen=True)
class Problem:
    """A forward's metadata. B, T, H: batch, tokens per sequence row, heads; K, V: head dims; N:
    sequences (B, or len(cu_seqlens) - 1 with varlen). The rest, with defaults for a problem
    described by its sizes alone (workspace sizing, scheduling): the token strides of q, k, g,
    v, out and beta in elements (None: packed rows), the states' dtypes (None: no state), how
    the gate parameters are held (A_log, dt_bias: abi.GATE_PARAM_DTYPES' code, 0 when not given;
    True is fp32's), and whether cu_seqlens is int64 (copied to int32 for the kernels).
    pool: None for dense states ([N, H, V, K], row n sequence n's), or the pool form
    (PoolForm); has_init: has_initial_state is given; ckpt: the
    checkpoints asked for (None: none)."""

    B: int
    T: int
    H: int
    K: int
    V: int
    N: int
    varlen: bool
    strides: tuple[int, int, int, int, int, int] | None = None
    state_in: torch.dtype | None = None
    state_out: torch.dtype | None = None
    A_log: int = 1
    dt_bias: int = 1
    cu_int64: bool = False
    pool: PoolForm | None = None
    has_init: bool = False
    ckpt: Checkpoints | None = None

    def token_strides(self) -> tuple[int, int, int, int, int, int]:
        """(q, k, g, v, out, beta) token strides in elements."""
        if self.strides is not None:
            return self.strides
        HK, HV = self.H * self.K, self.H * self.V
        return HK, HK, HK, HV, HV, self.H


@dataclass(frozen=True)
class Options:
    """How to run a forward. precision: "fast" (K2's products on fp16 operands) or "precise"
    (bf16 hi/lo splits). gate: "bounded", "unbounded" or "none". qk_l2norm, beta_sigmoid: K1
    normalises q and k and takes beta's sigmoid. segments: K2's segments per sequence (None:
    chosen from the grid, 1: never). config: a FwdConfig instead of the ladder's pick.
    alongside: K2 may run alongside K1 (default: KDA_CUTE_ALONGSIDE). wy: K2's WY form "auto"
    (where each CTA has an SM to itself), "off" or "force" (default: KDA_CUTE_WY). context:
    the segments schedule wherever the problem allows it (kda_cute.plans.context)."""

    precision: str = "fast"
    gate: str = "bounded"
    qk_l2norm: bool = True
    beta_sigmoid: bool = True
    segments: int | None = None
    config: object = None  # a ladder.FwdConfig (the ladder reads these records)
    alongside: bool = field(default_factory=lambda: ENV_ALONGSIDE)
    wy: str = field(default_factory=lambda: ENV_WY)
    # the segments schedule wherever a problem allows it, one segment a sequence included
    # (context parallelism's summary and finish: kda_cute.plans.context)
    context: bool = False


class Call(NamedTuple):
    """One forward call's tensors and scalars, by the roles a plan's sources name."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    out: torch.Tensor
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    initial_state: torch.Tensor | None
    final_state: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    scale: float
    lower_bound: float | None
    # the pool form: read and write slots of each sequence (initial_state / final_state are
    # then the pool), per-sequence "starts from its state" flags, null_slot=0 (index 0 pads)
    state_indices: torch.Tensor | None = None
    output_state_indices: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None
    null_slot: int | None = None
    # checkpoints (kda_cute.specs.checkpoints): the destination, and the offsets form's
    # offsets or the every-n form's slots, spacing and first boundaries
    checkpoint_state: torch.Tensor | None = None
    checkpoint_offsets: torch.Tensor | None = None
    checkpoint_slots: torch.Tensor | None = None
    checkpoint_every: int | None = None
    checkpoint_first: torch.Tensor | None = None


# ------------------------------------------------------------------------ serving steps
# A step's index tables, named as the token-step kernel's arguments (kda_cute.specs.step.args
# says what each means).
class StepRead(NamedTuple):
    """The state a row starts from: read_index[n * r_sn + sel * r_st] * r_mul + sel * r_add
    (read_mode 0: none)."""

    read_mode: int
    r_sn: int
    r_st: int
    r_wide: int
    r_mul: int
    r_add: int


class StepAccepted(NamedTuple):
    """sel = accepted[n] - acc_base, in [0, max_sel) (acc_on 0: sel 0; acc_skip: a negative
    sel skips the row)."""

    acc_on: int
    acc_wide: int
    acc_base: int
    acc_skip: int
    max_sel: int


class StepWrite(NamedTuple):
    """Where the state after token t goes: dst row write_index[n * w_sn + t * w_st] * w_mul +
    t * w_add (write_mode: specs.step.WRITE_*)."""

    write_mode: int
    w_sn: int
    w_st: int
    w_wide: int
    w_mul: int
    w_add: int


class StepParent(NamedTuple):
    """Tree drafts: token t starts from the state after token parent[n * p_sn + t * p_st]."""

    parent_on: int
    p_sn: int
    p_st: int
    p_wide: int


class StepNulls(NamedTuple):
    """Entries below these are padding: of the read index, of the write index."""

    r_null: int
    w_null: int


class StepWords(NamedTuple):
    """The int32 words of the tables cu_seqlens, read_index, write_index, accepted, parent and
    has_init (0: not given)."""

    NCU: int
    NRI: int
    NWI: int
    NAC: int
    NPA: int
    NHI: int


class TokenStrides(NamedTuple):
    """The token strides of q, k, g, v, out and beta, in elements."""

    sQ: int
    sK: int
    sG: int
    sV: int
    sO: int
    sB: int


@dataclass(frozen=True)
class StepProblem:
    """A serving step's metadata (decode, verify, commit or the dense token-by-token forward):
    everything the token-step kernel's arguments are made of, bar the tensors' addresses and
    the call's scale and lower bound (kda_cute.specs.step.args says what each entry means).

    form: "decode", "verify" (a slot per token), "verify scratch" (a read-only pool and a
    scratch of per-token states), "commit" or "recurrent" (dense states). N rows of the batch,
    T token rows, H heads, K and V head dims; pool: the state dtype name; slots / slot_stride:
    the pool's rows and row stride (elements); dst_rows / dst_stride: those of the tensor the
    states are written to (the pool again, a scratch, a dense final state); strides: the token
    strides; fixed_len: tokens per row (-1: cu_seqlens); read, accepted, write, parent,
    null_min: the index tables' addressing; lengths: the tables' words."""

    form: str
    N: int
    T: int
    H: int
    K: int
    V: int
    pool: str
    slots: int
    slot_stride: int
    dst_rows: int
    dst_stride: int
    strides: TokenStrides
    fixed_len: int
    cu_wide: bool
    max_tokens: int
    read: StepRead
    accepted: StepAccepted
    has_init: bool
    write: StepWrite
    parent: StepParent
    null_min: StepNulls
    A_log: int  # how the gate parameters are held: abi.GATE_PARAM_DTYPES' code, 0 not given
    dt_bias: int
    lengths: StepWords


@dataclass(frozen=True)
class StepOptions:
    """How a serving step computes: the gate form ("bounded", "unbounded", "none"), whether
    the kernel normalises q and k and takes beta's sigmoid, and a StepConfig instead of the
    ladder's pick (kernel development)."""

    gate: str = "bounded"
    qk_l2norm: bool = True
    beta_sigmoid: bool = True
    config: object = None


class StepCall(NamedTuple):
    """One serving step's tensors and scalars, by the roles a step plan's sources name. pool is
    the state read (the pool, a scratch for a commit, a dense initial state); dst where states
    are written; the index tables are int32 or int64 (read as word pairs)."""

    q: torch.Tensor | None
    k: torch.Tensor | None
    v: torch.Tensor | None
    g: torch.Tensor | None
    beta: torch.Tensor | None
    out: torch.Tensor | None
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    pool: torch.Tensor | None
    dst: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    read_index: torch.Tensor | None
    write_index: torch.Tensor | None
    accepted: torch.Tensor | None
    parent: torch.Tensor | None
    has_init: torch.Tensor | None
    scale: float
    lower_bound: float | None


class ReplayForm(NamedTuple):
    """A replay call's ring (kda_cute.specs.replay): mode ("decode", "verify", "flush",
    "commit"), its entries a (slot, head) and u's dtype name, the window (a decode at cursor
    c >= window - 1 folds), and the ring tensors' slot strides in elements."""

    mode: str
    ring: int
    u_dtype: str
    window: int
    sRK: int
    sRR: int
    sRU: int
    sRG: int


class ReplayProblem(NamedTuple):
    """A replay call's metadata: the token step's (its tokens, pool, tables) and its ring's.
    The plan's form and the error words' names are the step's."""

    step: StepProblem
    ring: ReplayForm

    @property
    def form(self) -> str:
        return f"replay {self.ring.mode}"

    def __getattr__(self, name):  # the step's fields (N, T, H, pool, ...)
        return getattr(self.step, name)


# A replay call's tensors: the step's roles (StepCall) and the ring's
ReplayCall = NamedTuple("ReplayCall", [*StepCall.__annotations__.items(), *(
    (n, "torch.Tensor") for n in ("ring_k", "ring_r", "ring_u", "ring_g", "cursor", "tickets"))])
