"""K1 alone on the H200: its workspace against the float64 chunked twin (skips without a GPU)."""

import pytest
import torch

from kda_cute import Call, checks, launch, plans
from kda_cute.chunked import chunk_intermediates
from kda_cute.ladder import EXPERIMENTAL, PRECISE, SIMT, TENSOR_CORE
from kda_cute.plans.workspace import views
from kda_cute.reference import preprocess, rel_err
from kda_cute.testing import as_double, make_inputs, token_rows


def prep_errors(inp, config=None) -> dict:
    """K1 alone: its workspace against the float64 chunked twin's intermediates. With bf16
    operands (config.prep.operands), kd, Aw and Mq are compared as hi + lo; for config.prep.f16
    the fp16 hi plane against the reference rounded to fp16."""
    q, v = inp["q"], inp["v"]
    out = torch.empty(v.shape, dtype=torch.bfloat16, device=q.device)
    call = Call(q, inp["k"], v, inp["g"], inp["beta"], out, inp["A_log"], inp["dt_bias"], None,
                None, inp["cu_seqlens"], inp["scale"], inp["lower_bound"])
    opts = checks.options(inp["gate"], inp["qk_l2norm"], inp["beta_sigmoid"], config=config,
                          alongside=False)
    p = checks.forward(call, opts)
    plan = plans.plan(p, opts, plans.device_info(q.device))
    cfg, chunk = plan.config, plan.config.chunk
    ws = torch.full((plan.workspace_bytes,), 0xFF, dtype=torch.uint8, device=q.device)
    launch.run(plan.only("offsets", "K1"), call, ws)
    w = views(ws, p, cfg)
    torch.cuda.synchronize()
    d = as_double(inp)
    qn, kn, a, b = preprocess(d["q"], d["k"], d["g"], d["beta"], A_log=d["A_log"],
                              dt_bias=d["dt_bias"], lower_bound=d["lower_bound"],
                              gate=d["gate"], qk_l2norm=d["qk_l2norm"],
                              beta_sigmoid=d["beta_sigmoid"])
    ref = chunk_intermediates(qn, kn, a, b, chunk=chunk, scale=d["scale"],
                              cu_seqlens=d["cu_seqlens"])
    B, T, H = q.shape[:3]
    rows, chunk_rows = token_rows(B, T, inp["cu_seqlens"], chunk)
    n_rows = int(chunk_rows.max()) + 1 if chunk_rows.numel() else 0
    pad = torch.zeros(n_rows, dtype=torch.bool)
    pad[chunk_rows] = True
    pad[rows] = False
    pad = pad.to(q.device)
    rows = rows.to(q.device)
    res = {"pad_max": 0.0}
    for name in ("qg", "kg", "kd", "aw", "mq"):
        r = ref[name.replace("aw", "Aw").replace("mq", "Mq")].reshape(B * T, H, -1)
        x = w[name]
        fp16 = x.dtype == torch.float16
        if cfg.prep.operands == "bf16" and name in ("kd", "aw", "mq"):
            # hi + lo; the f16 configs write the hi plane only, in fp16
            x = x[0].double() if cfg.prep.f16 else x[0].double() + x[1].double()
        if fp16:
            # what an fp16 output can hold (the f16 configs' every plane, qg and kg in every
            # tensor-core config): the reference rounded to fp16 (values below fp16's normal
            # range, e.g. under strong decay, keep only its absolute spacing)
            r = r.to(torch.float16).double()
        res[name] = rel_err(x[rows], r)
        # the padding rows of each sequence's last chunk: K1 writes them as zeros (K2 reads them)
        res["pad_max"] = max(res["pad_max"], float(x[:n_rows][pad].double().abs().max())
                             if bool(pad.any()) else 0.0)
    return res


pytestmark = pytest.mark.gpu

CASES = {
    "fixed-K128": dict(B=2, T=37, H=3, K=128),
    "fixed-K64-unbounded": dict(B=2, T=20, H=2, K=64, gate="unbounded"),
    "fixed-K256-none": dict(B=1, T=40, H=2, K=256, gate="none"),
    "varlen": dict(seqlens=[5, 0, 33, 16, 1], H=2, K=128),
    # |G| > 80 inside a chunk: phase B takes e^(G_i - G_j) per term instead of the factored form
    "strong-decay": dict(B=1, T=64, H=2, K=128, gate="unbounded", g_shift=20.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_prep_matches_chunked_twin(name):
    (cfg,) = [c for c in SIMT if c.prep.head_dim_k == CASES[name]["K"]]
    res = prep_errors(make_inputs(seed=len(name), **CASES[name]), config=cfg)
    # fp32 arithmetic on bf16 inputs: only fp32 rounding separates K1 from the float64 twin
    assert res.pop("pad_max") == 0.0, res
    assert all(e < 1e-5 for e in res.values()), res


@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("name", list(CASES))
def test_prep_bf16_operands(name, chunk):
    """The precise configs' workspace: fp16 qg, kg (rounding only) and bf16 hi + lo kd, Aw,
    Mq (~16 mantissa bits), for the shipped chunk and the experimental one."""
    kw = CASES[name]
    (cfg,) = [c for c in TENSOR_CORE + EXPERIMENTAL
              if c.prep.head_dim_k == kw["K"] and c.chunk == chunk and not c.prep.f16]
    res = prep_errors(make_inputs(seed=len(name), **kw), config=cfg)
    assert res["pad_max"] == 0.0, res
    assert all(res[n] < 1e-3 for n in ("qg", "kg")), res
    assert all(res[n] < 3e-5 for n in ("kd", "aw", "mq")), res


@pytest.mark.parametrize("name", list(CASES))
def test_prep_f16_operands(name):
    """The f16 configs' workspace: qg, kg, kd, Aw and Mq each one fp16 value, no lo planes:
    the float64 twin's values rounded to fp16, up to a last-bit flip where K1's fp32
    arithmetic lands on the other side of a rounding boundary (~2^-11 relative)."""
    kw = CASES[name]
    (cfg,) = [c for c in TENSOR_CORE + EXPERIMENTAL if c.prep.head_dim_k == kw["K"]
              and c.prep.f16]
    res = prep_errors(make_inputs(seed=len(name), **kw), config=cfg)
    assert res["pad_max"] == 0.0, res
    assert all(res[n] < 1e-3 for n in ("qg", "kg", "kd", "aw", "mq")), res


@pytest.mark.parametrize("K", [64, 128])
def test_prep_mid_chunk_decay_beyond_80(K):
    """Log-space gate (gate 'none') of -11 per token for the first 8 tokens of every chunk, then
    -0.1: G at the chunk's middle row is about -88 while no G is 80 away from it. K1 must take
    the unfactored path there (e^G through e^(G - r) e^r would need e^-88, below fp32's normal
    range) and still match the twin."""
    inp = make_inputs(B=1, T=48, H=2, K=K, gate="none", seed=K)
    t = torch.arange(48, device=inp["g"].device) % 16
    g = torch.where(t < 8, -11.0, -0.1).view(1, 48, 1, 1).expand_as(inp["g"])
    inp["g"] = g.to(torch.bfloat16).contiguous()
    (cfg,) = [c for c in PRECISE if c.prep.head_dim_k == K]
    res = prep_errors(inp, config=cfg)
    assert res["pad_max"] == 0.0, res
    assert all(res[n] < 1e-3 for n in ("qg", "kg")), res
    assert all(res[n] < 3e-5 for n in ("kd", "aw", "mq")), res
