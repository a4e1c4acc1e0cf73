"""The built K2 cubins keep their warpgroup MMAs asynchronous (CPU, with the nvdisasm that
ships in triton's wheel); and other properties of the built cubins' SASS that only a benchmark
would otherwise show (the last tests: K2's shuffles and dependent launches, the chunked token
step's tensor-core products).

When ptxas cannot prove an asynchronous wgmma's registers safe (an MMA accumulating into a view
of part of another MMA's accumulator registers, or a wgmma still in flight across a loop's
back-edge), it serializes every wgmma of the kernel: each waits for all before it
(`WARPGROUP.DEPBAR.LE gsb0, 0x0` only). The kernel stays correct, so the GPU tests pass, and
only the benchmark would show it. K2 overlaps its output product with the state update
(`warpgroup.wait_group(1)`), which must survive as a `WARPGROUP.DEPBAR.LE gsb0, 0x1`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kda_cute.cubin import CUBIN_ROOT
from kda_cute.ladder import (
    ALONGSIDE,
    CHECKPOINT_RUNS,
    EXPERIMENTAL,
    RESCALE_RUNS,
    SEGMENT_RUNS,
    SHIPPED,
    WY_RUNS,
)
from kda_cute.specs.recur import checkpoint_maps


def _nvdisasm() -> Path | None:
    try:
        import triton
    except ImportError:
        return None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    return path if path.exists() else None


NVDISASM = _nvdisasm()
WGMMA = sorted({c.recur for c in SHIPPED + EXPERIMENTAL + ALONGSIDE if c.recur.mma == "wgmma"}
               | set(WY_RUNS),
               key=lambda r: r.name)


def _sass(cfg) -> str:
    """The disassembly of a built config's cubin (skips the test where it is not built)."""
    cubin = CUBIN_ROOT / "sm_90a" / f"{cfg.name}.cubin"
    if not cubin.exists():
        pytest.skip(f"{cubin.name} not built (make kernels)")
    return subprocess.run([str(NVDISASM), "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.skipif(NVDISASM is None, reason="no nvdisasm (triton's wheel ships one)")
@pytest.mark.parametrize("cfg", WGMMA, ids=lambda r: r.name)
def test_wgmma_not_serialized(cfg):
    sass = _sass(cfg)
    assert "HGMMA" in sass
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass, (
        f"{cfg.name}: every wgmma waits for all before it (ptxas serialized them)")


@pytest.mark.skipif(NVDISASM is None, reason="no nvdisasm (triton's wheel ships one)")
@pytest.mark.parametrize("cfg", SEGMENT_RUNS, ids=lambda r: r.name)
def test_state_run_wgmma_groups_not_split(cfg):
    """K2 without outputs keeps one product group in flight at a time (P in its slabs of K, U,
    the update: each waited for with DEPBAR 0x0 by design), so the serialization shows
    differently: a WARPGROUP.ARRIVE before every HGMMA instead of one per group."""
    sass = _sass(cfg)
    hgmma, arrive = sass.count("HGMMA."), sass.count("WARPGROUP.ARRIVE")
    assert hgmma >= 3 * cfg.head_dim_k // 64 + 3, sass.count("HGMMA")
    groups = max(1, cfg.head_dim_k // 128) + 2
    assert arrive <= groups < hgmma, (hgmma, arrive)


@pytest.mark.skipif(NVDISASM is None, reason="no nvdisasm (triton's wheel ships one)")
@pytest.mark.parametrize("cfg", sorted(set(WGMMA) | set(SEGMENT_RUNS), key=lambda r: r.name),
                         ids=lambda r: r.name)
def test_tma_loads_issued_from_uniform_registers(cfg):
    """K2's producer warp issues each TMA load once: its descriptors, coordinates and stage
    index are warp-uniform. Where ptxas cannot prove them so (a store under a thread's own
    condition inside the warp-specialised loops did it), it wraps every load in an elect loop
    (ELECT, UTMALDG, `BRA.U.ANY` back), which slowed the output-free segment runs by half."""
    sass = _sass(cfg)
    assert "UTMALDG" in sass
    assert "BRA.U.ANY" not in sass, f"{cfg.name}: TMA loads inside elect loops"


@pytest.mark.skipif(NVDISASM is None, reason="no nvdisasm (triton's wheel ships one)")
@pytest.mark.parametrize("cfg", CHECKPOINT_RUNS, ids=lambda r: r.name)
def test_checkpoint_copies_issued_from_one_lane(cfg):
    """A checkpoint leaves a warp's slab in one TMA tensor store per destination form (fp32,
    bf16, scratch: UTMASTG.3D) where its padded row fits a box (specs.recur.checkpoint_maps);
    otherwise (K = 256) its row copies (cp.async.bulk, UBLKCP: addresses in uniform registers)
    are issued by one lane, 16 in a row. Issued from 16 lanes at once, ptxas runs them one lane
    at a time in a loop (`BRA.U.ANY` back), which cost a checkpoint ~0.3 us of the chain at
    bf16, and the 64 requests a CTA a checkpoint cost ~65 us on B1 T8192 H64 at one per 64
    tokens (bench/results/checkpoints-variants-h200-2026-12-04.md). (The rescale builds,
    RESCALE_RUNS, keep the row copies in a loop around each copy, entered by the one issuing
    lane: one pass, on a path run only where a forward overflowed.)"""
    sass = _sass(cfg)
    if checkpoint_maps(cfg):
        # (three a call site of K2's _checkpoints: before the first chunk and after a run)
        n = sass.count("UTMASTG.3D")
        assert n >= 3 and n % 3 == 0, n
        assert "UBLKCP" not in sass
    else:
        assert sass.count("UBLKCP") >= 3 * 16, sass.count("UBLKCP")
    assert "BRA.U.ANY" not in sass, f"{cfg.name}: bulk copies inside a per-lane loop"


@pytest.mark.skipif(NVDISASM is None, reason="no nvdisasm (triton's wheel ships one)")
@pytest.mark.parametrize("cfg", CHECKPOINT_RUNS, ids=lambda r: r.name)
def test_checkpoint_table_held_in_lanes_where_it_paid(cfg):
    """The fp16 alongside checkpoints builds at K >= 128 hold their checkpoint table in lanes,
    the due entry handed out by a shuffle (SHFL.IDX: two where a sequence's first entry is
    taken, two in each of K2's two inlined _checkpoints): 2-4% faster there; the other
    checkpoints builds read it a checkpoint ahead from global memory, which measured up to 7%
    faster for them (bench/results/checkpoints-lanes-h200-2026-12-04.md). K2 shuffles nothing
    else."""
    sass = _sass(cfg)
    lanes = cfg.f16 and cfg.alongside and cfg.head_dim_k >= 128
    assert sass.count("SHFL.IDX") == (6 if lanes else 0), cfg.name


@pytest.mark.skipif(NVDISASM is None, reason="no nvdisasm (triton's wheel ships one)")
@pytest.mark.parametrize(
    "cfg", sorted(set(WGMMA) | set(SEGMENT_RUNS) | set(CHECKPOINT_RUNS) | set(RESCALE_RUNS),
                  key=lambda r: r.name), ids=lambda r: r.name)
def test_rescale_runs_wait_for_the_k2_that_releases_them(cfg):
    """A fast forward's rescale run is launched as the programmatic dependent of the K2 right
    before it (plans.launches.rescale_run): every fp16 K2 but the alongside ones releases its
    dependent at its start (PREEXIT: griddepcontrol.launch_dependents; the alongside ones
    release K1), and the rescale builds wait for that K2 to complete (ACQBULK:
    griddepcontrol.wait) before their first global load: without the wait they would read
    the rescale words before the K2 wrote them."""
    sass = _sass(cfg)
    assert ("PREEXIT" in sass) == (cfg.alongside or (cfg.f16 and not cfg.rescale)), cfg.name
    if cfg.rescale:
        assert "ACQBULK" in sass, cfg.name
        # before the wait, at most the side run's sequence count (its offsets were written by
        # the checkpoints kernel, complete before that K2 started), none of the K2's outputs
        assert sass[:sass.index("ACQBULK")].count("LDG") <= 1, cfg.name
    else:
        assert "ACQBULK" not in sass, cfg.name



def _chunk_tiles():
    from kda_cute.step_ladder import step_tiles
    return [c for c in step_tiles() if c.chunk]


@pytest.mark.skipif(NVDISASM is None, reason="no nvdisasm (triton's wheel ships one)")
@pytest.mark.parametrize("cfg", _chunk_tiles(), ids=lambda c: c.name)
def test_chunk_tiles_products_on_tensor_cores(cfg):
    """A chunked token-step tile (StepConfig.chunk) takes every token's products with the start
    state by warp MMA, written once in its body (a persistent tile's loop too): a bf16 state
    against the hi and lo planes, m16n8k16 bf16 twice a k step of 16; an fp32 state split into
    tf32 hi and lo against the planes, m16n8k8 tf32 three times a k step of 8 (S_hi hi, S_hi lo,
    S_lo hi); one n8 tile per 8 of the planes' columns (max(8, 2 chunk)). Nothing else in the
    kernel runs on tensor cores, and nothing spills."""
    from kda_cute import cubin
    sass = _sass(cfg)
    K, cols = cfg.head_dim_k, max(8, 2 * cfg.chunk)
    if cfg.pool == "float32":
        want, form = 3 * (K // 8) * (cols // 8), "HMMA.1688.F32.TF32"
    else:
        want, form = 2 * (K // 16) * (cols // 8), "HMMA.16816.F32.BF16"
    assert sass.count("HMMA") == sass.count(form) == want, cfg.name
    assert cubin.manifest(cfg.name, "sm_90a")["frame_bytes"] == 0, cfg.name
