"""K2, the chunk recurrence (kernels/kda_recur_tc_sm90.py on tensor cores, kernels/kda_recur_sm90.py
the fp32 CUDA-core baseline): its config, constraints and argument list. No DSL import here."""

from __future__ import annotations

from dataclasses import dataclass

from .. import abi
from ..abi import QK_DTYPE, Arg, operand_dtype, operand_tma, scalar, tensor, tma, ws_tile

# The dtype of a state K2 or the combine reads or writes (`state_in`, `state_out`): none, fp32
# or bf16
STATE_NONE, STATE_F32, STATE_BF16 = 0, 1, 2
# Where a sequence's states are (K2's and the combine's `index_mode`): dense (sequence n's state
# is row n), in a pool (row state_index[n] read, out_index[n] written), or dense with the pool's
# index table read only for which rows are padding (the segments' last run, whose start states
# are the combine's)
INDEX_DENSE, INDEX_POOL, INDEX_PAD = 0, 1, 2
# The pool form's run-time arguments, shared by K2 and the combine (kernels.common.StateSlots):
# the mode, the index table's row of sequence n (n // row_div), the pool's slots, the read
# table's entry stride and int64 flag, whether a write table is given (else the read slot is
# written) with its stride and flag, whether has_init is read, and the least index that is not
# padding (0, or 1 with null_slot=0)
INDEX_SCALARS = ("index_mode", "row_div", "slots", "r_sn", "r_wide", "w_on", "w_sn", "w_wide",
                 "hi_on", "null_min")


def index_args() -> list[Arg]:
    """The pool form's tables (int32 words; an int64 table as word pairs), has_init flags, the
    error words (kda_cute.errors) and INDEX_SCALARS."""
    return [
        tensor("state_index", "int32", ("NRI",), (1,), dsl="mRIdx"),
        tensor("out_index", "int32", ("NWI",), (1,), dsl="mWIdx"),
        tensor("has_init", "int8", ("NHI",), (1,)),
        tensor("errors", "int32", (8,), (1,), dsl="mErr"),
        *(scalar(n) for n in INDEX_SCALARS),
    ]


@dataclass(frozen=True)
class RecurConfig(abi.SpecConfig):
    """K2 (chunk recurrence). One CTA per (sequence, head, block of `block_v` state rows)."""

    head_dim_k: int
    head_dim_v: int
    chunk: int = 16
    block_v: int = 16
    threads: int = 128
    stages: int = 2
    mma: str = "simt"  # "simt": fp32 CUDA cores; "wgmma": bf16 warpgroup MMA (hi/lo update)
    # False (wgmma): the state runs only, no output (no Pq and O products, no stores): the
    # segments' runs from zero and from the identity (kda_cute.segments), whose outputs are
    # not used
    outputs: bool = True
    # True (wgmma): K1 runs alongside and flags each (chunk, head); wait for a chunk's flag
    # before loading it
    alongside: bool = False
    # True (wgmma): every product on fp16 operands, one each (K1's qg, kg, kd, Aw and Mq in
    # fp16, no lo planes: PrepConfig.f16; the state converted to fp16 for P and Pq) instead of
    # U, O and the update as three bf16 products of hi/lo splits
    f16: bool = False
    # True (f16): the WY form, U^T = v^T Aw^T + S kgw^T with kgw = -Aw kg formed by the
    # producer warp from each landed stage (no P = S kg^T before U on the serial chain); the
    # launcher takes it where each K2 CTA has its SM to itself (ladder.WY_RUNS)
    wy: bool = False
    # True (wgmma, outputs): stores the state at the checkpoints of its table (checkpoint_args)
    # through a shared-memory slab and bulk copies; the builds without carry none of that code
    # (ladder.CHECKPOINT_RUNS: the main K2 of a forward with checkpoints)
    checkpoints: bool = False
    # True (f16, outputs, not wy or alongside): the rescale run after a fast forward's K2. That
    # K2 leaves the state rows of a warp whose state turned non-finite (an fp16 operand past
    # 65504: values of ~4e4 and more) or all but vanished (mean |S| under 2^-14: subnormal
    # fp16 operands) unwritten and flags them (rescale_args); this build
    # redoes only those, each state row and its values scaled by a power of two per chunk into
    # fp16's room, the outputs, checkpoints and final state unscaled exactly (ladder.RESCALE_RUNS)
    rescale: bool = False

    @property
    def name(self) -> str:
        tag = "" if self.mma == "simt" else f"_{self.mma}"
        flags = ((self.f16, "_f16"), (self.wy, "_wy"), (not self.outputs, "_noout"),
                 (self.alongside, "_al"), (self.checkpoints, "_ck"), (self.rescale, "_rs"))
        return (f"kda_recur{tag}_k{self.head_dim_k}_v{self.head_dim_v}_c{self.chunk}"
                f"_bv{self.block_v}_t{self.threads}_s{self.stages}"
                + "".join(t for on, t in flags if on))

    @property
    def block_threads(self) -> int:
        """Threads per CTA: `threads` compute threads, plus one TMA producer warp for wgmma."""
        return self.threads + (32 if self.mma == "wgmma" else 0)

    # The tensor-core K2's tuning switches, each kept where it measured faster (docs/notes/k2.md)
    @property
    def releases(self) -> bool:
        """Releases its rescale run at its start: the serial fp16 builds, which one follows."""
        return self.f16 and not self.alongside and not self.rescale

    @property
    def ck_lanes(self) -> bool:
        """Its checkpoint table in lanes: faster only in the fp16 alongside builds at K >= 128."""
        return self.checkpoints and self.f16 and self.alongside and self.head_dim_k >= 128

    @property
    def early(self) -> bool:
        """Tests the next stage's barriers during an update: pays in alongside / WY at K <= 128."""
        return (self.alongside or self.wy) and self.head_dim_k <= 128

    @property
    def min_blocks(self) -> int:
        """1 CTA an SM for ptxas, its registers loading the decay factors early: the fp16 builds
        with an SM to themselves (alongside at K <= 128, WY checkpoints at 128); 0: free."""
        wy_ck = self.wy and self.checkpoints and self.head_dim_k == 128
        return 1 if self.f16 and ((self.alongside and self.head_dim_k <= 128) or wy_ck) else 0

    @property
    def carry(self) -> bool:
        """The chunk loop carries its token counters: fewer instructions, except at K = 64's
        plain builds and the alongside checkpoints builds."""
        return (self.alongside or self.head_dim_k > 64) and not (self.alongside
                                                                  and self.checkpoints)

    @property
    def defer(self) -> bool:
        """A checkpoint stored beside the next chunk's first products, not between chunks: K =
        128's serial fp16 checkpoints builds."""
        return (self.checkpoints and self.f16 and not self.alongside and not self.rescale
                and not self.ck_lanes and self.head_dim_k == 128)

def supports(cfg: RecurConfig) -> tuple[bool, str]:
    if cfg.head_dim_k % 8 or not 8 <= cfg.head_dim_k <= 256:
        return False, f"head_dim_k must be a multiple of 8 in [8, 256], got {cfg.head_dim_k}"
    if cfg.head_dim_v % 8 or not 8 <= cfg.head_dim_v <= 256:
        return False, f"head_dim_v must be a multiple of 8 in [8, 256], got {cfg.head_dim_v}"
    if not 1 <= cfg.chunk <= 32:
        return False, f"chunk must be in [1, 32], got {cfg.chunk}"
    if cfg.block_v < 1 or cfg.head_dim_v % cfg.block_v:
        return False, f"block_v {cfg.block_v} must divide head_dim_v {cfg.head_dim_v}"
    if cfg.threads % cfg.block_v or cfg.head_dim_k % (cfg.threads // cfg.block_v):
        return False, (f"threads/block_v ({cfg.threads}/{cfg.block_v}) must divide "
                       f"head_dim_k {cfg.head_dim_k}")
    tpr = cfg.threads // cfg.block_v
    if tpr > 32 or 32 % tpr:
        return False, f"threads per state row (threads/block_v) must be a power of two <= 32, " \
            f"got {tpr}"
    most = 8 if cfg.mma == "wgmma" else 4
    if not 1 <= cfg.stages <= most:
        return False, f"stages must be in [1, {most}] for mma {cfg.mma!r}, got {cfg.stages}"
    if cfg.mma not in ("simt", "wgmma"):
        return False, f"mma must be 'simt' or 'wgmma', got {cfg.mma!r}"
    if not cfg.outputs and cfg.mma != "wgmma":
        return False, f"outputs=False needs mma 'wgmma', got {cfg.mma!r}"
    if cfg.f16 and cfg.mma != "wgmma":
        return False, f"f16 needs mma 'wgmma', got {cfg.mma!r}"
    if cfg.wy and not (cfg.f16 and cfg.outputs and not cfg.alongside and cfg.chunk == 16):
        return False, (f"wy needs f16, outputs, chunk 16 and no alongside, got f16={cfg.f16}, "
                       f"outputs={cfg.outputs}, chunk={cfg.chunk}, alongside={cfg.alongside}")
    if cfg.checkpoints and (cfg.mma != "wgmma" or not cfg.outputs):
        return False, (f"checkpoints needs mma 'wgmma' with outputs, got {cfg.mma!r}, "
                       f"outputs={cfg.outputs}")
    if cfg.rescale and not (cfg.f16 and cfg.outputs and not cfg.wy and not cfg.alongside):
        return False, (f"rescale needs f16 and outputs, neither wy nor alongside, got "
                       f"f16={cfg.f16}, outputs={cfg.outputs}, wy={cfg.wy}, "
                       f"alongside={cfg.alongside}")
    if cfg.alongside and (cfg.mma != "wgmma" or not cfg.outputs):
        return False, (f"alongside needs mma 'wgmma' with outputs, got {cfg.mma!r}, "
                       f"outputs={cfg.outputs}")
    if cfg.mma == "wgmma" and (cfg.block_v != 64 or cfg.threads != 128
                               or cfg.head_dim_k % 64 or cfg.chunk not in (16, 32)
                               or cfg.stages < 2):
        return False, (f"mma 'wgmma' needs block_v 64, threads 128, head_dim_k % 64 == 0, "
                       f"chunk 16 or 32 and stages >= 2, got {cfg.block_v}, {cfg.threads}, "
                       f"{cfg.head_dim_k}, {cfg.chunk}, {cfg.stages}")
    return True, ""


def args(cfg: RecurConfig) -> list[Arg]:
    """K2's `__call__` arguments, in order."""
    K, C = cfg.head_dim_k, cfg.chunk
    if cfg.mma == "wgmma":
        dt = operand_dtype(cfg.f16)
        return [
            operand_tma("kg", "HK", C, K, dtype=QK_DTYPE),
            operand_tma("qg", "HK", C, K, dtype=QK_DTYPE),
            operand_tma("kdh", "HK", C, K, mn_major=True, dtype=dt),
            operand_tma("kdl", "HK", C, K, mn_major=True, dtype=dt),
            operand_tma("awh", "HC", C, C, dtype=dt),
            operand_tma("awl", "HC", C, C, dtype=dt),
            operand_tma("mqh", "HC", C, C, dtype=dt),
            operand_tma("mql", "HC", C, C, dtype=dt),
            *_common(cfg),
            *checkpoint_args(cfg),
            *rescale_args(),
            Arg("mma_p", "mma", kernel_only=True),
            Arg("mma_s", "mma", kernel_only=True),
            # P and Pq on fp16 operands (the f16 builds: mma_p itself)
            Arg("mma_q", "mma", kernel_only=True),
        ]
    return [
        ws_tile("kg", "float32", "HK", (K, C)),
        ws_tile("qg", "float32", "HK", (K, C)),
        ws_tile("kd", "float32", "HK", (K, C)),
        ws_tile("aw", "float32", "HC", (C, C)),
        ws_tile("mq", "float32", "HC", (C, C)),
        *_common(cfg),
    ]


def checkpoint_args(cfg: RecurConfig) -> list[Arg]:
    """The tensor-core K2's checkpoints (kda_cute.specs.checkpoints; stored by the
    `checkpoints` builds, every build takes the arguments): its table (ck_rows
    int32 words a sequence: the chunks done before each store, ascending, -1 after the last;
    and where to: a destination row, or for a code < 0 scratch row -code - 1), the destination
    as fp32 and bf16 views ([rows, H, V, K], row stride sCK; ck_dtype says which), the fp32
    scratch rows (the same stride): tensors, or where checkpoint_maps(cfg) tensor maps of their
    [rows, H*V, K] views; `side` 1 for the side run, which finishes each mid-chunk
    checkpoint from its scratch row (sequence z's tokens at cu_seqlens[2z], [2z + 1], their
    count the table's last word; no outputs stored)."""
    K, V = cfg.head_dim_k, cfg.head_dim_v
    if checkpoint_maps(cfg):
        # tensor maps of [rows, H*V, K] views: a warp's 16 rows leave in one TMA store whose
        # box spans the slab's padded rows (the columns past K out of bounds, not written)
        dest = [tma(name, dt, (n, "HV", K), ("sCK", K, 1), ck_slab_box(K, pad), dsl=dsl)
                for name, dt, n, pad, dsl in CK_DESTS]
    else:
        dest = [tensor(name, dt, (n, "H", V, K), ("sCK", V * K, K, 1), dsl=dsl)
                for name, dt, n, _, dsl in CK_DESTS]
    return [
        tensor("ck_at", "int32", ("NCT",), (1,), dsl="mCkAt"),
        tensor("ck_to", "int32", ("NCT",), (1,), dsl="mCkTo"),
        *dest,
        scalar("ck_rows"),
        scalar("ck_dtype"),
        scalar("side"),
    ]


# a checkpoints build's slab rows are padded by CK_PAD fp32 (2 CK_PAD bf16) elements: the
# accumulator's row pairs land in distinct banks
CK_PAD = 8
# the checkpoint destinations: argument, dtype, rows symbol, the slab rows' padding in its
# elements, the DSL name (the final fp32 and bf16 views, the fp32 scratch rows)
CK_DESTS = (("ck_f", "float32", "NCK", CK_PAD, "mCkF"),
            ("ck_h", "bfloat16", "NCK", 2 * CK_PAD, "mCkH"),
            ("ck_s", "float32", "NSK", CK_PAD, "mCkS"))


def ck_slab_box(K: int, pad: int) -> tuple[int, int, int]:
    """The TMA box of a warp's checkpoint slab (checkpoint_maps), innermost first: one padded
    row of K + pad elements, 16 state rows, one destination row."""
    return (K + pad, 16, 1)


def checkpoint_maps(cfg: RecurConfig) -> bool:
    """Whether a checkpoints build stores through tensor maps (one TMA store a warp, its box
    the padded slab row: at most 256 elements) rather than a bulk copy a row. The rescale
    builds (a rare path; their rank-2-only C++ plan export) keep the row copies."""
    return cfg.checkpoints and not cfg.rescale and cfg.head_dim_k + 2 * CK_PAD <= 256


def rescale_args() -> list[Arg]:
    """The tensor-core K2's rescale words (every build takes them): four int32 words per (row
    of the launch's sequences, head, block of 64 state rows), one per warp of 16 rows, at
    ((row * H + head) * (V / 64) + block) * 4 + warp. With fix_on 1 a forward's K2 writes each
    (1: that warp's state turned non-finite or all but vanished, and its state rows were left
    as they were) and
    the `rescale` build run next with the same arguments redoes the flagged ones; fix_on 0 (the
    precise builds, the side and identity runs) writes none and reports a non-finite state in
    the error words instead."""
    return [tensor("fixes", "int32", ("NFX",), (1,), dsl="mFix"), scalar("fix_on")]


def _common(cfg: RecurConfig) -> list[Arg]:
    K, V, C, BV = cfg.head_dim_k, cfg.head_dim_v, cfg.chunk, cfg.block_v
    tc = cfg.mma == "wgmma"
    return [
        tma("gl", "float32", ("NCH", "HK"), ("HK", 1), (K, 1)),
        tma("v", "bfloat16", ("T", "HV"), ("sV", 1), (BV, C)),
        tensor("out", "bfloat16", ("T", "H", V), ("sO", V, 1)),
        *([tma("out_tma", "bfloat16", ("T", "HV"), ("sO", 1), (16, C), dsl="mOutT")]
          if tc else []),
        # dense states [N, H, V, K], or the pool [slots, H, V, K] (slot stride sS, a multiple
        # of 8 elements; 16-byte aligned bases: a thread's column pairs load and store at once)
        tensor("s0f", "float32", ("NS", "H", V, K), ("sS", V * K, K, 1), 16),
        tensor("s0h", "bfloat16", ("NS", "H", V, K), ("sS", V * K, K, 1), 16),
        tensor("s1f", "float32", ("NS", "H", V, K), ("sS", V * K, K, 1), 16),
        tensor("s1h", "bfloat16", ("NS", "H", V, K), ("sS", V * K, K, 1), 16),
        tensor("cu_seqlens", "int32", ("N1",), (1,), dsl="mCuSeq"),
        tensor("cu_chunks", "int32", ("N1",), (1,), dsl="mCuChunk"),
        # read only by an alongside build
        *([tensor("flags", "int32", ("FL",), (1,))] if tc else []),
        *index_args()[:4],
        scalar("num_seqs", grid_only=True),
        scalar("num_heads", grid_only=True),
        scalar("state_in"),
        scalar("state_out"),
        # 1: grid z runs the z-th longest sequence (varlen, fewer than the CTA's threads)
        *([scalar("ordered")] if tc else []),
        *index_args()[4:],
    ]


def dsl_class(cfg: RecurConfig) -> str:
    if cfg.mma == "wgmma":
        return "kernels.kda_recur_tc_sm90:KdaRecurTcSm90"
    return "kernels.kda_recur_sm90:KdaRecurSm90"
