"""The token step (kernels/kda_step_sm90.py, its persistent and chunked forms beside it, over
kernels/step_rows.py): decode and multi-token verify against a state pool, token by token with
the state in registers. Its config, constraints and argument list; no DSL import here.

One kernel serves every serving form: which slot a row reads, where the state after a token goes
and how a row's tokens are found are run-time arguments (index tables with strides, modes), so
one cubin per (head dims, pool dtype, tile) covers decode, both verify styles and tree drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..abi import Arg, SpecConfig, scalar, tensor

POOL_DTYPES = ("float32", "bfloat16")

# the error words the kernel sets (mErr[code] = 1; sticky until the host reads and clears them),
# each named by the argument whose value was bad
ERRORS = ("cu_seqlens", "cu_seqlens (tokens per row past the entries or scratch steps)",
          "num_accepted_tokens / accepted_step",
          "state_indices / ssm_state_indices / intermediate_state_indices (the read slot)",
          "output_state_indices / ssm_state_indices / intermediate_state_indices / "
          "state_indices / checkpoint_slots (a write slot)", "retrieve_parent_token",
          "cu_seqlens (a prefill's: non-decreasing from 0 to at most T; the call ran no tokens, "
          "its outputs were not written and its final states are its initial ones)",
          "precision (a forward's state became non-finite: the inputs or the initial state held "
          "inf or NaN, or values so large that the float64 result leaves bf16's range; fast "
          "precision redoes what overflowed its fp16 operands with its rows rescaled)")
ERROR_WORDS = len(ERRORS)
E_CU, E_CU_ROWS, E_ACCEPTED, E_READ, E_WRITE, E_PARENT = range(6)  # the words' indices
# what each of those words stands for in a call (the argument that fills it depends on the
# call: the read slot is decode's state_indices, verify's ssm_state_indices or state_indices,
# commit's intermediate_state_indices)
ERROR_ROLES = ("offsets", "tokens per row", "accepted count", "read slot", "write slot", "parent")

# write modes: nothing, the state after a row's last token, the state after every token, the
# start state itself (a commit: no tokens)
WRITE_NONE, WRITE_LAST, WRITE_ALL, WRITE_START = 0, 1, 2, 3
# gate modes (as the prefill's: kda_cute.specs.prep.GATE_MODES)
STEP_GATES = {"none": 0, "bounded": 1, "unbounded": 2}


@dataclass(frozen=True)
class StepConfig(SpecConfig):
    """One CTA per (block of `block_v` state rows, head, row of the batch); `tpr` lanes per state
    row, each holding K / tpr columns of `rows_per_thread` rows in fp32 registers. `pool` is
    the dtype of the state pool read and written (and of the verify scratch)."""

    head_dim_k: int
    head_dim_v: int
    pool: str = "float32"
    block_v: int = 32
    tpr: int = 8
    threads: int = 128
    access: int = 16  # bytes per pool access (16, or 8)
    unroll: int = 0  # the row loop's unroll (0: whole)
    min_blocks: int = 0  # CTAs per SM that ptxas must fit (registers capped to match; 0: free)
    # > 0: a persistent grid of this many CTAs per SM: single-token plans only, but for a chunked
    # tile (chunk), which takes the rows of up to its chunk of tokens either way
    persist: int = 0
    # a token's loads issued a step ahead: the first token's with the staging, each next
    # one's during the previous token's rows (more registers: the loads stay live)
    ahead: bool = False
    # > 0: a CTA's row groups prepare this many of a row's tokens at once (q, k and the decay
    # normed and exponentiated, beta, k . q, v and the write row), one group a token, into
    # shared memory that every group reads (two CTA barriers per such chunk), instead of every
    # group doing each token's math itself
    prep: int = 0
    # > 0: a multi-token row's tokens (at most this many) as one chunk: every token's row dot
    # products taken from the start state at once by warp MMA, a T x T solve per row, then the
    # states after each token by the plain update (no reduction in the token loop)
    chunk: int = 0

    @property
    def vec(self) -> int:
        """Pool elements per access."""
        return self.access // (4 if self.pool == "float32" else 2)

    @property
    def stage_bytes(self) -> int:
        """Shared memory a single-token plan uses: the staged start state (a persistent tile
        stages two tiles) and the prepared tokens' area (prep); a bf16 pool's fp32 keep area,
        for the states between a row's tokens, follows them."""
        tile = self.block_v * self.head_dim_k * (4 if self.pool == "float32" else 2)
        if self.chunk:  # every area is used at every token count: the whole storage
            return self.chunk_bytes
        return (2 * tile if self.persist else tile) + self.prep_bytes

    @property
    def chunk_bytes(self) -> int:
        """The chunked kernel's shared memory, each part 128-byte aligned: the start state's
        tile (in the pool's dtype, rows 16 bytes longer than K; two for a persistent tile), the
        tokens' area (prep_bytes' parts), the T x T products (two), the operand planes (hi, lo
        in the pool's dtype: 2 chunk columns, at least 8, rows as the tile's) and the rows'
        products (the planes' columns x block_v + 4)."""
        def up(n):
            return -(-n // 128) * 128
        c, K, BV = self.chunk, self.head_dim_k, self.block_v
        es = 4 if self.pool == "float32" else 2
        row = es * K + 16
        cols = max(8, 2 * c)
        tiles = 2 if self.persist else 1
        return (up(tiles * BV * row) + 3 * up(4 * c * K) + up(4 * c * BV) + up(8 * c)
                + up(4 * c) + 2 * up(4 * c * c) + 2 * up(cols * row) + up(4 * (BV + 4) * cols))

    @property
    def prep_bytes(self) -> int:
        """The prepared tokens' area (prep): per token q, k and the decay (K fp32 each), v (block_v
        fp32), beta and k . q, and the write row; each part 128-byte aligned."""
        if not self.prep:
            return 0
        def up(n):
            return -(-n // 128) * 128
        c = self.prep
        return 3 * up(4 * c * self.head_dim_k) + up(4 * c * self.block_v) + up(8 * c) + up(4 * c)

    @property
    def rows_per_thread(self) -> int:
        return self.block_v * self.tpr // self.threads

    @property
    def name(self) -> str:
        p = "f32" if self.pool == "float32" else "bf16"
        opts = ((self.access != 16, f"_a{self.access}"), (self.unroll, f"_u{self.unroll}"),
                (self.min_blocks, f"_m{self.min_blocks}"), (self.persist, f"_p{self.persist}"),
                (self.ahead, "_n"), (self.prep, f"_c{self.prep}"), (self.chunk, f"_k{self.chunk}"))
        return (f"kda_step_k{self.head_dim_k}_v{self.head_dim_v}_{p}_bv{self.block_v}"
                f"_r{self.tpr}_t{self.threads}" + "".join(t for on, t in opts if on))


def supports(cfg: StepConfig) -> tuple[bool, str]:
    K, V = cfg.head_dim_k, cfg.head_dim_v
    if cfg.pool not in POOL_DTYPES:
        return False, f"pool must be one of {POOL_DTYPES}, got {cfg.pool!r}"
    if K % 32 or not 32 <= K <= 256:
        return False, f"head_dim_k must be a multiple of 32 in [32, 256], got {K}"
    if V % 8 or not 8 <= V <= 256:
        return False, f"head_dim_v must be a multiple of 8 in [8, 256], got {V}"
    if cfg.access not in (8, 16):
        return False, f"access must be 8 or 16 bytes, got {cfg.access}"
    if cfg.unroll < 0:
        return False, f"unroll must be >= 0, got {cfg.unroll}"
    if cfg.persist < 0 or cfg.persist * cfg.threads > 2048:
        return False, (f"persist must be in [0, 2048 / threads], got {cfg.persist} at "
                       f"{cfg.threads} threads")
    if cfg.ahead and cfg.persist:
        return False, ("ahead is for the one-tile kernel; a persistent tile issues its next "
                       "tile's loads anyway")
    if cfg.prep and (cfg.persist or cfg.ahead):
        return False, ("prep is for the one-tile kernel without ahead (a prepared chunk's loads "
                       f"are issued together), got persist={cfg.persist}, ahead={cfg.ahead}")
    if cfg.prep < 0 or cfg.prep > max(1, cfg.threads // cfg.tpr):
        return False, (f"prep must be in [0, threads / tpr = {cfg.threads // cfg.tpr}] (one row "
                       f"group a prepared token), got {cfg.prep}")
    if cfg.prep * cfg.tpr % 32:  # the math's shuffles take whole warps
        return False, (f"prep * tpr must be a multiple of 32 (the preparing groups fill whole "
                       f"warps), got {cfg.prep} * {cfg.tpr}")
    if cfg.chunk:
        if cfg.prep or cfg.ahead or cfg.access != 16:
            return False, ("chunk is for tiles of 16-byte accesses without prep or ahead, got "
                           f"access={cfg.access}, prep={cfg.prep}, ahead={cfg.ahead}")
        if not 2 <= cfg.chunk <= cfg.threads // cfg.tpr or cfg.chunk * cfg.tpr % 32:
            return False, (f"chunk must be in [2, threads / tpr = {cfg.threads // cfg.tpr}] "
                           f"with chunk * tpr a multiple of 32, got {cfg.chunk}")
        if cfg.block_v != 16 * (cfg.threads // 32) or K % 16:
            return False, (f"chunk: block_v must be 16 rows a warp ({16 * (cfg.threads // 32)})"
                           f" and head_dim_k a multiple of 16, got {cfg.block_v}, {K}")
    if cfg.min_blocks < 0 or cfg.min_blocks * cfg.threads > 2048:
        return False, (f"min_blocks must be in [0, 2048 / threads], got {cfg.min_blocks} "
                       f"at {cfg.threads} threads")
    if cfg.tpr not in (1, 2, 4, 8, 16, 32):
        return False, f"tpr must be a power of two <= 32, got {cfg.tpr}"
    if K % (cfg.tpr * cfg.vec):
        return False, f"tpr * {cfg.vec} ({cfg.tpr * cfg.vec}) must divide head_dim_k {K}"
    if cfg.threads % 32 or not 32 <= cfg.threads <= 1024:
        return False, f"threads must be a multiple of 32 in [32, 1024], got {cfg.threads}"
    if cfg.block_v < 1 or V % cfg.block_v:
        return False, f"block_v {cfg.block_v} must divide head_dim_v {V}"
    groups = cfg.threads // cfg.tpr
    if cfg.block_v % groups:
        return False, (f"threads / tpr ({groups} row groups) must divide block_v "
                       f"{cfg.block_v}")
    if cfg.rows_per_thread > cfg.tpr:  # a row's lanes hold the v of its R rows between them
        return False, (f"rows_per_thread (block_v * tpr / threads = {cfg.rows_per_thread}) "
                       f"must be <= tpr {cfg.tpr}")
    return True, ""


def args(cfg: StepConfig) -> list[Arg]:
    """The step's `__call__` arguments, in order. Token rows are (T, H * D) views with a free row
    stride; the pool (P slots) and the written states (PD rows: the pool again, or the verify
    scratch) are (slots, H, V, K) with a free slot stride; index tables are flat int32 words
    (an int64 table is read as word pairs, its `*_wide` flag set), addressed by the strides the
    scalars give."""
    K, V = cfg.head_dim_k, cfg.head_dim_v

    def rows(name, width, stride):
        return tensor(name, "bfloat16", ("T", width), (stride, 1), 16)

    def words(name, n, dsl=""):
        return tensor(name, "int32", (n,), (1,), dsl=dsl)

    return [
        rows("q", "HK", "sQ"), rows("k", "HK", "sK"), rows("g", "HK", "sG"),
        rows("v", "HV", "sV"),
        tensor("beta", "bfloat16", ("T", "H"), ("sB", 1)),
        rows("out", "HV", "sO"),
        tensor("A_log", "float32", ("H",), (1,)),
        tensor("dt_bias", "float32", ("HK",), (1,)),
        tensor("pool", cfg.pool, ("P", "H", V, K), ("sP", V * K, K, 1), 16),
        tensor("dst", cfg.pool, ("PD", "H", V, K), ("sPD", V * K, K, 1), 16),
        words("cu_seqlens", "NCU", dsl="mCu"),
        words("read_index", "NRI", dsl="mRIdx"),
        words("write_index", "NWI", dsl="mWIdx"),
        words("accepted", "NAC", dsl="mAcc"),
        words("parent", "NPA"),
        tensor("has_init", "int8", ("NHI",), (1,)),
        tensor("errors", "int32", (8,), (1,), dsl="mErr"),
        # a persistent tile walks the (V / block_v, H, rows) tiles itself: it takes both
        scalar("num_rows", grid_only=not cfg.persist),
        scalar("num_heads", grid_only=not cfg.persist),
        # tokens: fixed_len >= 0 gives row n tokens n * fixed_len ..; < 0: cu_seqlens
        scalar("fixed_len"), scalar("cu_wide"), scalar("max_tokens"),
        # the read row: read_index[n * r_sn + sel * r_st] * r_mul + sel * r_add, with
        # sel = accepted[n] - acc_base in [0, max_sel) (0 without accepted; acc_skip: a
        # negative sel skips the row)
        scalar("read_mode"), scalar("r_sn"), scalar("r_st"), scalar("r_wide"),
        scalar("r_mul"), scalar("r_add"),
        scalar("acc_on"), scalar("acc_wide"), scalar("acc_base"), scalar("acc_skip"),
        scalar("max_sel"), scalar("hi_on"),
        # entries below these are padding: of the read index, of the write index
        scalar("r_null"), scalar("w_null"),
        # the state after token t: dst row write_index[n * w_sn + t * w_st] * w_mul + t * w_add
        scalar("write_mode"), scalar("w_sn"), scalar("w_st"), scalar("w_wide"),
        scalar("w_mul"), scalar("w_add"),
        # tree drafts: token t starts from the state after token parent[n * p_sn + t * p_st]
        scalar("parent_on"), scalar("p_sn"), scalar("p_st"), scalar("p_wide"),
        # how A_log and dt_bias are held (abi.GATE_PARAM_DTYPES; 0: not given, read as zeros)
        scalar("gate"), scalar("a_log_dtype"), scalar("dt_bias_dtype"), scalar("qk_l2norm"),
        scalar("beta_sigmoid"),
        scalar("scale", "f32"), scalar("lower_bound", "f32"),
    ]


def dsl_class(cfg: StepConfig) -> str:
    """The chunked tile (one tile a CTA or persistent), the persistent single-token kernel, or
    the one-tile token kernel."""
    if cfg.chunk:
        return "kernels.kda_step_chunk_sm90:KdaStepChunkSm90"
    if cfg.persist:
        return "kernels.kda_step_persist_sm90:KdaStepPersistSm90"
    return "kernels.kda_step_sm90:KdaStepSm90"
