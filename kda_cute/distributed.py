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
shard's end, not the sequence's). K == V."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .checks import err
from .context import context_finish, context_summary, sequences
from .segments import fp32_products

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
        initial_state: Tensor | None, final_state: Tensor, cu_seqlens: Tensor | None = None,
        *, carry_in: bool, group=None, gate: str = "bounded",
        qk_l2norm: bool = True, beta_sigmoid: bool = True, segments: int | None = None,
        precision: str = "fast") -> None:
    """This rank's shard of a context-parallel forward (module docstring): writes `out` and
    `final_state`. Every rank of `group` calls it once for the layer."""
    if not isinstance(carry_in, bool):
        raise err("carry_in", "a bool", repr(carry_in))
    N = sequences(q, cu_seqlens)
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    dev = q.device
    transition = torch.empty(N, H, K, K, dtype=F32, device=dev)
    bias = torch.empty(N, H, V, K, dtype=F32, device=dev)
    opts = dict(gate=gate, qk_l2norm=qk_l2norm, beta_sigmoid=beta_sigmoid, segments=segments,
                precision=precision)
    ws = context_summary(q, k, v, g, beta, scale, A_log, dt_bias, lower_bound, transition, bias,
                         cu_seqlens, out=out, **opts)
    start = (torch.zeros(N, H, V, K, dtype=F32, device=dev) if initial_state is None
             else initial_state.to(F32).clone())
    mine = message(transition, bias, carry_in, N, start[-1] if initial_state is not None
                   else None)
    R = dist.get_world_size(group)
    gathered = torch.empty(R * mine.numel(), dtype=F32, device=dev)
    dist.all_gather_into_tensor(gathered, mine, group=group)
    if carry_in:
        A, B, fresh = unpack(gathered, R, H, V, K)
        start[0] = entry_state(A, B, fresh, dist.get_rank(group))
    context_finish(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, start,
                   final_state, cu_seqlens, workspace=ws, **opts)
