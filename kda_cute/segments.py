"""Intra-sequence parallelism for K2 when few (sequence, head) pairs leave most SMs idle.

Each chunk maps the state affinely, S -> S A_c + B_c, so a run of chunks (a segment) does too.
Every sequence of a fixed-length batch is split into P segments of whole chunks and K2 runs on
all B * P segments at once, three times:
1. the value rows from a zero state: each segment's end state B_j (its outputs are discarded);
2. the identity (K state rows, v = 0): each segment's state map A_j;
3. after the segments are combined serially (one launch of kernels/kda_combine_sm90.py,
   S_start(0) = the initial state, S_start(j+1) = S_start(j) A_j + B_j; the last one is the
   final state; `combine` below is its torch form), the value rows
   again from each segment's true start state S_start(j): the outputs, exactly as the sequential
   recurrence computes them (one rounding to bf16).
The work is ~3x the sequential recurrence's, spread over P times more CTAs, so it pays where the
sequential grid fills a fraction of the GPU. `chunked.segmented_recurrence(rerun=True)` is the
float64 model.

Here: the segment plan, its size, and the combine step; the segments schedule (`plans/prefill.py`)
runs the kernels.
"""

from __future__ import annotations

import contextlib

import torch


def plan(B: int, T: int, chunk: int, segments: int) -> tuple[list[int], list[int]]:
    """Segments of whole chunks, `segments` per sequence of a fixed-length batch (trailing ones
    may be empty): (token offsets [B*P + 1], chunk offsets [B*P + 1] into K1's workspace)."""
    nc = -(-T // chunk)
    cps = max(1, -(-nc // segments))  # chunks per segment
    cu, cc = [0], [0]
    for b in range(B):
        for j in range(segments):
            c1 = min((j + 1) * cps, nc)
            cu.append(b * T + min(c1 * chunk, T))
            cc.append(b * nc + c1)
    return cu, cc


def varlen_tables(cu: list[int], chunk: int, segments: int) -> tuple[list[int], list[int]]:
    """`plan` for a varlen batch from its cu_seqlens, as the offsets kernel builds it on the
    device: each sequence's chunks in `segments` runs of ceil(chunks / segments), trailing ones
    empty; (token offsets [N P + 1], each segment's first chunk slot [N P + 1], the last the
    slots' end). Sequence n's first slot is cu[n] // chunk + n (workspace.chunk_slots)."""
    seg_cu, seg_cc = [cu[0]], []
    for n in range(len(cu) - 1):
        length, c0 = cu[n + 1] - cu[n], cu[n] // chunk + n
        nc = -(-length // chunk)
        per = -(-nc // segments)
        for j in range(segments):
            a = min(j * per, nc)
            seg_cc.append(c0 + a)
            seg_cu.append(cu[n] + min(min(a + per, nc) * chunk, length))
    seg_cc.append(cu[-1] // chunk + len(cu) - 1)
    return seg_cu, seg_cc


@contextlib.contextmanager
def fp32_products():
    """Matrix products in full fp32 inside, whatever torch's TF32 setting (the states' chains
    carry the fp32 state's accuracy)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def combine(A: torch.Tensor, Bs: torch.Tensor, initial_state: torch.Tensor | None,
            final: torch.Tensor | None = None):
    """A: [B, P, H, K, K], Bs: [B, P, H, V, K] (fp32) -> (start states [B, P, H, V, K],
    contiguous; final state [B, H, V, K]): S_start(0) = initial state (or 0), S_start(j+1) =
    S_start(j) A_j + B_j. `final`, when given (fp32, contiguous), receives the final state.

    One batched product per segment, over contiguous (sequence, head) matrices (segment-major
    working layout; for one sequence it is the launch layout, so nothing is copied), in full
    fp32 whatever torch's TF32 setting: the start states carry the fp32 state's accuracy."""
    B, P, H, V, K = Bs.shape
    a = A.transpose(0, 1).reshape(P, B * H, K, K)
    b = Bs.transpose(0, 1).reshape(P, B * H, V, K)
    st = torch.empty((P, B * H, V, K), dtype=Bs.dtype, device=Bs.device)
    if initial_state is None:
        st[0].zero_()
    else:
        st[0].copy_(initial_state.reshape(B * H, V, K))
    if final is None or final.dtype != Bs.dtype or not final.is_contiguous():
        final = torch.empty((B, H, V, K), dtype=Bs.dtype, device=Bs.device)
    with fp32_products():
        for j in range(P):
            dst = st[j + 1] if j + 1 < P else final.view(B * H, V, K)
            torch.baddbmm(b[j], st[j], a[j], out=dst)
    starts = st.view(P, B, H, V, K).transpose(0, 1).contiguous()
    return starts, final


# The segment count's cost model, in chain steps (one chunk of one K2 CTA): each of the three
# K2 runs pays a CTA's fixed cost (the state in and out, the pipeline's fill) and the combine a
# serial step per segment (docs/notes/bytes.md).
_CTA_FIXED_STEPS = 8
_COMBINE_STEPS = 5


def choose(B: int, T: int, H: int, V: int, chunk: int, block_v: int, sms: int) -> int:
    """How many segments per sequence: at most as many as keep one K2 run over the segments
    within one CTA an SM (two CTAs an SM retire little more than one, so a second CTA an SM
    costs nearly a wave: docs/notes/bytes.md), none shorter than 32 chunks, at most 8 (the
    combine's serial steps), and the count whose modelled chain (three runs of ceil(chunks / P)
    steps plus their fixed costs, and the combine) is the shortest, if shorter than the plain
    chain; else 1 (the plain recurrence). Only where the plain grid fills at most a quarter of
    the SMs, with V >= 128 (K = 64's shorter chain a chunk measured faster plain)."""
    ctas = B * H * (V // block_v)
    if V < 128 or 4 * ctas > sms:
        return 1
    nc = -(-T // chunk)
    best, best_steps = 1, nc
    for p in range(3, min(sms // ctas, nc // 32, 8) + 1):
        steps = 3 * (-(-nc // p) + _CTA_FIXED_STEPS) + _COMBINE_STEPS * p
        if steps < best_steps:
            best, best_steps = p, steps
    return best


def choose_context(B: int, T: int, H: int, V: int, chunk: int, block_v: int, sms: int) -> int:
    """Segments per sequence of a context-parallel shard (kda_cute.context), whose summary and
    finish run the value and identity rows, then the rows from the starts, whatever the count:
    the count whose modelled chain is the shortest, at most 8 and none shorter than 32 chunks.
    The model counts waves: the value and identity runs share the SMs, a second CTA an SM costs
    nearly a wave (docs/notes/bytes.md), each wave ceil(chunks / P) steps plus a CTA's fixed
    cost, and the combine a serial step per segment."""
    ctas = B * H * (V // block_v)
    nc = -(-T // chunk)

    def waves(n):
        return -(-n // sms)

    def steps(p):
        return ((waves(2 * ctas * p) + waves(ctas * p)) * (-(-nc // p) + _CTA_FIXED_STEPS)
                + _COMBINE_STEPS * p)
    return min(range(1, max(1, min(8, nc // 32)) + 1), key=steps)
