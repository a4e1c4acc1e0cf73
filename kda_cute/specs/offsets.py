"""A varlen forward's offsets (kernels/kda_offsets_sm90.py): cu_seqlens checked and copied on the
device, and the workspace's chunk slots from them, with no host sync. Its config, constraints and
argument list; no DSL import here."""

from __future__ import annotations

from dataclasses import dataclass

from ..abi import Arg, SpecConfig, scalar, tensor
from .step import ERRORS

# the error word a bad prefill cu_seqlens sets (kda_cute.errors)
E_PREFILL_CU = 6
assert ERRORS[E_PREFILL_CU].startswith("cu_seqlens (a prefill")


@dataclass(frozen=True)
class OffsetsConfig(SpecConfig):
    """One CTA of `threads` threads over the N + 1 entries of cu_seqlens: each entry checked
    (0 first, non-decreasing, at most T; an int64 one within int32's range), copied as int32
    into `cu_seqlens` and its sequence's first workspace chunk slot, cu_seqlens[s] // chunk + s,
    into `cu_chunks` (kda_cute.plans.workspace.chunk_slots). A batch with any bad entry runs as
    N empty sequences (every entry 0, the slots 0, 1, ..., N) and sets the error word.
    `shifted`: each row's chunk grid shifted by its first checkpoint boundary's phase (K1's
    split table and K2's cu_chunks as chunk0 * C + sigma: kda_cute.plans.workspace.
    shifted_tables, the kernel's docstring). `segments` P > 0: also each sequence's P segments of
    whole chunks for K2 (kda_cute.segments.varlen_tables is its float model): the segments'
    cu_seqlens (N P + 1 entries) and each segment's first chunk slot."""

    threads: int = 256

    @property
    def name(self) -> str:
        return f"kda_offsets_t{self.threads}"


def supports(cfg: OffsetsConfig) -> tuple[bool, str]:
    if cfg.threads % 32 or not 32 <= cfg.threads <= 1024:
        return False, f"threads must be a multiple of 32 in [32, 1024], got {cfg.threads}"
    return True, ""


def args(cfg: OffsetsConfig) -> list[Arg]:
    """The kernel's `__call__` arguments: the caller's cu_seqlens as int32 words (NCW: N + 1,
    or 2 (N + 1) for an int64 one, `wide`), the int32 cu_seqlens and cu_chunks it writes (N1 =
    N + 1 entries), the error words (kda_cute.errors); shifted only: the rows' first
    boundaries (int32 words, NCF; row stride f_sn entries, int64 for f_wide), K1's cu_seqlens
    and cu_chunks (N2 = 2N + 1 entries); the entries, the tokens T, log2 of the chunk and the
    shifted switch; the segments' tables (NSP1 = N P + 1 entries each) and P (0: none)."""
    return [
        tensor("cu_in", "int32", ("NCW",), (1,), dsl="mCuIn"),
        tensor("cu_seqlens", "int32", ("N1",), (1,), dsl="mCuSeq"),
        tensor("cu_chunks", "int32", ("N1",), (1,), dsl="mCuChunk"),
        tensor("errors", "int32", (8,), (1,), dsl="mErr"),
        tensor("first", "int32", ("NCF",), (1,), dsl="mFirst"),
        tensor("k1_cu_seqlens", "int32", ("N2",), (1,), dsl="mCu1"),
        tensor("k1_cu_chunks", "int32", ("N2",), (1,), dsl="mCc1"),
        scalar("wide"),
        scalar("entries"),
        scalar("tokens"),
        scalar("chunk_shift"),
        scalar("shifted"),
        scalar("f_sn"),
        scalar("f_wide"),
        tensor("seg_cu", "int32", ("NSP1",), (1,), dsl="mSegCu"),
        tensor("seg_cc", "int32", ("NSP1",), (1,), dsl="mSegCc"),
        scalar("segments"),
    ]


def dsl_class(cfg: OffsetsConfig) -> str:
    return "kernels.kda_offsets_sm90:KdaOffsetsSm90"
