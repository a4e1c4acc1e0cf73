"""The launcher's parameter contract (kda_cute.abi) against the shipped cubins (CPU only).

A mismatch here is a silent wrong launch on the GPU: the driver copies whatever bytes it is given
into the kernel's parameter bank. So every size, offset and TMA box is checked against the cubin
itself, not against what the build believed it produced.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import pytest
import torch

from kda_cute import abi
from kda_cute.cubin import CubinsMissing, kernel_params, kernel_resources, load_manifest
from kda_cute.ladder import SHIPPED, SIMT, all_kernels, select_config
from kda_cute.launch import driver
from kda_cute.specs import SPECS, spec_of
from kda_cute.specs import prep as prep_spec
from kda_cute.specs import recur as recur_spec

ARCH = "sm_90a"
# Kernel parameters live in constant bank 0 from 0x210 on sm_90 (SASS reads the last scalar of
# the recurrence, table offset 1492, at c[0x0][0x7e4]); the table's offsets are relative to it.
# Alignment holds for the absolute address, which is why the first 128-byte TMA descriptor sits
# at table offset 48 and not 0.
PARAM_BASE = 0x210
MAX_SMEM = 227 * 1024  # opt-in dynamic shared memory per block on H100 / H200

# every kernel the build ships (the registry), by cubin name -> (config, its spec's arguments)
KERNELS = {cfg.name: (cfg, spec_of(cfg).args) for cfg in all_kernels()}
KERNEL_IDS = list(KERNELS)


def load(name: str) -> tuple[dict, bytes, list]:
    """(manifest, cubin bytes, the spec's argument list) of one shipped kernel."""
    cfg, args_of = KERNELS[name]
    try:
        manifest, path = load_manifest(name, ARCH)
    except CubinsMissing as e:
        pytest.skip(f"cubins not built: {e}")
    return manifest, path.read_bytes(), args_of(cfg)


def cubin_table(manifest: dict, data: bytes) -> dict:
    table = kernel_params(data)
    assert manifest["entry"] in table, f"entry {manifest['entry']!r} not in {list(table)}"
    return table[manifest["entry"]]


def param_aligns(args: list) -> list[int]:
    """Natural alignment of each kernel parameter, in the order param_sizes lists them."""
    aligns = []
    for a in args:
        if a.grid_only:
            continue
        if a.kind == "tma":
            aligns.append(64)  # CUtensorMap is declared alignas(64)
            widths = [abi.SYM_WIDTH[e] // 8 for e in a.dynamic(a.shape)]
            if widths:
                aligns.append(max(widths))
        elif a.kind == "tensor":
            aligns.append(8)  # the struct opens with its u64 pointer
        elif a.kind == "mma":
            aligns.append(1)  # a TiledMma's accumulate flag is one byte
        else:
            aligns.append(4)
    return aligns


# ------------------------------------------------------------------ spec vs cubin, per kernel
@pytest.mark.parametrize("name", KERNEL_IDS)
def test_manifest_matches_cubin(name):
    manifest, data, args = load(name)
    table = cubin_table(manifest, data)
    assert [list(p) for p in table["params"]] == manifest["params"]
    assert table["param_bytes"] == manifest["param_bytes"]
    assert table["reqntid"] == manifest["reqntid"]
    assert manifest["name"] == name and manifest["arch"] == ARCH
    # same-size arguments swapped in the spec pass the size check; the recorded order does not
    assert manifest["args"] == [a.name for a in args]


@pytest.mark.parametrize("name", KERNEL_IDS)
def test_param_sizes_match_cubin(name):
    manifest, data, args = load(name)
    sizes = [p[2] for p in cubin_table(manifest, data)["params"]]
    assert abi.param_sizes(args) == sizes


@pytest.mark.parametrize("name", KERNEL_IDS)
def test_param_offsets_are_ordered_and_aligned(name):
    manifest, data, args = load(name)
    table = cubin_table(manifest, data)
    ordinals, offsets, sizes = zip(*table["params"], strict=True)
    assert list(ordinals) == list(range(len(ordinals)))
    # a leading TMA descriptor is pushed to the first 64-byte boundary past the bank's base
    assert offsets[0] == (48 if args[0].kind == "tma" else 0)
    for i in range(len(offsets) - 1):
        assert offsets[i] + sizes[i] <= offsets[i + 1], f"param {i} overlaps param {i + 1}"
    assert offsets[-1] + sizes[-1] <= table["param_bytes"]
    aligns = param_aligns(args)
    assert len(aligns) == len(offsets)
    for i, (off, size, align) in enumerate(zip(offsets, sizes, aligns, strict=True)):
        assert (PARAM_BASE + off) % align == 0, f"param {i} (size {size}) at {off}, align {align}"
        if size == 128:
            assert align == 64, f"param {i} has a descriptor's size but is not a TMA descriptor"


@pytest.mark.parametrize("name", KERNEL_IDS)
def test_tma_args_match_manifest(name):
    manifest, _, args = load(name)
    spec = [a for a in args if a.kind == "tma"]
    assert [a.name for a in spec] == [t["name"] for t in manifest["tma"]]
    for a, t in zip(spec, manifest["tma"], strict=True):
        assert t["dtype"] == a.dtype, a.name
        assert t["rank"] == len(a.shape) == len(a.box), a.name
        assert t["box"] == list(a.box), a.name
        # the compiled copy moves exactly one box per load (the kernels arm their barriers so)
        assert t["bytes"] == math.prod(a.box) * abi.DTYPE_BYTES[a.dtype], a.name
        # the launcher encodes the swizzle the kernel's smem layout was compiled for
        assert t["swizzle"] == a.swizzle, a.name
        if a.swizzle:
            assert a.box[0] * abi.DTYPE_BYTES[a.dtype] <= a.swizzle, a.name
        # cuTensorMapEncodeTiled refuses boxes over 256 per dim or an inner extent that is not a
        # multiple of 16 bytes; catch that here rather than at the first launch
        assert all(1 <= b <= 256 for b in a.box), a.name
        assert a.box[0] * abi.DTYPE_BYTES[a.dtype] % 16 == 0, a.name


@pytest.mark.parametrize("name", KERNEL_IDS)
def test_launch_geometry(name):
    manifest, data, _ = load(name)
    cfg, _ = KERNELS[name]
    assert manifest["block"] == [cfg.block_threads, 1, 1]
    assert cubin_table(manifest, data)["reqntid"] == manifest["block"]
    # the token step keeps everything in registers; every other kernel stages through smem
    least = 0 if spec_of(cfg).family == "step" else 1
    assert least <= manifest["dynamic_smem_bytes"] <= MAX_SMEM


@pytest.mark.parametrize("name", KERNEL_IDS)
def test_manifest_config(name):
    manifest, _, _ = load(name)
    cfg, _ = KERNELS[name]
    assert manifest["config"] == cfg.as_dict()
    assert manifest["kind"] == spec_of(cfg).family


# -------------------------------------------------- spec vs the DSL class's __call__, per kernel
def _dsl_call_params(cfg) -> list[str]:
    """The parameter names of the DSL class's __call__ (self and stream aside); needs the DSL."""
    pytest.importorskip("cutlass")
    import inspect

    from kernels.build import dsl_kernel  # the class the build compiles
    sig = inspect.signature(dsl_kernel(cfg).__call__)
    return [n for n in sig.parameters if n not in ("self", "stream")]


@pytest.mark.parametrize("name", KERNEL_IDS)
def test_args_name_the_dsl_call_in_order(name):
    """Each ABI argument names the __call__ parameter it is passed as (Arg.dsl), and those are
    the __call__'s parameters in order: two swapped arguments of the same size fail here."""
    cfg, args_of = KERNELS[name]
    dsl = [a.dsl for a in args_of(cfg) if not a.kernel_only]
    params = _dsl_call_params(cfg)
    assert [params.index(n) if n in params else None for n in dsl] == list(range(len(params)))


def test_swapped_args_fail_the_dsl_order():
    cfg = select_config(128, 128, False).recur
    params = _dsl_call_params(cfg)
    args = [a for a in spec_of(cfg).args(cfg) if not a.kernel_only]
    i = next(i for i, a in enumerate(args) if a.name == "s0f")
    args[i], args[i + 1] = args[i + 1], args[i]  # s0f and s0h: both 24-byte structs
    assert [params.index(a.dsl) for a in args] != list(range(len(params)))


def test_registry_covers_every_family():
    assert {spec_of(c).family for c in all_kernels()} == {s.family for s in SPECS}
    assert len({c.name for c in all_kernels()}) == len(all_kernels())


# ----------------------------------------------------------------------------------- packing
PTR = 0x7F12_3456_789A_BCD0
SIMT_CFG = [c for c in SIMT if c.prep.head_dim_k == 128][0]
TC_CFG = select_config(128, 128, False)
# 64-bit strides above 2**32 so a 32-bit field would truncate them
SYMS = {"T": 4099, "R": 4208, "H": 5, "HK": 5 * 128, "HV": 5 * 128, "HC": 5 * 16, "NCH": 263,
        "N1": 7, "FL": 263 * 5,
        "NS": 6, "NSP": 18, "sSP": 0x7_0000_0020, "sQ": 0x1_0000_0008, "sK": 1928, "sG": 1936,
        "sB": 0x2_0000_0003,
        "sV": 1944, "sO": 0x3_0000_0040, "sS": 0x4_0000_2000, "sW": 640, "sWc": 80,
        "P": 1031, "PD": 1033, "sP": 0x5_0000_0008, "sPD": 0x6_0000_0010, "NCU": 9, "NRI": 11,
        "NWI": 13, "NAC": 15, "NPA": 17, "NHI": 19, "NCW": 21, "NCT": 23, "NCK": 25,
        "sCK": 0x8_0000_0040, "NSK": 27, "NCE": 29, "NCF": 31, "NSC": 33, "N2": 37,
        "NFX": 35, "NSP1": 39, "sRK": 0x9_0000_0008, "sRR": 0xA_0000_0010,
        "sRU": 0xB_0000_0008, "sRG": 0xC_0000_0004}


def arg_named(args: list, name: str) -> abi.Arg:
    (a,) = [a for a in args if a.name == name]
    return a


def layout(size: int, *fields) -> bytes:
    """The bytes a struct of `size` should hold: (offset, struct format, value) fields, zeros
    elsewhere."""
    buf = bytearray(size)
    for off, fmt, value in fields:
        struct.pack_into("<" + fmt, buf, off, value)
    return bytes(buf)


# id -> (argument list, argument, expected bytes); offsets written out by hand from the C rules
PACK_TENSOR = {
    # the tensor-core K1's fp32 decay row per chunk (its other outputs leave by TMA)
    "prep-gl-tc": (prep_spec.args, "gl", layout(
        24, (0, "Q", PTR), (8, "i", SYMS["NCH"]), (12, "i", SYMS["H"]),
        (16, "i", SYMS["sW"])), "tc"),
    "prep-beta": (prep_spec.args, "beta", layout(
        24, (0, "Q", PTR), (8, "i", SYMS["T"]), (12, "i", SYMS["H"]), (16, "q", SYMS["sB"]))),
    # the workspace has R rows (whole chunks), not T
    "prep-qg": (prep_spec.args, "qg", layout(
        24, (0, "Q", PTR), (8, "i", SYMS["R"]), (12, "i", SYMS["H"]), (16, "i", SYMS["sW"]))),
    "prep-gl": (prep_spec.args, "gl", layout(
        24, (0, "Q", PTR), (8, "i", SYMS["NCH"]), (12, "i", SYMS["H"]),
        (16, "i", SYMS["sW"]))),
    "prep-aw": (prep_spec.args, "aw", layout(
        24, (0, "Q", PTR), (8, "i", SYMS["R"]), (12, "i", SYMS["H"]),
        (16, "i", SYMS["sWc"]))),
    "prep-A_log": (prep_spec.args, "A_log", layout(16, (0, "Q", PTR), (8, "i", SYMS["H"]))),
    "prep-dt_bias": (prep_spec.args, "dt_bias", layout(16, (0, "Q", PTR),
                                                      (8, "i", SYMS["HK"]))),
    "prep-cu_seqlens": (prep_spec.args, "cu_seqlens", layout(16, (0, "Q", PTR),
                                                            (8, "i", SYMS["N1"]))),
    "recur-out": (recur_spec.args, "out", layout(
        24, (0, "Q", PTR), (8, "i", SYMS["T"]), (12, "i", SYMS["H"]), (16, "q", SYMS["sO"]))),
    "recur-s0h": (recur_spec.args, "s0h", layout(
        24, (0, "Q", PTR), (8, "i", SYMS["NS"]), (12, "i", SYMS["H"]),
        (16, "q", SYMS["sS"]))),
    "recur-cu_chunks": (recur_spec.args, "cu_chunks", layout(16, (0, "Q", PTR),
                                                            (8, "i", SYMS["N1"]))),
    # K1's planes written by the threads (bf16 operands): (R, H, K | C) with a 32-bit stride
    "prep-kdl-tc": (prep_spec.args, "kdl", layout(
        24, (0, "Q", PTR), (8, "i", SYMS["R"]), (12, "i", SYMS["H"]), (16, "i", SYMS["sW"])),
        "tc"),
    "prep-mql-tc": (prep_spec.args, "mql", layout(
        24, (0, "Q", PTR), (8, "i", SYMS["R"]), (12, "i", SYMS["H"]), (16, "i", SYMS["sWc"])),
        "tc"),
}


def case_arg(args_of, name, which) -> abi.Arg:
    """A table case's argument, from the tensor-core config's list when the case says "tc"."""
    fwd = TC_CFG if which == ["tc"] else SIMT_CFG
    return arg_named(args_of(fwd.prep if args_of is prep_spec.args else fwd.recur), name)


@pytest.mark.parametrize("case_id", list(PACK_TENSOR))
def test_pack_tensor_layout(case_id):
    args_of, name, expected, *which = PACK_TENSOR[case_id]
    assert abi.pack_tensor(case_arg(args_of, name, which), PTR, SYMS) == expected


# id -> (argument list, TMA argument, expected coordinate-tensor bytes)
PACK_DYNAMIC = {
    "prep-q": (prep_spec.args, "q", layout(8, (0, "i", SYMS["T"]), (4, "i", SYMS["HK"]))),
    "recur-aw": (recur_spec.args, "aw", layout(8, (0, "i", SYMS["R"]), (4, "i", SYMS["HC"]))),
    "recur-gl": (recur_spec.args, "gl", layout(8, (0, "i", SYMS["NCH"]),
                                              (4, "i", SYMS["HK"]))),
    "recur-v": (recur_spec.args, "v", layout(8, (0, "i", SYMS["T"]), (4, "i", SYMS["HV"]))),
    # kd is declared as its transposed view (H*K, T): the coordinate tensor follows that order
    "recur-kdh-transposed": (recur_spec.args, "kdh", layout(8, (0, "i", SYMS["HK"]),
                                                          (4, "i", SYMS["R"])), "tc"),
    "recur-mqh": (recur_spec.args, "mqh", layout(8, (0, "i", SYMS["R"]), (4, "i", SYMS["HC"])),
                  "tc"),
    # the output's TMA view (T, H*V) for whole chunks; K1's TMA-store views (R, H*K)
    "recur-out_tma": (recur_spec.args, "out_tma", layout(8, (0, "i", SYMS["T"]),
                                                        (4, "i", SYMS["HV"])), "tc"),
    "prep-kg-store": (prep_spec.args, "kg", layout(8, (0, "i", SYMS["R"]),
                                                  (4, "i", SYMS["HK"])), "tc"),
}


@pytest.mark.parametrize("case_id", list(PACK_DYNAMIC))
def test_pack_dynamic_layout(case_id):
    args_of, name, expected, *which = PACK_DYNAMIC[case_id]
    a = case_arg(args_of, name, which)
    assert a.kind == "tma"
    assert abi.pack_dynamic(a.shape, SYMS) == expected


def test_pack_dynamic_static_shape_is_empty():
    # a fully static TMA tensor has no coordinate parameter, only its descriptor
    static = abi.Arg("x", "tma", "float32", (16, 128), (128, 1), (128, 16))
    assert abi.pack_dynamic(static.shape, SYMS) == b""
    assert abi.param_sizes([static]) == [128]


# id -> (Arg, value, expected bytes)
PACK_SCALAR = {
    "i32-negative": (abi.Arg("gate_mode", "i32"), -7, struct.pack("<i", -7)),
    "i32-max": (abi.Arg("num_seqs", "i32"), 2**31 - 1, b"\xff\xff\xff\x7f"),
    "f32-scale": (abi.Arg("scale", "f32"), 0.125, b"\x00\x00\x00\x3e"),
    "f32-lower_bound": (abi.Arg("lower_bound", "f32"), -5.0, b"\x00\x00\xa0\xc0"),
}


@pytest.mark.parametrize("case_id", list(PACK_SCALAR))
def test_pack_scalar(case_id):
    a, value, expected = PACK_SCALAR[case_id]
    assert abi.pack_scalar(a, value) == expected


def test_pack_scalar_refuses_overflow():
    # a silently wrapped count would launch over the wrong number of sequences
    with pytest.raises(struct.error):
        abi.pack_scalar(abi.Arg("num_seqs", "i32"), 2**31)


@pytest.mark.parametrize("name", KERNEL_IDS)
def test_pack_params_match_cubin(name, monkeypatch):
    """The whole launcher packing, with the CUDA-only descriptor encoder stubbed out."""
    manifest, data, args = load(name)
    encoded = []

    def fake_descriptor(a, ptr, syms):
        encoded.append((a.name, ptr))
        return bytes(128)

    monkeypatch.setattr(driver, "tma_descriptor", fake_descriptor)
    ptrs = {a.name: PTR + 256 * i for i, a in enumerate(args) if a.kind in ("tma", "tensor")}
    scalars = {a.name: 3 + i for i, a in enumerate(args) if a.kind == "i32"}
    scalars.update({a.name: 0.5 + i for i, a in enumerate(args) if a.kind == "f32"})
    params = driver.pack_params(args, {**ptrs, **scalars}, SYMS)
    sizes = [p[2] for p in cubin_table(manifest, data)["params"]]
    assert [len(p) for p in params] == sizes
    assert encoded == [(a.name, ptrs[a.name]) for a in args if a.kind == "tma"]
    # walk the spec: each tensor struct opens with its own pointer, each scalar is its own value
    it = iter(params)
    for a in args:
        if a.grid_only:
            continue
        p = next(it)
        if a.kind == "tma":
            if a.dynamic(a.shape):
                assert next(it) == abi.pack_dynamic(a.shape, SYMS), a.name
        elif a.kind == "tensor":
            assert struct.unpack_from("<Q", p)[0] == ptrs[a.name], a.name
        elif a.kind == "mma":
            assert p == b"\0", a.name  # the kernel sets the flag itself before every MMA
        else:
            fmt = "<i" if a.kind == "i32" else "<f"
            assert struct.unpack(fmt, p)[0] == scalars[a.name], a.name
    assert next(it, None) is None


# ------------------------------------------------------------------ the check can fail
def _drop_last(args, monkeypatch):
    last = max(i for i, a in enumerate(args) if not a.grid_only)
    return args[:last] + args[last + 1:]


def _drop_first_tma(args, monkeypatch):
    i = next(i for i, a in enumerate(args) if a.kind == "tma")
    return args[:i] + args[i + 1:]


def _grid_arg_as_param(args, monkeypatch):
    i = next(i for i, a in enumerate(args) if a.grid_only)
    return args[:i] + [dataclasses.replace(args[i], grid_only=False)] + args[i + 1:]


def _tma_as_tensor(args, monkeypatch):
    i = next(i for i, a in enumerate(args) if a.kind == "tma")
    return args[:i] + [dataclasses.replace(args[i], kind="tensor", align=8)] + args[i + 1:]


def _T_64bit(args, monkeypatch):
    monkeypatch.setitem(abi.SYM_WIDTH, "T", 64)
    return args


def _H_64bit(args, monkeypatch):
    monkeypatch.setitem(abi.SYM_WIDTH, "H", 64)
    return args


MUTATIONS = {"drop-last-param": _drop_last, "drop-first-tma": _drop_first_tma,
             "grid-arg-as-param": _grid_arg_as_param, "tma-as-tensor": _tma_as_tensor,
             "T-64bit": _T_64bit, "H-64bit": _H_64bit}


def _applies(name: str, mutation: str) -> bool:
    """The TMA mutations need a TMA argument, T-64bit a T extent (the combine has neither),
    H-64bit an H extent (the offsets have none), grid-arg-as-param a grid-only argument (a
    persistent token step has none)."""
    cfg, args_of = KERNELS[name]
    args = args_of(cfg)
    if mutation == "grid-arg-as-param":
        return any(a.grid_only for a in args)
    if mutation in ("drop-first-tma", "tma-as-tensor"):
        return any(a.kind == "tma" for a in args)
    if mutation == "T-64bit":
        return any("T" in a.shape for a in args)
    if mutation == "H-64bit":
        return any("H" in a.shape + a.stride for a in args)
    return True


@pytest.mark.parametrize("name,mutation", [(n, m) for n in KERNEL_IDS for m in MUTATIONS
                                           if _applies(n, m)])
def test_mutated_spec_disagrees_with_cubin(name, mutation, monkeypatch):
    manifest, data, args = load(name)
    sizes = [p[2] for p in cubin_table(manifest, data)["params"]]
    assert abi.param_sizes(args) == sizes
    assert abi.param_sizes(MUTATIONS[mutation](list(args), monkeypatch)) != sizes


@pytest.mark.parametrize("name", KERNEL_IDS)
def test_kernel_refuses_mismatched_args(name, monkeypatch):
    """Kernel() compares sizes before it touches the driver, so this runs without a GPU; if the
    comparison ever moved after cuLibraryLoadData this would fail here on a CPU machine."""
    _, _, args = load(name)
    with pytest.raises(RuntimeError, match="disagree with the cubin"):
        driver.Kernel(name, ARCH, _drop_last(list(args), monkeypatch))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="loading a cubin needs a CUDA device")
@pytest.mark.parametrize("name", KERNEL_IDS)
def test_kernel_loads(name):
    manifest, _, args = load(name)
    k = driver.Kernel(name, ARCH, args)
    assert k.sizes == [p[2] for p in manifest["params"]]
    assert k.block == tuple(manifest["block"])


@pytest.mark.parametrize("name", [n for n in KERNEL_IDS
                                  if n in {c.name for f in SHIPPED for c in (f.prep, f.recur)}])
def test_shipped_kernels_do_not_spill(name):
    """A stack frame means spills or a register array indexed at run time: slow local memory."""
    manifest, data, _ = load(name)
    res = kernel_resources(data)[manifest["entry"]]
    assert res == {"registers": manifest["registers"], "frame_bytes": manifest["frame_bytes"]}
    assert res["frame_bytes"] == 0, res
    assert res["registers"] <= 255, res


# K1's speed rests on how many of its CTAs one SM holds (docs/notes/k1.md, "K1 in column passes"):
# the ladder's K1 per head dim and the residency its registers and smem allow on an sm_90 SM
K1_RESIDENCY = {64: 11, 128: 8, 256: 4}


@pytest.mark.parametrize("head_dim", sorted(K1_RESIDENCY))
def test_ladder_k1_residency(head_dim):
    cfg = select_config(head_dim, head_dim, varlen=False).prep
    manifest, _, _ = load(cfg.name)
    threads = manifest["block"][0]
    regs = -(-manifest["registers"] // 8) * 8  # allocated per thread in units of 8
    by_regs = 65536 // (regs * threads)
    by_smem = 233472 // (manifest["dynamic_smem_bytes"] + 1024)  # 1 KB reserved per CTA
    per_sm = min(by_regs, by_smem, 2048 // threads, 32)
    assert per_sm >= K1_RESIDENCY[head_dim], (manifest["registers"], by_regs, by_smem)
