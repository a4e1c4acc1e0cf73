"""What a forward is asked to do, as metadata: the `Problem` (shapes, strides, dtypes, the state
form), the `Options` (how to run it: precision, gate form, schedule switches) and the `Call` (the
tensors and scalars of one call). A plan (kda_cute.plans) is a pure function of the first two
and the device; a run (kda_cute.launch) binds it to a `Call`.

The environment switches are read here, once, at import: `KDA_CUTE_ALONGSIDE=0` (K2 never runs
alongside K1) and `KDA_CUTE_WY=0|force` (K2's WY form never / wherever one is built). They are
only the defaults of `Options`; pass Options to override them per plan.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .ladder import FwdConfig

STATE_DTYPES = (torch.float32, torch.bfloat16)
WY_MODES = ("auto", "off", "force")


def _env_wy() -> str:
    v = os.environ.get("KDA_CUTE_WY", "1")
    return "off" if v == "0" else "force" if v == "force" else "auto"


ENV_ALONGSIDE = os.environ.get("KDA_CUTE_ALONGSIDE", "1") != "0"
ENV_WY = _env_wy()


@dataclass(frozen=True)
class Problem:
    """A forward's metadata. B, T, H: batch, tokens per sequence row, heads; K, V: head dims; N:
    sequences (B, or len(cu_seqlens) - 1 with varlen). The rest, with defaults for a problem
    described by its sizes alone (workspace sizing, scheduling): the token strides of q, k, g,
    v, out and beta in elements (None: packed rows), the states' dtypes (None: no state), which
    gate parameters are given, and whether cu_seqlens is int64 (copied to int32 for the
    kernels)."""

    B: int
    T: int
    H: int
    K: int
    V: int
    N: int
    varlen: bool
    strides: tuple[int, int, int, int, int, int] | None = None
    state_in: torch.dtype | None = None
    state_out: torch.dtype | None = None
    A_log: bool = True
    dt_bias: bool = True
    cu_int64: bool = False

    def token_strides(self) -> tuple[int, int, int, int, int, int]:
        """(q, k, g, v, out, beta) token strides in elements."""
        if self.strides is not None:
            return self.strides
        HK, HV = self.H * self.K, self.H * self.V
        return HK, HK, HK, HV, HV, self.H


@dataclass(frozen=True)
class Options:
    """How to run a forward. precision: "fast" (K2's products on fp16 operands) or "precise"
    (bf16 hi/lo splits). gate: "bounded", "unbounded" or "none". qk_l2norm, beta_sigmoid: K1
    normalises q and k and takes beta's sigmoid. segments: K2's segments per sequence (None:
    chosen from the grid, 1: never). config: a FwdConfig instead of the ladder's pick.
    alongside: K2 may run alongside K1 (default: KDA_CUTE_ALONGSIDE). wy: K2's WY form "auto"
    (where each CTA has an SM to itself), "off" or "force" (default: KDA_CUTE_WY)."""

    precision: str = "fast"
    gate: str = "bounded"
    qk_l2norm: bool = True
    beta_sigmoid: bool = True
    segments: int | None = None
    config: FwdConfig | None = None
    alongside: bool = field(default_factory=lambda: ENV_ALONGSIDE)
    wy: str = field(default_factory=lambda: ENV_WY)


class Call(NamedTuple):
    """One forward call's tensors and scalars, by the roles a plan's sources name."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    out: torch.Tensor
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    initial_state: torch.Tensor | None
    final_state: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    scale: float
    lower_bound: float | None
