"""The `kda-cute` command on the CPU: export's files and C header, its errors, info."""

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from kda_cute import cli, cubin
from kda_cute.ladder import all_kernels, select_config
from kda_cute.specs import spec_of
from tests import launch_record

ROOT = Path(__file__).resolve().parents[1]
needs_cubins = pytest.mark.skipif(not launch_record.CUBIN_DIR.exists(),
                                  reason="cubins not built (`make kernels`)")

# a C program that walks the header's table: every parameter inside the block, in order
WALK = r"""
#include <stdio.h>
#include "kda_cute_kernels.h"
int main(void) {
  for (unsigned i = 0; i < KDA_CUTE_NUM_KERNELS; ++i) {
    const kda_kernel *k = kda_cute_kernels[i];
    unsigned end = 0;
    for (unsigned j = 0; j < k->num_params; ++j) {
      const kda_param *p = &k->params[j];
      if (p->offset < end || p->offset + p->size > k->param_bytes) return 1;
      end = p->offset + p->size;
    }
    printf("%s %s %u %u %u %u %u\n", k->name, k->entry, k->block[0], k->dynamic_smem_bytes,
           k->param_bytes, k->num_params, k->num_tma);
  }
  return 0;
}
"""


def _run(*argv, capsys):
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_list_names_each_op_s_kernels(capsys):
    rc, out, _ = _run("export", "--list", capsys=capsys)
    assert rc == 0 and out.split() == [c.name for c in all_kernels()]
    rc, out, _ = _run("export", "--list", "--ops", "decode", capsys=capsys)
    assert rc == 0 and out.split() == [c.name for c in all_kernels()
                                       if spec_of(c).family in ("step", "replay")]
    rc, out, _ = _run("export", "--list", "--ops", "prefill", capsys=capsys)
    assert rc == 0 and "kda_recur_wgmma_k128_v128_c16_bv64_t128_s4_f16" in out.split()
    assert not any(n.startswith("kda_step") for n in out.split())


@pytest.mark.parametrize("ops", ["", "prefil", "prefill,verify"])
def test_bad_ops_name_the_argument(ops, capsys):
    rc, _, err = _run("export", "--list", "--ops", ops, capsys=capsys)
    assert rc == 2 and "--ops" in err and "prefill, decode" in err


def test_an_arch_without_wgmma_names_the_kernels(capsys):
    rc, out, err = _run("export", "--arch", "sm_100a", "--out", "/nonexistent", capsys=capsys)
    assert rc == 2 and out == ""
    assert "sm_100a" in err and "wgmma" in err
    wgmma = [c.name for c in all_kernels() if getattr(c, "mma", "") == "wgmma"]
    assert wgmma and all(n in err for n in wgmma)
    assert all(c.name in err for c in all_kernels())


def test_missing_cubins_say_how_to_build_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cubin, "CUBIN_ROOT", tmp_path / "none")
    rc, _, err = _run("export", "--out", str(tmp_path / "x"), capsys=capsys)
    assert rc == 2 and "make kernels" in err
    assert not (tmp_path / "x").exists()
    rc, _, err = _run("export", capsys=capsys)
    assert rc == 2 and "--out" in err


@needs_cubins
def test_export_writes_cubins_manifests_and_a_header_that_compiles(tmp_path, capsys):
    rc, out, _ = _run("export", "--out", str(tmp_path), capsys=capsys)
    assert rc == 0 and cli.HEADER in out
    kernels = all_kernels()
    for c in kernels:
        man, path = cubin.load_manifest(c.name, "sm_90a")
        assert (tmp_path / path.name).read_bytes() == path.read_bytes()
        assert (tmp_path / f"{c.name}.json").read_text() == path.with_suffix(".json").read_text()
    text = (tmp_path / cli.HEADER).read_text()
    assert f"#define KDA_CUTE_NUM_KERNELS {len(kernels)}" in text
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / "walk.c").write_text(WALK)
    exe = tmp_path / "walk"
    subprocess.run([cc, "-std=c99", "-Wall", "-Wextra", "-Werror", "-I", str(tmp_path),
                    str(tmp_path / "walk.c"), "-o", str(exe)], check=True)
    res = subprocess.run([str(exe)], capture_output=True, text=True, check=True)
    rows = [line.split() for line in res.stdout.splitlines()]
    assert [r[0] for r in rows] == [c.name for c in kernels]
    for (_name, entry, block, smem, pbytes, nparams, ntma), c in zip(rows, kernels, strict=True):
        man = cubin.manifest(c.name, "sm_90a")
        assert (entry, int(block), int(smem), int(pbytes), int(nparams), int(ntma)) == (
            man["entry"], man["block"][0], man["dynamic_smem_bytes"], man["param_bytes"],
            len(man["params"]), len(man.get("tma", [])))


@needs_cubins
def test_header_parameters_are_the_cubins_and_the_specs(tmp_path):
    """Each kernel's parameter rows: the cubin's offsets and sizes, named by its spec's
    arguments in order (a TMA argument: descriptor, then coordinates)."""
    c = [k for k in all_kernels() if k.name == "kda_recur_wgmma_k128_v128_c16_bv64_t128_s4_f16"][0]
    man = cubin.manifest(c.name, "sm_90a")
    text = cli.header([(c, man)], "sm_90a")
    rows = [line.strip() for line in text.splitlines() if line.strip().startswith('{"')]
    params = rows[:len(man["params"])]
    assert params[0] == f'{{"kg", KDA_TMA_DESCRIPTOR, {man["params"][0][1]}, 128}},'
    assert params[1].startswith('{"kg", KDA_TMA_COORDINATES,')
    for row, (_, off, size) in zip(params, man["params"], strict=True):
        assert row.endswith(f", {off}, {size}}},")
    assert any(r.startswith('{"fixes", KDA_TENSOR,') for r in params)
    assert any(r.startswith('{"fix_on", KDA_I32,') for r in params)
    tma = rows[len(man["params"]):]
    assert [r.split('"')[1] for r in tma] == [t["name"] for t in man["tma"]]
    assert tma[0] == '{"kg", "float16", 2, {64, 16, 1}, 128},'


@needs_cubins
def test_header_gives_the_checkpoint_maps_rank_3_boxes(tmp_path):
    """The checkpoints builds' tensor maps (rank 3: [rows, H*V, K], the box a warp's padded
    slab) keep their whole box in the header."""
    c = [k for k in all_kernels()
         if k.name == "kda_recur_wgmma_k128_v128_c16_bv64_t128_s8_f16_wy_ck"][0]
    man = cubin.manifest(c.name, "sm_90a")
    text = cli.header([(c, man)], "sm_90a")
    rows = [r for r in (line.strip() for line in text.splitlines())
            if r.startswith('{"ck_') and r.count('"') >= 4]
    assert rows == ['{"ck_f", "float32", 3, {136, 16, 1}, 0},',
                    '{"ck_h", "bfloat16", 3, {144, 16, 1}, 0},',
                    '{"ck_s", "float32", 3, {136, 16, 1}, 0},']


def test_info_names_the_ladder_s_pick(capsys):
    rc, out, _ = _run("info", "--head-dim", "128", "--varlen", capsys=capsys)
    cfg = select_config(128, 128, True, "fast")
    assert rc == 0 and cfg.prep.name in out and cfg.recur.name in out
    rc, _, err = _run("info", "--head-dim", "96", capsys=capsys)
    assert rc == 2 and "--head-dim" in err and "96" in err
    rc, out, _ = _run("info", capsys=capsys)
    assert rc == 0 and len(out.splitlines()) == len(all_kernels())


def test_the_console_script_is_declared():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["kda-cute"] == "kda_cute.cli:main"


@pytest.mark.parametrize("cmd", ["check", "bench"])
def test_gpu_commands_without_a_gpu_say_why_and_fail(cmd, tmp_path, capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "r.json"
    assert cli.main([cmd, "--json", str(out)]) == 1
    assert "cannot run: no CUDA device" in capsys.readouterr().out
    assert out.exists()
