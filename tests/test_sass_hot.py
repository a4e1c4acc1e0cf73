"""scripts/sass_hot.py on a small ncu-style source table (CPU)."""

import csv
import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "sass_hot", Path(__file__).resolve().parent.parent / "scripts" / "sass_hot.py")
sass_hot = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(sass_hot)

HEAD = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
ROWS = [("0x10", "FADD R1, R2, R3 ;", "5", "100"),
        ("0x20", "@!P0 MUFU.EX2 R4, R4 ;", "30", "100"),
        ("0x30", "BAR.SYNC.DEFER_BLOCKING 0x0 ;", "2", "4"),
        ("0x40", "HMMA.16816.F32.BF16 R4, R8, R2, R4 ;", "1", "50"),
        ("0x50", "FFMA R1, R2, R3, R1 ;", "0", "150")]


def test_opcodes():
    assert sass_hot.opcode("@!P0 NANOSLEEP.SYNCS 0x989680") == "NANOSLEEP"
    assert sass_hot.opcode("HMMA.16816.F32.BF16 R4, R8, R2, R4 ;") == "HMMA"
    assert sass_hot.opcode("") == ""


def test_regions_split_at_barriers():
    table = [list(r) for r in ROWS]
    parts = sass_hot.regions(table, 1, 3)
    assert [(first, tot) for first, tot, _ in parts] == [(0, 204.0), (3, 200.0)]
    assert parts[0][2]["MUFU"] == 100 and parts[1][2]["FFMA"] == 150


def test_report(tmp_path, capsys):
    path = tmp_path / "sass.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kernel table preamble"])
        w.writerow(HEAD)
        w.writerows(ROWS)
    sass_hot.main(str(path), top=2)
    out = capsys.readouterr().out
    assert "5 SASS rows, 38 stall samples" in out
    assert "executed warp instructions: 404" in out
    assert " 50.5%    0x10" in out and " 49.5%    0x40" in out
