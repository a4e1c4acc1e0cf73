"""The prefill forward's pool form on a CPU: its argument checks (each bad input named), the
Problem they describe, and the plan's pool-form arguments for every schedule (K2's index mode,
slots and tables; the segments' combine reading and writing the pool, the last segment run
reading the table for padding only). The kernels run in tests/test_gpu_pool_prefill.py."""

import pytest
import torch

from kda_cute import Call, api, checks, plans
from kda_cute.plans.steps import Errors, Role, Scalar
from kda_cute.specs.recur import INDEX_DENSE, INDEX_PAD, INDEX_POOL
from tests import launch_record

BF, F32 = torch.bfloat16, torch.float32
needs_manifests = pytest.mark.skipif(not launch_record.CUBIN_DIR.exists(),
                                     reason="cubins not built (`make kernels`)")


def inputs(seqlens=(30, 0, 70), H=2, K=64, slots=9, pool_dtype=F32, pad=0, idx=torch.int32):
    """fwd's arguments for a varlen batch against a pool (CPU tensors)."""
    T, N = sum(seqlens), len(seqlens)
    q, k, g = (torch.randn(1, T, H, K).to(BF) for _ in range(3))
    v = torch.randn(1, T, H, K).to(BF)
    buf = torch.zeros(slots, H * K * K + pad, dtype=pool_dtype)
    pool = buf[:, :H * K * K].unflatten(-1, (H, K, K))
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(q=q, k=k, v=v, g=g, beta=torch.randn(1, T, H).to(BF), scale=K ** -0.5,
                out=torch.empty(1, T, H, K, dtype=BF), A_log=torch.zeros(H),
                dt_bias=torch.zeros(H, K), lower_bound=-5.0, initial_state=pool,
                final_state=pool, cu_seqlens=cu,
                state_indices=torch.arange(1, N + 1, dtype=idx))


def problem(**kw):
    kw = dict(kw)
    return api.validate(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("g"), kw.pop("beta"),
                        kw.pop("scale"), kw.pop("out"), kw.pop("A_log"), kw.pop("dt_bias"),
                        kw.pop("lower_bound"), kw.pop("initial_state"), kw.pop("final_state"),
                        kw.pop("cu_seqlens"), "bounded", check_seqlens=False, cuda=False, **kw)


def test_pool_problem():
    x = inputs(slots=9, pad=8, idx=torch.int64)
    wi = torch.arange(3, dtype=torch.int32).flip(0)
    p = problem(**x, output_state_indices=wi, has_initial_state=torch.ones(3, dtype=torch.bool),
                null_slot=0)
    H, K = 2, 64
    # slots, stride, read stride / int64, write given, its stride / int64, null_min, words
    assert p.pool == (9, H * K * K + 8, 1, 1, 1, 1, 0, 1, 6, 3)
    assert p.has_init and p.state_in == F32 and p.state_out == F32


def test_read_only_pool_and_dense_has_init():
    x = inputs(pool_dtype=BF)
    p = problem(**{**x, "final_state": None})
    assert p.pool[4] == 0 and p.state_out is None and p.state_in == BF
    d = inputs()
    s = torch.zeros(3, 2, 64, 64)
    p = problem(**{**d, "initial_state": s, "final_state": s, "state_indices": None},
                has_initial_state=torch.zeros(3, dtype=torch.uint8))
    assert p.pool is None and p.has_init


@pytest.mark.parametrize("change,name,what", [
    (dict(state_indices=torch.zeros(4, dtype=torch.int32)), "state_indices", "shape"),
    (dict(state_indices=torch.zeros(3, dtype=torch.int16)), "state_indices", "dtype"),
    (dict(state_indices=torch.zeros(3, 2, dtype=torch.int32)), "state_indices", "1-d"),
    (dict(output_state_indices=torch.zeros(2, dtype=torch.int32)), "output_state_indices",
     "shape"),
    (dict(initial_state=None), "initial_state", "pool"),
    (dict(final_state=torch.zeros(8, 2, 64, 64)), "final_state", "shape"),
    (dict(null_slot=1), "null_slot", "None or 0"),
    (dict(has_initial_state=torch.ones(2, dtype=torch.bool)), "has_initial_state", "3 flags"),
    (dict(has_initial_state=torch.ones(3, dtype=torch.float32)), "has_initial_state", "dtype"),
])
def test_pool_checks_name_the_argument(change, name, what):
    x = {**inputs(), **change}
    with pytest.raises((ValueError, TypeError), match=name) as e:
        problem(**x)
    assert what in str(e.value)


def test_pool_slot_stride_and_layout():
    x = inputs(pad=4)  # a slot stride that is not a multiple of 8
    with pytest.raises(ValueError, match="initial_state.*multiple of 8"):
        problem(**x)
    pool = torch.zeros(9, 64, 64, 2).permute(0, 3, 1, 2)  # [slots, H, V, K] K not contiguous
    with pytest.raises(ValueError, match="initial_state"):
        problem(**{**inputs(), "initial_state": pool, "final_state": pool})


def test_dense_form_refuses_pool_arguments():
    d = inputs()
    s = torch.zeros(3, 2, 64, 64)
    base = {**d, "initial_state": s, "final_state": s, "state_indices": None}
    for name, val in (("output_state_indices", torch.zeros(3, dtype=torch.int32)),
                      ("null_slot", 0)):
        with pytest.raises(ValueError, match=f"{name}: expected None without state_indices"):
            problem(**base, **{name: val})
    with pytest.raises(ValueError, match="has_initial_state: expected None without "
                                         "initial_state"):
        problem(**{**base, "initial_state": None}, has_initial_state=torch.ones(3).bool())
    with pytest.raises(ValueError, match="output_state_indices: expected None when no state"):
        problem(**{**d, "final_state": None}, output_state_indices=torch.zeros(3).int())


def test_a_repeated_call_rechecks_a_changed_null_slot():
    """The checks are remembered by metadata; null_slot's value is part of it."""
    x = inputs()
    problem(**x, null_slot=0)
    with pytest.raises(ValueError, match="null_slot"):
        problem(**x, null_slot=3)


def test_chunk_kda_pool_form_needs_v_first():
    x = inputs()
    with pytest.raises(ValueError, match="state_v_first"):
        api.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                      state_indices=x["state_indices"], cu_seqlens=x["cu_seqlens"])
    with pytest.raises(ValueError, match="output_state_indices"):
        api.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                      output_state_indices=x["state_indices"], cu_seqlens=x["cu_seqlens"])


def _plan(spec):
    call = launch_record.make_call(spec)
    opts = launch_record._options(spec)
    p = checks.forward(Call(**{n: call.get(n) for n in Call._fields}), opts,
                       check_seqlens=False, cuda=False)
    return p, plans.plan(p, opts, plans.H200)


def _index_sources(step):
    return {n: step.source(n) for n in ("state_index", "out_index", "has_init", "index_mode",
                                        "row_div", "slots", "r_wide", "w_on", "hi_on",
                                        "null_min")}


@needs_manifests
@pytest.mark.parametrize("name", ["k128-varlen-pool", "k128-varlen-pool-int64-out-null",
                                  "k128-pool-alongside", "k128-pool-wy", "k128-pool-simt"])
def test_k2_reads_the_pool(name):
    spec = launch_record.PROBLEMS[name]
    p, pl = _plan(spec)
    k2 = pl.step("K2")
    src = _index_sources(k2)
    pool = spec["pool"]
    assert src["index_mode"] == Scalar(INDEX_POOL) and src["row_div"] == Scalar(1)
    assert src["slots"] == Scalar(pool["slots"])
    assert src["state_index"] == Role("state_indices")
    assert src["out_index"] == (Role("output_state_indices") if pool.get("out") else Errors())
    assert src["w_on"] == Scalar(int(bool(pool.get("out"))))
    assert src["r_wide"] == Scalar(int(bool(pool.get("idx64"))))
    assert src["null_min"] == Scalar(1 if pool.get("null_slot") == 0 else 0)
    assert src["has_init"] == (Role("has_initial_state") if spec.get("has_init") else Errors())
    syms = dict(k2.syms)
    assert syms["NS"] == pool["slots"] and syms["sS"] == p.pool[1]
    assert k2.source("s0f") == Role("initial_state") and k2.source("s1f") == Role("final_state")


@needs_manifests
def test_segments_read_and_write_the_pool_in_the_combine():
    spec = launch_record.PROBLEMS["k128-pool-segments-bf16"]
    p, pl = _plan(spec)
    zero, ident, comb, last = (pl.step(n) for n in ("K2 from zero", "K2 identity", "combine",
                                                     "K2 from starts"))
    for s in (zero, ident):
        assert s.source("index_mode") == Scalar(INDEX_DENSE)
        assert s.source("hi_on") == Scalar(0)
    c = _index_sources(comb)
    assert c["index_mode"] == Scalar(INDEX_POOL) and c["hi_on"] == Scalar(1)
    assert comb.source("s0h") == Role("initial_state")
    assert comb.source("final_h") == Role("final_state")
    assert comb.source("state_in") == Scalar(2) and comb.source("state_out") == Scalar(2)
    assert dict(comb.syms)["NS"] == spec["pool"]["slots"]
    # the last run: states from the combine's starts (dense), the table for padding only
    last_src = _index_sources(last)
    assert last_src["index_mode"] == Scalar(INDEX_PAD) and last_src["row_div"] == Scalar(3)
    assert last_src["state_index"] == Role("state_indices") and last_src["hi_on"] == Scalar(0)
    assert not any(type(s).__name__ == "Copy" for s in pl.steps)


@needs_manifests
def test_dense_plans_keep_the_dense_mode():
    p, pl = _plan(launch_record.PROBLEMS["k128-dense-has-init"])
    k2 = pl.step("K2")
    assert k2.source("index_mode") == Scalar(INDEX_DENSE)
    assert k2.source("has_init") == Role("has_initial_state")
    assert k2.source("state_index") == Errors()
