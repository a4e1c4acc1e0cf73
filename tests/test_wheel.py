"""The wheel (CPU): built from this tree, it carries every module and every cubin of the build's
INDEX, and installed on its own (no repo on the path) it finds its cubins; built from a tree
without cubins and without the means to build them, it stops and says how."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CUBINS = ROOT / "kda_cute" / "_cubins" / "sm_90a"


def _wheel(src: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(out)],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    if not (CUBINS / "INDEX").exists():
        pytest.skip("no cubin build here (make kernels writes kda_cute/_cubins/sm_90a/INDEX)")
    out = tmp_path_factory.mktemp("wheel")
    # a copy of what the wheel is built from, so that the build's own files stay out of this
    # checkout
    src = out / "src"
    shutil.copytree(ROOT / "kda_cute", src / "kda_cute",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "setup.py"):
        shutil.copy2(ROOT / f, src / f)
    r = _wheel(src, out)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = out.glob("kda_cute-*.whl")
    return whl


def test_wheel_carries_modules_and_cubins(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "kda_cute").rglob("*.py")}
    assert modules and modules <= names, sorted(modules - names)
    index = (CUBINS / "INDEX").read_text().split()
    want = {f"kda_cute/_cubins/sm_90a/{n}{ext}" for n in index for ext in (".cubin", ".json")}
    assert want <= names, sorted(want - names)[:5]
    assert "kda_cute/_cubins/sm_90a/INDEX" in names
    assert not any(n.startswith(("kernels/", "tests/", "bench/")) for n in names)


def test_installed_wheel_finds_its_cubins(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), str(wheel)], check=True, timeout=300)
    code = ("import sys, kda_cute, kda_cute.cubin as c, kda_cute.ladder as L\n"
            "assert c.CUBIN_ROOT.is_relative_to(sys.argv[1]), c.CUBIN_ROOT\n"
            "for k in L.all_kernels():\n"
            "    c.load_manifest(k.name, 'sm_90a')\n"
            "print(len(L.all_kernels()))\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"}
    r = subprocess.run([sys.executable, "-c", code, str(site)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert int(r.stdout.split()[-1]) == len((CUBINS / "INDEX").read_text().split())


def test_wheel_without_cubins_says_how(tmp_path):
    """No cubins and no kernels/ to build them from: the wheel build stops, naming the fix."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "kda_cute", src / "kda_cute",
                    ignore=shutil.ignore_patterns("_cubins", "__pycache__"))
    for f in ("pyproject.toml", "setup.py"):
        shutil.copy2(ROOT / f, src / f)
    r = _wheel(src, tmp_path / "out")
    assert r.returncode != 0
    text = r.stdout + r.stderr
    assert "holds no cubins" in text and "make kernels" in text, text[-2000:]
    assert not list((tmp_path / "out").glob("*.whl"))
