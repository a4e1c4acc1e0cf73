"""The wheel carries the ahead-of-time compiled cubins (kda_cute/_cubins/<arch>/, with a manifest
each): a wheel without them would install and then fail at its first launch. So building a wheel
(`pip wheel .`, `pip install .`, `make wheel`) first checks that every kernel the last cubin
build listed in its INDEX is there; where they are not, it builds them when it can (a source tree
with kernels/ and the CuTe DSL importable), else it stops and says how. Editable installs are
not checked: `make setup` installs before the cubins are built."""

import importlib.util
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent
ARCHS = ("sm_90a",)  # the archs a wheel carries (kernels/build.py's tested ones)


def missing(arch: str) -> list[str] | None:
    """The kernels of `arch`'s INDEX whose cubin or manifest is not there (None: no INDEX, the
    cubins were never built)."""
    folder = ROOT / "kda_cute" / "_cubins" / arch
    index = folder / "INDEX"
    if not index.exists():
        return None
    return [n for n in index.read_text().split()
            if not ((folder / f"{n}.cubin").exists() and (folder / f"{n}.json").exists())]


def can_build() -> bool:
    return (ROOT / "kernels" / "build.py").exists() and \
        importlib.util.find_spec("cutlass") is not None


class BdistWheel(bdist_wheel):
    def run(self):
        for arch in ARCHS:
            gone = missing(arch)
            if gone == []:
                continue
            if can_build():
                subprocess.run([sys.executable, "-m", "kernels.build", "--arch", arch],
                               cwd=ROOT, check=True)
                gone = missing(arch)
                if gone == []:
                    continue
            what = ("holds no cubins" if gone is None else
                    f"lacks {len(gone)} of its INDEX's kernels (e.g. {gone[0]})")
            raise SystemExit(
                f"kda-cute: kda_cute/_cubins/{arch} {what}, and a kda-cute wheel carries its "
                f"cubins. Build them first: `make kernels` (it installs the CuTe DSL, "
                f"nvidia-cutlass-dsl, into .venv; or `pip install -e '.[build]'` then "
                f"`python -m kernels.build --arch {arch}`), then build the wheel again "
                f"(`make wheel`).")
        super().run()


setup(cmdclass={"bdist_wheel": BdistWheel})
