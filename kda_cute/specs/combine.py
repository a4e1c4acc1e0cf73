"""The segments' combine (kernels/kda_combine_sm90.py): its config, constraints and argument
list. No DSL import here."""

from __future__ import annotations

from dataclasses import dataclass

from ..abi import Arg, SpecConfig, scalar, tensor
from .recur import index_args


@dataclass(frozen=True)
class CombineConfig(SpecConfig):
    """The segments' combine (kda_cute.segments) of the few-heads K2: the start states
    S_start(j + 1) = S_start(j) A_j + B_j in fp32. One CTA per (block of `rows` state rows, head,
    sequence), one thread per key column (V = K: segments need K == V)."""

    head_dim_k: int
    rows: int = 8

    @property
    def name(self) -> str:
        return f"kda_combine_k{self.head_dim_k}_r{self.rows}"

    @property
    def block_threads(self) -> int:
        return self.head_dim_k


def supports(cfg: CombineConfig) -> tuple[bool, str]:
    if cfg.head_dim_k % 32 or not 32 <= cfg.head_dim_k <= 256:
        return False, f"head_dim_k must be a multiple of 32 in [32, 256], got {cfg.head_dim_k}"
    if cfg.rows not in (1, 2, 4, 8, 16) or cfg.head_dim_k % cfg.rows:
        return False, f"rows must be 1, 2, 4, 8 or 16 and divide head_dim_k, got {cfg.rows}"
    return True, ""


def args(cfg: CombineConfig) -> list[Arg]:
    """The combine's `__call__` arguments: NSP = sequences x segments (the fp32 scratch
    states, stride sSP = H * K * K); the initial and final states as K2's (fp32 or bf16, dense
    [N, H, K, K] or the pool's slots, stride sS), read and written as state_in / state_out say
    (0 none, 1 fp32, 2 bf16) at the slots the pool form's arguments give."""
    K = cfg.head_dim_k

    def scratch(name, dsl):
        return tensor(name, "float32", ("NSP", "H", K, K), ("sSP", K * K, K, 1), dsl=dsl)

    def state(name, dtype, dsl):
        return tensor(name, dtype, ("NS", "H", K, K), ("sS", K * K, K, 1), dsl=dsl)

    idx = index_args()
    return [
        scratch("maps", "mA"), scratch("ends", "mB"),
        state("s0f", "float32", "mS0f"), state("s0h", "bfloat16", "mS0h"),
        scratch("starts", "mStart"),
        state("final", "float32", "mFinal"), state("final_h", "bfloat16", "mFinalH"),
        *idx[:4],
        scalar("segments"),
        scalar("state_in"),
        scalar("state_out"),
        *idx[4:],
        scalar("num_seqs", grid_only=True),
        scalar("num_heads", grid_only=True),
    ]


def dsl_class(cfg: CombineConfig) -> str:
    return "kernels.kda_combine_sm90:KdaCombineSm90"
