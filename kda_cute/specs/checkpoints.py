"""A prefill's checkpoints (kernels/kda_checkpoints_sm90.py): where K2 stores the state of each
checkpoint, worked out on the device from the caller's offsets or slots, with no host sync. Its
config, constraints and argument list; no DSL import here.

A checkpoint at token offset o of a sequence (1 <= o <= its length) is the state after its first
o tokens. Where o ends a chunk (o % chunk == 0, or o is the length) K2 stores it straight from
its registers after chunk ceil(o / chunk); otherwise K2 stores the state after the o // chunk
whole chunks before it to an fp32 scratch row, K1 prepares the partial chunk [chunk start, o) as
a sequence of its own in the workspace's side slots, and K2's side run (side = 1) finishes each
from its scratch row into the checkpoint: every step the one a forward of the prefix alone takes.

The every-n form with first boundaries (checkpoint_first) shifts instead, where K2 runs the rows
whole (every schedule but segments): each row's chunk grid starts sigma = (C - first % C) % C
tokens before the row, its first chunk partial (kda_cute.specs.offsets: shifted), so every
boundary ends a chunk and there is no side slot or side run; each checkpoint is then, bit for
bit, the final state of a forward of its prefix alone with the same checkpoint_first (the same
grid), and within rounding of one without.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..abi import Arg, SpecConfig, scalar, tensor
from .recur import index_args

# the most checkpoints a sequence row may ask for (one CTA's entries, in shared memory)
MAX_ENTRIES = 1024


@dataclass(frozen=True)
class CheckpointsConfig(SpecConfig):
    """One CTA of `threads` threads per batch row, over its checkpoint entries: each entry's
    offset (`every` == 0: checkpoint_offsets[n, e]; else first[n] + e * every, its slot
    checkpoint_slots[n, e]), checked, ranked among the row's valid ones and written to K2's
    table of its row (or segment): (chunks done, destination), ascending, -1 after the last. A
    mid-chunk one takes a side slot (a global counter): its partial chunk's token range, its
    workspace chunk, scratch row and destination for K1's and K2's side runs."""

    threads: int = 256

    @property
    def name(self) -> str:
        return f"kda_checkpoints_t{self.threads}"


def supports(cfg: CheckpointsConfig) -> tuple[bool, str]:
    if cfg.threads % 32 or not 32 <= cfg.threads <= 1024:
        return False, f"threads must be a multiple of 32 in [32, 1024], got {cfg.threads}"
    return True, ""


def args(cfg: CheckpointsConfig) -> list[Arg]:
    """The kernel's `__call__` arguments:
    - cu_seqlens: K2's rows' token offsets (N * row_segments + 1: a batch row's segments, or
      its sequence), int32; entries (the caller's offsets or slots, int32 words; an int64 table
      as word pairs) with its row and entry strides in entries and `wide`; first (the caller's
      first-boundary offsets, read when `first_on`) with its stride and `wide`;
    - ck_at, ck_to: K2's table, (entries + 1) words per K2 row; side_cu (side slot k's token
      range at 2k, 2k + 1, the count of side slots used at 2 * side_slots; zeroed before the
      launch), k1_chunks (K1's chunk table for the pairs: k at 2k, k + 1 at 2k + 1), side_chunk
      (the workspace chunk of side slot k), side_read, side_write (its scratch row and
      destination);
    - the pool form's arguments (recur.index_args: which rows are padding) and the scalars."""
    return [
        tensor("cu_seqlens", "int32", ("N1",), (1,), dsl="mCuSeq"),
        tensor("entries", "int32", ("NCE",), (1,), dsl="mEntries"),
        tensor("first", "int32", ("NCF",), (1,), dsl="mFirst"),
        tensor("ck_at", "int32", ("NCT",), (1,), dsl="mCkAt"),
        tensor("ck_to", "int32", ("NCT",), (1,), dsl="mCkTo"),
        tensor("side_cu", "int32", ("NSC",), (1,), dsl="mSideCu"),
        tensor("k1_chunks", "int32", ("NSC",), (1,), dsl="mK1Chunks"),
        tensor("side_chunk", "int32", ("NSC",), (1,), dsl="mSideChunk"),
        tensor("side_read", "int32", ("NSC",), (1,), dsl="mSideRead"),
        tensor("side_write", "int32", ("NSC",), (1,), dsl="mSideWrite"),
        *index_args(),
        scalar("num_rows", grid_only=True),
        scalar("row_segments"),  # K2 rows per batch row (segments), 1 otherwise
        scalar("per_row"),  # entries per batch row
        scalar("e_sn"),  # entries' row stride (entries)
        scalar("e_se"),  # entries' entry stride
        scalar("e_wide"),
        scalar("every"),  # 0: entries are offsets; else the boundaries' spacing (tokens)
        scalar("first_on"),
        scalar("f_sn"),
        scalar("f_wide"),
        scalar("dest_rows"),  # every > 0: the destination pool's slots
        scalar("dest_min"),  # every > 0: slots below are skipped (null_slot=0: 1)
        scalar("side_slots"),  # N * per_row
        scalar("side_base"),  # the first side slot's workspace chunk
        scalar("chunk_shift"),  # log2 of the chunk
        scalar("in_place"),  # 1: an fp32 destination, its own scratch row
        scalar("shifted"),  # 1: the rows' grids start at their first boundaries' phase
    ]


def dsl_class(cfg: CheckpointsConfig) -> str:
    return "kernels.kda_checkpoints_sm90:KdaCheckpointsSm90"
