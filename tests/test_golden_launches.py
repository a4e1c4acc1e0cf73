"""Every forward launches exactly what it launched when the golden records were taken
(tests/launch_record.py: cubins, grids, blocks, shared memory, programmatic flags, parameter
bytes with addresses mapped back to tensor roles, memsets, events), on a CPU with the driver
faked. A refactor of the launcher must leave every record as it is."""

from __future__ import annotations

import json

import pytest

from tests import launch_record

GOLDEN = json.loads(launch_record.GOLDEN.read_text())


def test_every_problem_has_a_record():
    assert sorted(GOLDEN) == sorted(launch_record.PROBLEMS)


@pytest.mark.parametrize("name", list(launch_record.PROBLEMS))
def test_launches_match_the_golden_record(name, monkeypatch):
    if not launch_record.CUBIN_DIR.exists():
        pytest.skip("cubins not built (`make kernels`)")
    got = launch_record.record(name, monkeypatch)
    want = GOLDEN[name]
    assert got["schedule"] == want["schedule"]
    assert len(got["ops"]) == len(want["ops"])
    for i, (g, w) in enumerate(zip(got["ops"], want["ops"], strict=True)):
        assert g == w, f"op {i} ({w.get('kernel', w['op'])})"
    assert got["anon"] == want["anon"]
