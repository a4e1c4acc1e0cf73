"""The kernels' shape (CPU, no DSL import): the prefill's K1 and K2 and the token steps, one
kernel class a file over shared modules, take their run-time arguments as named records, so
that no device function or helper takes more than ~20 parameters (the host entry, __call__,
is the flat argument list the spec names: kda_cute.specs)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
FILES = ("kda_prep_sm90.py", "kda_recur_tc_sm90.py", "step_rows.py", "kda_step_sm90.py",
         "kda_step_persist_sm90.py", "kda_step_chunk_sm90.py", "kda_replay_sm90.py",
         "kda_replay_verify_sm90.py")
MOST = 20


def _functions(name):
    for node in ast.walk(ast.parse((KERNELS / name).read_text())):
        if isinstance(node, ast.FunctionDef):
            a = node.args
            n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
            yield node.name, n - (1 if a.args and a.args[0].arg == "self" else 0)


@pytest.mark.parametrize("name", FILES)
def test_no_helper_over_twenty_parameters(name):
    wide = {f: n for f, n in _functions(name) if f != "__call__" and n > MOST}
    assert not wide, f"{name}: {wide}"


@pytest.mark.parametrize("name", ["kda_step_sm90.py", "kda_step_persist_sm90.py",
                                  "kda_step_chunk_sm90.py"])
def test_step_kernels_one_class_a_file_over_the_rows(name):
    """Each token-step file holds one class, a StepRows, and its kernels take the records."""
    tree = ast.parse((KERNELS / name).read_text())
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    assert [ast.unparse(b) for c in classes for b in c.bases] == ["StepRows"]
    kernels = [f for f in ast.walk(classes[0]) if isinstance(f, ast.FunctionDef)
               and any(ast.unparse(d) == "cute.kernel" for d in f.decorator_list)]
    assert kernels
    for k in kernels:
        notes = [ast.unparse(a.annotation) for a in k.args.args[1:]]
        assert notes[:4] == ["Tokens", "GateParams", "States", "Tables"], (k.name, notes)
        assert notes[-7:] == ["Seqs", "Read", "Accepted", "Starts", "Write", "Parents", "Gate"]
