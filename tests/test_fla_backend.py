"""The fla backend (fla-core >= 0.6 installed; skipped otherwise). On a CPU: registration and
order, the verifiers' verdicts and reasons on FakeTensors, dispatch of fla's own entry points to
kda-cute with the arguments mapped, and the rejection logged by fla. On the H200 (the tests
marked gpu): fla.ops.kda.chunk_kda as fla's KimiDeltaAttention calls it, and the decode entry
fused_recurrent_kda_fwd against a pool, each dispatched to kda-cute and checked against the
float64 reference."""

from __future__ import annotations

import inspect
import logging
from inspect import unwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

pytest.importorskip("fla.backends")

from fla.backends import _function_registries, _get_operation_registry  # noqa: E402
from fla.ops.kda import chunk_kda as fla_chunk_kda  # noqa: E402
from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_recurrent  # noqa: E402

from kda_cute import api, fla_forms, memo, serving  # noqa: E402
from kda_cute.checks import prefill as prefill_checks  # noqa: E402
from kda_cute.checks import step as step_checks  # noqa: E402
from kda_cute.integrations import fla as kda_fla  # noqa: E402
from kda_cute.reference import rel_err  # noqa: E402
from kda_cute.testing import make_inputs, reference  # noqa: E402

BF, F32 = torch.bfloat16, torch.float32
H, K = 4, 128


@pytest.fixture(autouse=True)
def registered():
    kda_fla.register()
    yield


@pytest.fixture
def fake():
    with FakeTensorMode() as mode:
        yield mode


def layer_call(T=100, K=K, **over):
    """What fla's KimiDeltaAttention passes in prefill (all keywords), as FakeTensors."""
    d = "cuda"
    kw = dict(q=torch.empty(1, T, H, K, dtype=BF, device=d),
              k=torch.empty(1, T, H, K, dtype=BF, device=d),
              v=torch.empty(1, T, H, K, dtype=BF, device=d),
              g=torch.empty(1, T, H, K, dtype=BF, device=d),
              beta=torch.empty(1, T, H, dtype=BF, device=d),
              A_log=torch.empty(H, dtype=F32, device=d),
              dt_bias=torch.empty(H * K, dtype=F32, device=d),
              initial_state=torch.empty(2, H, K, K, dtype=F32, device=d),
              output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False, safe_gate=True,
              lower_bound=-5.0, state_v_first=True,
              cu_seqlens=torch.tensor([0, 40, T], dtype=torch.int32, device=d))
    kw.update(over)
    return kw


def backend():
    return kda_fla.KdaCuteBackend()


def test_registered_ahead_of_flash_kda_once():
    kda_fla.register()  # a second call changes nothing
    reg = _function_registries[unwrap(fla_chunk_kda)]
    order = [b.backend_type for b in reg._get_sorted_backends()]
    assert order.index("kda_cute") < order.index("flash_kda")
    assert "kda_cute" in [b.backend_type for b in _get_operation_registry("kda")
                          ._get_sorted_backends()]


def test_layer_call_accepted(fake):
    assert backend().verify("chunk_kda", **layer_call()) == (True, None)
    # positional, as fla's signature orders them
    kw = layer_call()
    args = [kw.pop(n) for n in ("q", "k", "v", "g", "beta")]
    assert backend().verify("chunk_kda", *args, None, kw.pop("initial_state"), **kw) == \
        (True, None)


@pytest.mark.parametrize("over, reason", [
    (dict(allow_neg_eigval=True), "allow_neg_eigval"),
    (dict(cp_context=object()), "context parallel"),
    (dict(return_intermediate_states=True), "return_intermediate_states"),
    (dict(K=96), "head dims K == V"),
    (dict(v="gva"), "GVA"),
    (dict(g="fp32"), "g: expected dtype bfloat16"),
    (dict(lower_bound=1.0), "lower_bound"),
    (dict(safe_gate=True, lower_bound=None),
     "lower_bound: expected a float in [-5, 0) with safe_gate"),
    (dict(use_gate_in_kernel=True, lower_bound=None, safe_gate=False, A_log=None),
     "A_log: expected a tensor [4] (float32, bfloat16 or float16) for the unbounded gate"),
    (dict(initial_state="wrong"), "initial_state"),
    (dict(transpose_state_layout=True), "both given"),
    (dict(some_new_option=1), "unsupported arguments ['some_new_option']"),
    (dict(device="cpu"), "q: expected a CUDA tensor"),
])
def test_turned_down_with_a_reason(fake, over, reason):
    K_ = over.pop("K", K)
    kw = layer_call(K=K_)
    if over.pop("v", None):
        kw["v"] = torch.empty(1, 100, H // 2, K, dtype=BF, device="cuda")
    if over.pop("g", None):
        kw["g"] = kw["g"].float()
    if over.pop("initial_state", None):
        kw["initial_state"] = torch.empty(3, H, K, K, dtype=F32, device="cuda")
    if over.pop("device", None):
        kw = {n: (t.to("cpu") if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    kw.update(over)
    ok, why = backend().verify("chunk_kda", **kw)
    assert not ok and reason in why, why


def test_grad_enabled_turned_down_only_when_an_input_requires_grad(fake):
    kw = layer_call()
    assert backend().verify("chunk_kda", **kw) == (True, None)
    kw["q"] = kw["q"].requires_grad_()
    ok, why = backend().verify("chunk_kda", **kw)
    assert not ok and "forward only" in why
    with torch.no_grad():
        assert backend().verify("chunk_kda", **kw) == (True, None)


def test_k_first_state_and_deprecated_name(fake):
    kw = layer_call(state_v_first=False)
    assert backend().verify("chunk_kda", **kw) == (True, None)
    kw.pop("state_v_first")
    assert backend().verify("chunk_kda", transpose_state_layout=True, **kw) == (True, None)
    assert kda_fla._chunk_args(transpose_state_layout=True, **kw)["state_v_first"] is True


def test_fla_chunk_kda_dispatches_here_with_arguments_mapped(fake, monkeypatch, caplog):
    seen = {}

    def fake_chunk(**kw):
        seen.update(kw)
        return "ours"

    monkeypatch.setattr(fla_forms, "chunk_kda", fake_chunk)
    kw = layer_call(state_v_first=False)
    kw.pop("state_v_first")
    with caplog.at_level(logging.INFO, logger="fla.backends"):
        assert fla_chunk_kda(transpose_state_layout=True, **kw) == "ours"
    assert seen["state_v_first"] is True
    assert tuple(seen["dt_bias"].shape) == (H * K,)  # [H*K], as fla passes it
    assert seen["scale"] is None and seen["lower_bound"] == -5.0  # (the call defaults scale)
    assert seen["use_gate_in_kernel"] and seen["safe_gate"]


def test_bounded_gate_without_A_log_is_the_calls_own(fake):
    """fla's bounded gate without A_log (exp(A_log) = 1): the call takes A_log None as that."""
    kw = layer_call(A_log=None)
    assert kda_fla._chunk_args(**kw)["A_log"] is None
    assert backend().verify("chunk_kda", **kw) == (True, None)


def test_a_rejected_call_is_logged_by_fla(fake, caplog):
    kw = layer_call(allow_neg_eigval=True)
    with caplog.at_level(logging.INFO, logger="fla.backends"):
        try:
            fla_chunk_kda(**kw)  # falls back to fla's own path (which cannot run here)
        except Exception:
            pass
    assert any("kda_cute rejected: allow_neg_eigval" in r.getMessage() for r in caplog.records)


def decode_call(**over):
    d = "cuda"
    N = 3
    kw = dict(q=torch.empty(N, 1, H, K, dtype=BF, device=d),
              k=torch.empty(N, 1, H, K, dtype=BF, device=d),
              v=torch.empty(N, 1, H, K, dtype=BF, device=d),
              g=torch.empty(N, 1, H, K, dtype=BF, device=d),
              beta=torch.empty(N, 1, H, dtype=BF, device=d),
              A_log=torch.empty(H, dtype=F32, device=d),
              dt_bias=torch.empty(H * K, dtype=F32, device=d),
              initial_state=torch.empty(8, H, K, K, dtype=F32, device=d),
              inplace_final_state=True, state_v_first=True,
              ssm_state_indices=torch.tensor([3, -1, 5], dtype=torch.int32, device=d),
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
    kw.update(over)
    return kw


def test_fla_decode_entry_dispatches_here(fake, monkeypatch):
    seen = {}

    def fake_step(**kw):
        seen.update(kw)
        return "ours"

    monkeypatch.setattr(fla_forms, "fused_recurrent_kda_fwd", fake_step)
    assert backend().verify("fused_recurrent_kda_fwd", **decode_call()) == (True, None)
    assert fla_recurrent(**decode_call()) == "ours"
    assert tuple(seen["dt_bias"].shape) == (H * K,)


@pytest.mark.parametrize("over, reason", [
    (dict(allow_neg_eigval=True), "allow_neg_eigval"),
    (dict(state_v_first=False), "state_v_first: expected True"),
    (dict(beta="headwise"), "headwise beta"),
    (dict(mystery=1), "unsupported arguments"),
])
def test_decode_turned_down_with_a_reason(fake, over, reason):
    kw = decode_call()
    if over.pop("beta", None):
        kw["beta"] = torch.empty(3, 1, H, K, dtype=BF, device="cuda")
    kw.update(over)
    ok, why = backend().verify("fused_recurrent_kda_fwd", **kw)
    assert not ok and reason in why, why


# ------------------------------------------------- every argument mutated, on CPU tensors
@pytest.fixture
def runs(monkeypatch):
    """kda-cute's implementations run on a CPU up to their launch, which is recorded instead:
    the CUDA requirements lifted (the forward's and the step's device checks),
    the device taken as an H200. Returns the list of launches ("fwd" / "step")."""
    from kda_cute import errors, launch, plans
    from kda_cute.plans.step import step_plan
    made = []
    monkeypatch.setattr(prefill_checks, "require_cuda", lambda c: None)
    monkeypatch.setattr(api, "device_info", lambda dev: plans.H200)
    monkeypatch.setattr(errors, "raise_pending", lambda dev: None)
    monkeypatch.setattr(launch, "run", lambda *a, **k: made.append("fwd"))

    def planned(c, dev):
        p, opts = c.problem, c.options
        return step_plan(p, opts)

    monkeypatch.setattr(step_checks, "on_cuda", lambda dev, what: None)
    monkeypatch.setattr(serving, "_plan", planned)
    monkeypatch.setattr(serving, "_launch", lambda *a, **k: made.append("step"))
    monkeypatch.setattr(serving, "_again", lambda *a: False)
    memo.clear()
    yield made
    memo.clear()


def _cpu(**kw):
    return {n: (t.to("cpu") if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}


def _filled(kw):
    """Real CPU tensors for a call's arguments (random values, index tables kept)."""
    out = {}
    for n, t in kw.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t = torch.randn(t.shape).to(t.dtype)
        elif isinstance(t, torch.Tensor):
            t = t.clone()
        out[n] = t
    return out


def _mutation_entries():
    """(fla entry, its registry, valid keyword arguments on CPU tensors) for fla's prefill
    (V-first and K-first states, bf16 gate parameters as a cast model holds them) and decode
    (a pool and dense states)."""
    gate16 = dict(A_log=torch.zeros(H, dtype=BF), dt_bias=torch.zeros(H * K, dtype=BF))
    with FakeTensorMode(allow_non_fake_inputs=True):
        shapes = dict(chunk=layer_call(), chunk_kfirst=layer_call(state_v_first=False),
                      decode=decode_call(), dense=decode_call(
                          ssm_state_indices=None, inplace_final_state=False,
                          output_final_state=True, initial_state=torch.empty(3, H, K, K)))
    chunk_reg = _function_registries[unwrap(fla_chunk_kda)]
    step_reg = _get_operation_registry("kda")
    out = {}
    for name, kw in shapes.items():
        kw = _filled({n: (torch.empty(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor)
                          else t) for n, t in kw.items()})
        if name == "decode":
            kw["ssm_state_indices"] = torch.tensor([3, -1, 5], dtype=torch.int32)
        if name.startswith("chunk"):
            kw["cu_seqlens"] = torch.tensor([0, 40, 100], dtype=torch.int32)
            out[name] = (fla_chunk_kda, chunk_reg, "chunk_kda", {**kw, **gate16})
        else:
            out[name] = (fla_recurrent, step_reg, "fused_recurrent_kda_fwd", {**kw, **gate16})
    return out


def _flag_cases():
    """Whole-call variants a model may hand in (each on the chunk or the step entry)."""
    f16 = torch.float16
    return [
        ("chunk", dict(q=("dtype", f16))), ("chunk", dict(k=("dtype", f16), v=("dtype", f16))),
        ("chunk", dict(use_gate_in_kernel=False, safe_gate=False, g=("dtype", F32))),
        ("chunk", dict(use_gate_in_kernel=False, safe_gate=False)),
        ("chunk", dict(beta=("dtype", F32))),
        ("chunk", dict(A_log=("dtype", F32), dt_bias=("dtype", F32))),
        ("chunk", dict(A_log=("dtype", f16), dt_bias=("dtype", f16))),
        ("chunk", dict(A_log=("dtype", F32), dt_bias=("dtype", BF))),
        ("chunk", dict(output_final_state=False)), ("chunk", dict(initial_state=None)),
        ("chunk", dict(initial_state=None, output_final_state=False)),
        ("chunk_kfirst", dict(output_final_state=False)),
        ("chunk", dict(cu_seqlens=("dtype", torch.int64))),
        ("chunk", dict(initial_state=("dtype", BF))),
        ("chunk", dict(safe_gate=False, lower_bound=None)),  # the unbounded gate
        ("chunk", dict(A_log=None)),
        ("decode", dict(A_log=("dtype", F32), dt_bias=("dtype", F32))),
        ("decode", dict(A_log=("dtype", f16), dt_bias=None)),
        ("decode", dict(q=("dtype", f16))), ("decode", dict(beta=("dtype", F32))),
        ("decode", dict(use_gate_in_kernel=False, g=("dtype", F32))),
        ("decode", dict(initial_state=("dtype", BF))),
        ("decode", dict(ssm_state_indices=("dtype", torch.int64))),
        ("dense", dict(output_final_state=False)), ("dense", dict(initial_state=None)),
        ("dense", dict(initial_state=None, inplace_final_state=False, output_final_state=True)),
        ("dense", dict(state_v_first=False)),
        ("dense", dict(cu_seqlens=torch.tensor([0, 1, 2, 3]), q=("flat", None))),
    ]


def _apply(kw, over):
    kw = dict(kw)
    for n, val in over.items():
        if isinstance(val, tuple) and val[0] == "dtype":
            kw[n] = kw[n].to(val[1])
        elif isinstance(val, tuple) and val[0] == "flat":  # packed rows [1, N, H, D]
            for m in ("q", "k", "v", "g", "beta"):
                kw[m] = kw[m].transpose(0, 1).contiguous()
        else:
            kw[n] = val
    return kw


def _ours(reg):
    return next(b for b in reg._get_sorted_backends() if b.backend_type == "kda_cute")


def _judge(entry, reg, fname, kw, made, caplog, what):
    """verify says no: fla falls back (ours is not called) and logs the reason; yes: fla's
    entry runs ours to its launch without an exception. Returns the verdict."""
    ok, why = _ours(reg).verify(fname, **kw)
    before = len(made)
    if ok:
        entry(**kw)
        assert len(made) == before + 1, (what, "accepted but not launched")
        return True
    assert why, what
    reg._logged.clear()
    with caplog.at_level(logging.INFO, logger="fla.backends"):
        caplog.clear()
        try:
            entry(**kw)  # fla's own path (which cannot run on a CPU)
        except Exception:
            pass
    assert len(made) == before, (what, "refused, yet ours ran")
    assert any(f"kda_cute rejected: {why}" in r.getMessage() for r in caplog.records), \
        (what, why)
    return False


def test_every_argument_mutated_verdict_matches_the_call(runs, caplog):
    """fla's prefill and decode entries with each tensor argument replaced by each of
    tests/mutations.py's values, each argument given each odd value, and the whole-call
    variants a model hands in (fp16 q / k / v, fp32 g with the gate off, fp32 beta, gate
    parameters in fp32 / bf16 / fp16, states in and out, int32 / int64 offsets): where the
    verifier says no, fla falls back with the reason logged; where it says yes, the call runs.
    A refusal names one argument of fla's entry."""
    from tests.mutations import odd_swaps, tensor_swaps
    entries = _mutation_entries()
    verdicts = {}
    for name, (entry, reg, fname, kw) in entries.items():
        # (fla's chunk_kda takes A_log, dt_bias and transpose_state_layout as **kwargs)
        names = set(inspect.signature(unwrap(entry)).parameters) | {
            "transpose_state_layout", "A_log", "dt_bias"}
        assert _judge(entry, reg, fname, kw, runs, caplog, (name, "valid"))
        cases = [(a, w, bad) for a, w, bad in tensor_swaps(kw)]
        cases += [(a, w, bad) for a, w, bad in odd_swaps(unwrap(entry), kw)
                  if a not in ("kwargs",)]
        for arg, what, bad in cases:
            ok = _judge(entry, reg, fname, bad, runs, caplog, (name, arg, what))
            verdicts[(name, arg, what)] = ok
            if not ok:
                why = _ours(reg).verify(fname, **bad)[1]
                said = why.split(": ")[0]
                assert said in names, (name, arg, what, why)
    for name, over in _flag_cases():
        entry, reg, fname, kw = entries[name]
        verdicts[(name, repr(over))] = _judge(entry, reg, fname, _apply(kw, over), runs, caplog,
                                             (name, over))
    accepted = {k for k, ok in verdicts.items() if ok}
    # gate parameters in any of the three dtypes are taken, fp16 tokens are not
    assert ("chunk", repr(dict(A_log=("dtype", torch.float16),
                               dt_bias=("dtype", torch.float16)))) in accepted
    assert ("chunk", "q", "dtype torch.float16") not in accepted
    assert len(accepted) > 20 and len(verdicts) - len(accepted) > 100


# On the GPU: each test below is marked gpu (tests/conftest.py skips it where the kernels
# cannot run).

OUT_TOL, STATE_TOL = 3.5e-3, 2.5e-3


@pytest.fixture
def calls(monkeypatch):
    """kda-cute's entries, counted as fla reaches them."""
    kda_fla.register()
    seen = {"chunk_kda": 0, "fused_recurrent_kda_fwd": 0}
    real_chunk, real_step = fla_forms.chunk_kda, fla_forms.fused_recurrent_kda_fwd

    def chunk(*a, **kw):
        seen["chunk_kda"] += 1
        return real_chunk(*a, **kw)

    def step(*a, **kw):
        seen["fused_recurrent_kda_fwd"] += 1
        return real_step(*a, **kw)

    monkeypatch.setattr(fla_forms, "chunk_kda", chunk)
    monkeypatch.setattr(fla_forms, "fused_recurrent_kda_fwd", step)
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("K", [64, 128, 256])
@pytest.mark.parametrize("v_first, cu_dtype", [(True, torch.int32), (False, torch.int64)])
@torch.no_grad()
def test_fla_chunk_kda_dispatches_here(calls, K, v_first, cu_dtype):
    inp = make_inputs(seqlens=[300, 77, 1024], H=4, K=K, seed=K)
    s0 = inp["initial_state"] if v_first else inp["initial_state"].transpose(-1, -2).contiguous()
    o, s = fla_chunk_kda(
        q=inp["q"], k=inp["k"], v=inp["v"], g=inp["g"], beta=inp["beta"],
        A_log=inp["A_log"], dt_bias=inp["dt_bias"].flatten(), initial_state=s0,
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False, safe_gate=True,
        lower_bound=-5.0, state_v_first=v_first, cu_seqlens=inp["cu_seqlens"].to(cu_dtype))
    assert calls["chunk_kda"] == 1
    ref_o, ref_s = reference(inp)
    if not v_first:
        s = s.transpose(-1, -2)
    assert rel_err(o, ref_o) < OUT_TOL and rel_err(s, ref_s) < STATE_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_fla_decode_entry_dispatches_here_on_a_pool(calls, pool_dtype):
    N, H, K, slots = 6, 8, 128, 20
    inp = make_inputs(B=N, T=1, H=H, K=K, seed=11)
    pool = torch.randn(slots, H, K, K, device="cuda").to(pool_dtype)
    idx = torch.tensor([3, -1, 7, 0, 19, 12], dtype=torch.int32, device="cuda")
    before = pool.clone()
    out, st = fla_recurrent(
        q=inp["q"], k=inp["k"], v=inp["v"], g=inp["g"], beta=inp["beta"],
        A_log=inp["A_log"], dt_bias=inp["dt_bias"].flatten(), initial_state=pool,
        inplace_final_state=True, state_v_first=True, ssm_state_indices=idx,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        lower_bound=-5.0)
    assert calls["fused_recurrent_kda_fwd"] == 1 and st is pool
    live = [n for n in range(N) if idx[n] >= 0]
    ref = dict(inp, initial_state=before[idx[live].long()],
               **{n: inp[n][live] for n in ("q", "k", "v", "g", "beta")})
    ref_o, ref_s = reference(ref)
    tol = STATE_TOL if pool_dtype == torch.float32 else 6e-3
    assert rel_err(out[live], ref_o) < OUT_TOL
    assert rel_err(pool[idx[live].long()], ref_s) < tol
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # the padding row
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[idx[live].long().cpu()] = False
    assert torch.equal(pool[untouched.cuda()], before[untouched.cuda()])
