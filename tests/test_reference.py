"""The float64 loop against closed forms, and the chunked twin against the loop (CPU only)."""

from __future__ import annotations

import dataclasses
import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from kda_cute.chunked import chunk_intermediates, chunk_recurrence, kda_chunked
from kda_cute.reference import GATE_FORMS, kda_reference, preprocess, rel_err

LOWER_BOUND = -5.0
F64 = torch.float64
# Same-dtype chunked vs loop: both are exact math in float64, so only rounding separates them
# (measured ~1e-15 up to chunk 64).
TOL_F64 = 1e-10
# The float32 twin vs the float64 loop (measured ~1e-6 at K=V=128, T=512, chunk 64).
TOL_F32 = 1e-5


@dataclasses.dataclass(frozen=True)
class Case:
    T: int = 100  # fixed length; ignored when seqlens is set
    B: int = 2
    H: int = 2
    K: int = 16
    V: int = 16
    chunk: int = 16
    gate: str = "bounded"
    in_kernel: bool = True  # False: q/k arrive L2-normalised and beta arrives in (0, 1)
    seqlens: tuple[int, ...] | None = None
    cu_dtype: torch.dtype = torch.int64
    state: torch.dtype | None = None
    g_offset: float = 0.0  # added to the gate logits: large values make the unbounded decay strong


def make_inputs(case: Case, seed_text: str) -> dict:
    """Fresh random inputs for one case, seeded by its id, as kda_reference/kda_chunked kwargs."""
    gen = torch.Generator().manual_seed(zlib.crc32(seed_text.encode()))

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    B, T = (1, sum(case.seqlens)) if case.seqlens is not None else (case.B, case.T)
    N = len(case.seqlens) if case.seqlens is not None else B
    H, K, V = case.H, case.K, case.V
    q, k, g = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, K) + case.g_offset
    v, beta = randn(B, T, H, V), randn(B, T, H)
    if case.gate == "none":
        g = -F.softplus(g)
    if not case.in_kernel:
        q, k, beta = F.normalize(q, dim=-1), F.normalize(k, dim=-1), torch.sigmoid(beta)
    kwargs = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "gate": case.gate,
              "qk_l2norm": case.in_kernel, "beta_sigmoid": case.in_kernel,
              "A_log": torch.rand(H, generator=gen), "dt_bias": torch.rand(H, K, generator=gen),
              "lower_bound": LOWER_BOUND}
    if case.seqlens is not None:
        offsets = [0]
        for n in case.seqlens:
            offsets.append(offsets[-1] + n)
        kwargs["cu_seqlens"] = torch.tensor(offsets, dtype=case.cu_dtype)
    if case.state is not None:
        kwargs["initial_state"] = randn(N, H, V, K).to(case.state)
    return kwargs


VARLEN = (5, 0, 35, 17, 1)  # 58 tokens: an empty sequence, one shorter than any chunk, odd tails

CHUNKED_CASES = {
    "fixed-T1-c16": Case(T=1),
    "fixed-T15-c16": Case(T=15),
    "fixed-T17-c16": Case(T=17),
    "fixed-T17-c64": Case(T=17, chunk=64),
    "fixed-T100-c1": Case(chunk=1),
    "fixed-T100-c7": Case(chunk=7),
    "fixed-T100-c16": Case(),
    "fixed-T100-c64": Case(chunk=64),
    "fixed-T100-c16-K64": Case(K=64, V=64),
    "fixed-T100-c7-unbounded": Case(chunk=7, gate="unbounded"),
    "fixed-T100-c64-unbounded": Case(chunk=64, gate="unbounded"),
    "fixed-T17-c16-unbounded": Case(T=17, gate="unbounded"),
    "fixed-T100-c16-none": Case(gate="none"),
    "fixed-T100-c64-none": Case(chunk=64, gate="none"),
    "fixed-T100-c16-preactivated": Case(in_kernel=False),
    "fixed-T100-c7-unbounded-preactivated": Case(chunk=7, gate="unbounded", in_kernel=False),
    "fixed-T100-c16-K32V48": Case(K=32, V=48),
    "fixed-T100-c7-K32V48-unbounded": Case(chunk=7, K=32, V=48, gate="unbounded"),
    "fixed-T100-c16-state_fp32": Case(state=torch.float32),
    "fixed-T17-c7-state_bf16": Case(T=17, chunk=7, state=torch.bfloat16),
    "fixed-T100-c64-unbounded-state_fp32": Case(chunk=64, gate="unbounded", state=torch.float32),
    "varlen-c1": Case(seqlens=VARLEN, chunk=1),
    "varlen-c7": Case(seqlens=VARLEN, chunk=7),
    "varlen-c16": Case(seqlens=VARLEN),
    "varlen-c64": Case(seqlens=VARLEN, chunk=64),
    "varlen-c16-cu32": Case(seqlens=VARLEN, cu_dtype=torch.int32),
    "varlen-c7-cu32-unbounded": Case(seqlens=VARLEN, chunk=7, cu_dtype=torch.int32,
                                     gate="unbounded"),
    "varlen-c16-none": Case(seqlens=VARLEN, gate="none"),
    "varlen-c16-preactivated": Case(seqlens=VARLEN, in_kernel=False),
    "varlen-c16-K32V48": Case(seqlens=VARLEN, K=32, V=48),
    "varlen-c16-state_fp32": Case(seqlens=VARLEN, state=torch.float32),
    "varlen-c7-state_bf16": Case(seqlens=VARLEN, chunk=7, state=torch.bfloat16),
    "varlen-c64-cu32-unbounded-state_bf16": Case(seqlens=VARLEN, chunk=64, cu_dtype=torch.int32,
                                                 gate="unbounded", state=torch.bfloat16),
    "varlen-empty_first_last-c16-state_fp32": Case(seqlens=(0, 20, 0), state=torch.float32),
}


def _case_table(cases: dict):
    return pytest.mark.parametrize("case_id", list(cases), ids=list(cases))


@_case_table(CHUNKED_CASES)
def test_chunked_matches_loop(case_id):
    case = CHUNKED_CASES[case_id]
    kwargs = make_inputs(case, case_id)
    out_ref, state_ref = kda_reference(**kwargs)
    out, state = kda_chunked(**kwargs, chunk=case.chunk, dtype=F64)
    assert out.dtype == F64 and state.dtype == F64
    assert rel_err(out, out_ref) < TOL_F64
    assert rel_err(state, state_ref) < TOL_F64


# (gate logit offset, compute dtype, tolerance, the widest dtype whose exp(-G) over one chunk of 64
# overflows in every key dim for these inputs)
STRONG_DECAY_CASES = {
    "g+5-f64": (5.0, F64, TOL_F64, torch.float32),
    "g+5-f32": (5.0, torch.float32, TOL_F32, torch.float32),
    "g+20-f64": (20.0, F64, TOL_F64, F64),
    "g+20-f32": (20.0, torch.float32, TOL_F32, F64),
}


@_case_table(STRONG_DECAY_CASES)
def test_strong_unbounded_decay(case_id):
    g_offset, dtype, tol, overflows = STRONG_DECAY_CASES[case_id]
    case = Case(T=150, chunk=64, gate="unbounded", g_offset=g_offset, state=torch.float32)
    kwargs = make_inputs(case, case_id)
    _, _, a, _ = preprocess(kwargs["q"], kwargs["k"], kwargs["g"], kwargs["beta"],
                            A_log=kwargs["A_log"], dt_bias=kwargs["dt_bias"], gate="unbounded",
                            dtype=dtype)
    # The case must exercise the trap: exp(-G) over the first chunk overflows in every dim.
    assert (-a[:, :64].double().sum(1)).min() > math.log(torch.finfo(overflows).max)

    out_ref, state_ref = kda_reference(**kwargs)
    out, state = kda_chunked(**kwargs, chunk=case.chunk, dtype=dtype)
    assert rel_err(out, out_ref) < tol
    assert rel_err(state, state_ref) < tol


F32_TWIN_CASES = {
    "bounded-c16": ("bounded", 16),
    "bounded-c64": ("bounded", 64),
    "unbounded-c16": ("unbounded", 16),
    "unbounded-c64": ("unbounded", 64),
}


@_case_table(F32_TWIN_CASES)
def test_float32_twin_accuracy(case_id):
    gate, chunk = F32_TWIN_CASES[case_id]
    case = Case(B=1, T=512, K=128, V=128, chunk=chunk, gate=gate, state=torch.float32)
    kwargs = make_inputs(case, case_id)
    out_ref, state_ref = kda_reference(**kwargs)
    out, state = kda_chunked(**kwargs, chunk=chunk, dtype=torch.float32)
    assert out.dtype == torch.float32 and state.dtype == torch.float32
    assert rel_err(out, out_ref) < TOL_F32
    assert rel_err(state, state_ref) < TOL_F32


# ----------------------------------------------------------------------------------------------
# The loop against closed forms that do not share its code
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [None, 0.3], ids=["scale_default", "scale_0.3"])
@pytest.mark.parametrize("gate", GATE_FORMS)
def test_loop_single_token_closed_form(gate, scale):
    case = Case(T=1, K=32, V=48, gate=gate)
    kwargs = make_inputs(case, f"single-{gate}-{scale}")
    qn, kn, _, b = preprocess(kwargs["q"], kwargs["k"], kwargs["g"], kwargs["beta"],
                              A_log=kwargs["A_log"], dt_bias=kwargs["dt_bias"],
                              lower_bound=LOWER_BOUND, gate=gate)
    out, state = kda_reference(**kwargs, scale=scale)
    s = case.K ** -0.5 if scale is None else scale
    v = kwargs["v"].double()
    # From a zero state the decay does nothing and the delta rule writes b * v kn^T.
    expected_out = s * b[..., None] * (kn * qn).sum(-1, keepdim=True) * v
    expected_state = b[:, 0, :, None, None] * v[:, 0, :, :, None] * kn[:, 0, :, None, :]
    assert rel_err(out, expected_out) < 1e-14
    assert rel_err(state, expected_state) < 1e-14


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_loop_no_decay_no_write_keeps_state(state_dtype):
    case = Case(T=9, gate="none", in_kernel=False, state=state_dtype)
    kwargs = make_inputs(case, f"frozen-{state_dtype}")
    kwargs["g"] = torch.zeros_like(kwargs["g"])
    kwargs["beta"] = torch.zeros_like(kwargs["beta"])
    out, state = kda_reference(**kwargs)
    S0 = kwargs["initial_state"].double()
    assert torch.equal(state, S0)
    expected = case.K ** -0.5 * torch.einsum("bhvk,bthk->bthv", S0, kwargs["q"].double())
    assert rel_err(out, expected) < 1e-14


@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_loop_decay_only_closed_form(gate):
    case = Case(T=30, gate=gate, state=torch.float32)
    kwargs = make_inputs(case, f"decay-only-{gate}")
    kwargs["beta"] = torch.zeros_like(kwargs["beta"])
    kwargs["beta_sigmoid"] = False
    qn, _, a, _ = preprocess(kwargs["q"], kwargs["k"], kwargs["g"], kwargs["beta"],
                             A_log=kwargs["A_log"], dt_bias=kwargs["dt_bias"],
                             lower_bound=LOWER_BOUND, gate=gate)
    out, state = kda_reference(**kwargs)
    S0 = kwargs["initial_state"].double()
    decay = torch.exp(torch.cumsum(a, dim=1))  # [B, T, H, K]: the decay applies before the output
    S_t = S0[:, None] * decay[:, :, :, None, :]  # [B, T, H, V, K]
    expected = case.K ** -0.5 * (S_t @ qn[..., None]).squeeze(-1)
    assert rel_err(out, expected) < 1e-13
    assert rel_err(state, S_t[:, -1]) < 1e-13


@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_loop_delta_rule_writes_value(gate):
    # With beta = 1 and a unit key the update makes S @ k = v exactly, whatever the decay and the
    # state before it; reading with q = k returns scale * v at every token.
    case = Case(T=40, gate=gate, in_kernel=False, state=torch.float32)
    kwargs = make_inputs(case, f"delta-{gate}")
    # Normalised in float64: a float32 unit vector is off by ~1e-7 in norm, and so would be S @ k.
    kwargs["k"] = kwargs["q"] = F.normalize(kwargs["k"].double(), dim=-1)
    kwargs["beta"] = torch.ones_like(kwargs["beta"])
    out, _ = kda_reference(**kwargs)
    assert rel_err(out, case.K ** -0.5 * kwargs["v"].double()) < 1e-13


EMPTY_SEQ_CASES = {
    "loop-state_fp32": ("loop", torch.float32),
    "loop-state_bf16": ("loop", torch.bfloat16),
    "chunked_f64-state_fp32": ("chunked_f64", torch.float32),
    "chunked_f64-state_bf16": ("chunked_f64", torch.bfloat16),
    "chunked_f32-state_bf16": ("chunked_f32", torch.bfloat16),
}


@_case_table(EMPTY_SEQ_CASES)
def test_empty_sequence_keeps_state(case_id):
    impl, state_dtype = EMPTY_SEQ_CASES[case_id]
    kwargs = make_inputs(Case(seqlens=(3, 0, 21, 0), chunk=7, state=state_dtype), case_id)
    if impl == "loop":
        _, state = kda_reference(**kwargs)
        dtype = F64
    else:
        dtype = F64 if impl == "chunked_f64" else torch.float32
        _, state = kda_chunked(**kwargs, chunk=7, dtype=dtype)
    S0 = kwargs["initial_state"].to(dtype)
    for n in (1, 3):
        assert torch.equal(state[n], S0[n])
    for n in (0, 2):
        assert not torch.equal(state[n], S0[n])


# ----------------------------------------------------------------------------------------------
# The pieces: preprocessing, K1's workspace definitions, rel_err, input checks
# ----------------------------------------------------------------------------------------------


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def test_preprocess_formulas():
    gen = torch.Generator().manual_seed(7)
    B, T, H, K = 1, 2, 2, 3
    q, k, g = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    beta = torch.randn(B, T, H, generator=gen)
    A_log, dt_bias = torch.rand(H, generator=gen), torch.rand(H, K, generator=gen)
    common = {"A_log": A_log, "dt_bias": dt_bias, "lower_bound": LOWER_BOUND}
    qn, kn, a_bounded, b = preprocess(q, k, g, beta, gate="bounded", **common)
    _, _, a_unbounded, _ = preprocess(q, k, g, beta, gate="unbounded", **common)
    for t in range(T):
        for h in range(H):
            rate = math.exp(A_log[h].item())
            assert b[0, t, h].item() == pytest.approx(_sigmoid(beta[0, t, h].item()), rel=1e-15)
            for x, xn in ((q, qn), (k, kn)):
                norm = math.sqrt(sum(x[0, t, h, d].item() ** 2 for d in range(K)) + 1e-6)
                for d in range(K):
                    assert xn[0, t, h, d].item() == pytest.approx(x[0, t, h, d].item() / norm,
                                                                  rel=1e-14)
            for d in range(K):
                z = g[0, t, h, d].item() + dt_bias[h, d].item()
                assert a_bounded[0, t, h, d].item() == pytest.approx(
                    LOWER_BOUND * _sigmoid(rate * z), rel=1e-14)
                assert a_unbounded[0, t, h, d].item() == pytest.approx(
                    -rate * math.log1p(math.exp(z)), rel=1e-14)


def test_preprocess_passthrough_and_dtype():
    gen = torch.Generator().manual_seed(8)
    q, k, g = (torch.randn(2, 3, 2, 4, generator=gen) for _ in range(3))
    beta = torch.randn(2, 3, 2, generator=gen)
    qn, kn, a, b = preprocess(q, k, g, beta, gate="none", qk_l2norm=False, beta_sigmoid=False,
                              dtype=torch.float32)
    for got, want in ((qn, q), (kn, k), (a, g), (b, beta)):
        assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_preprocess_dt_bias_forms(gate):
    gen = torch.Generator().manual_seed(9)
    H, K = 3, 5
    q, k, g = (torch.randn(1, 4, H, K, generator=gen) for _ in range(3))
    beta = torch.randn(1, 4, H, generator=gen)
    A_log, dt_bias = torch.rand(H, generator=gen), torch.rand(H, K, generator=gen)
    kw = {"A_log": A_log, "lower_bound": LOWER_BOUND, "gate": gate}
    a_2d = preprocess(q, k, g, beta, dt_bias=dt_bias, **kw)[2]
    a_flat = preprocess(q, k, g, beta, dt_bias=dt_bias.reshape(H * K), **kw)[2]
    assert torch.equal(a_2d, a_flat)
    a_none = preprocess(q, k, g, beta, dt_bias=None, **kw)[2]
    a_zero = preprocess(q, k, g, beta, dt_bias=torch.zeros(H, K), **kw)[2]
    assert torch.equal(a_none, a_zero)
    assert not torch.equal(a_none, a_2d)


def test_preprocess_unbounded_softplus_is_exact_for_large_logits():
    # torch's softplus returns x above its threshold (20), an error of ~exp(-20); ln(1+e^x) is
    # exactly x + ln(1+e^-x) and must stay finite far past exp's overflow.
    g = torch.tensor([25.0, 800.0], dtype=F64).view(1, 1, 1, 2)
    q = torch.ones_like(g)
    a = preprocess(q, q, g, torch.zeros(1, 1, 1), A_log=torch.zeros(1), gate="unbounded")[2]
    assert a[0, 0, 0, 0].item() == pytest.approx(-(25.0 + math.log1p(math.exp(-25.0))), rel=1e-16)
    assert a[0, 0, 0, 1].item() == -800.0


def _naive_intermediates(qn, kn, a, b, *, chunk, scale, starts_lens):
    """chunk_intermediates' definitions written out chunk by chunk with a dense inverse."""
    T, H, K = qn.shape[1], qn.shape[2], qn.shape[3]
    out = {name: torch.zeros(1, T, H, K, dtype=F64) for name in ("qg", "kg", "kd", "gl")}
    out.update({name: torch.zeros(1, T, H, chunk, dtype=F64) for name in ("Aw", "Mq")})
    for start, length in starts_lens:
        for c0 in range(start, start + length, chunk):
            c = min(chunk, start + length - c0)
            tok = slice(c0, c0 + c)
            G = torch.cumsum(a[0, tok], dim=0)  # [c, H, K]
            out["qg"][0, tok] = scale * qn[0, tok] * torch.exp(G)
            out["kg"][0, tok] = kn[0, tok] * torch.exp(G)
            out["kd"][0, tok] = kn[0, tok] * torch.exp(G[-1] - G)
            out["gl"][0, tok] = torch.exp(G[-1])
            for h in range(H):
                L = torch.zeros(c, c, dtype=F64)
                for i in range(c):
                    for j in range(i + 1):
                        e = torch.exp(G[i, h] - G[j, h])
                        out["Mq"][0, c0 + i, h, j] = scale * (qn[0, c0 + i, h] * kn[0, c0 + j, h]
                                                              * e).sum()
                        if j < i:
                            L[i, j] = b[0, c0 + i, h] * (kn[0, c0 + i, h] * kn[0, c0 + j, h]
                                                         * e).sum()
                Aw = torch.linalg.inv(torch.eye(c, dtype=F64) + L) @ torch.diag(b[0, tok, h])
                out["Aw"][0, tok, h, :c] = Aw
    return out


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunk_intermediates_definitions(chunk):
    case = Case(seqlens=(7, 0, 12, 3), H=2, K=8, V=8, gate="unbounded")
    kwargs = make_inputs(case, f"intermediates-{chunk}")
    qn, kn, a, b = preprocess(kwargs["q"], kwargs["k"], kwargs["g"], kwargs["beta"],
                              A_log=kwargs["A_log"], dt_bias=kwargs["dt_bias"], gate="unbounded")
    got = chunk_intermediates(qn, kn, a, b, chunk=chunk, scale=0.7,
                              cu_seqlens=kwargs["cu_seqlens"])
    want = _naive_intermediates(qn, kn, a, b, chunk=chunk, scale=0.7,
                                starts_lens=[(0, 7), (7, 0), (7, 12), (19, 3)])
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == F64 and got[name].shape == want[name].shape, name
        assert rel_err(got[name], want[name]) < 1e-13, name


def test_chunk_intermediates_keep_dtype():
    case = Case(T=20, chunk=8)
    kwargs = make_inputs(case, "intermediates-f32")
    pre = preprocess(kwargs["q"], kwargs["k"], kwargs["g"], kwargs["beta"],
                     A_log=kwargs["A_log"], dt_bias=kwargs["dt_bias"], lower_bound=LOWER_BOUND,
                     dtype=torch.float32)
    inter = chunk_intermediates(*pre, chunk=8, scale=0.25)
    assert all(x.dtype == torch.float32 for x in inter.values())
    out, state = chunk_recurrence(inter, kwargs["v"], chunk=8)
    assert out.dtype == torch.float32 and state.dtype == torch.float32


def test_chunk_recurrence_ignores_workspace_padding():
    # A kernel's workspace holds garbage past each chunk's valid tokens and columns; K2 must not
    # read it. T = 20 with chunk 8 leaves a 4-token tail chunk.
    case = Case(T=20, chunk=8, state=torch.float32)
    kwargs = make_inputs(case, "padding")
    pre = preprocess(kwargs["q"], kwargs["k"], kwargs["g"], kwargs["beta"],
                     A_log=kwargs["A_log"], dt_bias=kwargs["dt_bias"], lower_bound=LOWER_BOUND)
    inter = chunk_intermediates(*pre, chunk=8, scale=0.25)
    poisoned = {name: x.clone() for name, x in inter.items()}
    for name in ("Aw", "Mq"):
        poisoned[name][:, 16:, :, 4:] = math.nan
    ref = chunk_recurrence(inter, kwargs["v"], chunk=8, initial_state=kwargs["initial_state"])
    got = chunk_recurrence(poisoned, kwargs["v"], chunk=8, initial_state=kwargs["initial_state"])
    for x, y in zip(got, ref, strict=True):
        assert torch.equal(x, y)


def test_rel_err():
    ref = torch.tensor([3.0, 4.0])
    assert rel_err(ref, ref) == 0.0
    assert rel_err(torch.tensor([3.0, 5.0]), ref) == pytest.approx(0.2)
    assert rel_err(torch.tensor([math.nan, 4.0]), ref) == math.inf
    assert rel_err(torch.tensor([math.inf, 4.0]), ref) == math.inf
    with pytest.raises(ValueError, match="shapes differ"):
        rel_err(torch.zeros(3), ref)


def _bad_inputs(change: str) -> dict:
    kwargs = make_inputs(Case(T=10, B=1, K=8, V=8), "bad-" + change)
    if change == "gate":
        kwargs["gate"] = "softplus"
    elif change == "lower_bound":
        kwargs["lower_bound"] = None
    elif change == "A_log_shape":
        kwargs["A_log"] = torch.zeros(3)
    elif change == "dt_bias_shape":
        kwargs["dt_bias"] = torch.zeros(2, 7)
    elif change == "v_shape":
        kwargs["v"] = kwargs["v"][:, :9]
    elif change == "beta_shape":
        kwargs["beta"] = kwargs["beta"][..., None]
    elif change == "state_shape":
        kwargs["initial_state"] = torch.zeros(1, 2, 8, 7)
    elif change == "cu_batch":
        kwargs.update({x: kwargs[x].expand(2, -1, -1, -1) for x in ("q", "k", "v", "g")})
        kwargs["beta"] = kwargs["beta"].expand(2, -1, -1)
        kwargs["cu_seqlens"] = torch.tensor([0, 10])
    elif change == "cu_end":
        kwargs["cu_seqlens"] = torch.tensor([0, 4, 9])
    elif change == "cu_order":
        kwargs["cu_seqlens"] = torch.tensor([0, 6, 4, 10])
    elif change == "cu_dtype":
        kwargs["cu_seqlens"] = torch.tensor([0.0, 10.0])
    return kwargs


BAD_INPUT_CASES = {
    "gate": (ValueError, "gate"),
    "lower_bound": (ValueError, "lower_bound"),
    "A_log_shape": (ValueError, "A_log"),
    "dt_bias_shape": (ValueError, "dt_bias"),
    "v_shape": (ValueError, "v:"),
    "beta_shape": (ValueError, "beta"),
    "state_shape": (ValueError, "initial_state"),
    "cu_batch": (ValueError, "batch size 1"),
    "cu_end": (ValueError, "end at T=10"),
    "cu_order": (ValueError, "non-decreasing"),
    "cu_dtype": (TypeError, "cu_seqlens"),
}


@pytest.mark.parametrize("fn", [kda_reference, kda_chunked], ids=["loop", "chunked"])
@_case_table(BAD_INPUT_CASES)
def test_bad_inputs_raise(case_id, fn):
    error, match = BAD_INPUT_CASES[case_id]
    with pytest.raises(error, match=match):
        fn(**_bad_inputs(case_id))


FACTORED = {
    "bounded-c64-s16": ("bounded", 0.0, 64, 16),
    "unbounded-strong-c64-s16": ("unbounded", 20.0, 64, 16),
    "bounded-c32-s8": ("bounded", 0.0, 32, 8),
}


@pytest.mark.parametrize("case_id", list(FACTORED))
def test_factored_intermediates_match_elementwise(case_id):
    """Sub-chunk factoring (what a tensor-core K1 computes) changes nothing but rounding."""
    gate, shift, chunk, sub = FACTORED[case_id]
    gen = torch.Generator().manual_seed(zlib.crc32(case_id.encode()))
    B, T, H, K = 1, 150, 2, 32
    q, k, g = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) for _ in range(3))
    beta = torch.randn(B, T, H, generator=gen, dtype=torch.float64)
    A_log = torch.rand(H, generator=gen, dtype=torch.float64)
    dt_bias = torch.rand(H, K, generator=gen, dtype=torch.float64)
    qn, kn, a, b = preprocess(q, k, g + shift, beta, A_log=A_log, dt_bias=dt_bias,
                              lower_bound=-5.0, gate=gate)
    exact = chunk_intermediates(qn, kn, a, b, chunk=chunk, scale=K ** -0.5)
    factored = chunk_intermediates(qn, kn, a, b, chunk=chunk, scale=K ** -0.5, sub=sub)
    for name in exact:
        assert torch.isfinite(factored[name]).all(), name
        assert rel_err(factored[name], exact[name]) < 1e-12, name


def test_factored_intermediates_reject_bad_sub():
    x = torch.randn(1, 8, 1, 8, dtype=torch.float64)
    b = torch.rand(1, 8, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="sub"):
        chunk_intermediates(x, x, -x.abs(), b, chunk=8, scale=1.0, sub=3)


@pytest.mark.parametrize("rerun", [False, True], ids=["correction", "rerun"])
@pytest.mark.parametrize("segments", [1, 2, 3, 7])
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_segmented_recurrence_matches_sequential(segments, gate, rerun):
    """Chunk-parallel partial states (the few-heads K2's math): per-segment affine maps from
    [0; I], chained serially, then outputs from the true starts, equal the sequential twin."""
    from kda_cute.chunked import segmented_recurrence
    gen = torch.Generator().manual_seed(segments)
    T, H, K, V, C = 7 * 16 + 5, 2, 16, 12, 16
    q, k, g = (torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) for _ in range(3))
    v = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    beta = torch.randn(1, T, H, generator=gen, dtype=torch.float64)
    A_log, dt = torch.rand(H, generator=gen, dtype=torch.float64), torch.rand(H, K, generator=gen,
                                                                             dtype=torch.float64)
    S0 = torch.randn(1, H, V, K, generator=gen, dtype=torch.float64)
    qn, kn, a, b = preprocess(q, k, g, beta, A_log=A_log, dt_bias=dt, lower_bound=-5.0, gate=gate)
    inter = chunk_intermediates(qn, kn, a, b, chunk=C, scale=K ** -0.5)
    o_ref, s_ref = chunk_recurrence(inter, v, chunk=C, initial_state=S0)
    o, s = segmented_recurrence(inter, v, chunk=C, segments=segments, initial_state=S0,
                                rerun=rerun)
    assert rel_err(o, o_ref) < 1e-12 and rel_err(s, s_ref) < 1e-12


def test_segmented_recurrence_rejects_bad_arguments():
    from kda_cute.chunked import segmented_recurrence
    T, H, K = 40, 1, 8
    qn = kn = torch.randn(1, T, H, K, dtype=F64)
    a = -torch.rand(1, T, H, K, dtype=F64)
    inter = chunk_intermediates(qn, kn, a, torch.rand(1, T, H, dtype=F64), chunk=16, scale=0.3)
    v = torch.randn(1, T, H, K, dtype=F64)
    with pytest.raises(ValueError, match="segments"):
        segmented_recurrence(inter, v, chunk=16, segments=4)  # 3 chunks
    two = {key: torch.cat([x, x]) for key, x in inter.items()}
    with pytest.raises(ValueError, match="B == 1"):
        segmented_recurrence(two, torch.cat([v, v]), chunk=16, segments=1)


def test_wy_form_equals_the_delta_rule_step():
    """The identity K2's WY build relies on: U = Aw (v - kg S^T) = Aw v + kgw S^T with
    kgw = -Aw kg (per chunk; Aw's rows and columns past the chunk's length are zero). A chunk
    loop in that form gives chunk_recurrence's outputs and final state to float64 rounding."""
    case = Case(B=1, T=45, H=2, K=8, V=8, gate="unbounded", state=F64)
    kw = make_inputs(case, "wy-form")
    qn, kn, a, b = preprocess(kw["q"], kw["k"], kw["g"], kw["beta"], A_log=kw["A_log"],
                              dt_bias=kw["dt_bias"], gate="unbounded")
    C = 16
    inter = chunk_intermediates(qn, kn, a, b, chunk=C, scale=0.5)
    out_ref, s_ref = chunk_recurrence(inter, kw["v"], chunk=C, initial_state=kw["initial_state"])
    S = kw["initial_state"][0].clone()  # [H, V, K]
    out = torch.zeros_like(out_ref)
    for c0 in range(0, case.T, C):
        tok = slice(c0, min(c0 + C, case.T))
        n = tok.stop - c0
        qg, kg, kd, v = (x[0, tok].transpose(0, 1) for x in (inter["qg"], inter["kg"],
                                                             inter["kd"], kw["v"].to(F64)))
        Aw = inter["Aw"][0, tok, :, :n].transpose(0, 1)  # [H, n, n]
        Mq = inter["Mq"][0, tok, :, :n].transpose(0, 1)
        kgw = -Aw @ kg  # what the producer warp forms
        U = Aw @ v + kgw @ S.transpose(-1, -2)
        out[0, tok] = (qg @ S.transpose(-1, -2) + Mq @ U).transpose(0, 1)
        S = S * inter["gl"][0, c0].unsqueeze(-2) + U.transpose(-1, -2) @ kd
    assert rel_err(out, out_ref) < 1e-12
    assert rel_err(S.unsqueeze(0), s_ref) < 1e-12
