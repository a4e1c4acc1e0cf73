"""bench/report.py: the generated tables are current in the tree (a stale README or
docs/results.md fails here), and the generator on a tiny synthetic result."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("_bench_report", ROOT / "bench" / "report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)


def test_tree_is_current(capsys):
    assert report.main(["--check"]) == 0, capsys.readouterr().err


def test_current_files_exist():
    results = ROOT / "bench" / "results"
    for name, _ in [*report.CURRENT.values(), *report.RECORDS.values()]:
        assert (results / name).is_file(), name
    for extra in report.EXTRA.values():
        for name in extra:
            assert (results / name).is_file(), name


def _row(case, K, kda, fla, est=None, schedule="serial"):
    r = {"case": case, "K": K, "schedule": schedule, "roofline_ms": kda / 4, "kda_ms": kda,
         "kda_graph_ms": kda * 0.99, "kda_k1_gpu_ms": kda / 2, "kda_k2_gpu_ms": kda / 2,
         "kda_pct_roofline": 25.0, "kda_out_err": 1.7e-3, "kda_state_err": 3.5e-4,
         "fla_ms": fla}
    if est:
        r["flashkda_est_ms"] = est
    return r


def _tree(tmp_path):
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    data = {"versions": {"device": "NVIDIA H200", "commit": "abc1234"},
            "rows": [_row("B1 T8 H2", 128, 0.5, 1.5, 1.0),
                     _row("B1 T8 H1", 128, 0.25, 1.0, 0.75, schedule="alongside"),
                     _row("B1 T8 H2", 64, 0.2, 0.8)]}
    (results / "bench-h200-2026-01-02-abc1234.json").write_text(json.dumps(data))
    (results / "bench-h200-2026-01-02-abc1234.md").write_text("table\n")
    peers = {"versions": {"device": "NVIDIA H100", "commit": "def5678"},
             "rows": [{"case": "B1 T8 H2", "gate": "random", "kda_ms": 0.5, "cudnn_ms": 0.25,
                       "flashkda_ms": 1.0},
                      {"case": "B1 T8 H2", "gate": "slow", "kda_ms": 0.5, "cudnn_ms": 5.0},
                      {"case": "B1 T8 H1", "gate": "random", "kda_ms": 0.25, "cudnn_ms": 0.5,
                       "flashkda_ms": 1.0}]}
    (results / "peers-ten-h100-2026-01-03-def5678.json").write_text(json.dumps(peers))
    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "README.md").write_text(
        "# x\n\n<!-- speed-table:begin -->\nold\n<!-- speed-table:end -->\n\nafter\n")
    (docs / "results.md").write_text("".join(
        f"## {m}\n\n<!-- results:{m}:begin -->\n<!-- results:{m}:end -->\n\n"
        for m in ("prefill-k128", "prefill-k256", "prefill-k64")))
    current = {"prefill": ("bench-h200-2026-01-02-abc1234.json", "prefill"),
               "peers-ten": ("peers-ten-h100-2026-01-03-def5678.json", "peers")}
    return results, current


def test_generator_on_a_synthetic_result(tmp_path):
    results, current = _tree(tmp_path)
    out, stray = report.generate(tmp_path, current, {})
    assert stray == []
    readme = out[tmp_path / "README.md"]
    assert "NVIDIA H100, commit def5678, 2026-01-03." in " ".join(readme.split())
    # the random gates' rows only, the peers' time over kda_cute's
    assert "| B1 T8 H2 | 500.0 | 250.0 | 0.50x | 1000.0 | 2.00x |" in readme
    assert "| B1 T8 H1 | 250.0 | 500.0 | 2.00x | 1000.0 | 4.00x |" in readme
    assert "5000.0" not in readme
    assert "Geometric mean: 1.00x cuDNN fused, 2.83x FlashKDA" in readme
    assert readme.endswith("<!-- speed-table:end -->\n\nafter\n") and "\nold\n" not in readme
    page = out[tmp_path / "docs" / "results.md"]
    assert "| B1 T8 H1 (alongside) | 0.062 | 0.250 |" in page
    assert "[`bench-h200-2026-01-02-abc1234.md`](../bench/results/" in page
    # K = 64 has no FlashKDA estimate: its table has no such columns
    k64 = page.split("<!-- results:prefill-k64:begin -->")[1]
    assert "FlashKDA" not in k64 and "| B1 T8 H2 | 0.050 | 0.200 |" in k64
    index = out[results / "INDEX.md"]
    assert "| prefill | NVIDIA H200 | abc1234 | 2026-01-02 |" in index
    assert "bench-h200-2026-01-02-abc1234.md" in index


def test_stale_and_stray_files_are_found(tmp_path):
    results, current = _tree(tmp_path)
    out, _ = report.generate(tmp_path, current, {})
    for path, text in out.items():
        path.write_text(text)
    again, stray = report.generate(tmp_path, current, {})
    assert all(path.read_text() == text for path, text in again.items())
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("2.00x", "2.10x"))
    (results / "old-run.txt").write_text("superseded\n")
    again, stray = report.generate(tmp_path, current, {})
    assert again[readme] != readme.read_text()
    assert stray == ["old-run.txt"]


def test_splice_needs_both_markers():
    assert report.splice("a\n<!-- m:begin -->\nx\n<!-- m:end -->\nb", "m", ["y"]) == \
        "a\n<!-- m:begin -->\ny\n<!-- m:end -->\nb"
    with pytest.raises(ValueError):
        report.splice("a\n<!-- m:begin -->\nx\n", "m", ["y"])
