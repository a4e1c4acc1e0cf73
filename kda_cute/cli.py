"""The `kda-cute` command: export the shipped cubins for another runtime, and say what ships.

    kda-cute export --out DIR [--arch sm_90a] [--ops prefill,decode] [--list]
    kda-cute info [--head-dim K] [--varlen] [--precision fast|precise]
    kda-cute check [--json FILE]       the GPU self-test against the float64 reference
    kda-cute bench [--json FILE]       a short timing of prefill and decode on this GPU
    kda-cute plan --out DIR --B .. --T .. --H .. --K ..   one forward's launches as a C header

`export` copies each selected kernel's cubin and manifest into DIR and writes one C header,
`kda_cute_kernels.h`, that describes every kernel it copied: the entry name, the block and
dynamic shared memory it launches with, its parameter block (each parameter's byte offset and
size, and which kernel argument it carries), and each TMA descriptor argument's box, dtype and
swizzle, with the grid rule in words. A runtime loads a cubin with cuModuleLoadData, finds the
entry with cuModuleGetFunction and packs the parameter block by the header's table. Nothing
here needs the DSL or a GPU.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from . import abi, cubin
from .abi import c_ident
from .ladder import all_kernels, select_config
from .specs import args_for, spec_of

SUPPORTED_ARCHS = ("sm_90a",)
# which kernel families (manifest "kind") each --ops name exports
OPS = {"prefill": ("offsets", "checkpoints", "prep", "recur", "combine"),
       "decode": ("step", "replay")}
HEADER = "kda_cute_kernels.h"
# the launch grid of each family, in words (the plans compute it from the problem)
GRID_RULES = {
    "prep": "(H, min(chunk slots, 65535), ceil(chunk slots / 65535)): one CTA per (head, chunk)",
    "recur": "(V / block_v, H, sequences or fewer): one CTA per (block of state rows, head), "
             "sequences z, z + gridDim.z, ...",
    "combine": "(K / rows, H, B): one CTA per (rows of the state, head, sequence)",
    "step": "persistent or one CTA per (block of state rows, head, row); see kda_cute.plans.step",
    "offsets": "(1, 1, 1)",
    "checkpoints": "(N, 1, 1): one CTA per sequence",
    "replay": "(V / block_v, H, rows): one CTA per (block of state rows, head, row)",
}


class CliError(Exception):
    pass


def _why_not(arch: str, kernels) -> str:
    """Why kernels cannot be exported for `arch`, naming them."""
    wgmma = [c.name for c in kernels if getattr(c, "mma", "") == "wgmma"]
    rest = [c.name for c in kernels if getattr(c, "mma", "") != "wgmma"]
    lines = [f"--arch {arch}: the kernels are built and tested for {', '.join(SUPPORTED_ARCHS)}"
             f" only."]
    if wgmma:
        lines.append(f"  {len(wgmma)} need Hopper's warpgroup MMA (wgmma, sm_90a only): "
                     + ", ".join(wgmma))
    if rest:
        lines.append(f"  {len(rest)} use TMA and mbarrier pipelines as sm_90a has them, untested "
                     f"elsewhere: " + ", ".join(rest))
    return "\n".join(lines)


def selected(ops: str) -> list:
    """The shipped kernel configs of the --ops list (comma separated names of OPS)."""
    names = [o.strip() for o in ops.split(",") if o.strip()]
    bad = [o for o in names if o not in OPS]
    if bad or not names:
        raise CliError(f"--ops: expected a comma-separated subset of {', '.join(OPS)}, got "
                       f"{ops!r}")
    kinds = {k for o in names for k in OPS[o]}
    return [c for c in all_kernels() if spec_of(c).family in kinds]


def header(entries: list[tuple[object, dict]], arch: str) -> str:
    """The C header describing each (config, manifest)."""
    out = [
        "/* kda-cute kernels for " + arch + ": written by `kda-cute export`. */",
        "#ifndef KDA_CUTE_KERNELS_H", "#define KDA_CUTE_KERNELS_H", "",
        "#include <stddef.h>", "",
        "typedef enum { KDA_TMA_DESCRIPTOR, KDA_TMA_COORDINATES, KDA_TENSOR, KDA_I32, KDA_F32,",
        "               KDA_MMA_FLAG } kda_param_role;", "",
        "typedef struct { const char *arg; kda_param_role role; unsigned offset, size; }",
        "    kda_param;", "",
        "/* a TMA descriptor argument: its rank (2, or 3: the checkpoint destinations), the box",
        "   in elements (innermost first; 1 past the rank), its dtype, the shared-memory swizzle",
        "   span in bytes (0: none) */",
        "typedef struct { const char *arg; const char *dtype; unsigned rank, box[3], swizzle; }",
        "    kda_tma;", "",
        "typedef struct {",
        "  const char *name, *entry, *kind, *grid_rule;",
        "  unsigned block[3], dynamic_smem_bytes, param_bytes, registers;",
        "  unsigned num_params; const kda_param *params;",
        "  unsigned num_tma; const kda_tma *tma;",
        "} kda_kernel;", "",
    ]
    table = []
    for cfg, man in entries:
        ident = c_ident(man["name"])
        spec = abi.params(args_for(cfg))
        params = man["params"]
        if [s for _, _, s in spec] != [size for _, _, size in params]:
            raise CliError(f"{man['name']}: its cubin's parameter sizes are not its spec's: "
                           f"rebuild the cubins")
        out.append(f"static const kda_param {ident}_params[] = {{")
        for (arg, role, _), (_, offset, size) in zip(spec, params, strict=True):
            # (kda_param_role's names are abi.params' roles in capitals)
            out.append(f'  {{"{arg}", KDA_{role.upper()}, {offset}, {size}}},')
        out.append("};")
        tma = man.get("tma", [])
        if tma:
            out.append(f"static const kda_tma {ident}_tma[] = {{")
            for t in tma:
                box = (list(t["box"]) + [1, 1, 1])[:3]
                out.append(f'  {{"{t["name"]}", "{t["dtype"]}", {t["rank"]}, '
                           f'{{{box[0]}, {box[1]}, {box[2]}}}, {t["swizzle"]}}},')
            out.append("};")
        block = man["block"]
        out += [f"static const kda_kernel {ident} = {{",
                f'  "{man["name"]}", "{man["entry"]}", "{man["kind"]}",',
                f'  "{GRID_RULES[man["kind"]]}",',
                f"  {{{block[0]}, {block[1]}, {block[2]}}}, {man['dynamic_smem_bytes']}, "
                f"{man['param_bytes']}, {man['registers']},",
                f"  {len(params)}, {ident}_params, {len(tma)}, {ident + '_tma' if tma else 'NULL'}",
                "};", ""]
        table.append(ident)
    out.append("static const kda_kernel *const kda_cute_kernels[] = {")
    out += [f"  &{t}," for t in table]
    out += ["};", f"#define KDA_CUTE_NUM_KERNELS {len(table)}", "", "#endif", ""]
    return "\n".join(out)


def export(out_dir: str | None, arch: str, ops: str, listing: bool) -> list[str]:
    kernels = selected(ops)
    if arch not in SUPPORTED_ARCHS:
        raise CliError(_why_not(arch, kernels))
    if listing:
        return [c.name for c in kernels]
    if not out_dir:
        raise CliError("--out: expected a folder to write the cubins, manifests and header to")
    entries, files = [], []
    for c in kernels:
        try:
            man, path = cubin.load_manifest(c.name, arch)
        except cubin.CubinsMissing as e:
            raise CliError(str(e)) from None
        entries.append((c, man))
        files.append(path)
    dest = Path(out_dir)
    dest.mkdir(parents=True, exist_ok=True)
    for path in files:
        shutil.copyfile(path, dest / path.name)
        shutil.copyfile(path.with_suffix(".json"), dest / (path.stem + ".json"))
    (dest / HEADER).write_text(header(entries, arch))
    return [c.name for c in kernels]


def info(head_dim: int | None, varlen: bool, precision: str) -> list[str]:
    lines = []
    if head_dim is not None:
        cfg = select_config(head_dim, head_dim, varlen, precision)
        if cfg is None:
            raise CliError(f"--head-dim: expected one of the shipped head dims, got {head_dim}")
        lines.append(f"K = V = {head_dim}, {'varlen' if varlen else 'fixed length'}, "
                     f"{precision}: K1 {cfg.prep.name}, K2 {cfg.recur.name}")
        return lines
    for c in all_kernels():
        try:
            m = cubin.manifest(c.name, "sm_90a")
            lines.append(f"{c.name:60s} {m['kind']:11s} block {m['block'][0]:4d} smem "
                         f"{m['dynamic_smem_bytes']:6d} regs {m['registers']:3d}")
        except cubin.CubinsMissing:
            lines.append(f"{c.name:60s} {spec_of(c).family:11s} (not built)")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kda-cute", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="cubins, manifests and a C header for another runtime")
    ex.add_argument("--arch", default="sm_90a")
    ex.add_argument("--out", default=None)
    ex.add_argument("--ops", default="prefill,decode")
    ex.add_argument("--list", action="store_true", help="name the kernels; write nothing")
    inf = sub.add_parser("info", help="the shipped kernels, or the ladder's pick for a shape")
    inf.add_argument("--head-dim", type=int, default=None)
    inf.add_argument("--varlen", action="store_true")
    inf.add_argument("--precision", choices=("fast", "precise"), default="fast")
    for name, what in (("check", "the GPU self-test: each kernel family against the float64 "
                                  "reference"),
                       ("bench", "a short timing of prefill and decode (cold L2, medians)")):
        c = sub.add_parser(name, help=what)
        c.add_argument("--json", default=None, help="also write the results to this file")
    sub.add_parser("plan", add_help=False,
                   help="kda_cute_plan.h: one forward's launches for a C++ runtime "
                        "(kda-cute plan --help; examples/cpp)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:
        from . import plan_export
        return plan_export.main(argv[1:])
    a = ap.parse_args(argv)
    if a.cmd in ("check", "bench"):
        return _gpu(a.cmd, a.json)
    try:
        if a.cmd == "export":
            names = export(a.out, a.arch, a.ops, a.list)
            if a.list:
                print("\n".join(names))
            else:
                print(f"{len(names)} kernels and {HEADER} written to {a.out}")
        else:
            print("\n".join(info(a.head_dim, a.varlen, a.precision)))
    except CliError as e:
        print(f"kda-cute {a.cmd}: {e}", file=sys.stderr)
        return 2
    return 0


def _gpu(cmd: str, json_path: str | None) -> int:
    import json

    from . import selftest
    lines: list[str] = []

    def echo(line):
        lines.append(line)
        print(line, flush=True)

    if cmd == "check":
        good = selftest.check(echo)
        result = {"passed": good, "lines": lines}
    else:
        rows = selftest.bench(echo)
        good = bool(rows)
        result = {"rows": rows}
    if json_path:
        import torch
        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        result["torch"] = torch.__version__
        Path(json_path).write_text(json.dumps(result, indent=1))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
