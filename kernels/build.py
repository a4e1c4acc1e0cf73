"""Ahead-of-time build: every shipped kernel config (ladder.all_kernels) -> one cubin + one JSON
manifest, each compiled from the DSL class and argument list its spec names (kda_cute.specs).

    python -m kernels.build [--arch sm_90a] [--jobs N] [--force] [--out DIR]

Runs on a machine without a GPU. Incremental: a config is skipped when its manifest records the
same build key (hash of the kernel sources, the config and the DSL version). Configs compile in
parallel worker processes (the DSL import, once a process, is small beside the compiles). A build
with no failure lists every kernel it covers in <out>/<arch>/INDEX, which a wheel build checks
(setup.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kda_cute import abi, ladder  # noqa: E402
from kda_cute.cubin import kernel_params, kernel_resources  # noqa: E402
from kda_cute.specs import spec_of  # noqa: E402

DEFAULT_OUT = ROOT / "kda_cute" / "_cubins"
TESTED_ARCHS = ("sm_90a",)
# what a cubin is built from: a change to any of these rebuilds every config
SOURCES = ("kernels/kda_prep_sm90.py", "kernels/kda_recur_sm90.py", "kernels/build.py",
           "kernels/common.py", "kernels/kda_recur_tc_sm90.py", "kernels/kda_combine_sm90.py",
           "kda_cute/abi.py", "kda_cute/specs/__init__.py", "kda_cute/specs/prep.py",
           "kda_cute/specs/recur.py", "kda_cute/specs/combine.py", "kernels/kda_step_sm90.py",
           "kernels/step_rows.py", "kernels/kda_step_persist_sm90.py",
           "kernels/kda_step_chunk_sm90.py", "kernels/kda_replay_sm90.py",
           "kernels/kda_replay_verify_sm90.py",
           "kda_cute/specs/replay.py",
           "kda_cute/specs/step.py", "kernels/kda_offsets_sm90.py", "kda_cute/specs/offsets.py")


def dsl_version() -> str:
    from importlib.metadata import version
    return version("nvidia-cutlass-dsl")


def build_key(cfg, arch: str) -> str:
    h = hashlib.sha256()
    for rel in SOURCES:
        h.update((ROOT / rel).read_bytes())
    h.update(json.dumps([spec_of(cfg).family, cfg.as_dict(), arch, dsl_version()]).encode())
    return h.hexdigest()[:16]


def _fake_args(args, cutlass, cute):
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    dtypes = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32,
              "int32": cutlass.Int32, "int8": cutlass.Int8}
    syms = {}

    def sym(e):
        if not isinstance(e, str):
            return e
        if e not in syms:
            width = abi.SYM_WIDTH[e]
            syms[e] = cute.sym_int(width, divisibility=abi.SYM_DIV.get(e, 1), symbol=e)
        return syms[e]

    out = []
    for a in args:
        if a.kernel_only:
            continue
        if a.kind in ("tma", "tensor"):
            out.append(make_fake_tensor(dtypes[a.dtype], tuple(sym(e) for e in a.shape),
                                        stride=tuple(sym(e) for e in a.stride),
                                        assumed_align=a.align))
        elif a.kind == "i32":
            out.append(cutlass.Int32(0))
        else:
            out.append(cutlass.Float32(0.0))
    out.append(make_fake_stream())
    return out


def dsl_kernel(cfg):
    """The DSL class a spec names for `cfg` (spec_of(cfg).dsl_class), imported."""
    import importlib
    module, cls = spec_of(cfg).dsl_class(cfg).split(":")
    return getattr(importlib.import_module(module), cls)


def compile_one(cfg, arch: str, out_dir: str) -> dict:
    """Compile one config in this process; returns its manifest (also written to disk)."""
    t0 = time.time()
    dump = tempfile.mkdtemp(prefix="kda_dump_")
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ["CUTE_DSL_KEEP"] = "cubin"
    os.environ["CUTE_DSL_DUMP_DIR"] = dump
    import cutlass
    import cutlass.cute as cute

    spec = spec_of(cfg)
    kern = dsl_kernel(cfg)(cfg)
    args = spec.args(cfg)
    compiled = cute.compile(kern, *_fake_args(args, cutlass, cute))
    cubin = compiled.__cubin__
    if not isinstance(cubin, bytes):
        cubin = Path(cubin).read_bytes()
    (entry,) = list(compiled.kernel_info.keys())
    table = kernel_params(cubin)[entry]
    res = kernel_resources(cubin).get(entry, {})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{cfg.name}.cubin").write_bytes(cubin)
    manifest = {
        "name": cfg.name,
        "kind": spec.family,
        "config": cfg.as_dict(),
        "arch": arch,
        "entry": entry,
        "block": [cfg.block_threads, 1, 1],
        "dynamic_smem_bytes": int(kern.smem_bytes),
        "params": [list(p) for p in table["params"]],
        "param_bytes": table["param_bytes"],
        "reqntid": table["reqntid"],
        "registers": res.get("registers"),
        "frame_bytes": res.get("frame_bytes"),
        "args": [a.name for a in args],
        "tma": kern.tma_meta,
        "dsl_version": dsl_version(),
        "build_key": build_key(cfg, arch),
        "compile_s": round(time.time() - t0, 2),
    }
    (out / f"{cfg.name}.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _one_line(e: Exception) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    lines = [ln.strip() for ln in text.splitlines() if "error" in ln.lower()]
    return f"{type(e).__name__}: {(lines[-1] if lines else text.strip())[:300]}"


def up_to_date(cfg, arch: str, out_dir: Path) -> bool:
    man, cub = out_dir / f"{cfg.name}.json", out_dir / f"{cfg.name}.cubin"
    if not (man.exists() and cub.exists()):
        return False
    try:
        return json.loads(man.read_text()).get("build_key") == build_key(cfg, arch)
    except (OSError, ValueError):
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90a", help="target (sm_90a tested; others untested)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="root folder; one subfolder per arch")
    a = ap.parse_args(argv)
    if a.arch not in TESTED_ARCHS:
        print(f"warning: {a.arch} compiles but is untested", file=sys.stderr)
    out_dir = Path(a.out) / a.arch
    todo, skipped = [], []
    for cfg in ladder.all_kernels():
        (skipped if not a.force and up_to_date(cfg, a.arch, out_dir) else todo).append(cfg)
    t0 = time.time()
    results, failed = [], []
    if todo:
        with cf.ProcessPoolExecutor(max_workers=max(1, min(a.jobs, len(todo)))) as pool:
            futs = {pool.submit(compile_one, cfg, a.arch, str(out_dir)): cfg for cfg in todo}
            for fut in cf.as_completed(futs):
                try:
                    results.append(fut.result())
                except Exception as e:  # report every failing config, then fail the build
                    failed.append((futs[fut].name, _one_line(e)))
    print(f"{'config':<44} {'status':<8} {'compile_s':>9} {'smem':>7} {'regs':>5} {'frame':>5}")
    for m in sorted(results, key=lambda m: m["name"]):
        print(f"{m['name']:<44} {'built':<8} {m['compile_s']:>9.2f} {m['dynamic_smem_bytes']:>7} "
              f"{m['registers']:>5} {m['frame_bytes']:>5}")
    for cfg in skipped:
        print(f"{cfg.name:<44} {'cached':<8} {'-':>9} {'-':>7}")
    for name, err in failed:
        print(f"{name:<44} FAILED   {err}")
    print(f"{len(results)} built, {len(skipped)} up to date, {len(failed)} failed "
          f"in {time.time() - t0:.1f}s -> {out_dir}")
    if failed:
        return 1
    # every kernel of this build, one name a line: what a wheel build checks it carries (setup.py)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "INDEX").write_text("".join(f"{c.name}\n" for c in ladder.all_kernels()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
