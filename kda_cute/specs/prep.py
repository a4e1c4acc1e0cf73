"""K1, the token-parallel preparation (kernels/kda_prep_sm90.py): its config, the constraints it
is built under, and its argument list. No DSL import here."""

from __future__ import annotations

from dataclasses import dataclass

from ..abi import QK_DTYPE, Arg, SpecConfig, operand_dtype, scalar, tensor, tma, ws_rows, ws_tile

# gate_mode values passed to K1 at run time (one cubin serves all three forms)
GATE_NONE, GATE_BOUNDED, GATE_UNBOUNDED = 0, 1, 2
GATE_MODES = {"none": GATE_NONE, "bounded": GATE_BOUNDED, "unbounded": GATE_UNBOUNDED}

# K1's grid: heads on x, chunks on y and z (chunk = y + K1_GRID_Y * z; grid y is at most 65535)
K1_GRID_Y = 65535


@dataclass(frozen=True)
class PrepConfig(SpecConfig):
    """K1 (token-parallel preparation)."""

    head_dim_k: int
    chunk: int = 16
    threads: int = 128
    # "f32": fp32 workspace, read by the SIMT K2. "bf16": the tensor-core K2's operands (bf16 qg,
    # kg, Mq; kd and Aw as bf16 hi + lo pairs; fp32 gl), laid out for its TMA loads
    operands: str = "f32"
    # True (bf16 operands): flag each (chunk, head) in the workspace once written, for a K2
    # running alongside (K2 first, this K1 its programmatic dependent)
    alongside: bool = False
    # True (bf16 operands): qg, kg, kd, Aw and Mq in fp16, kd, Aw and Mq in their hi planes
    # only (no lo planes written), for a K2 taking one f16 product each (RecurConfig.f16)
    f16: bool = False
    # True (the checkpoints' side run, ladder.looped_of): a CTA prepares side slots y,
    # y + grid y, ... below the count of those in use (cu_seqlens[num_seqs + 1], the
    # checkpoints kernel's counter; slot b's chunk cu_seqlens[2b] .. [2b + 1]) instead of slot
    # y alone, so the run's grid is one resident wave however many side slots it covers
    looped: bool = False

    @property
    def name(self) -> str:
        tag = "" if self.operands == "f32" else f"_{self.operands}"
        flags = ((self.f16, "_f16"), (self.alongside, "_al"), (self.looped, "_lp"))
        return (f"kda_prep{tag}_k{self.head_dim_k}_c{self.chunk}_t{self.threads}"
                + "".join(t for on, t in flags if on))


def supports(cfg: PrepConfig) -> tuple[bool, str]:
    if cfg.head_dim_k % 8 or not 8 <= cfg.head_dim_k <= 256:
        return False, f"head_dim_k must be a multiple of 8 in [8, 256], got {cfg.head_dim_k}"
    if cfg.chunk not in (16, 32):
        return False, f"chunk must be 16 or 32 (phase B's m16 MMA tiles), got {cfg.chunk}"
    if cfg.head_dim_k % 32:
        return False, f"head_dim_k must be a multiple of 32, got {cfg.head_dim_k}"
    tpr = cfg.threads // (2 * cfg.chunk)
    if (cfg.threads < 64 or cfg.threads % (2 * cfg.chunk) or tpr & (tpr - 1) or tpr > 32
            or (cfg.head_dim_k // 8) % tpr):
        return False, (f"threads must be >= 64 and 2*chunk times a power of two dividing "
                       f"head_dim_k / 8 (the row norms read 8-element vectors), "
                       f"got {cfg.threads}")
    if cfg.threads < cfg.head_dim_k:
        # the output pass gives each thread two columns of half the chunk's rows
        return False, (f"threads must be >= head_dim_k {cfg.head_dim_k} (two columns of half "
                       f"the rows per thread), got {cfg.threads}")
    if cfg.operands not in ("f32", "bf16"):
        return False, f"operands must be 'f32' or 'bf16', got {cfg.operands!r}"
    if cfg.alongside and cfg.operands != "bf16":
        return False, f"alongside needs operands 'bf16', got {cfg.operands!r}"
    if cfg.f16 and (cfg.operands != "bf16" or cfg.chunk != 16):
        return False, f"f16 needs operands 'bf16' and chunk 16, got {cfg.operands!r}, {cfg.chunk}"
    if cfg.looped and (cfg.operands != "bf16" or cfg.alongside or not column_passes(cfg)):
        return False, (f"looped needs the column-pass K1 (operands 'bf16', chunk 16, 64, 128 "
                       f"or 256 threads, not alongside), got {cfg.name}")
    return True, ""


def column_passes(cfg: PrepConfig) -> bool:
    """Whether the bf16 K1 runs phases A and B in column passes (kernels/kda_prep_sm90.py,
    _body_passes): chunk 16, 64, 128 or 256 threads, head_dim_k a multiple of the pass width
    max(64, threads / 2)."""
    return (cfg.chunk == 16 and cfg.threads in (64, 128, 256)
            and cfg.head_dim_k % max(64, cfg.threads // 2) == 0)


def args(cfg: PrepConfig) -> list[Arg]:
    """K1's `__call__` arguments, in order."""
    K, C = cfg.head_dim_k, cfg.chunk
    gl = tensor("gl", "float32", ("NCH", "H", K), ("sW", K, 1), 16)
    if cfg.operands == "bf16":
        # TMA stores from smem: (C, K) tiles of qg and kg (fp16: abi.QK_DTYPE); kd's, Aw's and
        # Mq's planes by the threads (fp16 throughout for the f16 configs, which write no lo
        # planes)
        dt = operand_dtype(cfg.f16)
        outs = [ws_tile("qg", QK_DTYPE, "HK", (K, C)), ws_tile("kg", QK_DTYPE, "HK", (K, C)),
                *(ws_rows(n, dt, K, "sW") for n in ("kdh", "kdl")),
                *(ws_rows(n, dt, C, "sWc") for n in ("awh", "awl", "mqh", "mql")), gl]
    else:
        outs = [*(ws_rows(n, "float32", K, "sW") for n in ("qg", "kg", "kd")), gl,
                *(ws_rows(n, "float32", C, "sWc") for n in ("aw", "mq"))]
    return [
        tma("q", "bfloat16", ("T", "HK"), ("sQ", 1), (K, C)),
        tma("k", "bfloat16", ("T", "HK"), ("sK", 1), (K, C)),
        tma("g", "bfloat16", ("T", "HK"), ("sG", 1), (K, C)),
        tensor("beta", "bfloat16", ("T", "H"), ("sB", 1)),
        # held in the caller's dtype (a_log_dtype, dt_bias_dtype): declared fp32, read as held
        tensor("A_log", "float32", ("H",), (1,)),
        tensor("dt_bias", "float32", ("HK",), (1,)),
        tensor("cu_seqlens", "int32", ("N1",), (1,), dsl="mCuSeq"),
        tensor("cu_chunks", "int32", ("N1",), (1,), dsl="mCuChunk"),
        *outs,
        tensor("flags", "int32", ("FL",), (1,)),  # written only by an alongside build
        scalar("num_seqs"),
        scalar("seq_len"),  # a fixed-length batch's T (K1 finds its chunks by arithmetic)
        scalar("num_chunks", grid_only=True),
        scalar("num_heads", grid_only=True),
        scalar("scale", "f32"),
        scalar("lower_bound", "f32"),
        scalar("gate_mode"),
        scalar("qk_l2norm"),
        scalar("beta_sigmoid"),
        scalar("a_log_dtype"),  # abi.GATE_PARAM_DTYPES
        scalar("dt_bias_dtype"),
    ]


def dsl_class(cfg: PrepConfig) -> str:
    """Where the DSL class that compiles `cfg` lives (module:attribute)."""
    cls = ("KdaPrepSm90" if cfg.operands == "f32"
           else "KdaPrepSm90Split" if column_passes(cfg) else "KdaPrepSm90OnePass")
    return f"kernels.kda_prep_sm90:{cls}"
