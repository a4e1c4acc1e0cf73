"""The benchmark's arithmetic on the CPU: the FlashKDA estimate, the geometric means, the
tables (the timing itself needs the GPU)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _load(name):
    """bench/<name>.py as a module (name may have a folder: "probes/host_probe")."""
    spec = importlib.util.spec_from_file_location(f"_bench_{name.replace('/', '_')}",
                                                  ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load("bench")
accuracy = _load("accuracy")


def _row(case="B1 T8192 H64", K=128, kda=0.5, fla=None, **kw):
    r = {"case": case, "K": K, "roofline_ms": 0.16, "kda_ms": kda, "kda_k1_ms": 0.2,
         "kda_k1_gpu_ms": 0.18, "kda_k2_gpu_ms": kda - 0.18, "kda_other_gpu_ms": 0.0,
         "kda_graph_ms": kda, "kda_pct_roofline": 100 * 0.16 / kda, "kda_out_err": 1.7e-3,
         "kda_state_err": 5e-6, **kw}
    if fla is not None:
        r.update(fla_ms=fla, speedup_vs_fla=fla / kda, fla_out_err=4e-3, fla_state_err=3e-3)
    return r


def test_flashkda_estimate_scales_by_this_runs_fla():
    flashkda, fla_then = bench.FLASHKDA_REF["B1 T8192 H64"]
    # fla twice as slow here as in the run: FlashKDA's figure doubles with it
    assert bench.flashkda_estimate(_row(fla=2 * fla_then)) == pytest.approx(2 * flashkda)
    assert bench.flashkda_estimate(_row()) is None  # no fla in this run
    assert bench.flashkda_estimate(_row(K=64, fla=1.0)) is None  # no FlashKDA figure at K = 64
    assert bench.flashkda_estimate(_row(case="not a table case", fla=1.0)) is None


def test_write_results_summary(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "versions", lambda: {"commit": "test"})
    ref = bench.FLASHKDA_REF
    rows = [_row("B1 T8192 H64", kda=0.5, fla=1.0), _row("B1 T8192 H16", kda=0.25, fla=2.0),
            _row("B1 T8192 H32", K=64, kda=1.0)]
    out = tmp_path / "r.json"
    bench.write_results(rows, 4.2e12, out, final=False)
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert s["cases"] == 3 and s["complete"] is False
    assert s["geomean_speedup_vs_fla"] == pytest.approx(4.0)  # speedups 2 and 8
    est = [ref[c][0] * f / ref[c][1] / k for c, f, k in
           (("B1 T8192 H64", 1.0, 0.5), ("B1 T8192 H16", 2.0, 0.25))]
    assert s["geomean_speedup_vs_flashkda_est"] == pytest.approx(math.sqrt(est[0] * est[1]))
    table = [ref["B1 T8192 H64"][0] / 0.5, ref["B1 T8192 H16"][0] / 0.25]
    assert s["geomean_speedup_vs_flashkda_table"] == pytest.approx(math.sqrt(table[0] * table[1]))
    assert doc["rows"][0]["flashkda_est_ms"] == pytest.approx(est[0] * 0.5)
    md = out.with_suffix(".md").read_text().splitlines()
    assert len(md) == 2 + len(rows)
    # the K = 64 row has no fla or FlashKDA figures: dashes, not zeros or NaN
    assert md[-1].count(" - |") == 6 and "nan" not in md[-1]
    # the first row: the FlashKDA estimate's ratio, then the figure's, unscaled
    cells = [c.strip() for c in md[2].split("|")]
    assert cells[11] == f"{est[0]:.2f}x" and cells[12] == f"{table[0]:.2f}x"


def _run_doc(path, rows, commit="abc", device="NVIDIA H200", ceiling=4.2):
    summary = {"copy_TBps": ceiling, "complete": True}
    path.write_text(json.dumps({"versions": {"commit": commit, "device": device},
                                "summary": summary, "rows": rows}))
    return path


def test_merge_results(tmp_path):
    """A table measured in several calls: one document with every row in case order, the
    runs' own versions (not this machine's) and each run's copy ceiling."""
    a = _run_doc(tmp_path / "a.json", [_row("B32 T256 H32", K=256, kda=1.0, fla=2.0)])
    b = _run_doc(tmp_path / "b.json", [_row("B1 T8192 H96", K=256, kda=2.0, fla=3.0),
                                       _row("B1 T8192 H16", K=256, kda=1.0, fla=1.5)],
                 ceiling=4.0)
    out = tmp_path / "m.json"
    bench.main(["--merge", str(a), str(b), "--out", str(out)])
    doc = json.loads(out.read_text())
    assert [r["case"] for r in doc["rows"]] == ["B1 T8192 H96", "B1 T8192 H16", "B32 T256 H32"]
    assert doc["versions"] == {"commit": "abc", "device": "NVIDIA H200"}
    s = doc["summary"]
    assert s["cases"] == 3 and s["complete"] is True
    assert s["merged_from"] == ["a.json", "b.json"] and s["copy_TBps_runs"] == [4.2, 4.0]
    assert s["geomean_speedup_vs_fla"] == pytest.approx((2.0 * 1.5 * 1.5) ** (1 / 3))
    assert len(out.with_suffix(".md").read_text().splitlines()) == 2 + 3


@pytest.mark.parametrize("clash", ["commit", "case"])
def test_merge_refuses_mixed_runs(tmp_path, clash):
    a = _run_doc(tmp_path / "a.json", [_row("B1 T8192 H16")])
    b = _run_doc(tmp_path / "b.json", [_row("B1 T8192 H16" if clash == "case" else "B8 T1024 H32")],
                 commit="def" if clash == "commit" else "abc")
    with pytest.raises(SystemExit, match=clash):
        bench.main(["--merge", str(a), str(b), "--out", str(tmp_path / "m.json")])


def test_accuracy_markdown():
    doc = {"device": "GPU", "commit": "abc", "torch": "2", "bar": {"out": 3.5e-3, "state": 2.5e-3},
           "rows": [{"case": "T512", "config": ["k1", "k2"], "out_err": 1.7e-3,
                     "state_err": 5e-6, "out_finite": True, "state_finite": False}]}
    lines = accuracy.markdown(doc).splitlines()
    assert "commit abc" in lines[0] and "output <= 0.0035" in lines[0]
    assert lines[-1] == "| T512 | k1, k2 | 1.70e-03 | 5.00e-06 | False | - | - |"
    doc["rows"][0].update(fla_out_err=4.1e-3, fla_state_err=2.8e-3)
    assert accuracy.markdown(doc).splitlines()[-1].endswith("| - | 4.10e-03 / 2.80e-03 |")
    doc["rows"][0].update(precise_out_err=1.6e-3, precise_state_err=4e-6)
    assert accuracy.markdown(doc).splitlines()[-1].endswith(
        "| 1.60e-03 / 4.00e-06 | 4.10e-03 / 2.80e-03 |")


@pytest.mark.parametrize("gate, expected", [
    ("bounded", dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0)),
    ("unbounded", dict(use_gate_in_kernel=True)),
    ("none", dict(use_gate_in_kernel=False)),
])
def test_fla_call_matches_the_gate_form(monkeypatch, gate, expected):
    """fla's chunk_kda gets the inputs' gate form and activations, and the state layout
    [N, H, V, K] (a stand-in module records the call; fla itself needs a GPU)."""
    import sys
    import types

    from kda_cute.testing import make_inputs

    calls = []
    fake = types.ModuleType("fla.ops.kda")
    fake.chunk_kda = lambda *a, **kw: calls.append((a, kw)) or (None, None)
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.kda", fake)
    x = make_inputs(B=1, T=8, H=2, K=32, gate=gate, device="cpu")
    bench.fla_chunk_kda(x)
    (args, kw), = calls
    assert args[3].dtype == (torch.float32 if gate == "none" else torch.bfloat16)
    assert {k: kw[k] for k in expected} == expected
    assert set(kw) & {"safe_gate", "lower_bound"} == set(expected) & {"safe_gate", "lower_bound"}
    assert kw["use_qk_l2norm_in_kernel"] is True and kw["use_beta_sigmoid_in_kernel"] is True
    assert kw["state_v_first"] is True and kw["output_final_state"] is True
    assert kw["initial_state"] is x["initial_state"] and kw["A_log"] is x["A_log"]


def test_kernel_split_sorts_kernels():
    """K1 is the prep kernel, K2 every recurrence launch and the segments' combine, the rest
    the small torch kernels."""
    times = {"kernel_cutlass_kernel_kernelskda_prep_sm90KdaPrepSm90Split_object_at_": 0.3,
             "kernel_cutlass_kernel_kernelskda_recur_tc_sm90KdaRecurTcSm90_object_at_": 0.4,
             "kernel_cutlass_kernel_kernelskda_combine_sm90KdaCombineSm90_object_at_": 0.02,
             "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor": 0.001}
    k1, k2, other = bench.kernel_split(times)
    assert (k1, k2, other) == pytest.approx((0.3, 0.42, 0.001))


def test_markdown_shows_each_kernels_gpu_time():
    """The K1 / K2 column: each kernel's own GPU time when recorded; results from before it
    was show the eager K1 time, marked."""
    new = _row(kda_k1_gpu_ms=0.334, kda_k2_gpu_ms=0.397)
    old = {k: v for k, v in _row("B1 T8192 H16").items() if "gpu" not in k}
    lines = bench.markdown([new, old]).splitlines()
    assert "K1 / K2 ms" in lines[0]
    assert "| 0.334 / 0.397 |" in lines[2]
    assert "| 0.200 (eager) / - |" in lines[3]


def test_markdown_names_the_schedule_where_kernels_overlap():
    """Alongside (and segmented) rows say so beside the K1 / K2 times, which overlap there;
    serial rows and rows from before the schedule was recorded show the times alone."""
    rows = [_row(kda_k1_gpu_ms=0.511, kda_k2_gpu_ms=0.512, schedule="alongside"),
            _row(kda_k1_gpu_ms=0.090, kda_k2_gpu_ms=0.258, schedule="segments 8"),
            _row(kda_k1_gpu_ms=0.334, kda_k2_gpu_ms=0.397, schedule="serial"),
            _row(kda_k1_gpu_ms=0.334, kda_k2_gpu_ms=0.397)]
    lines = bench.markdown(rows).splitlines()
    assert "| 0.511 / 0.512 (alongside) |" in lines[2]
    assert "| 0.090 / 0.258 (segments 8) |" in lines[3]
    assert "| 0.334 / 0.397 |" in lines[4] and "| 0.334 / 0.397 |" in lines[5]


def test_input_sets_rotate_poisoned_sets_with_workspaces(monkeypatch):
    """input_sets (CPU inputs): enough sets for 3x the L2, the seeds it documents, NaN outputs,
    and a workspace large enough for every config asked for."""
    from kda_cute import api
    from kda_cute.ladder import EXPERIMENTAL
    from kda_cute.testing import make_inputs

    seeds = []

    def cpu_inputs(spec, K, seed):
        seeds.append(seed)
        B, T, H = spec
        return make_inputs(B=B, T=T, H=H, K=K, seed=seed, device="cpu")

    monkeypatch.setattr(bench, "case_inputs", cpu_inputs)
    monkeypatch.setattr(bench, "L2_BYTES", 3 * 2**20)
    spec, K = (1, 256, 4), 64
    wide = next(c for c in EXPERIMENTAL if c.prep.head_dim_k == K)
    sets = bench.input_sets(spec, K, 7, later_seed=0, configs=[None, wide])
    per_set = bench.compulsory_bytes(sets[0])
    assert len(sets) == max(2, math.ceil(9 * 2**20 / per_set))
    assert seeds == [7, *range(1, len(sets))]
    p = bench.problem_of(sets[0])
    need = max(api.workspace_bytes(p, api.config_for(p, c)) for c in (None, wide))
    for x in sets:
        assert torch.isnan(x["out"].float()).all() and torch.isnan(x["final_state"]).all()
        assert x["workspace"].dtype == torch.uint8 and x["workspace"].numel() == need
    seeds.clear()
    plain = bench.input_sets(spec, K, 3, workspace=False)
    assert seeds == [3 + i for i in range(len(plain))]
    assert all(x["workspace"] is None for x in plain)


def test_host_probe_times_the_calls_per_round(monkeypatch):
    """host_probe.host_ms: wall ms per call, the fastest and slowest of its rounds, cycling
    through the input sets and synchronising between rounds."""
    import time

    host_probe = _load("probes/host_probe")
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(1))
    seen = []

    def run(x):
        seen.append(x)
        time.sleep(0.002)

    lo, hi = host_probe.host_ms(run, ["a", "b", "c"], calls=4, rounds=3)
    assert 2.0 <= lo <= hi < 50.0
    assert seen[:4] == ["a", "b", "c", "a"] and len(seen) == 12
    assert len(syncs) == 3


# ------------------------------------------------ the probes' plans (bench/probes), on a CPU
def _cpu_inputs(**kw):
    """make_inputs on the CPU with bench.py's out, final state and workspace: (inputs, problem)."""
    from kda_cute import api
    from kda_cute.testing import make_inputs

    x = make_inputs(device="cpu", **kw)
    x["out"] = torch.empty_like(x["v"])
    x["final_state"] = torch.empty_like(x["initial_state"])
    p = bench.problem_of(x)
    x["workspace"] = torch.empty(api.workspace_bytes(p, api.config_for(p)), dtype=torch.uint8)
    return x, p


def _driver_ops(monkeypatch, fn, *args):
    """What fn(*args) hands the CUDA driver (faked, torch.cuda as an H200's): each launch as
    (kernel, shared memory, programmatic), each memset as ("memset", value)."""
    from kda_cute.launch import driver
    from tests import launch_record

    drv = launch_record.driver()
    drv.ops = []
    with launch_record.fake_device(monkeypatch), driver.substitute(drv):
        fn(*args)
    return [(o["kernel"], o["smem"], o["programmatic"]) if o["op"] == "launch"
            else ("memset", o["value"]) for o in drv.ops if o["op"] in ("launch", "memset_d32")]


@pytest.fixture
def probes(monkeypatch):
    """bench/probes/<name>.py loaded as a probe runs (its siblings and bench.py importable), the
    modules it imported forgotten afterwards."""
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield lambda name: _load(f"probes/{name}")
    for name in set(sys.modules) - before:
        if (getattr(sys.modules[name], "__file__", None) or "").startswith(str(ROOT / "bench")):
            del sys.modules[name]


@pytest.mark.parametrize("mode,expect", [
    ("serial", [("K1", "prep"), ("K2", "recur"), ("K2 rescale", "rescale")]),
    ("alongside", [("zero flags", 0), ("K2", "recur"), ("K1", "prep"),
                   ("K2 rescale", "rescale")]),
    ("preset", [("zero flags", 1), ("K2", "recur"), ("K1", "prep"), ("K2 rescale", "rescale")]),
    ("k2-only", [("zero flags", 1), ("K2", "recur")])])
def test_alongside_probe_schedules(probes, monkeypatch, mode, expect):
    """bench/probes/alongside_probe.py's four schedules are the plans its docstring says (the
    steps, their kinds and kernels, the flags memset's value), the driver is handed just that,
    and the launcher's own plan is left as it was."""
    from kda_cute import Options, plan, plans
    from kda_cute.ladder import alongside_of, rescale_of
    from kda_cute.plans.steps import Launch, Memset

    probe = probes("alongside_probe")
    # 2 K2 CTAs on an H200's 132 SMs, 32 chunks: the launcher runs K2 alongside K1
    x, p = _cpu_inputs(B=1, T=32 * 16, H=2, K=64)
    own = plan(p, Options(alongside=True), plans.H200)
    assert str(own.schedule) == "alongside"
    pl = probe.schedules(p, plans.H200)[mode]
    cfg = own.config if mode == "serial" else alongside_of(own.config)
    kernels = {"prep": cfg.prep, "recur": cfg.recur, "rescale": rescale_of(cfg.recur)}
    want = [(name, Memset, e) if isinstance(e, int) else (name, Launch, kernels[e])
            for name, e in expect]
    assert [(s.name, type(s), s.value if isinstance(s, Memset) else s.kernel)
            for s in pl.steps] == want
    if mode == "serial":
        assert pl == plan(p, Options(alongside=False), plans.H200)
        # K1 and K2 ordinary launches; the rescale run K2's programmatic dependent
        assert [s.name for s in pl.launches() if s.programmatic] == ["K2 rescale"]
    else:
        # the launcher's steps but for the memset's value: the flags of every (chunk, head)
        # pair, K2 on a whole SM's shared memory, K1 its programmatic dependent
        flags = own.step("zero flags")
        nch = plans.workspace.rows(p, own.config.chunk)[0]
        assert (pl.step("zero flags").target, pl.step("zero flags").count) == (
            flags.target, nch * p.H)
        assert all(s == own.step(s.name) for s in pl.launches())
        assert pl.step("K2").smem == plans.H200.smem_per_block
    ops = _driver_ops(monkeypatch, probe.bench.plan_runner(pl), x)
    assert [o[1] if o[0] == "memset" else o[0] for o in ops] == [
        e if isinstance(e, int) else kernels[e].name for _, e in expect]
    assert [o[2] for o in ops if o[0] != "memset"] == [
        e == ("rescale" if mode == "serial" else "prep") for _, e in expect
        if not isinstance(e, int)]
    assert own == plan(p, Options(alongside=True), plans.H200)
    assert own.step("zero flags").value == 0


def test_alongside_probe_holds_k1(probes):
    """--k1-ctas N: K1 beside K2 reserves the shared memory that holds it to N CTAs per SM of
    an H200 (a third of 233472 bytes in whole 128-byte units, less the 1 KB a CTA's system
    share takes); the other steps, and the serial and k2-only plans, as without it."""
    from kda_cute import plans

    probe = probes("alongside_probe")
    _, p = _cpu_inputs(B=1, T=32 * 16, H=2, K=64)
    plain = probe.schedules(p, plans.H200)
    held = probe.schedules(p, plans.H200, ctas=3)
    # the launcher holds K1 to one CTA per SM here (2 pairs on 130 SMs)
    assert plain["alongside"].step("K1").smem == 233472 - 1024
    for mode in ("alongside", "preset"):
        k1 = held[mode].step("K1")
        assert k1.smem == 233472 // 3 // 128 * 128 - 1024 and k1.programmatic
        assert ([s for s in held[mode].steps if s.name != "K1"]
                == [s for s in plain[mode].steps if s.name != "K1"])
    assert held["serial"] == plain["serial"] and held["k2-only"] == plain["k2-only"]


def test_alongside_probe_shared_forces_alongside(probes, monkeypatch):
    """--shared: the alongside schedule where the launcher runs K1 then K2 (67 K2 CTAs, more
    than half of 132 SMs), K2 at its own shared memory and the device's own grid, K1 held to
    the launcher's CTAs per SM (or --k1-ctas') in what one K2 CTA leaves of an SM; a shape the
    launcher splits into segments keeps its plan (nothing to probe)."""
    from kda_cute import Options, Problem, plan, plans
    from kda_cute.ladder import alongside_of
    from kda_cute.plans.device import resources
    from kda_cute.plans.schedule import k1_alongside_ctas
    from kda_cute.plans.steps import Memset, Scalar

    probe = probes("alongside_probe")
    x, p = _cpu_inputs(B=1, T=32 * 16, H=67, K=64)
    own = plan(p, Options(alongside=True), plans.H200)
    assert str(own.schedule) == "serial"
    acfg = alongside_of(own.config)
    k1_own, k2_own = (resources(c, "sm_90a").smem for c in (acfg.prep, acfg.recur))
    left = 233472 - -(-(k2_own + 1024) // 128) * 128  # an SM less one K2 CTA's allocation
    for ctas in (None, 2):
        modes = probe.schedules(p, plans.H200, ctas=ctas, shared=True)
        pl = modes["alongside"]
        assert str(pl.schedule) == "alongside" and pl.device == plans.H200
        assert [(s.name, type(s).__name__) for s in pl.steps] == [
            ("zero flags", "Memset"), ("K2", "Launch"), ("K1", "Launch"),
            ("K2 rescale", "Launch")]
        k2, k1 = pl.step("K2"), pl.step("K1")
        assert (k2.kernel, k1.kernel) == (acfg.recur, acfg.prep)
        assert k2.grid == own.step("K2").grid == (1, 67, 1) and k2.smem == k2_own
        assert k2.source("ordered") == own.step("K2").source("ordered")
        n = ctas or k1_alongside_ctas(p, 67, plans.H200, resources(acfg.prep, "sm_90a"))
        assert k1.programmatic and k1.smem == max(k1_own, left // n // 128 * 128 - 1024)
        flags = pl.step("zero flags")
        assert flags.value == 0 and modes["k2-only"].steps == (
            Memset("zero flags", flags.target, 1, flags.count), k2)
    ops = _driver_ops(monkeypatch, probe.bench.plan_runner(pl), x)  # --k1-ctas 2's
    rs = pl.step("K2 rescale").kernel
    assert ops == [("memset", 0), (acfg.recur.name, k2_own, False),
                   (acfg.prep.name, k1.smem, True), (rs.name, resources(rs, "sm_90a").smem, False)]
    # a varlen batch whose K2 grid takes more than one wave of an H200: K2 takes its sequences
    # longest first, as the launcher's plan has it (one planned for more SMs would not)
    pv = Problem(1, 16 * 512, 64, 64, 64, 16, True, state_in=torch.float32,
                 state_out=torch.float32, cu_int64=True)
    own_v = plan(pv, Options(alongside=True), plans.H200)
    assert str(own_v.schedule) == "serial" and own_v.step("K2").source("ordered") == Scalar(1)
    forced = probe.schedules(pv, plans.H200, shared=True)["alongside"]
    assert str(forced.schedule) == "alongside" and forced.step("K2").source("ordered") == Scalar(1)
    _, p16 = _cpu_inputs(B=1, T=8192, H=16, K=128)
    segmented = plan(p16, Options(alongside=True), plans.H200)
    assert str(segmented.schedule) == "segments 8"
    assert probe.schedules(p16, plans.H200, shared=True) == {
        "serial": plan(p16, Options(alongside=False), plans.H200), "alongside": segmented}


@pytest.mark.parametrize("varlen", [False, True])
def test_k1_runner_runs_k1_alone(monkeypatch, varlen):
    """bench.k1_runner (K1's own time): K1 alone as a serial forward launches it (its own
    build, shared memory and grid, not programmatic), even where the forward runs K2 alongside
    K1; a varlen batch's offsets before it."""
    from kda_cute import Options, plan, plans
    from kda_cute.ladder import OFFSETS
    from kda_cute.plans.device import resources
    from tests import launch_record

    # 32 chunks per sequence, 2 heads: the forward runs K2 alongside K1
    x, p = _cpu_inputs(H=2, K=64, **(dict(seqlens=[700, 324]) if varlen else dict(T=32 * 16)))
    assert str(plan(p, Options(alongside=True), plans.H200).schedule) == "alongside"
    serial = plan(p, Options(alongside=False, segments=1), plans.H200)
    cfg = serial.config
    ops = _driver_ops(monkeypatch, bench.k1_runner(), x)
    k1 = (cfg.prep.name, resources(cfg.prep, "sm_90a").smem, False)
    assert ops == ([(OFFSETS.name, resources(OFFSETS, "sm_90a").smem, False), k1] if varlen
                   else [k1])
    with launch_record.fake_device(monkeypatch):
        pl = bench.k1_plan(p, x["q"].device)
    assert [s.name for s in pl.steps] == (["offsets", "K1"] if varlen else ["K1"])
    assert pl.launches()[-1] == serial.step("K1")
    assert pl.step("K1").grid == (2, plans.workspace.rows(p, cfg.chunk)[0], 1)


def test_alongside_probe_prefers_the_largest_carveout(probes):
    """--shared: every kernel of a plan gets the preferred shared-memory carveout (100%) on its
    CUfunction, the one the launcher then launches (with the driver faked)."""
    from kda_cute import plans
    from kda_cute.launch import driver
    from tests import launch_record

    class Attributes(launch_record.FakeDriver):
        def __init__(self):
            super().__init__()
            self.attrs = []

        def cuFuncSetAttribute(self, f, attr, value):  # noqa: N802 (the driver's name)
            self.attrs.append((self._libs[f][0], attr, value))
            return (0,)

    probe = probes("alongside_probe")
    _, p = _cpu_inputs(B=1, T=32 * 16, H=67, K=64)
    pl = probe.schedules(p, plans.H200, shared=True)["alongside"]
    drv = Attributes()
    with driver.substitute(drv):
        probe.prefer_shared(pl, 0)
    carveout = [(k, v) for k, a, v in drv.attrs
                if a == "CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT"]
    assert carveout == [(s.kernel.name, 100) for s in pl.launches()]
    assert [(k, v) for k, a, v in drv.attrs
            if a == "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES"] == [
        (s.kernel.name, s.smem) for s in pl.launches()]


@pytest.mark.parametrize("name", sorted(
    f"{d}/{f.stem}" for d in ("probes", "studies") for f in (ROOT / "bench" / d).glob("*.py")))
def test_probes_and_studies_import_and_take_help(probes, capsys, name):
    """Every probe and study imports on a CPU (its siblings and bench.py found from its own
    folder) and, where it takes arguments, parses --help."""
    import inspect

    mod = probes(name.split("/", 1)[1]) if name.startswith("probes/") else _load(name)
    if not inspect.signature(mod.main).parameters:
        return  # no arguments (precision_range)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out


def test_rescale_probe_scales_exactly(probes):
    """bench/probes/rescale_probe.py's modes scale v and the initial state by 2^16 (exact in
    bf16 and fp32) in one head or everywhere, and leave the ordinary mode's inputs alone."""
    probe = probes("rescale_probe")
    for mode in probe.MODES:
        x, _ = _cpu_inputs(B=1, T=64, H=3, K=64, seed=4)
        v0, s0 = x["v"].float().clone(), x["initial_state"].clone()
        probe.scaled(x, mode)
        heads = [] if mode == "ordinary" else [1] if mode.startswith("one head") else [0, 1, 2]
        for h in range(3):
            f = 2.0 ** 16 if h in heads else 1.0
            assert torch.equal(x["v"][:, :, h].float(), v0[:, :, h] * f), (mode, h)
            assert torch.equal(x["initial_state"][:, h], s0[:, h] * f), (mode, h)
    assert probe.EXPONENTS[0] < -14 < 16 < probe.EXPONENTS[-1]


@pytest.mark.parametrize("mode", ["planned", "1", "none"])
def test_rescale_grid_probe_plans(probes, monkeypatch, mode):
    """bench/probes/rescale_grid_probe.py --rescale-z: the plan's rescale runs as planned, with
    grid z 1 (x and y, arguments and the programmatic flag unchanged), or none; the other steps
    untouched."""
    from kda_cute import Options, plans
    from kda_cute.plans import prefill

    monkeypatch.setattr(prefill, "_rescale_run", prefill._rescale_run)  # restored after
    _, p = _cpu_inputs(B=8, T=64, H=4, K=128)
    plans.clear()
    own = plans.plan(p, Options(alongside=False), plans.H200)
    probe = probes("rescale_grid_probe")
    probe.patch(mode)
    pl = plans.plan(p, Options(alongside=False), plans.H200)
    plans.clear()
    rs = [s for s in own.launches() if s.name.endswith(" rescale")]
    assert rs and rs[0].grid[2] > 1
    rest = [s for s in own.steps if s not in rs]
    if mode == "none":
        assert list(pl.steps) == rest
        return
    assert [s for s in pl.steps if not s.name.endswith(" rescale")] == rest
    got = [s for s in pl.launches() if s.name.endswith(" rescale")]
    assert [dataclasses.replace(s, grid=r.grid) for s, r in zip(got, rs, strict=True)] == rs
    assert all(s.grid == (*r.grid[:2], 1 if mode == "1" else r.grid[2])
               for s, r in zip(got, rs, strict=True))



def test_side_runs_probe_edits_only_the_side_steps(probes, monkeypatch):
    """bench/probes/side_runs_probe.py's variants of a plan with side runs: each changes only
    the steps its name says (the K2 side run's grid z or programmatic flag; the K2 side runs,
    or K1's side run, left out; K1's side run's grid cut), every other step as planned; a plan
    without side runs has no variants."""
    from tests.launch_record import plan_of

    probe = probes("side_runs_probe")
    pl = plan_of(B=1, T=300, H=4, K=128, ckpt=dict(offsets=5, dtype="bf16"))
    vs = probe.variants(pl)
    side = pl.step("K2 side")
    assert side.grid[2] > 1 and not side.programmatic
    assert vs["plan"] is pl
    assert vs["K2 side z 1"].step("K2 side").grid == (*side.grid[:2], 1)
    assert vs["K2 side programmatic"].step("K2 side").programmatic
    for name, gone in (("no K2 side runs", {"K2 side", "K2 side rescale"}),
                       ("no K2 side rescale", {"K2 side rescale"}), ("no K1 side", {"K1 side"})):
        assert list(vs[name].steps) == [s for s in pl.steps if s.name not in gone]
    # K1's side run: planned as the looped twin over one resident wave of CTAs (4 heads: 165
    # rows, cut to the 5 side slots); the plain K1 a CTA a slot (as before the twin), or the
    # twin over two waves, about eight or two CTAs an SM
    k1 = pl.step("K1 side")
    assert k1.kernel.looped and k1.grid == (4, 5, 1)
    before = vs["K1 side a CTA a slot"].step("K1 side")
    assert before.kernel == dataclasses.replace(k1.kernel, looped=False)
    assert before.grid == (4, 5, 1)
    assert (before.args, before.sources, before.smem) == (k1.args, k1.sources, k1.smem)
    big = plan_of(B=1, T=8192, H=64, K=128, ckpt=dict(offsets=128, dtype="bf16"))
    bv = probe.variants(big)
    # K128's f16 K1 holds 5 CTAs an SM (88 registers): 660 over 64 heads
    assert big.step("K1 side").grid == (64, 10, 1)
    assert bv["K1 side a CTA a slot"].step("K1 side").grid == (64, 128, 1)
    for y in (20, 17, 5):
        assert bv[f"K1 side looped, grid y {y}"].step("K1 side").grid == (64, y, 1)
    assert [n for n in vs if n.startswith("K1 side looped")] == []  # 5 slots: all the same
    for name in ("K1 side a CTA a slot", "K1 side looped, grid y 20"):
        assert [s for s in bv[name].steps if s.name != "K1 side"] == [
            s for s in big.steps if s.name != "K1 side"]
    for name in ("K2 side z 1", "K2 side programmatic"):
        assert [s for s in vs[name].steps if s.name != "K2 side"] == [
            s for s in pl.steps if s.name != "K2 side"]
    # an input set's Call with checkpoint arguments: bench.call_of's, those fields set (bench.py
    # importable as the probe's main makes it)
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.delitem(sys.modules, "bench", raising=False)
    x, _ = _cpu_inputs(B=1, T=64, H=2, K=64)
    kw = {"checkpoint_state": torch.empty(1), "checkpoint_every": 64}
    c = probe.call_with(x, kw)
    assert c._replace(checkpoint_state=None, checkpoint_every=None) == bench.call_of(x)
    assert c.checkpoint_state is kw["checkpoint_state"] and c.checkpoint_every == 64
    aligned = plan_of(B=1, T=300, H=4, K=128,
                    ckpt=dict(every=64, per_row=5, slots=5, dtype="bf16"))
    assert list(probe.variants(aligned)) == ["plan"]


def test_checkpoints_probe_modes(probes):
    """bench/probes/checkpoints_probe.py's every-n modes: the first offset on chunk boundaries
    (every), mid-chunk (every - 24) or absent ("no first"), and the bytes each writes."""
    probe = probes("checkpoints_probe")
    x, _ = _cpu_inputs(B=2, T=200, H=2, K=64)
    for mode, first in (("every 64 bf16", 64), ("every 64 fp32 mid-chunk", 40),
                        ("every 64 bf16 no first", None)):
        assert mode in probe.MODES
        kw, nbytes = probe.checkpoint_args(x, mode)
        if first is None:
            assert "checkpoint_first" not in kw
        else:
            assert kw["checkpoint_first"].tolist() == [first, first]
        per = (200 - (first or 64)) // 64 + 1  # a row's boundaries: 64, 128, 192 or 40, 104, 168
        elem = 4 if "fp32" in mode else 2
        assert nbytes == 2 * per * 2 * 64 * 64 * elem and kw["checkpoint_every"] == 64


def test_forward_bytes_probe_reads_the_last_forward(probes):
    """bench/probes/forward_bytes_probe.py's parse of ncu's CSV (base units): each kernel's
    three metrics, the last of two forwards' kernels, in launch order; a count that is not
    whole forwards raises."""
    probe = probes("forward_bytes_probe")
    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
    rows = []
    for i, name in enumerate(["kda_prep_a", "kda_recur_tc_b"] * 2):
        for metric, value in zip(probe.METRICS, (1000 + i, 2e6 + i, "3,000,000"), strict=True):
            rows.append(f'"{i}","{name}","{metric}","x","{value}"\n')
    ks = probe.parse("==PROF== noise\n" + head + "".join(rows))
    assert [(k["name"], k["ns"], k["read"], k["write"]) for k in ks] == [
        ("kda_prep_a", 1002.0, 2e6 + 2, 3e6), ("kda_recur_tc_b", 1003.0, 2e6 + 3, 3e6)]
    with pytest.raises(RuntimeError, match="3 kernels"):
        probe.parse(head + "".join(rows[:9]))
    with pytest.raises(RuntimeError, match="no CSV"):
        probe.parse("nothing")


def test_checkpoints_probe_pairs_each_mode_with_the_base_around_it(probes):
    """--rounds: a round times base, m1, base, m2, base; m2's ratio in round j is against the
    base timings right before and after it, and the figure is the median over rounds."""
    probe = probes("checkpoints_probe")
    # two rounds, modes (base, m1, m2): base timings 1, 2, 3 | 10, 20, 30
    base = [1.0, 2.0, 3.0, 10.0, 20.0, 30.0]
    assert probe.paired(base, [1.5, 15.0], 0, 3) == 1.0
    assert probe.paired(base, [5.0, 50.0], 1, 3) == 2.0
    assert probe.paired(base, [2.5, 100.0], 1, 3) == pytest.approx((1.0 + 4.0) / 2)


def test_stream_probe_kernels_move_the_slots_they_name(probes, monkeypatch):
    """bench/probes/stream_probe.py's Triton streams, run by Triton's interpreter on the CPU:
    the out-of-place one writes slot odx[n] with slot idx[n] and nothing else; the in-place
    ones (a tile a program, persistent) leave the pool as it was (x / 2 + x / 2)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    probe = probes("stream_probe")
    tile, persist, _, moved = probe.kernels()
    H, V, K, N, bv = 2, 128, 128, 3, 32
    pool = torch.randn(8, H, V, K)
    out = torch.zeros_like(pool)
    idx = torch.tensor([5, 0, 3], dtype=torch.int32)
    odx = torch.tensor([1, 7, 2], dtype=torch.int32)
    tiles = N * H * V // bv
    moved[(tiles,)](pool, out, idx, odx, H, pool.stride(0), BV=bv, KD=K, VD=V)
    assert torch.equal(out[odx.long()], pool[idx.long()])
    assert not out[[0, 3, 4, 5, 6]].any()
    before = pool.clone()
    tile[(tiles,)](pool, idx, H, pool.stride(0), BV=bv, KD=K, VD=V)
    persist[(4,)](pool, idx, H, pool.stride(0), tiles, BV=bv, KD=K, VD=V, NPROG=4, STAGES=1)
    assert torch.equal(pool, before)


_TC_PROBE_CHECK = """
import sys, torch
sys.path[:0] = [{root!r}, {root!r} + "/bench", {root!r} + "/bench/probes"]
import tc_decode_probe as probe
from kda_cute.reference import kda_reference, rel_err
step, _, verify, _ = probe.kernels()
gen = torch.Generator().manual_seed(3)
N, T, H, K, V = 2, 3, 2, 128, 128
rnd = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16)
q, k, g, v, beta = rnd(N, T, H, K), rnd(N, T, H, K), rnd(N, T, H, K), rnd(N, T, H, V), rnd(N, T, H)
a_log, bias = torch.randn(H, generator=gen) * 0.5, torch.randn(H * K, generator=gen) * 0.5
pool0 = (torch.randn(4 * N * T, H, V, K, generator=gen) * 0.3).to(torch.bfloat16)
idx = torch.randperm(4 * N * T, generator=gen)[:N * T].view(N, T).to(torch.int32)
acc = torch.tensor([2, 3], dtype=torch.int32)
kw = dict(A_log=a_log, dt_bias=bias, lower_bound=probe.LOWER, gate="bounded")
scale = K ** -0.5
S = pool0[idx[torch.arange(N), acc.long() - 1].long()].double()
for t in range(T):
    sl = slice(t, t + 1)
    o, S = kda_reference(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], scale=scale,
                         initial_state=S, **kw)
out = torch.full((N, T, H, V), float("nan")).to(torch.bfloat16)
pool = pool0.clone()
verify[(N * H * 2,)](q, k, v, g, beta, a_log, bias, pool, idx, acc, out, H, pool.stride(0),
                     scale, probe.LOWER, T=T, BV=64, KD=K, VD=V, MMA=0)
errs = [rel_err(out[:, -1:].double(), o), rel_err(pool[idx[:, -1].long()].double(), S)]
one = [x[:, :1].contiguous() for x in (q, k, v, g, beta)]
s0 = idx[:, 0].contiguous()
pool = pool0.clone()
out = torch.full((N, 1, H, V), float("nan")).to(torch.bfloat16)
step[(N * H * 2,)](*one, a_log, bias, pool, s0, out, H, pool.stride(0), scale, probe.LOWER,
                   BV=64, KD=K, VD=V, MMA=0)
o, S = kda_reference(*one, scale=scale, initial_state=pool0[s0.long()].double(), **kw)
errs += [rel_err(out.double(), o), rel_err(pool[s0.long()].double(), S)]
print(" ".join(f"{{e:.3e}}" for e in errs))
"""


def test_tc_decode_probe_cuda_core_forms_match_the_reference():
    """bench/probes/tc_decode_probe.py's CUDA-core decode and verify (style (a): the start slot
    from the accepted count, every token's state to its slot), run by Triton's interpreter on the
    CPU against the float64 reference: the last token's output and state of the verify, the
    decode's output and state, each at the bf16 floor. (A process of its own: the interpreter
    must be on before triton.language is first imported.)"""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", _TC_PROBE_CHECK.format(root=str(ROOT))], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    errs = [float(x) for x in r.stdout.split()]
    assert len(errs) == 4 and all(e < 5e-3 for e in errs), errs


def test_ab_cubins_probe(probes, monkeypatch):
    """bench/probes/ab_cubins_probe.py: use_cubins points the kernel loader at another cubin
    root (manifests read again, loaded kernels forgotten, the launcher's generation moved on);
    summary's ratios are the medians of the rounds' adjacent timings."""
    from kda_cute import cubin
    from kda_cute.launch import driver

    probe = probes("ab_cubins_probe")
    monkeypatch.setattr(cubin, "CUBIN_ROOT", cubin.CUBIN_ROOT)
    gen = driver.generation
    probe.use_cubins(ROOT / "nowhere")
    assert cubin.CUBIN_ROOT == ROOT / "nowhere" and driver.generation == gen + 1
    with pytest.raises(cubin.CubinsMissing, match="nowhere"):
        cubin.manifest("kda_offsets_t256", "sm_90a")
    monkeypatch.undo()
    cubin.manifest.cache_clear()
    rounds = [{"none@new": 1.0, "m@new": 1.2, "none@old": 1.0, "m@old": 1.5},
              {"none@new": 2.0, "m@new": 2.2, "none@old": 1.0, "m@old": 1.1},
              {"none@new": 1.0, "m@new": 1.1, "none@old": 2.0, "m@old": 2.2}]
    r = probe.summary(rounds, "m")
    assert r["new_over_old"] == pytest.approx(0.8)  # 0.8, 2.0, 0.5
    assert r["none_new_over_old"] == pytest.approx(1.0)  # 1, 2, 0.5
    assert r["cost_new"] == pytest.approx(0.1) and r["cost_old"] == pytest.approx(0.1)


def test_ab_decode_probe(probes):
    """bench/probes/ab_decode_probe.py: its shapes parsed (decode, or verify with a token count;
    bad ones named), new / old the median of the rounds' ratios, and the two sets timed first
    in turn."""
    probe = probes("ab_decode_probe")
    assert probe.parse_shapes("bfloat16:64:32,float32:8:12,bfloat16:64:32:4") == [
        ("bfloat16", 64, 32, 1), ("float32", 8, 12, 1), ("bfloat16", 64, 32, 4)]
    for bad in ("bf16:64:32", "float32:64", "float32:0:12", "float32:a:12", "float32:8:12:0",
                "float32:8:12:2:1"):
        with pytest.raises(SystemExit, match="--shapes"):
            probe.parse_shapes(bad)
    assert probe.ratio([1.0, 2.2, 3.0], [2.0, 2.0, 2.0]) == pytest.approx(1.1)
    with pytest.raises(ValueError):
        probe.ratio([1.0], [1.0, 2.0])
    assert [probe.order(r) for r in range(3)] == [("new", "old"), ("old", "new"),
                                                  ("new", "old")]
    with pytest.raises(SystemExit, match="--old"):
        probe.main(["--old", str(ROOT / "nowhere"), "--shapes", "float32:1:1"])


def test_ab_cubin_roots(probes, tmp_path):
    """ab_cubins_probe.cubin_roots: the two roots, new defaulting to the shipped cubins, each
    one checked to hold sm_90a/ (the error names the flag)."""
    from kda_cute import cubin

    probe = probes("ab_cubins_probe")
    (tmp_path / "a" / "sm_90a").mkdir(parents=True)
    (tmp_path / "b" / "sm_90a").mkdir(parents=True)
    assert probe.cubin_roots(tmp_path / "a", tmp_path / "b") == {"new": tmp_path / "a",
                                                                 "old": tmp_path / "b"}
    if (cubin.CUBIN_ROOT / "sm_90a").is_dir():
        assert probe.cubin_roots(None, tmp_path / "b")["new"] == cubin.CUBIN_ROOT
    with pytest.raises(SystemExit, match="--new"):
        probe.cubin_roots(tmp_path, tmp_path / "b")


def test_decode_ncu_target_shape(probes):
    """bench/probes/decode_ncu_target.py: its N:H argument parsed, bad ones named."""
    probe = probes("decode_ncu_target")
    assert probe.parse_shape("64:32") == (64, 32)
    for bad in ("64", "64:0", "a:32", "64:32:1"):
        with pytest.raises(SystemExit, match="shape"):
            probe.parse_shape(bad)


def test_serving_step_bytes(probes):
    """bench/serving.py's ceiling bytes: a row's start state read once, its state after every
    token written, and its tokens (q, k, g, v, out and beta, bf16) once each."""
    serving = probes("../serving")  # bench/serving.py, loaded as the probes are
    state = 128 * 128
    tokens = 3 * 128 * 2 + 2 * 128 * 2 + 2
    assert serving.step_bytes(2, 1, 3, 4) == 2 * 2 * 3 * state * 4 + 2 * 1 * 3 * tokens
    assert serving.step_bytes(5, 4, 2, 2) == 5 * 5 * 2 * state * 2 + 5 * 4 * 2 * tokens


def test_serving_sweep_table_and_plot(probes, tmp_path):
    """bench/serving.py --sweep's table and plot: each shape's tiles fastest first, the % of the
    ceiling and the time over the fastest; empty shapes left out."""
    serving = probes("../serving")
    res = {"copy_bandwidth": 4.2e12, "sweep": [
        {"form": "verify", "N": 64, "H": 32, "T": 2, "pool": "bfloat16", "ceiling_ms": 0.05,
         "ms": {"kda_step_k128_v128_bf16_bv64_r16_t128_u2_n": 0.0720,
                "kda_step_k128_v128_bf16_bv64_r16_t128_u2_k2": 0.0600}},
        {"form": "decode", "N": 8, "H": 32, "T": 1, "pool": "bfloat16", "ceiling_ms": 0.004,
         "ms": {}}]}
    md = serving.sweep_markdown(res).splitlines()
    rows = [ln for ln in md if ln.startswith("| verify")]
    assert len(rows) == 2 and not any(ln.startswith("| decode") for ln in md)
    assert rows[0] == ("| verify | bfloat16 | 64 | 32 | 2 | bf16_bv64_r16_t128_u2_k2 | 0.0600 | "
                       "83.3 | 1.000 |")
    assert rows[1].endswith("| 0.0720 | 69.4 | 1.200 |")
    pytest.importorskip("matplotlib")
    serving.sweep_plot(res, tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 0


def test_serving_table_names_the_tile(probes):
    """bench/serving.py's table: each row's plan tile (its name without the head dims), '-' for
    a row without one (results written before the column)."""
    serving = probes("../serving")
    tile = "bf16_bv64_r16_t128_u2_p5"
    assert serving._short("kda_step_k128_v128_" + tile) == tile
    rows = [{"form": "decode", "pool": "bfloat16", "N": 64, "H": 32, "T": 1, "kda_graph_ms": 0.04,
             "kda_ms": 0.05, "kda_pct": 76.0, "tile": "bf16_bv64_r16_t128_u2_p5"},
            {"form": "verify", "pool": "float32", "N": 64, "H": 32, "T": 2, "kda_graph_ms": 0.1,
             "kda_ms": 0.1, "kda_pct": 80.0}]
    md = serving.markdown(rows, {"eager_us": 60.0, "bound_us": 15.8}, 4.2e12).splitlines()
    header = next(ln for ln in md if ln.startswith("| form"))
    assert header.rstrip(" |").endswith("tile")
    body = [ln for ln in md if ln.startswith("| decode") or ln.startswith("| verify")]
    assert body[0].endswith("| bf16_bv64_r16_t128_u2_p5 |") and body[1].endswith("| - |")
    assert all(ln.count("|") == header.count("|") for ln in body)
    assert "full launch path" not in md[0]
    md = serving.markdown(rows, {"eager_us": 20.0, "eager_full_us": 60.0, "bound_us": 15.8},
                          4.2e12).splitlines()
    assert "eager 20.0 us (every call through the full launch path: 60.0 us), bound 15.8" in md[0]


def test_pyplot_absent_skips_plots(monkeypatch, tmp_path):
    """bench.pyplot: None where matplotlib cannot be imported, and the plots then write
    nothing (the tables and JSON still do)."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert bench.pyplot() is None
    bench.plot([{"case": "B1", "K": 128, "kda_ms": 1.0, "kda_pct_roofline": 30.0}],
               tmp_path / "p.png")
    assert not (tmp_path / "p.png").exists()


def test_serving_head_dim_is_the_sweeps(probes):
    """bench/serving.py --head-dim: for the tile sweep only (the table is at K = V = 128),
    refused before anything runs."""
    serving = probes("../serving")
    with pytest.raises(SystemExit, match="--head-dim: the tile sweep"):
        serving.main(["--head-dim", "64", "--no-fla"])
    assert serving.K == serving.V == 128


def test_host_stub_probe_table(probes):
    """bench/probes/host_stub_probe.py's --merge: a row a call of the newer run, old / new / the
    ratio, '-' for a call the older run did not time."""
    probe = probes("host_stub_probe")
    old = {"commit": "aaa", "machine": "x86_64", "torch": "2.x",
           "calls": {"decode, eager": {"us": 15.0}}}
    new = {"commit": "bbb", "machine": "x86_64", "torch": "2.x",
           "calls": {"decode, eager": {"us": 10.0}, "commit, eager": {"us": 6.0}}}
    lines = probe.merge(old, new).splitlines()
    assert "aaa against bbb" in lines[0]
    assert "| decode, eager | 15.00 | 10.00 | 0.67 |" in lines
    assert "| commit, eager | - | 6.00 | - |" in lines


def test_gather_stream_probe_plan(probes):
    """bench/probes/gather_stream_probe.py: its shapes parsed (a bad one named), every variant's
    kernel defined in probe.cu, whole tiles of a head, the bulk variants' stages within an SM's
    shared memory, and its parameter block laid out as probe.cu's struct."""
    import ctypes
    import re

    probe = probes("gather_stream_probe")
    assert probe.parse_shapes("64:32,256:12") == [(64, 32), (256, 12)]
    for bad in ("64", "64:0", "a:32", "64:32:1"):
        with pytest.raises(SystemExit, match="shapes"):
            probe.parse_shapes(bad)
    src = (ROOT / "bench/probes/gather_stream/probe.cu").read_text()
    defined = {f"vec_{a}_{b}" for a, b in re.findall(r"^VEC\((\d+), (\d+)\)", src, re.M)}
    defined |= {f"flat_{a}" for a in re.findall(r"^FLAT\((\d+)\)", src, re.M)}
    defined |= {f"bulk_{a}" for a in re.findall(r"^BULK\((\d+)\)", src, re.M)}
    for head_bytes in (128 * 128 * 2, 128 * 128 * 4):
        vs = probe.variants(132, head_bytes)
        assert {v[1] for v in vs} <= defined and {"flat_8", "bulk_4"} <= {v[1] for v in vs}
        for name, kernel, tile, grid, threads, smem in vs:
            assert head_bytes % tile == 0 and tile % 16 == 0, name
            if kernel.startswith("vec"):
                assert tile // 16 % threads == 0, name
            if kernel.startswith("bulk"):
                stages = int(kernel.split("_")[1])
                assert smem == stages * tile and grid // 132 * (smem + 1024) <= 228 * 1024
    assert ctypes.sizeof(probe.Tiles) == 56  # 3 pointers, a long long, 5 ints, padded to 8
    res = {"copy_bandwidth": 4.2e12, "rows": [
        {"pool": "bfloat16", "N": 64, "H": 32, "decode_pct": 76.1,
         "pct": {"copy_": 80.0, "vec 16 KB 128 thr": 84.0, "vec 4 KB 128 thr": 85.5,
                 "flat unroll 4 (8 CTAs/SM)": 83.0, "bulk 32 KB x 4 stages, 1/SM": None}}]}
    md = probe.markdown(res).splitlines()
    assert md[-1] == ("| bfloat16 | 64 | 32 | 76.1% | 85.5% (vec 4 KB 128 thr) | "
                      "83.0% (flat unroll 4 (8 CTAs/SM)) | - | 80.0% |")
