"""The C++ example (examples/cpp/kda_forward.cpp) on the H200: built with nvcc against an export
(the cubins, kda_cute_kernels.h, kda_cute_plan.h), run on random inputs written as raw files,
its out and final state bit-identical to the Python launcher's forward of the same plan on the
same inputs (and to kda_cute.fwd's where fwd's default schedule is the same arithmetic), and
within the accuracy bar of the float64 reference. Skips without a Hopper GPU, the cubins or
nvcc."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kda_cute import cli, plan_export
from kda_cute.plan_export import LaunchOp
from kda_cute.problem import ENV_ALONGSIDE
from kda_cute.reference import rel_err
from kda_cute.testing import make_inputs, reference, run_kda

NVCC = shutil.which("nvcc") or next(
    (p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).exists()), None)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(NVCC is None, reason="no nvcc")]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "cpp" / "kda_forward.cpp"
# the forward's bar against float64 (tests/test_forward.py's)
OUT_TOL, STATE_TOL = 3.5e-3, 2.5e-3

# export_plan's arguments; T not a multiple of 64 nor of the chunk
CASES = {
    # fwd's default schedule here is alongside: the same arithmetic as wy="off"
    "k128-t1000": dict(B=1, T=1000, H=4, K=128),
    "k128-t1000-wy": dict(B=1, T=1000, H=4, K=128, wy="auto"),
    "k64-b2-precise": dict(B=2, T=333, H=2, K=64, precision="precise"),
    "k256-unbounded": dict(B=1, T=130, H=2, K=256, gate="unbounded"),
}


@pytest.fixture(scope="module")
def kernels_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export")
    cli.export(str(out), "sm_90a", "prefill", False)
    return out


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def _read(path: Path, shape, dtype) -> torch.Tensor:
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=dtype).view(shape).cuda()


def _python(inp: dict, kw: dict, plan):
    """The Python launcher's forward with export_plan's options (NaN-poisoned outputs), after
    checking that it launches the plan's kernels."""
    from kda_cute import Call, checks, plans, run

    q, v = inp["q"], inp["v"]
    B, T, H, V = v.shape
    out = torch.full(v.shape, float("nan"), dtype=torch.bfloat16, device=q.device)
    final = torch.full((B, H, V, q.shape[3]), float("nan"), device=q.device)
    call = Call(q, inp["k"], v, inp["g"], inp["beta"], out, inp["A_log"], inp["dt_bias"],
                inp["initial_state"], final, None, inp["scale"], inp["lower_bound"])
    opts = checks.options(inp["gate"], inp["qk_l2norm"], inp["beta_sigmoid"], segments=1,
                          precision=kw.get("precision", "fast"), alongside=False,
                          wy=kw.get("wy", "off"))
    pl = plans.plan(checks.forward(call, opts), opts, plans.device_info(q.device))
    assert [s.kernel.name for s in pl.launches()] == [
        op.kernel for op in plan.ops if isinstance(op, LaunchOp)], pl.describe()
    run(pl, call)
    torch.cuda.synchronize()
    return out, final


def _fwd_same_arithmetic(inp: dict, kw: dict, plan) -> bool:
    """Whether kda_cute.fwd's default schedule (segments=1) computes as the plan does: the
    alongside schedule against the plan's serial K2 without the WY form, or the same kernels."""
    from kda_cute import Problem, checks, plans

    q, v = inp["q"], inp["v"]
    B, T, H, K = q.shape
    p = Problem(B=B, T=T, H=H, K=K, V=v.shape[3], N=B, varlen=False,
                state_in=torch.float32, state_out=torch.float32)
    opts = checks.options(inp["gate"], inp["qk_l2norm"], inp["beta_sigmoid"], segments=1,
                          precision=kw.get("precision", "fast"))
    pl = plans.plan(p, opts, plans.device_info(q.device))
    ours = [op.kernel for op in plan.ops if isinstance(op, LaunchOp)]
    return ((str(pl.schedule) == "alongside" and kw.get("wy", "off") == "off")
            or [s.kernel.name for s in pl.launches()] == ours)


@pytest.mark.parametrize("name", list(CASES))
def test_cpp_forward_is_the_python_launchers(name, tmp_path, kernels_dir):
    kw = CASES[name]
    inp = make_inputs(B=kw["B"], T=kw["T"], H=kw["H"], K=kw["K"],
                      gate=kw.get("gate", "bounded"), seed=len(name) + kw["T"])
    plan = plan_export.export_plan(tmp_path, scale=inp["scale"],
                                   lower_bound=inp["lower_bound"], **kw)
    shutil.copy(kernels_dir / cli.HEADER, tmp_path / cli.HEADER)
    exe = tmp_path / "kda_forward"
    build = subprocess.run([NVCC, "-std=c++17", "-O2", "-I", str(tmp_path), str(EXAMPLE),
                            "-lcuda", "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    ins, outs = tmp_path / "in", tmp_path / "out"
    ins.mkdir()
    outs.mkdir()
    for b in plan.buffers:
        if b.kind == "input":
            t = inp[b.name]
            assert tuple(t.shape) == b.shape and str(t.dtype) == "torch." + b.dtype, b
            (ins / f"{b.name}.bin").write_bytes(_raw(t))
    res = subprocess.run([str(exe), str(kernels_dir), str(ins), str(outs)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    ob, fb = plan.buffer("out"), plan.buffer("final_state")
    out = _read(outs / "out.bin", ob.shape, torch.bfloat16)
    final = _read(outs / "final_state.bin", fb.shape, torch.float32)
    assert torch.isfinite(out.float()).all() and torch.isfinite(final).all()

    # bit for bit: the Python launcher on the same plan, and fwd where it computes the same way
    out_p, final_p = _python(inp, kw, plan)
    assert torch.equal(out, out_p) and torch.equal(final, final_p)
    same = _fwd_same_arithmetic(inp, kw, plan)
    if name == "k128-t1000" and ENV_ALONGSIDE:
        assert same  # the case the example is checked by (fwd's schedule: alongside)
    if same:
        out_f, final_f = run_kda(inp, precision=kw.get("precision", "fast"), segments=1)
        assert torch.equal(out, out_f) and torch.equal(final, final_f)

    ref_o, ref_s = reference(inp)
    assert rel_err(out, ref_o) < OUT_TOL
    assert rel_err(final, ref_s) < STATE_TOL

    # a short input file: a message naming it and a non-zero status, nothing launched
    (ins / "q.bin").write_bytes(_raw(inp["q"])[:-2])
    bad = subprocess.run([str(exe), str(kernels_dir), str(ins), str(outs)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "q.bin" in bad.stderr, bad.stderr
