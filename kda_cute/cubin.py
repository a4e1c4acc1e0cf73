"""The shipped cubins and their manifests: where they live, and what a cubin's ELF says of its
kernel (parameter table, registers, stack frame). No DSL, no CUDA.

Used by the AOT build to write each manifest, by the planner (a kernel's resources), the
launcher (loading) and the ABI tests.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from pathlib import Path

CUBIN_ROOT = Path(os.environ.get("KDA_CUTE_CUBIN_DIR", Path(__file__).parent / "_cubins"))
BUILD_HINT = "build them with `make kernels` (or `python -m kernels.build --arch {arch}`)"


class CubinsMissing(RuntimeError):
    pass


def load_manifest(name: str, arch: str) -> tuple[dict, Path]:
    """A kernel's manifest and the path of its cubin (CubinsMissing where not built)."""
    folder = CUBIN_ROOT / arch
    man, cub = folder / f"{name}.json", folder / f"{name}.cubin"
    if not (man.exists() and cub.exists()):
        raise CubinsMissing(f"no cubin '{name}' for {arch} in {folder}: "
                            + BUILD_HINT.format(arch=arch))
    return json.loads(man.read_text()), cub


@functools.lru_cache(maxsize=256)
def manifest(name: str, arch: str) -> dict:
    """A kernel's manifest, read once per process."""
    return load_manifest(name, arch)[0]


_EIATTR_REGCOUNT = 0x2F
_EIATTR_FRAME_SIZE = 0x11
_EIATTR_KPARAM_INFO = 0x17
_EIATTR_CBANK_PARAM_SIZE = 0x19
_EIATTR_REQNTID = 0x10
_EIFMT_NVAL, _EIFMT_HVAL, _EIFMT_SVAL = 0x01, 0x03, 0x04


def _sections(data: bytes) -> list[tuple[str, int, int]]:
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError("not an ELF64 cubin")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    raw = []
    for i in range(shnum):
        name, _typ, _flags, _addr, off, size = struct.unpack_from(
            "<IIQQQQ", data, shoff + i * shentsize)
        raw.append((name, off, size))
    strtab = raw[shstrndx][1]
    return [(_c_string(data, strtab + n), off, size) for n, off, size in raw]


def _c_string(data: bytes, start: int) -> str:
    return data[start:data.index(b"\0", start)].decode()


def _attributes(data: bytes, off: int, size: int):
    """The (attribute, payload) records of an `.nv.info` section, up to an unknown format."""
    p, end = off, off + size
    while p < end:
        fmt, attr = data[p], data[p + 1]
        if fmt == _EIFMT_SVAL:
            n = struct.unpack_from("<H", data, p + 2)[0]
            payload, p = data[p + 4:p + 4 + n], p + 4 + n
        elif fmt == _EIFMT_HVAL:
            payload, p = data[p + 2:p + 4], p + 4
        elif fmt == _EIFMT_NVAL:
            payload, p = b"", p + 2
        else:
            return
        yield attr, payload


def kernel_params(data: bytes) -> dict[str, dict]:
    """{entry: {"params": [(ordinal, offset, size)...], "param_bytes": n, "reqntid": [x,y,z]}}"""
    secs = _sections(data)
    out = {n[len(".text."):]: {"params": [], "param_bytes": None, "reqntid": None}
           for n, _, _ in secs if n.startswith(".text.")}
    for name, off, size in secs:
        entry = name[len(".nv.info."):] if name.startswith(".nv.info.") else None
        if entry not in out:
            continue
        k = out[entry]
        for attr, payload in _attributes(data, off, size):
            if attr == _EIATTR_KPARAM_INFO:
                _index, ordinal, offset, flags = struct.unpack_from("<IHHI", payload)
                k["params"].append((ordinal, offset, (flags >> 18) & 0x3FFF))
            elif attr == _EIATTR_CBANK_PARAM_SIZE:
                k["param_bytes"] = struct.unpack_from("<H", payload)[0]
            elif attr == _EIATTR_REQNTID:
                k["reqntid"] = list(struct.unpack_from("<III", payload))
        k["params"].sort()
    return out


def _symbols(data: bytes, secs) -> list[str]:
    by_name = {n: (off, size) for n, off, size in secs}
    sym_off, sym_size = by_name[".symtab"]
    str_off, _ = by_name[".strtab"]
    names = []
    for i in range(sym_size // 24):  # Elf64_Sym
        st_name = struct.unpack_from("<I", data, sym_off + i * 24)[0]
        names.append(_c_string(data, str_off + st_name))
    return names


def kernel_resources(data: bytes) -> dict[str, dict]:
    """{function: {"registers": n, "frame_bytes": n}} from the global `.nv.info` section: the
    compiler's register count and stack frame (a non-zero frame means spills or local arrays)."""
    secs = _sections(data)
    names = _symbols(data, secs)
    out: dict[str, dict] = {}
    for name, off, size in secs:
        if name != ".nv.info":
            continue
        for attr, payload in _attributes(data, off, size):
            if attr in (_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE) and len(payload) == 8:
                sym, value = struct.unpack_from("<II", payload)
                key = "registers" if attr == _EIATTR_REGCOUNT else "frame_bytes"
                out.setdefault(names[sym], {})[key] = value
    return out
