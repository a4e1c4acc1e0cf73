"""Helpers shared by the kernel classes (trace time only)."""

import re

_GBASIS = re.compile(r'tma_gbasis = <"\(([^)]*)\):\(([^)]*)\)">')
_BITS = re.compile(r"copy_bits = (\d+)")


def tma_meta(name: str, atom, dtype: str, swizzle: int = 0) -> dict:
    """What a compiled TMA load expects of its descriptor, read back from the atom's type: the box
    per global mode, innermost (mode 1 of our row-major rank-2 views) first, and its byte count.
    The manifest records it and the ABI test compares it with what the launcher encodes."""
    text = str(atom.type)
    m, bits = _GBASIS.search(text), _BITS.search(text)
    if not m or not bits:
        raise ValueError(f"{name}: unrecognised TMA atom type {text}")
    sizes = [int(x) for x in m.group(1).split(",")]
    modes = [int(b.split("@")[1]) for b in m.group(2).split(",")]
    box = {mode: size for size, mode in zip(sizes, modes, strict=True)}
    rank = max(modes) + 1
    return {"name": name, "dtype": dtype, "rank": rank,
            "box": [box.get(i, 1) for i in reversed(range(rank))],
            "bytes": int(bits.group(1)) // 8, "swizzle": swizzle}
