"""The launches a prefill plan is made of, each kernel's arguments taken by name (the specs'
names): the launch itself, the pool form's index arguments, K2's rescale run and its
checkpoints build, a fixed-length batch's segment offsets."""

from __future__ import annotations

import torch

from ..ladder import (
    checkpoints_of,
    rescale_of,
)
from ..problem import PoolForm, Problem
from ..specs import args_for
from ..specs.recur import (
    INDEX_DENSE,
    INDEX_POOL,
    STATE_BF16,
    STATE_F32,
    STATE_NONE,
)
from .device import DeviceInfo, resources
from .steps import (
    At,
    Buffer,
    Errors,
    Launch,
    Role,
    Scalar,
)

F32, BF16, I32 = torch.float32, torch.bfloat16, torch.int32
STATE_CODE = {None: STATE_NONE, torch.float32: STATE_F32, torch.bfloat16: STATE_BF16}


def kernel_launch(name, cfg, grid, values: dict, syms: dict, dev: DeviceInfo, smem: int = 0,
                  programmatic: bool = False) -> Launch:
    """A Launch of kernel `cfg`: each of its parameter arguments' source taken by name from
    `values`, the dynamic dimensions its arguments use from `syms`."""
    res = resources(cfg, dev.arch)
    args = [a for a in args_for(cfg) if not a.grid_only and a.kind != "mma"]
    used = {e for a in args for e in a.shape + a.stride if isinstance(e, str)}
    return Launch(name, cfg, tuple(grid), (res.threads, 1, 1), max(res.smem, smem),
                  programmatic, tuple(a.name for a in args),
                  tuple(values[a.name] for a in args), tuple((s, syms[s]) for s in sorted(used)))


def index_values(p: Problem, N: int, mode: int | None = None, row_div: int = 1,
                 has_init: bool | None = None) -> dict:
    """The pool form's arguments of K2 and the combine (kda_cute.specs.recur.index_args) for
    problem `p` (the error words stand in for the tables a plan does not read): dense states
    unless `p.pool`, `mode` (INDEX_*) and `has_init` overriding the problem's."""
    err = Errors()
    pool = p.pool or PoolForm(N, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    hi = p.has_init if has_init is None else has_init
    if mode is None:
        mode = INDEX_POOL if p.pool else INDEX_DENSE
    tables = mode != INDEX_DENSE
    return {"state_index": Role("state_indices") if tables else err,
            "out_index": Role("output_state_indices") if tables and pool.w_on else err,
            "has_init": Role("has_initial_state") if hi else err,
            "errors": err,
            "index_mode": Scalar(mode), "row_div": Scalar(row_div), "hi_on": Scalar(int(hi)),
            **{n: Scalar(getattr(pool, n)) for n in POOL_SCALARS}}


# the pool form's scalars, by their names in Problem.pool (PoolForm)
POOL_SCALARS = ("slots", "r_sn", "r_wide", "w_on", "w_sn", "w_wide", "null_min")


def index_syms(p: Problem) -> dict:
    """The dynamic dimensions of the pool form's tables (word counts, at least one)."""
    nri, nwi = (p.pool.NRI, p.pool.NWI) if p.pool else (0, 0)
    return {"NRI": max(1, nri), "NWI": max(1, nwi), "NHI": max(1, p.N if p.has_init else 0)}


# K2 without checkpoints: no table (ck_rows 0; the error words stand in for its tensors)
NO_CHECKPOINTS = {"ck_at": Errors(), "ck_to": Errors(), "ck_f": Errors(), "ck_h": Errors(),
                  "ck_s": Errors(), "ck_rows": Scalar(0), "ck_dtype": Scalar(STATE_NONE),
                  "side": Scalar(0)}


NO_CHECKPOINTS_SYMS = {"NCT": 1, "NCK": 1, "NSK": 1}


def rescale_run(name: str, k2, grid, vals: dict, syms: dict, dev: DeviceInfo) -> list:
    """The rescale run after K2 launch `name` (kernel k2, grid, arguments `vals`): the same
    arguments, its grid's z cut to about two CTAs an SM (each CTA reads its rows' words at
    once and, nearly always, leaves); none where `vals` has fix_on 0. Right after a K2 that
    is not alongside, as that K2's programmatic dependent (the K2 releases it at its start;
    the run waits for the K2 to complete before reading anything it wrote), so its launch
    and prologue run beside the K2's chunks; after an alongside K2 (K1 comes between, and
    the K2 releases K1) an ordinary launch."""
    rs = rescale_of(k2)
    if rs is None or not vals["fix_on"].value:
        return []
    z = min(grid[2], max(1, -(-2 * dev.sms // (grid[0] * grid[1]))))
    return [kernel_launch(name + " rescale", rs, (grid[0], grid[1], z),
                          {**vals, "ordered": Scalar(0)}, syms, dev, programmatic=not k2.alongside)]


def stores_build(recur, ck):
    """The main K2 of a forward: its checkpoints build where the forward stores checkpoints
    (`ck`), the plain one otherwise."""
    if not ck:
        return recur
    twin = checkpoints_of(recur)
    if twin is None:
        raise ValueError(f"config: expected a forward with a checkpoints build of its K2 "
                         f"(ladder.CHECKPOINT_RUNS) with checkpoints, got {recur.name}")
    return twin


def segment_offsets(B: int, T: int, C: int, P: int) -> tuple[At, At]:
    """cu_seqlens and cu_chunks of a fixed-length batch as B * P segments."""
    return tuple(At(Buffer("segments", (B * P + 1,), I32, (B, T, C, P, which)))
                 for which in ("cu_seqlens", "cu_chunks"))
