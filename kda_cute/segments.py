"""Intra-sequence parallelism for K2 when few (sequence, head) pairs leave most SMs idle.

Each chunk maps the state affinely, S -> S A_c + B_c, so a run of chunks (a segment) does too.
Every sequence of a fixed-length batch is split into P segments of whole chunks and K2 runs on
all B * P segments at once, twice:
- the value rows from a zero state: each token's output o0_t and the segment's end state B_j;
- the identity (K state rows, v = 0): each token's K-vector O_I,t (the linear map from the
  segment's start state to that token's output, o_t = S_start O_I,t + o0_t) and the segment's
  state map A_j.
Then, serially over the P segments (small batched matmuls): S_start(j) = S, S = S A_j + B_j from
the sequence's initial state; the last S is the final state; and every token's output gains
S_start(its segment) O_I,t. The work is ~2x the sequential recurrence ((V + K) state rows instead
of V) spread over P times more CTAs. `reference.segmented_recurrence` is the float64 model.

Here: the segment plan and the two torch steps after K2 (combine, correct); the launcher
(`api.launch_forward`) runs the kernels.
"""

from __future__ import annotations

import torch


def plan(B: int, T: int, chunk: int, segments: int) -> tuple[list[int], list[int], int]:
    """Segments of whole chunks, `segments` per sequence of a fixed-length batch (trailing ones
    may be empty): (token offsets [B*P + 1], chunk offsets [B*P + 1] into K1's workspace, tokens
    per full segment)."""
    nc = -(-T // chunk)
    cps = max(1, -(-nc // segments))  # chunks per segment
    cu, cc = [0], [0]
    for b in range(B):
        for j in range(segments):
            c1 = min((j + 1) * cps, nc)
            cu.append(b * T + min(c1 * chunk, T))
            cc.append(b * nc + c1)
    return cu, cc, cps * chunk


def combine(A: torch.Tensor, Bs: torch.Tensor, initial_state: torch.Tensor | None):
    """A: [B, P, H, K, K], Bs: [B, P, H, V, K] (fp32) -> (start states [B, P, H, V, K], final
    state [B, H, V, K]): S_start(0) = initial state (or 0), S_start(j+1) = S_start(j) A_j + B_j."""
    starts = torch.empty_like(Bs)
    S = (torch.zeros_like(Bs[:, 0]) if initial_state is None
         else initial_state.to(Bs.dtype))
    for j in range(Bs.shape[1]):
        starts[:, j] = S
        S = torch.matmul(S, A[:, j]) + Bs[:, j]
    return starts, S


def correct(out: torch.Tensor, o_identity: torch.Tensor, starts: torch.Tensor, seg_tokens: int):
    """out [B, T, H, V] (the zero-start outputs, any float dtype, updated in place) +=
    S_start(segment of t) O_I,t, with o_identity [B, T, H, K] and starts [B, P, H, V, K]; the sum
    is formed in the starts' dtype (fp32) and rounded once into out's dtype."""
    T = out.shape[1]
    for j in range(starts.shape[1]):
        t0, t1 = j * seg_tokens, min((j + 1) * seg_tokens, T)
        if t0 >= t1:
            break
        corr = torch.einsum("bthk,bhvk->bthv", o_identity[:, t0:t1].to(starts.dtype),
                            starts[:, j])
        out[:, t0:t1] = (out[:, t0:t1].to(starts.dtype) + corr).to(out.dtype)


def choose(B: int, T: int, H: int, K: int, V: int, chunk: int, block_v: int, sms: int,
           slots: int) -> int:
    """How many segments per sequence: as many as keep the two K2 runs (V + K state rows per
    head) within one wave of `slots` resident CTAs (SMs x K2 CTAs per SM), none shorter than
    32 chunks; 1 (the plain recurrence) when the sequential grid already fills the SMs."""
    if B * H * (V // block_v) >= sms:
        return 1
    per_segment = B * H * ((V + K) // block_v)
    return max(1, min(slots // per_segment, -(-T // chunk) // 32, 16))
