"""Context parallelism over torch.distributed (NCCL on GPUs): one layer's prefill split into
contiguous shards of tokens, one a rank, each rank holding its shard as a batch of pieces
(local cu_seqlens). The shard's first piece may continue its sequence from the rank before
(`carry_in`), its last may go on to the rank after.

    kda_cute.distributed.fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound,
                             initial_state, final_state, cu_seqlens, carry_in=True,
                             group=group)

Each rank: its shard's summary (kda_cute.context), one fixed-size message (its last piece's
transition and bias, and whether the piece began on this rank, in which case the bias already
holds the sequence's initial state), an all-gather of the messages, its entry state folded
from the earlier ranks' messages on the device (`entry_state`), and its shard's finish from
it. No host sync; the message is H (K^2 + V K) + 1 fp32 words whatever the length, so the
step captures into a CUDA graph with the collective.

States: fp32 [N, H, V, K] a piece (row 0 of initial_state is not read where carry_in: the
entry replaces it; row N - 1 of final_state, where that piece goes on, is the state at the
shard's end, not the sequence's), or the pool form: a state pool whose slots the ranks holding
a sequence's first and last tokens read and write (`fwd`). Checkpoints on positions counted
from each sequence's start (`position`). K == V. `shard_steps` is the same forward with the
exchange left to the caller."""

from __future__ import annotations

from collections.abc import Generator

import torch
import torch.distributed as dist
from torch import Tensor

from . import errors, serving
from .checks import base, err
from .context import context_finish, context_summary, sequences
from .segments import fp32_products
from .specs.step import E_READ, E_WRITE

F32 = torch.float32


def entry_state(transition: Tensor, bias: Tensor, fresh: Tensor, rank: int) -> Tensor:
    """The state entering rank `rank`'s first piece, from every rank's message: transition
    [R, H, K, K] and bias [R, H, V, K] of each rank's last piece, fresh [R] (1.0 where that
    piece began on its rank, its bias then from its sequence's initial state; else 0.0). The
    fold over the ranks before `rank`, each fresh one restarting it (a new sequence), in fp32
    whatever torch's TF32 setting."""
    R, H, V, K = bias.shape
    s = torch.zeros(H, V, K, dtype=bias.dtype, device=bias.device)
    with fp32_products():
        for j in range(rank):
            on = torch.baddbmm(bias[j], s, transition[j])
            s = torch.where(fresh[j] > 0.5, bias[j], on)  # fresh: its bias alone
    return s


def message(transition: Tensor, bias: Tensor, carry_in: bool, pieces: int,
            initial: Tensor | None) -> Tensor:
    """This rank's message from its summary (transition [N, H, K, K], bias [N, H, V, K] of
    its `pieces` pieces): its last piece's transition and bias, and whether the piece began
    here (not a continued single piece): then its bias from the piece's initial state
    (`initial` [H, V, K], None: zeros). An empty shard's: the identity, zero, not fresh."""
    H, V, K = bias.shape[1:]
    if pieces == 0:  # an empty shard passes the state on unchanged
        fresh = False
        A = torch.eye(K, dtype=bias.dtype, device=bias.device).expand(H, K, K)
        B = torch.zeros(H, V, K, dtype=bias.dtype, device=bias.device)
    else:
        fresh = not (carry_in and pieces == 1)
        A, B = transition[-1], bias[-1]
        if fresh and initial is not None:
            with fp32_products():
                B = torch.baddbmm(B, initial.to(A.dtype), A)
    flag = torch.full((1,), float(fresh), dtype=A.dtype, device=A.device)
    return torch.cat([A.reshape(-1), B.reshape(-1), flag])


def unpack(gathered: Tensor, R: int, H: int, V: int, K: int):
    """The all-gathered messages [R * (H K K + H V K + 1)] as (transition [R, H, K, K], bias
    [R, H, V, K], fresh [R])."""
    m = gathered.view(R, -1)
    a, b = H * K * K, H * V * K
    return (m[:, :a].view(R, H, K, K), m[:, a:a + b].view(R, H, V, K), m[:, a + b])


def fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, out: Tensor,
        A_log: Tensor | None, dt_bias: Tensor | None, lower_bound: float | None,
        initial_state: Tensor | None, final_state: Tensor | None,
        cu_seqlens: Tensor | None = None, *, carry_in: bool, carry_out: bool | None = None,
        group=None, gate: str = "bounded", qk_l2norm: bool = True, beta_sigmoid: bool = True,
        segments: int | None = None, precision: str = "fast",
        state_indices: Tensor | None = None, output_state_indices: Tensor | None = None,
        has_initial_state: Tensor | None = None, null_slot: int | None = None,
        position: int = 0, checkpoint_state: Tensor | None = None,
        checkpoint_offsets: Tensor | None = None, checkpoint_slots: Tensor | None = None,
        checkpoint_every: int | None = None, checkpoint_first: Tensor | None = None) -> None:
    """This rank's shard of a context-parallel forward (module docstring): writes `out` and
    `final_state`. Every rank of `group` calls it once for the layer.

    The pool form (state_indices given; carry_out then required): initial_state is the state
    pool [slots, H, V, K] (fp32 or bf16) that each piece beginning on this rank reads at its
    slot, and final_state the pool (or None) that each piece ending on this rank writes at
    output_state_indices[n] (default state_indices[n]): the rank holding a sequence's first
    token reads its slot, the rank holding its last writes it. An index < 0 (or null_slot)
    reads and writes no state (the piece runs from zeros); has_initial_state [N] bool as
    kda_cute.fwd's; a slot past the pool is raised as kda_cute.DeviceValueError like the
    serving calls'.
    Checkpoints on absolute positions: `position` is the shard's first token's offset in its
    sequence (0 unless carry_in); the checkpoint arguments as kda_cute.fwd's, counted from each
    sequence's start: checkpoint_first (default checkpoint_every) or checkpoint_offsets name
    positions in the whole sequence, and each piece writes those that fall in it (the i-th of
    its own into checkpoint_slots[n, i])."""
    _checked(q, v, cu_seqlens, carry_in, carry_out, position, initial_state, final_state,
             state_indices, output_state_indices, has_initial_state)  # (before the group is)
    steps = shard_steps(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound,
                        initial_state, final_state, cu_seqlens, carry_in=carry_in,
                        carry_out=carry_out, rank=dist.get_rank(group), gate=gate,
                        qk_l2norm=qk_l2norm, beta_sigmoid=beta_sigmoid, segments=segments,
                        precision=precision, state_indices=state_indices,
                        output_state_indices=output_state_indices,
                        has_initial_state=has_initial_state, null_slot=null_slot,
                        position=position, checkpoint_state=checkpoint_state,
                        checkpoint_offsets=checkpoint_offsets, checkpoint_slots=checkpoint_slots,
                        checkpoint_every=checkpoint_every, checkpoint_first=checkpoint_first)
    mine = next(steps)
    gathered = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=F32,
                           device=mine.device)
    dist.all_gather_into_tensor(gathered, mine, group=group)
    try:
        steps.send(gathered)
    except StopIteration:
        pass


def shard_steps(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                out: Tensor, A_log: Tensor | None, dt_bias: Tensor | None,
                lower_bound: float | None, initial_state: Tensor | None,
                final_state: Tensor | None, cu_seqlens: Tensor | None = None, *,
                carry_in: bool, carry_out: bool | None = None, rank: int,
                gate: str = "bounded", qk_l2norm: bool = True, beta_sigmoid: bool = True,
                segments: int | None = None, precision: str = "fast",
                state_indices: Tensor | None = None,
                output_state_indices: Tensor | None = None,
                has_initial_state: Tensor | None = None, null_slot: int | None = None,
                position: int = 0, checkpoint_state: Tensor | None = None,
                checkpoint_offsets: Tensor | None = None,
                checkpoint_slots: Tensor | None = None, checkpoint_every: int | None = None,
                checkpoint_first: Tensor | None = None) -> Generator[Tensor, Tensor, None]:
    """`fwd` as a generator, for an exchange other than torch.distributed's (or ranks run in
    turn on one device): the first step yields this rank's message (fp32, the same size on
    every rank); sent the ranks' messages in rank order (one tensor, as all_gather_into_tensor
    makes it), it finishes the shard. `rank`: this rank's place in that order."""
    N = _checked(q, v, cu_seqlens, carry_in, carry_out, position, initial_state, final_state,
                 state_indices, output_state_indices, has_initial_state)
    pooled = state_indices is not None
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    dev = q.device
    transition = torch.empty(N, H, K, K, dtype=F32, device=dev)
    bias = torch.empty(N, H, V, K, dtype=F32, device=dev)
    opts = dict(gate=gate, qk_l2norm=qk_l2norm, beta_sigmoid=beta_sigmoid, segments=segments,
                precision=precision,
                **_local_checkpoints(checkpoint_state, checkpoint_offsets, checkpoint_slots,
                                     checkpoint_every, checkpoint_first, position, N,
                                     dev))
    ws = context_summary(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, transition, bias,
                         cu_seqlens, out=out, **opts)
    if pooled:
        start = _read_slots(initial_state, state_indices, has_initial_state, null_slot,
                            carry_in, N, H, V, K)
    else:
        start = (torch.zeros(N, H, V, K, dtype=F32, device=dev) if initial_state is None
                 else initial_state.to(F32).clone())
    mine = message(transition, bias, carry_in, N,
                   start[-1] if pooled or initial_state is not None else None)
    gathered = yield mine
    if carry_in:
        A, B, fresh = unpack(gathered, gathered.numel() // mine.numel(), H, V, K)
        start[0] = entry_state(A, B, fresh, rank)
    if not pooled:
        context_finish(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, start,
                       final_state, cu_seqlens, workspace=ws, **opts)
        return
    context_finish(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, start, start,
                   cu_seqlens, workspace=ws, **opts)
    if final_state is not None:
        _write_slots(final_state, start,
                     state_indices if output_state_indices is None else output_state_indices,
                     null_slot, carry_out)


def _checked(q, v, cu_seqlens, carry_in, carry_out, position, pool, out_pool, idx, out_idx,
             has_initial) -> int:
    """The flags, and the pool form's arguments as kda_cute.fwd's pool form checks them (the
    slots' values are checked on the device by the copies' kernel), before any work; the rest
    the shard's calls check. Returns the shard's sequences."""
    _flags(carry_in, carry_out, position, idx)
    N, dev = sequences(q, cu_seqlens, v), q.device
    if idx is None:
        return N
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    base.pool("initial_state", pool, H, V, K, dev)
    if out_pool is not None:
        base.pool("final_state", out_pool, H, V, K, dev)
    base.index_table("state_indices", idx, (N,), dev)
    if out_idx is not None:
        base.index_table("output_state_indices", out_idx, (N,), dev)
    if has_initial is not None:
        base.flags("has_initial_state", has_initial, N, dev)
    return N


def _flags(carry_in, carry_out, position, state_indices) -> None:
    if not isinstance(carry_in, bool):
        raise err("carry_in", "a bool", repr(carry_in))
    if state_indices is not None and not isinstance(carry_out, bool):
        raise err("carry_out", "a bool with state_indices (whether the shard's last piece "
                  "goes on to the next rank, which then writes its slot)", repr(carry_out))
    if type(position) is not int or position < 0 or (position and not carry_in):
        raise err("position", "an int >= 0, 0 unless carry_in (the shard's first token's "
                  "offset in its sequence)", repr(position))


def _local_checkpoints(state, offsets, slots, every, first, position: int, N: int,
                       dev) -> dict:
    """The checkpoint arguments for the shard's own tokens: row 0's positions moved back by
    `position` (the tokens of its sequence on the ranks before), on the device."""
    given = dict(checkpoint_state=state, checkpoint_offsets=offsets, checkpoint_slots=slots,
                 checkpoint_every=every, checkpoint_first=first)
    if not position or (offsets is None and every is None):
        return given
    if isinstance(offsets, Tensor) and offsets.dim() == 2 and offsets.shape[0] == N:
        local = offsets.clone()
        local[0] = offsets[0] - position  # (those on earlier ranks fall below 1: unused)
        given["checkpoint_offsets"] = local
    elif isinstance(every, int) and every > 0:
        if first is None:
            first = torch.full((N,), every, dtype=torch.int32, device=dev)
        if isinstance(first, Tensor) and first.dim() == 1 and first.shape[0] == N:
            f = first[0]
            # the first boundary after the shard's start: its offset from the start
            local = first.clone()
            local[0] = torch.where(f > position, f - position,
                                   every - torch.remainder(position - f, every))
            given["checkpoint_first"] = local
    return given  # (anything else: kda_cute.fwd's checks name it)


def _read_slots(pool: Tensor, idx: Tensor, has_initial: Tensor | None, null_slot, carry_in: bool,
                N: int, H: int, V: int, K: int) -> Tensor:
    """Each piece's initial state from the pool (fp32 [N, H, V, K]): the slots of the pieces
    beginning here, zeros elsewhere; by commit's kernel, which checks the slots on the
    device."""
    read = idx >= 0
    if null_slot is not None:
        read &= idx != null_slot
    if has_initial is not None:
        read &= has_initial.to(torch.bool)
    if carry_in:  # the first piece's entry comes from the ranks before (a fill: no copy
        read[:1].fill_(False)  # from the host, as a graph's capture needs)
    held = torch.zeros(N, H, V, K, dtype=pool.dtype, device=pool.device)
    ss = pool.stride(0) if pool.shape[0] > 1 else H * V * K
    rows = pool.as_strided((pool.shape[0], 1, H, V, K), (ss, ss, V * K, K, 1))
    step = torch.where(read, 0, -1).to(torch.int32)
    ramp = torch.arange(N, dtype=torch.int32, device=pool.device)
    serving.commit(held, rows, ramp, step, idx)
    errors.note(pool.device, "distributed.fwd", ((E_READ, "state_indices"),))
    return held.to(F32)


def _write_slots(pool: Tensor, states: Tensor, idx: Tensor, null_slot, carry_out: bool) -> None:
    """The final states of the pieces ending here into the pool at `idx` (padding and the last
    piece where it goes on skipped), in the pool's dtype."""
    N = states.shape[0]
    step = torch.zeros(N, dtype=torch.int32, device=states.device)
    if carry_out and N:
        step[-1:].fill_(-1)
    serving.commit(pool, states.to(pool.dtype)[:, None], idx, step, null_slot=null_slot)
    errors.note(pool.device, "distributed.fwd", ((E_WRITE, "output_state_indices"),))
