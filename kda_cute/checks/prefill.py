"""Every check of a forward's inputs, in three kinds:

- metadata (`metadata`, `problem`, `options`): shapes, dtypes, strides, devices, option values.
  They read no tensor memory and no device, so they run on FakeTensors (a dry run) and on CPU
  tensors;
- addresses (`addresses`, `workspace`): alignment and size of the memory the kernels touch;
- values (`seqlens`): cu_seqlens' contents, a host sync, only where asked (check_seqlens=True)
  and skipped during CUDA-graph capture; the offsets kernel checks them on the device on every
  varlen call (kda_cute.specs.offsets).

`forward` runs them all in that order, then the config and the CUDA requirement (so every input
error is found on a CPU too); `validate` is its form with fwd's argument list.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from .. import declare, errors, memo
from ..abi import SYM_DIV
from ..ladder import PRECISIONS, FwdConfig, config_for, supports
from ..problem import STATE_DTYPES, WY_MODES, Call, Checkpoints, Options, PoolForm, Problem
from ..specs.checkpoints import MAX_ENTRIES
from ..specs.prep import GATE_MODES
from ..specs.step import E_READ, E_WRITE
from .base import (
    capturing,
    err,
    flag,
    flags,
    gate_params,
    has_address,
    index_table,
    index_words,
    is_wide,
    null_min,
    on_cuda,
    pool,
    scalars,
    tensor,
)


def _tma_rows(div: int) -> str:
    """What a TMA-read or -written tensor's rows need (the stride check's and the address
    check's expectation, one text)."""
    return f"token stride a multiple of {div} elements and a 16-byte aligned base"


def _rows(name, t, div: int):
    """[B, T, H, D] with D contiguous and heads packed; the token stride is free (a multiple of
    `div` elements: TMA rows) but rows must not overlap (a kernel reads and writes whole token
    rows)."""
    B, T, H, D = t.shape
    if t.stride(3) != 1 or (H > 1 and t.stride(2) != D):
        raise err(name, f"the last two dims contiguous (strides (..., {D}, 1))",
                  f"strides {tuple(t.stride())}")
    if T > 1 and t.stride(1) < H * D:
        raise err(name, f"a token stride >= H*D = {H * D} (rows must not overlap)",
                  f"strides {tuple(t.stride())}")
    if B > 1 and T > 0 and t.stride(0) != T * t.stride(1):
        raise err(name, "batch stride == T * token stride", f"strides {tuple(t.stride())}")
    if t.stride(1) % div:
        raise err(name, _tma_rows(div), f"stride {t.stride(1)}")


def options(gate="bounded", qk_l2norm=True, beta_sigmoid=True, segments=None, config=None,
            precision="fast", alongside=None, wy=None) -> Options:
    """Checked Options (alongside / wy None: the environment's defaults), made once per
    distinct set of values (and their types: segments=True is not segments=1)."""
    args = (gate, qk_l2norm, beta_sigmoid, segments, config, precision, alongside, wy)
    try:
        return _options(*args)
    except TypeError as e:
        if "unhashable" not in str(e):
            raise
        return _options.__wrapped__(*args)


@functools.lru_cache(maxsize=256, typed=True)
def _options(gate, qk_l2norm, beta_sigmoid, segments, config, precision, alongside, wy) -> Options:
    if not isinstance(gate, str) or gate not in GATE_MODES:
        raise err("gate", f"one of {sorted(GATE_MODES)}", repr(gate))
    if segments is not None and (isinstance(segments, bool) or not isinstance(segments, int)
                                 or segments < 1):
        raise err("segments", "None or an int >= 1", repr(segments))
    if precision not in PRECISIONS:
        raise err("precision", f"one of {PRECISIONS}", repr(precision))
    if config is not None:
        if not isinstance(config, FwdConfig):
            raise TypeError(f"config: expected a FwdConfig, got {type(config).__name__}")
        ok, why = supports(config)
        if not ok:
            raise err("config", "a supported config", why)
    if wy is not None and wy not in WY_MODES:
        raise err("wy", f"one of {WY_MODES}", repr(wy))
    switches = {}  # the environment's defaults unless given
    if alongside is not None:
        switches["alongside"] = flag("alongside", alongside)
    if wy is not None:
        switches["wy"] = wy
    return Options(precision=precision, gate=gate, qk_l2norm=flag("qk_l2norm", qk_l2norm),
                   beta_sigmoid=flag("beta_sigmoid", beta_sigmoid), segments=segments,
                   config=config, **switches)


def problem(c: Call, opts: Options) -> Problem:
    """The tensors' metadata checks; returns the Problem they describe."""
    q, k, v, g, beta, out = c.q, c.k, c.v, c.g, c.beta, c.out
    tensor("q", q, (torch.bfloat16,), 4)
    dev = q.device
    B, T, H, K = q.shape
    for name, t in (("k", k), ("g", g)):
        tensor(name, t, (torch.bfloat16,), 4, dev, (B, T, H, K))
    tensor("v", v, (torch.bfloat16,), 4, dev)
    if tuple(v.shape[:3]) != (B, T, H):
        raise err("v", f"shape ({B}, {T}, {H}, V)", f"{tuple(v.shape)}")
    V = v.shape[3]
    tensor("beta", beta, (torch.bfloat16,), 3, dev, (B, T, H))
    if (H > 1 and beta.stride(2) != 1) or (T > 1 and beta.stride(1) < H) or (
            B > 1 and T > 0 and beta.stride(0) != T * beta.stride(1)):
        raise err("beta", "heads contiguous, token stride >= H, batch stride == T * token "
                  "stride", f"strides {tuple(beta.stride())}")
    if out is None:
        raise err("out", "a bf16 tensor [B, T, H, V] to write", None)
    tensor("out", out, (torch.bfloat16,), 4, dev, (B, T, H, V))
    for name, t in (("out", out), ("q", q), ("k", k), ("g", g), ("v", v)):
        _rows(name, t, SYM_DIV["s" + name[0].upper()])
    a_dt, b_dt = gate_params(c.A_log, c.dt_bias, opts.gate, H, K, dev)
    cu = c.cu_seqlens
    if cu is not None:
        tensor("cu_seqlens", cu, (torch.int64, torch.int32), 1, dev)
        if B != 1:
            raise err("q", "batch size 1 when cu_seqlens is given", f"batch size {B}")
        if cu.numel() < 2:
            raise err("cu_seqlens", "at least 2 entries [N+1]", f"{cu.numel()}")
        if not cu.is_contiguous():
            raise err("cu_seqlens", "a contiguous tensor", f"strides {tuple(cu.stride())}")
        N = cu.numel() - 1
    else:
        N = B
    pool = _pool_form(c, N, H, V, K, dev) if c.state_indices is not None else None
    if pool is None:
        for name, t in (("output_state_indices", c.output_state_indices),
                        ("null_slot", c.null_slot)):
            if t is not None:
                raise err(name, "None without state_indices (the pool form)",
                          type(t).__name__)
        for name, st in (("initial_state", c.initial_state), ("final_state", c.final_state)):
            if st is None:
                continue
            tensor(name, st, STATE_DTYPES, 4, dev, (N, H, V, K))
            if not st.is_contiguous():
                raise err(name, "a contiguous tensor", f"strides {tuple(st.stride())}")
    hi = c.has_initial_state
    if hi is not None:
        if c.initial_state is None:
            raise err("has_initial_state", "None without initial_state", "a tensor")
        flags("has_initial_state", hi, N, dev)
    ckpt = _checkpoints(c, N, H, V, K, dev)
    if ckpt is not None and opts.context:  # (a shard's segments: its grids stay as they are)
        ckpt = replace(ckpt, fixed_grid=1)
    return Problem(
        B, T, H, K, V, N, cu is not None,
        strides=(q.stride(1), k.stride(1), g.stride(1), v.stride(1), out.stride(1),
                 beta.stride(1)),
        state_in=None if c.initial_state is None else c.initial_state.dtype,
        state_out=None if c.final_state is None else c.final_state.dtype,
        A_log=a_dt, dt_bias=b_dt,
        cu_int64=cu is not None and cu.dtype == torch.int64, pool=pool,
        has_init=hi is not None, ckpt=ckpt)


CHECKPOINT_ARGS = ("checkpoint_offsets", "checkpoint_slots", "checkpoint_every",
                   "checkpoint_first")


def _checkpoints(c: Call, N: int, H: int, V: int, K: int, dev) -> Checkpoints | None:
    """The checkpoints' checks (kda_cute.specs.checkpoints): checkpoint_state with exactly one
    of checkpoint_offsets [N, C] (the state after each offset, into checkpoint_state [N, C, H,
    V, K]) and checkpoint_slots [N, M] with checkpoint_every (a multiple of 64: the state every
    that many tokens from checkpoint_first[n], default checkpoint_every, the i-th into pool slot
    checkpoint_slots[n, i] of checkpoint_state [slots, H, V, K]). Returns Problem.ckpt."""
    cs = c.checkpoint_state
    given = {n: getattr(c, n) for n in CHECKPOINT_ARGS}
    if cs is None:
        for name, t in given.items():
            if t is not None:
                raise err(name, "None without checkpoint_state", type(t).__name__)
        return None
    offs, slots = c.checkpoint_offsets, c.checkpoint_slots
    if (offs is None) == (slots is None):
        raise err("checkpoint_offsets / checkpoint_slots", "exactly one with checkpoint_state "
                  "(offsets [N, C] into checkpoint_state [N, C, H, V, K], or slots [N, M] "
                  "with checkpoint_every into a pool)", "both" if offs is not None else "neither")
    if offs is not None:
        for name in ("checkpoint_every", "checkpoint_first"):
            if given[name] is not None:
                raise err(name, "None with checkpoint_offsets (checkpoint_slots' form)",
                          type(given[name]).__name__)
        sn, se = index_table("checkpoint_offsets", offs, (N, None), dev)
        E = offs.shape[1]
        if not 1 <= E <= MAX_ENTRIES:
            raise err("checkpoint_offsets", f"1 to {MAX_ENTRIES} checkpoints per sequence", E)
        tensor("checkpoint_state", cs, STATE_DTYPES, 5, dev, (N, E, H, V, K))
        st = cs.stride()
        if st[2:] != (V * K, K, 1):
            raise err("checkpoint_state", f"each checkpoint's [H, V, K] dense (strides (..., "
                      f"{V * K}, {K}, 1))", f"strides {st}")
        row = st[1] if E > 1 else st[0] if N > 1 else H * V * K
        if row % 8 or row < H * V * K or (N > 1 and E > 1 and st[0] != E * st[1]):
            raise err("checkpoint_state", f"a checkpoint stride >= H*V*K = {H * V * K}, a "
                      "multiple of 8 elements, and the sequence stride C times it",
                      f"strides {st}")
        return Checkpoints(0, E, N * E, row, cs.dtype, sn, se, is_wide(offs), index_words(offs))
    every = c.checkpoint_every
    if (isinstance(every, bool) or not isinstance(every, int) or every < 64 or every % 64
            or every >= 2 ** 24):
        raise err("checkpoint_every", "a multiple of 64 (tokens) below 2^24 with "
                  "checkpoint_slots", repr(every))
    sn, se = index_table("checkpoint_slots", slots, (N, None), dev)
    E = slots.shape[1]
    if not 1 <= E <= MAX_ENTRIES:
        raise err("checkpoint_slots", f"1 to {MAX_ENTRIES} checkpoints per sequence", E)
    stride = pool("checkpoint_state", cs, H, V, K, dev)
    if not 1 <= cs.shape[0] < 2 ** 31:
        raise err("checkpoint_state", "a pool of 1 to 2^31 - 1 slots", cs.shape[0])
    first = c.checkpoint_first
    f_sn = 0
    if first is not None:
        f_sn = index_table("checkpoint_first", first, (N,), dev)[0]
    return Checkpoints(every, E, cs.shape[0], stride, cs.dtype, sn, se, is_wide(slots),
                       index_words(slots), int(first is not None), f_sn, is_wide(first),
                       index_words(first), null_min(c.null_slot))


def _pool_form(c: Call, N: int, H: int, V: int, K: int, dev) -> PoolForm:
    """The pool form's checks: initial_state the pool [slots, H, V, K], final_state None (the
    pool is only read) or it (or a tensor of its shape and strides), state_indices and
    output_state_indices [N] int32 / int64."""
    st = c.initial_state
    if st is None:
        raise err("initial_state", "the state pool [slots, H, V, K] that state_indices index",
                  None)
    stride = pool("initial_state", st, H, V, K, dev)
    slots = st.shape[0]
    if slots < 1 or slots >= 2 ** 31:
        raise err("initial_state", "a pool of 1 to 2^31 - 1 slots", slots)
    fs = c.final_state
    if fs is not None:
        tensor("final_state", fs, STATE_DTYPES, 4, dev)
        if fs.shape != st.shape or (slots > 1 and fs.stride() != st.stride()) or (
                fs.stride()[1:] != st.stride()[1:]):
            raise err("final_state", "the pool (initial_state), or a tensor of its shape and "
                      f"strides {tuple(st.stride())}",
                      f"shape {tuple(fs.shape)}, strides {tuple(fs.stride())}")
    r_sn = index_table("state_indices", c.state_indices, (N,), dev)[0]
    wi = c.output_state_indices
    w_sn = 0
    if wi is not None:
        if fs is None:
            raise err("output_state_indices", "None when no state is written (final_state "
                      "None)", "a tensor")
        w_sn = index_table("output_state_indices", wi, (N,), dev)[0]
    return PoolForm(slots=slots, sS=stride, r_sn=r_sn, r_wide=is_wide(c.state_indices),
                    w_on=int(wi is not None), w_sn=w_sn, w_wide=is_wide(wi),
                    null_min=null_min(c.null_slot), NRI=index_words(c.state_indices),
                    NWI=index_words(wi))


def metadata(c: Call, opts: Options) -> Problem:
    """Every check that reads no memory (FakeTensor-safe): the tensors', then the scalars'."""
    p = problem(c, opts)
    scalars(c.scale, c.lower_bound, opts.gate)
    return p


def addresses(c: Call) -> None:
    """The TMA-read and -written tensors' bases are 16-byte aligned, and the states' and
    checkpoint_state's (K2 moves a thread's column pairs of a state row at once; checkpoint
    rows leave by bulk copies). A FakeTensor (a dry run's stand-in) has no address."""
    for name in ("out", "q", "k", "g", "v"):
        t = getattr(c, name)
        if has_address(t) and t.data_ptr() % 16:
            raise err(name, _tma_rows(SYM_DIV["s" + name[0].upper()]),
                      f"address {t.data_ptr()}")
    for name in ("initial_state", "final_state", "checkpoint_state"):
        t = getattr(c, name)
        if has_address(t) and t.data_ptr() % 16:
            raise err(name, "a 16-byte aligned base", f"address {t.data_ptr()}")


def require_cuda(c: Call) -> None:
    on_cuda(c.q.device, "q")


def seqlens(cu_seqlens: torch.Tensor, T: int) -> None:
    """cu_seqlens' values: non-decreasing from 0 to at most T (a host sync)."""
    cs = cu_seqlens.cpu()
    if int(cs[0]) != 0 or bool((cs[1:] < cs[:-1]).any()) or int(cs[-1]) > T:
        raise err("cu_seqlens", f"non-decreasing offsets from 0 to at most T={T}",
                  cs.tolist() if cs.numel() < 17 else f"{cs[:8].tolist()}...")


def workspace(ws: torch.Tensor, need: int, dev) -> None:
    if (not isinstance(ws, torch.Tensor) or ws.dtype != torch.uint8 or ws.device != dev
            or ws.numel() < need or not ws.is_contiguous()):
        got = (f"{ws.dtype} [{ws.numel()}] on {ws.device}" if isinstance(ws, torch.Tensor)
               else type(ws).__name__)
        raise err("workspace", f"a contiguous uint8 CUDA tensor of >= {need} bytes on {dev}",
                  got)


def _error_names(c: Call) -> tuple:
    """(error word, the argument behind it)s of a forward (kda_cute.errors.note)."""
    names = []
    if c.state_indices is not None:
        names.append((E_READ, "state_indices"))
        if c.output_state_indices is not None:
            names.append((E_WRITE, "output_state_indices"))
        elif c.final_state is not None:
            names.append((E_WRITE, "state_indices"))
    if c.checkpoint_slots is not None:
        names.append((E_WRITE, "checkpoint_slots"))
    return tuple(names)


def forward(c: Call, opts: Options, check_seqlens: bool = False, cuda: bool = True,
            config: bool = True, memory: bool = True) -> Problem:
    """Every check of a forward call, in order: the tensors' metadata, the scalars, addresses
    (`memory`; False for FakeTensors, which have none), cu_seqlens' values on the host
    (`check_seqlens`, a host sync; not during capture: the offsets kernel checks them on the
    device either way), a shipped or given config for the head dims (`config`), the CUDA
    requirement (`cuda`). Returns its Problem."""
    # (every argument but scale and lower_bound, which are checked each call)
    key = memo.key("forward", (*c[:11], *c[13:16], *c[17:20], c.checkpoint_first),
                   (opts, c.null_slot, c.checkpoint_every))
    p = memo.recall(key)
    if p is None:
        p = memo.remember(key, problem(c, opts))
        if c.q.device.type == "cuda" and not declare.dry():
            errors.note(c.q.device, "fwd", _error_names(c))
    if check_seqlens is not False:
        check_seqlens = flag("check_seqlens", check_seqlens)
    scalars(c.scale, c.lower_bound, opts.gate)
    if memory:
        addresses(c)
    # (a stand-in's values cannot be read: the device checks them when it runs)
    if check_seqlens and has_address(c.cu_seqlens) and not capturing(c.q.device):
        seqlens(c.cu_seqlens, p.T)
    if config:
        cfg = config_for(p, opts)
        if p.ckpt is not None and cfg.recur.mma != "wgmma":
            raise err("config", "a tensor-core forward with checkpoints", cfg.recur.name)
    if flag("cuda", cuda):
        require_cuda(c)
    return p


def validate(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state,
             final_state, cu_seqlens, gate, check_seqlens=False, cuda=True, *,
             state_indices=None, output_state_indices=None, has_initial_state=None,
             null_slot=None, checkpoint_state=None, checkpoint_offsets=None,
             checkpoint_slots=None, checkpoint_every=None, checkpoint_first=None) -> Problem:
    """`forward`'s checks with fwd's arguments (gate as fwd's keyword), head dims without a
    config aside: the Problem they describe. cuda=False: tensors on any device (the checks on a
    CPU)."""
    return forward(Call(q, k, v, g, beta, out, A_log, dt_bias, initial_state, final_state,
                        cu_seqlens, scale, lower_bound, state_indices, output_state_indices,
                        has_initial_state, null_slot, checkpoint_state, checkpoint_offsets,
                        checkpoint_slots, checkpoint_every, checkpoint_first), options(gate),
                   check_seqlens, cuda,
                   config=False)
