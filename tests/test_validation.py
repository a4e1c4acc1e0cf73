"""Host-side validation of `validate`, `fwd` and `chunk_kda`: every bad input raises ValueError or
TypeError naming the argument (CPU only).

The inputs live on the CPU. The CUDA requirement is the last check (kda_cute.checks.forward), so
every other check runs here exactly as it would on the GPU: `validate(..., cuda=False)` skips it,
and `fwd` reaches it only once every other check has passed.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from kda_cute import Problem, api, chunk_kda, fwd
from kda_cute import validate as validate_on_cuda
from tests.launch_record import PROBLEMS, make_call
from tests.mutations import must_refuse, odd_swaps, outcome, tensor_swaps

BF16, F32 = torch.bfloat16, torch.float32
# K != V everywhere, so a state or output given in the [.., K, V] layout instead of [.., V, K]
# cannot pass by accident.
B, T, H, K, V = 2, 24, 2, 64, 32
SEQLENS = (5, 0, 17, 2)  # 24 tokens: an empty sequence and lengths that are not chunk multiples
N_VARLEN = len(SEQLENS)


def rand(*shape, dtype=BF16, device="cpu"):
    return torch.randn(*shape, device=device).to(dtype)


def rows(B, T, H, D, pad=0, offset=0):
    """[B, T, H, D] sliced out of a packed projection: token stride H*D + pad, base + offset."""
    packed = rand(B, T, H * D + pad + offset)
    return packed[..., offset:offset + H * D].view(B, T, H, D)


def cu(*offsets, dtype=torch.int64):
    return torch.tensor(offsets, dtype=dtype)


def inputs(*, B=B, T=T, H=H, K=K, V=V, seqlens=None, gate="bounded", cu_dtype=torch.int64,
           initial_state=None, final_state=None) -> dict:
    """Keyword arguments of a valid `validate` / `fwd` call (CPU tensors, random, never zeros).

    With `seqlens`, B is 1 and T is their sum. initial_state / final_state: a dtype or None.
    """
    cu_seqlens = None
    if seqlens is not None:
        B, T = 1, sum(seqlens)
        offsets = [0]
        for n in seqlens:
            offsets.append(offsets[-1] + n)
        cu_seqlens = cu(*offsets, dtype=cu_dtype)
    N = len(seqlens) if seqlens is not None else B
    return {
        "q": rand(B, T, H, K), "k": rand(B, T, H, K), "v": rand(B, T, H, V),
        "g": rand(B, T, H, K), "beta": rand(B, T, H), "scale": K ** -0.5,
        "out": rand(B, T, H, V), "A_log": rand(H, dtype=F32), "dt_bias": rand(H, K, dtype=F32),
        "lower_bound": -5.0,
        "initial_state": rand(N, H, V, K, dtype=initial_state) if initial_state else None,
        "final_state": rand(N, H, V, K, dtype=final_state) if final_state else None,
        "cu_seqlens": cu_seqlens, "gate": gate,
    }


def varlen(**kw) -> dict:
    return inputs(seqlens=SEQLENS, **kw)


def meta(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def validate(**kw):
    """kda_cute.validate on CPU tensors: every check but the CUDA requirement."""
    return validate_on_cuda(**kw, cuda=False)


def sizes(p: Problem) -> tuple:
    """The Problem's sizes (the fields a Problem made from sizes alone compares on)."""
    return p.B, p.T, p.H, p.K, p.V, p.N, p.varlen


# -------------------------------------------------------------------- bad inputs, one per check
# id -> (a valid problem, the change that breaks it, exception, argument named, got-value shown)
ERRORS = {
    # dtypes and types
    "q-float32": (inputs, lambda d: d.update(q=d["q"].float()), TypeError, "q", "float32"),
    "k-float32": (inputs, lambda d: d.update(k=d["k"].float()), TypeError, "k", "float32"),
    "v-float32": (inputs, lambda d: d.update(v=d["v"].float()), TypeError, "v", "float32"),
    "g-float32": (inputs, lambda d: d.update(g=d["g"].float()), TypeError, "g", "float32"),
    "beta-float32": (inputs, lambda d: d.update(beta=d["beta"].float()), TypeError, "beta",
                     "float32"),
    "q-not-a-tensor": (inputs, lambda d: d.update(q=d["q"].tolist()), TypeError, "q", "list"),
    "k-None": (inputs, lambda d: d.update(k=None), TypeError, "k", "NoneType"),
    "out-float32": (inputs, lambda d: d.update(out=d["out"].float()), TypeError, "out",
                    "float32"),
    # ranks
    "q-rank3": (inputs, lambda d: d.update(q=d["q"][0]), ValueError, "q", f"{(T, H, K)}"),
    "k-rank5": (inputs, lambda d: d.update(k=d["k"][None]), ValueError, "k",
                f"{(1, B, T, H, K)}"),
    "v-rank3": (inputs, lambda d: d.update(v=d["v"][0]), ValueError, "v", f"{(T, H, V)}"),
    "beta-rank4": (inputs, lambda d: d.update(beta=d["beta"][..., None]), ValueError, "beta",
                   f"{(B, T, H, 1)}"),
    "out-rank3": (inputs, lambda d: d.update(out=d["out"][0]), ValueError, "out",
                  f"{(T, H, V)}"),
    # shapes against q
    "k-head-dim": (inputs, lambda d: d.update(k=rand(B, T, H, K + 8)), ValueError, "k",
                   f"{(B, T, H, K + 8)}"),
    "k-tokens": (inputs, lambda d: d.update(k=rand(B, T + 1, H, K)), ValueError, "k",
                 f"{(B, T + 1, H, K)}"),
    "g-heads": (inputs, lambda d: d.update(g=rand(B, T, H + 1, K)), ValueError, "g",
                f"{(B, T, H + 1, K)}"),
    "g-batch": (inputs, lambda d: d.update(g=rand(B + 1, T, H, K)), ValueError, "g",
                f"{(B + 1, T, H, K)}"),
    "v-batch": (inputs, lambda d: d.update(v=rand(B + 1, T, H, V)), ValueError, "v",
                f"{(B + 1, T, H, V)}"),
    "v-tokens": (inputs, lambda d: d.update(v=rand(B, T - 1, H, V)), ValueError, "v",
                 f"{(B, T - 1, H, V)}"),
    "v-heads": (inputs, lambda d: d.update(v=rand(B, T, H + 1, V)), ValueError, "v",
                f"{(B, T, H + 1, V)}"),
    "beta-shape": (inputs, lambda d: d.update(beta=rand(B, T, H + 1)), ValueError, "beta",
                   f"{(B, T, H + 1)}"),
    "out-shape": (inputs, lambda d: d.update(out=rand(B, T, H, V + 16)), ValueError, "out",
                  f"{(B, T, H, V + 16)}"),
    "out-shape-K-for-V": (inputs, lambda d: d.update(out=rand(B, T, H, K)), ValueError, "out",
                          f"{(B, T, H, K)}"),
    # strides: the TMA loads need 16-byte token rows and a 16-byte aligned base
    "q-token-stride-odd": (inputs, lambda d: d.update(q=rows(B, T, H, K, pad=3)), ValueError,
                           "q", f"stride {H * K + 3}"),
    "k-token-stride-odd": (inputs, lambda d: d.update(k=rows(B, T, H, K, pad=1)), ValueError,
                           "k", f"stride {H * K + 1}"),
    "g-token-stride-odd": (inputs, lambda d: d.update(g=rows(B, T, H, K, pad=4)), ValueError,
                           "g", f"stride {H * K + 4}"),
    "v-token-stride-odd": (inputs, lambda d: d.update(v=rows(B, T, H, V, pad=5)), ValueError,
                           "v", f"stride {H * V + 5}"),
    # out leaves by TMA stores too: its rows obey the same alignment as the inputs'
    "out-token-stride-odd": (inputs, lambda d: d.update(out=rows(B, T, H, V, pad=3)),
                             ValueError, "out", f"stride {H * V + 3}"),
    "out-base-misaligned": (inputs, lambda d: d.update(out=rows(B, T, H, V, pad=7, offset=1)),
                            ValueError, "out", "address"),
    "q-base-misaligned": (inputs, lambda d: d.update(q=rows(B, T, H, K, pad=7, offset=1)),
                          ValueError, "q", "address"),
    "q-head-dim-strided": (inputs, lambda d: d.update(q=rand(B, T, H, 2 * K)[..., ::2]),
                           ValueError, "q", f"{(T * H * 2 * K, H * 2 * K, 2 * K, 2)}"),
    "k-heads-not-packed": (inputs, lambda d: d.update(k=rand(B, T, H, K + 8)[..., :K]),
                           ValueError, "k", f"{(T * H * (K + 8), H * (K + 8), K + 8, 1)}"),
    "g-batch-stride": (inputs, lambda d: d.update(g=rand(T, B, H, K).transpose(0, 1)),
                       ValueError, "g", f"{(H * K, B * H * K, K, 1)}"),
    "beta-head-strided": (inputs, lambda d: d.update(beta=rand(B, T, 2 * H)[..., ::2]),
                          ValueError, "beta", f"{(T * 2 * H, 2 * H, 2)}"),
    "out-head-dim-strided": (inputs, lambda d: d.update(out=rand(B, T, H, 2 * V)[..., ::2]),
                             ValueError, "out", f"{(T * H * 2 * V, H * 2 * V, 2 * V, 2)}"),
    # every tensor on q's device
    "k-other-device": (inputs, lambda d: d.update(k=meta(B, T, H, K)), ValueError, "k", "meta"),
    "beta-other-device": (inputs, lambda d: d.update(beta=meta(B, T, H)), ValueError, "beta",
                          "meta"),
    "A_log-other-device": (inputs, lambda d: d.update(A_log=meta(H, dtype=F32)), ValueError,
                           "A_log", "meta"),
    "cu_seqlens-other-device": (varlen, lambda d: d.update(cu_seqlens=d["cu_seqlens"].to("meta")),
                                ValueError, "cu_seqlens", "meta"),
    "final_state-other-device": (inputs, lambda d: d.update(final_state=meta(B, H, V, K,
                                                                            dtype=F32)),
                                 ValueError, "final_state", "meta"),
    # gate, scale, lower bound
    "gate-unknown": (inputs, lambda d: d.update(gate="softplus"), ValueError, "gate",
                     "'softplus'"),
    "gate-None": (inputs, lambda d: d.update(gate=None), ValueError, "gate", "None"),
    "scale-zero": (inputs, lambda d: d.update(scale=0.0), ValueError, "scale", "0.0"),
    "scale-negative": (inputs, lambda d: d.update(scale=-0.125), ValueError, "scale", "-0.125"),
    "scale-nan": (inputs, lambda d: d.update(scale=float("nan")), ValueError, "scale", "nan"),
    "scale-inf": (inputs, lambda d: d.update(scale=float("inf")), ValueError, "scale", "inf"),
    "scale-str": (inputs, lambda d: d.update(scale="0.125"), ValueError, "scale", "'0.125'"),
    "scale-None": (inputs, lambda d: d.update(scale=None), ValueError, "scale", "None"),
    "lower_bound-zero": (inputs, lambda d: d.update(lower_bound=0.0), ValueError, "lower_bound",
                         "0.0"),
    "lower_bound-below-5": (inputs, lambda d: d.update(lower_bound=-6.0), ValueError,
                            "lower_bound", "-6.0"),
    "lower_bound-None": (inputs, lambda d: d.update(lower_bound=None), ValueError,
                         "lower_bound", "None"),
    "lower_bound-nan": (inputs, lambda d: d.update(lower_bound=float("nan")), ValueError,
                        "lower_bound", "nan"),
    # gate parameters
    "A_log-missing-unbounded": (lambda: inputs(gate="unbounded"),
                                lambda d: d.update(A_log=None), ValueError, "A_log", "None"),
    "A_log-numel": (inputs, lambda d: d.update(A_log=rand(H + 1, dtype=F32)), ValueError,
                    "A_log", f"{(H + 1,)}"),
    # (fp32, bf16 and fp16 are read as held: tests/test_gate_params.py)
    "A_log-f64": (inputs, lambda d: d.update(A_log=rand(H, dtype=torch.float64)), TypeError,
                  "A_log", "float64"),
    "A_log-int": (inputs, lambda d: d.update(A_log=rand(H).to(torch.int32)), TypeError, "A_log",
                  "int32"),
    "A_log-strided-unbounded": (lambda: inputs(gate="unbounded"),
                                lambda d: d.update(A_log=rand(2 * H, dtype=F32)[::2]),
                                ValueError, "A_log", f"{(H,)}"),
    "dt_bias-numel": (inputs, lambda d: d.update(dt_bias=rand(H, K + 1, dtype=F32)), ValueError,
                      "dt_bias", f"{(H, K + 1)}"),
    "dt_bias-V-for-K": (inputs, lambda d: d.update(dt_bias=rand(H, V, dtype=F32)), ValueError,
                        "dt_bias", f"{(H, V)}"),
    "dt_bias-f64-unbounded": (lambda: inputs(gate="unbounded"),
                              lambda d: d.update(dt_bias=rand(H, K, dtype=torch.float64)),
                              TypeError, "dt_bias", "float64"),
    # cu_seqlens
    "cu_seqlens-float32": (varlen, lambda d: d.update(cu_seqlens=d["cu_seqlens"].float()),
                           TypeError, "cu_seqlens", "float32"),
    "cu_seqlens-int16": (varlen, lambda d: d.update(cu_seqlens=d["cu_seqlens"].short()),
                         TypeError, "cu_seqlens", "int16"),
    "cu_seqlens-rank2": (varlen, lambda d: d.update(cu_seqlens=d["cu_seqlens"][None]),
                         ValueError, "cu_seqlens", f"{(1, N_VARLEN + 1)}"),
    "cu_seqlens-batch2": (inputs, lambda d: d.update(cu_seqlens=cu(0, 10, T)), ValueError, "q",
                          f"batch size {B}"),
    # the host check of the values (check_seqlens=True; by default the device checks them)
    "cu_seqlens-decreasing": (varlen, lambda d: d.update(cu_seqlens=cu(0, 10, 5, T),
                                                         check_seqlens=True), ValueError,
                              "cu_seqlens", f"[0, 10, 5, {T}]"),
    "cu_seqlens-nonzero-start": (varlen, lambda d: d.update(cu_seqlens=cu(3, 10, T),
                                                            check_seqlens=True), ValueError,
                                 "cu_seqlens", f"[3, 10, {T}]"),
    "cu_seqlens-past-T": (varlen, lambda d: d.update(cu_seqlens=cu(0, 10, T + 1),
                                                         check_seqlens=True), ValueError,
                          "cu_seqlens", f"[0, 10, {T + 1}]"),
    "cu_seqlens-past-T-int32": (varlen, lambda d: d.update(cu_seqlens=cu(0, T + 8,
                                                                        dtype=torch.int32),
                                                                 check_seqlens=True),
                                ValueError, "cu_seqlens", f"[0, {T + 8}]"),
    "cu_seqlens-strided": (varlen, lambda d: d.update(cu_seqlens=torch.stack(
        [d["cu_seqlens"], d["cu_seqlens"]], 1).flatten()[::2]), ValueError, "cu_seqlens",
        "strides"),
    "beta-batch-stride": (inputs, lambda d: d.update(beta=rand(T, B, H).transpose(0, 1)),
                          ValueError, "beta", "strides"),
    "q-overlapping-rows": (inputs, lambda d: d.update(q=rand(B, 1, H, K).expand(B, T, H, K)),
                           ValueError, "q", "strides"),
    "out-overlapping-rows": (inputs, lambda d: d.update(out=rand(B, 1, H, V).expand(B, T, H, V)),
                             ValueError, "out", "strides"),
    "cu_seqlens-one-entry": (varlen, lambda d: d.update(cu_seqlens=cu(0)), ValueError,
                             "cu_seqlens", "got 1"),
    "cu_seqlens-empty": (varlen, lambda d: d.update(cu_seqlens=cu()), ValueError, "cu_seqlens",
                         "got 0"),
    # states: [N, H, V, K], N sequences
    "initial_state-k-first": (inputs, lambda d: d.update(initial_state=rand(B, H, K, V,
                                                                            dtype=F32)),
                              ValueError, "initial_state", f"{(B, H, K, V)}"),
    "initial_state-N-fixed": (inputs, lambda d: d.update(initial_state=rand(B + 1, H, V, K,
                                                                            dtype=F32)),
                              ValueError, "initial_state", f"{(B + 1, H, V, K)}"),
    "initial_state-N-varlen": (varlen, lambda d: d.update(initial_state=rand(1, H, V, K,
                                                                             dtype=F32)),
                               ValueError, "initial_state", f"{(1, H, V, K)}"),
    # K2 moves a thread's column pairs of a state row at once: 16-byte aligned bases
    "initial_state-base-misaligned": (
        inputs, lambda d: d.update(initial_state=rand(B * H * V * K + 1, dtype=F32)[1:].view(
            B, H, V, K)), ValueError, "initial_state", "16-byte aligned base"),
    "final_state-base-misaligned": (
        inputs, lambda d: d.update(final_state=rand(B * H * V * K + 2)[2:].view(B, H, V, K)),
        ValueError, "final_state", "16-byte aligned base"),
    "final_state-k-first": (inputs, lambda d: d.update(final_state=rand(B, H, K, V, dtype=F32)),
                            ValueError, "final_state", f"{(B, H, K, V)}"),
    "final_state-rank3": (inputs, lambda d: d.update(final_state=rand(H, V, K, dtype=F32)),
                          ValueError, "final_state", f"{(H, V, K)}"),
    "initial_state-float16": (inputs, lambda d: d.update(initial_state=rand(
        B, H, V, K, dtype=torch.float16)), TypeError, "initial_state", "float16"),
    "final_state-float16": (varlen, lambda d: d.update(final_state=rand(
        N_VARLEN, H, V, K, dtype=torch.float16)), TypeError, "final_state", "float16"),
    "initial_state-non-contiguous": (inputs, lambda d: d.update(
        initial_state=rand(B, H, K, V, dtype=F32).transpose(-1, -2)), ValueError,
        "initial_state", f"{(H * K * V, K * V, 1, V)}"),
    "final_state-non-contiguous": (varlen, lambda d: d.update(
        final_state=rand(N_VARLEN, H, K, V, dtype=BF16).transpose(-1, -2)), ValueError,
        "final_state", f"{(H * K * V, K * V, 1, V)}"),
}


@pytest.mark.parametrize("entry", ["validate", "fwd"])
@pytest.mark.parametrize("case_id", list(ERRORS))
def test_bad_input_raises_naming_argument(case_id, entry):
    make, breaks, exc, arg, got = ERRORS[case_id]
    kw = make()
    breaks(kw)
    call = validate if entry == "validate" else fwd
    with pytest.raises(exc) as info:
        call(**kw)
    msg = str(info.value)
    assert msg.startswith(f"{arg}:"), msg
    assert got in msg, msg


def test_error_table_inputs_are_valid_before_the_change():
    """Each case's starting point must pass, or a case could raise for a reason other than its
    own change."""
    for make in {make for make, *_ in ERRORS.values()}:
        assert isinstance(validate(**make()), Problem)


# ------------------------------------------------------------------------- the CUDA requirement
@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("entry", ["validate", "fwd"])
def test_non_cuda_q_rejected(entry, device):
    """A problem fwd could run (head dims with a shipped config) but for its device: the CUDA
    requirement, checked last, names q."""
    kw = inputs(V=K)
    kw = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()}
    call = validate_on_cuda if entry == "validate" else fwd
    with pytest.raises(ValueError) as info:
        call(**kw)
    msg = str(info.value)
    assert msg.startswith("q:") and "CUDA" in msg and device in msg, msg


def test_chunk_kda_cpu_rejected():
    kw = inputs(V=K)
    with pytest.raises(ValueError) as info:
        chunk_kda(kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"])
    msg = str(info.value)
    assert msg.startswith("q:") and "CUDA" in msg and "cpu" in msg, msg


# --------------------------------------------------------------------------- valid problems
VALID = {
    "fixed": (lambda: inputs(), Problem(B, T, H, K, V, B, False)),
    "fixed-K128-V128-state": (lambda: inputs(K=128, V=128, initial_state=BF16,
                                             final_state=F32),
                              Problem(B, T, H, 128, 128, B, False)),
    "fixed-T1-H1": (lambda: inputs(B=3, T=1, H=1), Problem(3, 1, 1, K, V, 3, False)),
    "fixed-unbounded-no-dt_bias": (lambda: {**inputs(gate="unbounded"), "dt_bias": None},
                                   Problem(B, T, H, K, V, B, False)),
    "fixed-none-gate-ignores-gate-params": (
        lambda: {**inputs(gate="none"), "A_log": None, "lower_bound": None},
        Problem(B, T, H, K, V, B, False)),
    "fixed-token-stride-padded": (lambda: {**inputs(), "q": rows(B, T, H, K, pad=8),
                                           "v": rows(B, T, H, V, pad=16)},
                                  Problem(B, T, H, K, V, B, False)),
    "fixed-lower_bound-just-below-0": (lambda: {**inputs(), "lower_bound": -1e-3},
                                       Problem(B, T, H, K, V, B, False)),
    "varlen-int64": (lambda: varlen(initial_state=F32, final_state=F32),
                     Problem(1, T, H, K, V, N_VARLEN, True)),
    "varlen-int32": (lambda: varlen(cu_dtype=torch.int32),
                     Problem(1, T, H, K, V, N_VARLEN, True)),
    "varlen-shorter-than-T": (lambda: {**varlen(), "cu_seqlens": cu(0, 7, T - 3)},
                              Problem(1, T, H, K, V, 2, True)),
    "varlen-one-sequence": (lambda: {**varlen(), "cu_seqlens": cu(0, T),
                                     "final_state": rand(1, H, V, K)},
                            Problem(1, T, H, K, V, 1, True)),
}


@pytest.mark.parametrize("case_id", list(VALID))
def test_valid_problem(case_id):
    make, expected = VALID[case_id]
    assert sizes(validate(**make())) == sizes(expected)


@pytest.mark.parametrize("explicit", [False, True], ids=["default", "check_seqlens-False"])
def test_unchecked_seqlens_skip_the_host_sync(monkeypatch, explicit):
    """The default (and check_seqlens=False) is the no-sync path: cu_seqlens' values are not
    read on the host (the offsets kernel checks them on the device)."""
    kw = {**varlen(), "cu_seqlens": cu(0, 10, 5, T)}

    def no_sync(self):
        raise AssertionError("cu_seqlens was copied to the host")

    monkeypatch.setattr(torch.Tensor, "cpu", no_sync)
    extra = {"check_seqlens": False} if explicit else {}
    assert sizes(validate(**kw, **extra)) == sizes(Problem(1, T, H, K, V, 3, True))


# ------------------------------------------------------------------- head dims without a config
NO_CONFIG = {"K96-V96": (96, 96), "K128-V64": (128, 64), "K64-V128": (64, 128),
             "K32-V32": (32, 32)}


@pytest.mark.parametrize("case_id", list(NO_CONFIG))
def test_head_dims_without_shipped_config(case_id):
    Kx, Vx = NO_CONFIG[case_id]
    kw = inputs(K=Kx, V=Vx)
    p = validate(**kw)
    with pytest.raises(ValueError) as info:
        api.config_for(p)
    msg = str(info.value)
    assert msg.startswith("q/v:") and f"K={Kx}, V={Vx}" in msg, msg
    # fwd must stop at the same check, before anything is launched
    with pytest.raises(ValueError, match=f"K={Kx}, V={Vx}"):
        fwd(**kw)


def test_fwd_requires_out():
    with pytest.raises(ValueError) as info:
        fwd(**{**inputs(), "out": None})
    msg = str(info.value)
    assert msg.startswith("out:") and "None" in msg, msg


def _config_cases():
    from kda_cute import FwdConfig, PrepConfig, RecurConfig
    return {
        "not-a-config": ("fast", TypeError, "str"),
        "other-head-dim": (FwdConfig(PrepConfig(128), RecurConfig(128, 128)), ValueError,
                           "(128, 128)"),
        "unsupported": (FwdConfig(PrepConfig(K), RecurConfig(K, V, block_v=3)), ValueError,
                        "block_v"),
    }


@pytest.mark.parametrize("case_id", list(_config_cases()))
def test_fwd_config_override_rejected(case_id):
    config, exc, got = _config_cases()[case_id]
    with pytest.raises(exc) as info:
        fwd(**inputs(), config=config)
    msg = str(info.value)
    assert msg.startswith("config:") and got in msg, msg


# ----------------------------------------------------------------------------------- chunk_kda
def chunk_kw(**over) -> dict:
    """chunk_kda keyword arguments for a valid bounded-gate call (fla's state layout [N,H,K,V])."""
    d = inputs()
    kw = {n: d[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "lower_bound")}
    kw.update(use_gate_in_kernel=True, safe_gate=True, use_qk_l2norm_in_kernel=True,
              use_beta_sigmoid_in_kernel=True,
              initial_state=rand(B, H, K, V, dtype=F32), output_final_state=True)
    kw.update(over)
    return kw


# id -> (keyword changes, exception, argument named, got-value shown)
CHUNK_KDA_ERRORS = {
    "unsupported-cp_context": ({"cp_context": object()}, ValueError, "cp_context", ""),
    "unsupported-flag": ({"transpose_state_layout": True}, ValueError, "transpose_state_layout",
                         ""),
    "safe_gate-without-lower_bound": ({"lower_bound": None}, ValueError, "lower_bound", "None"),
    "safe_gate-lower_bound-out-of-range": ({"lower_bound": -6.0}, ValueError, "lower_bound",
                                           "-6.0"),
    "unbounded-without-A_log": ({"safe_gate": False, "lower_bound": None, "A_log": None},
                                ValueError, "A_log", "None"),
    "q-rank3": ({"q": rand(T, H, K)}, ValueError, "q", f"{T}, {H}, {K}"),
    "beta-float32": ({"beta": rand(B, T, H, dtype=F32)}, TypeError, "beta", "float32"),
    # a state already in the kernels' [N, H, V, K] layout without state_v_first is the wrong
    # shape once transposed
    "initial_state-v-first-layout": ({"initial_state": rand(B, H, V, K, dtype=F32)}, ValueError,
                                     "initial_state", f"{(B, H, K, V)}"),
    "initial_state-k-first-with-state_v_first": ({"state_v_first": True}, ValueError,
                                                 "initial_state", f"{(B, H, K, V)}"),
    "cu_seqlens-batch2": ({"cu_seqlens": cu(0, 10, T)}, ValueError, "q", f"batch size {B}"),
    "K96": ({"q": rand(B, T, H, 96), "k": rand(B, T, H, 96), "g": rand(B, T, H, 96),
             "dt_bias": None, "initial_state": None}, ValueError, "q/v", "K=96"),
}


@pytest.mark.parametrize("case_id", list(CHUNK_KDA_ERRORS))
def test_chunk_kda_bad_input(case_id):
    over, exc, arg, got = CHUNK_KDA_ERRORS[case_id]
    with pytest.raises(exc) as info:
        chunk_kda(**chunk_kw(**over))
    msg = str(info.value)
    assert arg in msg and got in msg, msg
    if not case_id.startswith("unsupported"):
        assert msg.startswith(f"{arg}:"), msg


def test_chunk_kda_ignores_unset_options():
    """fla callers pass optional features as None/False; only set ones are refused. The call
    still fails, at the first check a real problem would hit (K=96 has no config), which proves
    the options were accepted without launching anything."""
    over = {"q": rand(B, T, H, 96), "k": rand(B, T, H, 96), "g": rand(B, T, H, 96),
            "dt_bias": None, "initial_state": None, "cp_context": None,
            "transpose_state_layout": False}
    with pytest.raises(ValueError, match="^q/v:"):
        chunk_kda(**chunk_kw(**over))


# ------------------------------------------------------------------ metadata checks on fakes
def _fake_call(**over):
    """A valid fixed-length call's tensors as FakeTensors on a (fake) CUDA device."""
    from kda_cute import Call
    kw = {**inputs(V=K, initial_state=F32, final_state=F32), **over}
    return Call(**{n: kw.get(n) for n in Call._fields})


def _no_data_ptr(monkeypatch):
    def refuse(self):
        raise AssertionError("a metadata check read a tensor's address")

    monkeypatch.setattr(torch.Tensor, "data_ptr", refuse)


def test_metadata_checks_run_on_fake_tensors(monkeypatch):
    """checks.metadata reads shapes, dtypes, strides and devices only: it runs under
    FakeTensorMode (a torch.library fake, the fla verifier) and never reads an address."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kda_cute import checks
    opts = checks.options()
    with FakeTensorMode() as mode:
        call = _fake_call()
        call = call._replace(**{n: mode.from_tensor(t).to("cuda") for n, t in
                                call._asdict().items() if isinstance(t, torch.Tensor)})
        _no_data_ptr(monkeypatch)
        p = checks.metadata(call, opts)
        assert sizes(p) == (B, T, H, K, K, B, False)
        with pytest.raises(ValueError, match="^k:"):
            checks.metadata(call._replace(k=call.k[..., :K // 2]), opts)
        with pytest.raises(ValueError, match="^scale:"):
            checks.metadata(call._replace(scale=-1.0), opts)


# ------------------------------------------------------------ every tensor argument, mutated
FUZZ_PROBLEMS = ("k128-varlen-pool-int64-out-null", "k64-ckpt-every-pool-varlen",
                 "k128-ckpt-offsets-serial", "k128-strided-rows", "k64-pool-read-only-bf16",
                 "k128-dense-has-init")
CUDA_ONLY = "q: expected a CUDA tensor"  # the last check: everything before it passed
NAMES = set(inspect.signature(chunk_kda).parameters) | set(inspect.signature(fwd).parameters)


def _chunk_kda_call() -> dict:
    T_ = 130
    return dict(q=rand(1, T_, H, K), k=rand(1, T_, H, K), v=rand(1, T_, H, K),
                g=rand(1, T_, H, K), beta=rand(1, T_, H), initial_state=rand(2, H, K, K, dtype=F32),
                output_final_state=True, cu_seqlens=cu(0, 60, T_))


def _passed(e) -> bool:
    """Every check passed (the CUDA requirement, last, is what raised)."""
    return e is None or str(e).startswith(CUDA_ONLY)


@pytest.mark.parametrize("name", FUZZ_PROBLEMS)
def test_every_fwd_tensor_argument_mutated(name):
    """Each tensor argument of a valid forward (tests/launch_record.py's problems: varlen, the
    pool with int64 indices and null_slot, both checkpoint forms, strided rows, a read-only
    bf16 pool, dense has_initial_state) replaced by each of tests/mutations.py's values: the
    forward raises TypeError or ValueError naming its own arguments, or passes every check but
    the CUDA requirement; never another exception; what mutations.must_refuse names is
    refused."""
    x = make_call(PROBLEMS[name])
    assert _passed(outcome(fwd, x, NAMES))
    refused = 0
    for arg, what, bad in tensor_swaps(x):
        if _passed(outcome(fwd, bad, NAMES, (), (arg, what))):
            assert not must_refuse(arg, what), f"{name}: {arg} ({what}) accepted"
        else:
            refused += 1
    assert refused > 20


def test_every_chunk_kda_tensor_argument_mutated():
    """chunk_kda (fla's call: K-first states, transposed before the forward) under the same
    mutations: a named TypeError / ValueError or every check passed, never another exception."""
    kw = _chunk_kda_call()
    assert _passed(outcome(chunk_kda, kw, NAMES))
    for arg, what, bad in tensor_swaps(kw):
        if _passed(outcome(chunk_kda, bad, NAMES, (), (arg, what))):
            assert not must_refuse(arg, what), f"chunk_kda: {arg} ({what}) accepted"


def test_every_fwd_and_chunk_kda_argument_given_odd_values():
    """mutations.ODD for each keyword argument of fwd (the varlen pool with checkpoints every
    64 tokens) and of chunk_kda: a named TypeError / ValueError, or every check passed; never
    another exception."""
    for fn, kw in ((fwd, make_call(PROBLEMS["k64-ckpt-every-pool-varlen"])),
                   (chunk_kda, _chunk_kda_call())):
        for arg, odd, bad in odd_swaps(fn, kw):
            outcome(fn, bad, NAMES, (), (fn.__name__, arg, odd))


def test_every_validate_argument_given_odd_values():
    """validate (fwd's checks alone, cuda=False here) under mutations.ODD and every tensor
    mutation: a named TypeError / ValueError or a pass, never another exception."""
    x = make_call(PROBLEMS["k64-ckpt-every-pool-varlen"])
    sig = inspect.signature(validate_on_cuda)
    kw = {**{n: x[n] for n in sig.parameters if n in x}, "gate": "bounded", "cuda": False}
    names = set(sig.parameters)
    assert outcome(validate_on_cuda, kw, names) is None
    for arg, what, bad in [*odd_swaps(validate_on_cuda, kw), *tensor_swaps(kw)]:
        outcome(validate_on_cuda, bad, names, (), (arg, what))


def test_switches_take_bools_and_refuse_the_rest():
    """checks.flag, every switch's check: bools, ints and numpy scalars 0 / 1, None (off); a
    tensor (whose truth value on a GPU is a host sync), a list, a string, a 2 are refused."""
    np = pytest.importorskip("numpy")

    from kda_cute.checks import flag
    for v, want in ((True, True), (False, False), (1, True), (0, False), (None, False),
                    (np.True_, True), (np.False_, False), (np.int64(1), True),
                    (np.int32(0), False)):
        assert flag("x", v) is want
    for v in (2, -1, 1.0, np.int64(2), np.float64(1.0), torch.tensor(True), "True", [1], object()):
        with pytest.raises(TypeError, match="^x: expected a bool"):
            flag("x", v)
