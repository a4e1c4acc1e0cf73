"""Read a cubin's kernel parameter table (ELF `.nv.info.<kernel>` attributes). No DSL, no CUDA.

Used by the AOT build to write each manifest and by the ABI test to check the launcher.
"""

from __future__ import annotations

import struct

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

    def name_at(o: int) -> str:
        start = strtab + o
        return data[start:data.index(b"\0", start)].decode()

    return [(name_at(n), off, size) for n, off, size in raw]


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
                break
            if attr == _EIATTR_KPARAM_INFO:
                _index, ordinal, offset, flags = struct.unpack_from("<IHHI", payload)
                k["params"].append((ordinal, offset, (flags >> 18) & 0x3FFF))
            elif attr == _EIATTR_CBANK_PARAM_SIZE:
                k["param_bytes"] = struct.unpack_from("<H", payload)[0]
            elif attr == _EIATTR_REQNTID:
                k["reqntid"] = list(struct.unpack_from("<III", payload))
        k["params"].sort()
    return out
