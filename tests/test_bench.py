"""The benchmark's arithmetic on the CPU: the FlashKDA estimate, the geometric means, the
tables (the timing itself needs the GPU)."""

from __future__ import annotations

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


# -------------------------------------------- the probes (bench/probes) and serving.py, on a CPU
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
    """bench/<name>.py ("probes/host_probe", "serving") loaded as it runs (bench.py importable
    through its one sys.path entry), sys.path and the modules it imported restored afterwards."""
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield _load
    for name in set(sys.modules) - before:
        if (getattr(sys.modules[name], "__file__", None) or "").startswith(str(ROOT / "bench")):
            del sys.modules[name]


PROBES = sorted(f.stem for f in (ROOT / "bench" / "probes").glob("*.py"))


@pytest.mark.parametrize("name", PROBES)
def test_probes_import_and_take_help(probes, capsys, name):
    """Every probe imports on a CPU (bench.py found through its one sys.path entry) and parses
    --help."""
    mod = probes(f"probes/{name}")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("name", PROBES)
def test_probes_import_only_the_package_and_bench(name):
    """A probe stands alone: it imports the standard library, torch, kda_cute and at most
    bench.py (never another probe), edits sys.path once, and bench/README.md lists it."""
    import ast
    import sys

    src = (ROOT / "bench" / "probes" / f"{name}.py").read_text()
    tops = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            tops.add(node.module.split(".")[0])
    assert tops - set(sys.stdlib_module_names) <= {"torch", "kda_cute", "bench"}, tops
    assert src.count("sys.path") <= 1
    assert f"bench/probes/{name}.py" in (ROOT / "bench" / "README.md").read_text()


def test_parse_case():
    """bench.parse_case: a table case ('_' for ' '), a fixed-length or a varlen shape; anything
    else refused with the forms it takes."""
    assert bench.parse_case("B1_T8192_H64") == ("B1 T8192 H64", (1, 8192, 64))
    assert bench.parse_case("varlen_mix_H64") == ("varlen mix H64", bench.CASES["varlen mix H64"])
    assert bench.parse_case("B2_T100_H3") == ("B2 T100 H3", (2, 100, 3))
    assert bench.parse_case("V1024x8_H64") == ("V1024x8 H64", ("varlen", [1024] * 8, 64))
    with pytest.raises(SystemExit, match="V<len>x<n>_H<h>"):
        bench.parse_case("T8192")


def test_host_probe_times_the_calls_per_round(probes, monkeypatch):
    """host_probe.host_ms: wall ms per call, the fastest and slowest of its rounds, cycling
    through the input sets and synchronising between rounds."""
    import time

    host_probe = probes("probes/host_probe")
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


def test_serving_step_bytes(probes):
    """bench/serving.py's ceiling bytes: a row's start state read once, its state after every
    token written, and its tokens (q, k, g, v, out and beta, bf16) once each."""
    serving = probes("serving")  # bench/serving.py, loaded as the probes are
    state = 128 * 128
    tokens = 3 * 128 * 2 + 2 * 128 * 2 + 2
    assert serving.step_bytes(2, 1, 3, 4) == 2 * 2 * 3 * state * 4 + 2 * 1 * 3 * tokens
    assert serving.step_bytes(5, 4, 2, 2) == 5 * 5 * 2 * state * 2 + 5 * 4 * 2 * tokens


def test_serving_sweep_table_and_plot(probes, tmp_path):
    """bench/serving.py --sweep's table and plot: each shape's tiles fastest first, the % of the
    ceiling and the time over the fastest; empty shapes left out."""
    serving = probes("serving")
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
    serving = probes("serving")
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
    serving = probes("serving")
    with pytest.raises(SystemExit, match="--head-dim: the tile sweep"):
        serving.main(["--head-dim", "64", "--no-fla"])
    assert serving.K == serving.V == 128


def test_peers_gates_and_tables(probes):
    """bench/peers.py: the slow and mixed gates shift every channel or one in ten; the summary
    and the Markdown table take rows with a peer absent."""
    peers = probes("peers")
    sets = [{"g": torch.zeros(1, 4, 2, 20, dtype=torch.bfloat16)} for _ in range(2)]
    peers.shaped(sets, "mixed")
    assert (sets[1]["g"][..., ::10] == peers.SLOW_SHIFT).all()
    assert (sets[1]["g"][..., 1::10] == 0).all()
    peers.shaped(sets, "slow")
    assert (sets[0]["g"][..., 1] == peers.SLOW_SHIFT).all()
    row = {"case": "2048/12/1", "gate": "random", "roofline_ms": 0.01, "kda_ms": 0.05,
           "kda_k1_ms": 0.02, "kda_k2_ms": 0.03, "kda_pct_roofline": 20.0, "kda_err": 1.7e-3,
           "cudnn_ms": 0.04, "kda_vs_cudnn": 0.8, "cudnn_err": 5e-3}
    s = peers.summary([row, {**row, "case": "1024/4/1", "kda_ms": 0.02, "kda_vs_cudnn": 2.0}])
    assert s["random"]["kda_vs_cudnn_min"] == 0.8
    assert abs(s["random"]["kda_vs_cudnn_geomean"] - 1.6 ** 0.5) < 1e-12
    assert s["random"]["kda_vs_flashkda_geomean"] is None
    md = peers.markdown([row], peers.summary([row]))
    assert "| 2048/12/1 | 10.0 | 50.0 | 20 / 30 | 20.0 | 40.0 | 0.80x | - | -x |" in md


def test_checkpoints_args_and_table(probes, tmp_path):
    """bench/checkpoints.py: a pool with a slot for each boundary at every, 2 every, ... of
    each sequence, first = every, the bytes written counted; the table from merged processes
    names the worst paired ratio where a bar is missed."""
    ck = probes("checkpoints")
    x = {"q": torch.zeros(2, 130, 3, 8), "v": torch.zeros(2, 130, 3, 8), "cu_seqlens": None}
    kw, nbytes = ck.checkpoint_args(x, "every 64 bf16")
    assert kw["checkpoint_state"].shape == (4, 3, 8, 8)
    assert kw["checkpoint_state"].dtype == torch.bfloat16
    assert kw["checkpoint_slots"].tolist() == [[0, 1], [2, 3]]
    assert kw["checkpoint_first"].tolist() == [64, 64] and kw["checkpoint_every"] == 64
    assert nbytes == 4 * 3 * 8 * 8 * 2
    assert ck.checkpoint_args(x, "none") == ({}, 0)

    def proc(ratio):
        modes = {m: {"bytes": 1e6, "graph": 0.5, "eager": 0.5} for m in ck.MODES}
        for m in ck.BARS:
            modes[m].update(graph_paired=ratio, eager_paired=1.01)
        return {"processes": [{"rows": [{"case": "B1 T8192 H64", "modes": modes}]}]}

    doc = {"versions": {"device": "GPU", "commit": "abc"}, "method": "m", "bars": ck.BARS}
    for i, r in enumerate((1.05, 1.08)):
        (tmp_path / f"{i}.json").write_text(json.dumps({**doc, **proc(r)}))
    ck.main(["--merge", str(tmp_path / "0.json"), str(tmp_path / "1.json"),
             "--out", str(tmp_path / "t")])
    md = (tmp_path / "t.md").read_text()
    assert "| B1 T8192 H64 | every 64 bf16 | <= 10% | 0.5000 / 0.5000 | +5.0% / +8.0% |" in md
    assert "| B1 T8192 H64 | every 1024 fp32 | <= 2% |" in md and "no (+8.0%)" in md
    assert md.count("| yes |") == 2  # every 64 fp32 (<= 20%) and every 64 bf16 (<= 10%)


def test_replay_bytes_model_and_tables(probes, tmp_path):
    """bench/replay.py's bytes model (a decode's state read and written against the replay's
    checkpoint read, a fold a window and its live entries), its ncu CSV reading and its table."""
    rp = probes("replay")
    K = rp.K
    tok = rp.tokens_bytes(1, 1)
    assert rp.decode_bytes(1, 1, 4) == 2 * 4 * K * K + tok
    e = rp.entry_bytes(2)
    assert e == 2 * K + 4 * K + 4 + 2 * K
    want = 4 * K * K * (1 + 1 / 8) + e * (3.5 + 7 / 8) + tok
    assert rp.replay_bytes(1, 1, 4, 8, 2) == pytest.approx(want)
    # the fp32 replay's bytes at a window of 8: 0.60-0.65 of decode's at every shape
    for N, H in rp.DECODE:
        r = rp.replay_bytes(N, H, 4) / rp.decode_bytes(N, H, 4)
        assert 0.55 < r < 0.65, (N, H, r)
    assert rp.verify_bytes(2, 4, 3, 4) == 2 * 3 * 5 * 4 * K * K + rp.tokens_bytes(8, 3)
    assert rp.replay_verify_bytes(2, 4, 3, 4, 4) == 2 * 3 * (4 * K * K + 8 * e) + \
        rp.tokens_bytes(8, 3)
    csv_text = ('"ID","Kernel Name","dram__bytes_read.sum","dram__bytes_write.sum"\n'
                '"","","byte","byte"\n'
                '"0","kda_step_a","1,000","500"\n"1","kda_step_a","1,200","500"\n'
                '"2","kda_replay_b","700","10"\n"3","kda_step_a","1,100","500"\n')
    p = tmp_path / "ncu.csv"
    p.write_text(csv_text)
    assert rp.ncu_bytes(p) == {"kda_step_a": 1600.0, "kda_replay_b": 710.0}
    row = {"form": "decode", "pool": "float32", "N": 8, "H": 32, "T": 1, "entries": 8,
           "decode_ms": 0.02, "replay_ms": 0.015, "decode_bytes": 100, "replay_bytes": 62,
           "decode_pct": 90.0, "replay_pct": 80.0, "decode_tile": "a", "replay_tile": "b"}
    md = rp.markdown([row], 3e12)
    assert "| decode | float32 | 8 | 32 | 1 | 8 | 0.0200 | 0.0150 | 0.75 | 0.62 | 90 | 80 | - |" \
        in md
