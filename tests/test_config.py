"""Tile configs, the head-dim ladder and the build's bookkeeping (CPU only)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kda_cute.cubin import CubinsMissing, load_manifest
from kda_cute.ladder import (
    ALONGSIDE,
    CHECKPOINT_RUNS,
    CHECKPOINTS,
    COMBINE,
    EXPERIMENTAL,
    FAST,
    HEAD_DIMS,
    OFFSETS,
    PRECISE,
    RESCALE_RUNS,
    SEGMENT_RUNS,
    SHIPPED,
    SIDE_PREPS,
    SIMT,
    TENSOR_CORE,
    WY_RUNS,
    WY_STAGES,
    FwdConfig,
    all_kernels,
    alongside_of,
    select_config,
    supports,
    wy_of,
)
from kda_cute.specs import PrepConfig, RecurConfig
from kda_cute.specs.prep import supports as supports_prep
from kda_cute.specs.recur import supports as supports_recur
from kda_cute.step_ladder import (
    REPLAY,
    REPLAY_VARIANTS,
    STEP,
    STEP_CHUNK,
    STEP_MULTI,
    STEP_SINGLE,
    STEP_VARIANTS,
)
from kernels.build import build_key, up_to_date

ARCH = "sm_90a"
FWD_IDS = [f"k{f.prep.head_dim_k}_v{f.recur.head_dim_v}" for f in SHIPPED]


# ------------------------------------------------------------------------------- supports
@pytest.mark.parametrize("fwd_cfg", SHIPPED, ids=FWD_IDS)
def test_shipped_configs_supported(fwd_cfg):
    assert supports(fwd_cfg) == (True, "")
    assert supports_prep(fwd_cfg.prep) == (True, "")
    assert supports_recur(fwd_cfg.recur) == (True, "")


# Legal configs at the edges of each range: the checks must not be stricter than stated.
ACCEPTED = {
    "prep-k32": (supports_prep, PrepConfig(32)),
    "prep-k256-t256": (supports_prep, PrepConfig(256, threads=256)),
    "prep-k96-t128": (supports_prep, PrepConfig(96, threads=128)),
    "prep-bf16": (supports_prep, PrepConfig(64, operands="bf16")),
    "recur-bv32": (supports_recur, RecurConfig(64, 64, block_v=32)),
    "recur-s1": (supports_recur, RecurConfig(128, 128, stages=1)),
    "recur-s4": (supports_recur, RecurConfig(128, 128, stages=4)),
    "recur-wgmma-s8": (supports_recur, RecurConfig(128, 128, block_v=64, stages=8,
                                                   mma="wgmma")),
    "fwd-k128-v64": (supports, FwdConfig(PrepConfig(128), RecurConfig(128, 64))),
}


@pytest.mark.parametrize("case_id", list(ACCEPTED))
def test_supports_accepts(case_id):
    check, cfg = ACCEPTED[case_id]
    assert check(cfg) == (True, "")


# id -> (check, config, field named in the reason, got-value shown in the reason)
REJECTED = {
    "prep-k-not-mult8": (supports_prep, PrepConfig(100), "head_dim_k", "100"),
    "prep-k-over-256": (supports_prep, PrepConfig(264), "head_dim_k", "264"),
    "prep-k0": (supports_prep, PrepConfig(0), "head_dim_k", "0"),
    "prep-k-not-mult32": (supports_prep, PrepConfig(40), "head_dim_k", "40"),
    "prep-chunk0": (supports_prep, PrepConfig(64, chunk=0), "chunk", "0"),
    "prep-chunk64": (supports_prep, PrepConfig(64, chunk=64), "chunk", "64"),
    "prep-threads-not-warps": (supports_prep, PrepConfig(64, threads=100), "threads", "100"),
    "prep-threads-below-64": (supports_prep, PrepConfig(32, threads=32), "threads", "32"),
# the vectors fit (4 threads per row, 32 vectors), but the output pass needs a thread per
# column pair of each half of the rows
"prep-threads-below-k": (supports_prep, PrepConfig(256, threads=128), "threads", "128"),
    # 16 threads per row norm, but a K = 96 row has 12 eight-element vectors
    "prep-threads-per-row-over-vectors": (supports_prep, PrepConfig(96, threads=512), "threads",
                                          "512"),
    "prep-threads-not-pow2-rows": (supports_prep, PrepConfig(64, threads=96 * 2),
                                   "threads", "192"),
    "prep-operands": (supports_prep, PrepConfig(64, operands="fp8"), "operands", "fp8"),
    "recur-k-not-mult8": (supports_recur, RecurConfig(100, 64), "head_dim_k", "100"),
    "recur-k-over-256": (supports_recur, RecurConfig(512, 64), "head_dim_k", "512"),
    "recur-block_v-not-dividing-v": (supports_recur, RecurConfig(64, 64, block_v=24),
                                     "block_v", "24"),
    "recur-block_v-over-v": (supports_recur, RecurConfig(64, 64, block_v=128), "block_v",
                             "128"),
    "recur-threads-per-row-not-dividing-k": (supports_recur,
                                             RecurConfig(40, 64, threads=256), "threads", "40"),
    "recur-threads-per-row-over-32": (supports_recur, RecurConfig(64, 64, block_v=2),
                                      "threads", ""),
    "recur-stages0": (supports_recur, RecurConfig(64, 64, stages=0), "stages", "0"),
    "recur-stages5": (supports_recur, RecurConfig(64, 64, stages=5), "stages", "5"),
    "fwd-chunk-mismatch": (supports, FwdConfig(PrepConfig(64), RecurConfig(64, 64, chunk=32)),
                           "chunk", "32"),
    "fwd-head_dim_k-mismatch": (supports, FwdConfig(PrepConfig(64), RecurConfig(128, 128)),
                                "head_dim_k", ""),
    "fwd-bad-prep": (supports, FwdConfig(PrepConfig(64, threads=100), RecurConfig(64, 64)),
                     "threads", "100"),
    "fwd-bad-recur": (supports, FwdConfig(PrepConfig(64), RecurConfig(64, 64, stages=9)),
                      "stages", "9"),
    "recur-wgmma-s9": (supports_recur, RecurConfig(64, 64, block_v=64, stages=9, mma="wgmma"),
                       "stages", "9"),
    "prep-alongside-f32": (supports_prep, PrepConfig(64, alongside=True), "alongside", "f32"),
    # the looped side run is a column-pass K1 (chunk 16, 64 / 128 / 256 threads), not alongside
    "prep-looped-f32": (supports_prep, PrepConfig(128, looped=True), "looped", "_lp"),
    "prep-looped-chunk32": (supports_prep, PrepConfig(128, chunk=32, operands="bf16",
                                                      looped=True), "looped", "_c32_"),
    "prep-looped-alongside": (supports_prep, PrepConfig(128, operands="bf16", alongside=True,
                                                        looped=True), "looped", "_al_lp"),
    "recur-alongside-simt": (supports_recur, RecurConfig(64, 64, alongside=True), "alongside",
                             "simt"),
    "recur-alongside-noout": (supports_recur, RecurConfig(64, 64, block_v=64, mma="wgmma",
                                                          outputs=False, alongside=True),
                              "alongside", "outputs=False"),
    # the WY form: fp16 products only, with outputs, serial (no alongside build)
    "recur-wy-bf16": (supports_recur, RecurConfig(128, 128, block_v=64, mma="wgmma", wy=True),
                      "wy", "f16=False"),
    "recur-wy-noout": (supports_recur, RecurConfig(128, 128, block_v=64, mma="wgmma", f16=True,
                                                   outputs=False, wy=True),
                       "wy", "outputs=False"),
    "recur-wy-alongside": (supports_recur, RecurConfig(128, 128, block_v=64, mma="wgmma",
                                                       f16=True, alongside=True, wy=True),
                           "wy", "alongside=True"),
    # a K1 that never flags beside a K2 that waits for its flags would hang
    "fwd-alongside-mismatch": (supports, FwdConfig(
        PrepConfig(64, threads=64, operands="bf16"),
        RecurConfig(64, 64, block_v=64, stages=8, mma="wgmma", alongside=True)),
        "alongside", "False"),
}


@pytest.mark.parametrize("case_id", list(REJECTED))
def test_supports_rejects_naming_field(case_id):
    check, cfg, field, got = REJECTED[case_id]
    ok, reason = check(cfg)
    assert ok is False
    assert field in reason and got in reason, reason


# ---------------------------------------------------------------------- alongside builds
@pytest.mark.parametrize("fwd_cfg", TENSOR_CORE, ids=lambda f: f.prep.name)
def test_alongside_build_of_each_tensor_core_forward(fwd_cfg):
    """Each shipped tensor-core forward has its alongside build: the same kernels with the
    flags compiled in (K1 flags, K2 waits), K2 in eight stages where they fit a whole SM."""
    a = alongside_of(fwd_cfg)
    assert a in ALONGSIDE and supports(a) == (True, "")
    assert a.prep == dataclasses.replace(fwd_cfg.prep, alongside=True)
    assert a.recur == dataclasses.replace(fwd_cfg.recur, alongside=True, stages=a.recur.stages)
    assert a.recur.stages == (8 if fwd_cfg.recur.head_dim_k <= 128 else 4)
    assert a.prep.name == fwd_cfg.prep.name + "_al" and a.recur.name.endswith("_al")
    assert a.prep in all_kernels() and a.recur in all_kernels()


@pytest.mark.parametrize("fwd_cfg", SIMT + EXPERIMENTAL + ALONGSIDE,
                         ids=lambda f: f"{f.prep.name}-{f.recur.name}")
def test_no_alongside_build_otherwise(fwd_cfg):
    assert alongside_of(fwd_cfg) is None


# ------------------------------------------------------------------------------ the ladder
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("d", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
def test_select_config_shipped(d, varlen):
    cfg = select_config(d, d, varlen)
    assert cfg in SHIPPED
    assert cfg in TENSOR_CORE  # verified on the H200: the ladder picks the tensor-core forward
    assert (cfg.prep.head_dim_k, cfg.recur.head_dim_k, cfg.recur.head_dim_v) == (d, d, d)
    assert supports(cfg)[0]


NO_CONFIG = {"k96": (96, 96), "k32": (32, 32), "k512": (512, 512), "k128-v64": (128, 64),
             "k64-v128": (64, 128), "k0": (0, 0)}


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("case_id", list(NO_CONFIG))
def test_select_config_none(case_id, varlen):
    assert select_config(*NO_CONFIG[case_id], varlen) is None


# ------------------------------------------------------------------------------- names, jobs
def test_kernel_names_unique():
    names = [c.name for c in all_kernels()]
    assert len(set(names)) == len(names), names
    shipped = {f.prep for f in SHIPPED} | {f.recur for f in SHIPPED}
    assert len({c.name for c in shipped}) == len(shipped)


NAME_FIELDS = [(PrepConfig(128), f.name) for f in dataclasses.fields(PrepConfig)]
NAME_FIELDS += [(RecurConfig(128, 128), f.name) for f in dataclasses.fields(RecurConfig)]


@pytest.mark.parametrize("cfg,field", NAME_FIELDS,
                         ids=[f"{type(c).__name__}-{f}" for c, f in NAME_FIELDS])
def test_name_encodes_every_field(cfg, field):
    """Two configs with one name would overwrite each other's cubin and manifest."""
    value = getattr(cfg, field)
    other = dataclasses.replace(cfg, **{field: not value if isinstance(value, bool) else value * 2})
    assert other.name != cfg.name


def test_all_kernels_once_each():
    """ladder.all_kernels: every built kernel once, the forwards' K1 and K2 first."""
    kernels = all_kernels()
    assert len(set(kernels)) == len(kernels)
    forwards = SHIPPED + EXPERIMENTAL + ALONGSIDE
    assert set(kernels) == ({f.prep for f in forwards} | {f.recur for f in forwards}
                            | set(SEGMENT_RUNS) | set(WY_RUNS) | set(CHECKPOINT_RUNS)
                            | set(SIDE_PREPS) | set(RESCALE_RUNS) | set(COMBINE) | set(STEP)
                            | {c for _, c in STEP_SINGLE + STEP_MULTI + STEP_CHUNK}
                            | set(STEP_VARIANTS)
                            | {OFFSETS, CHECKPOINTS} | set(REPLAY) | set(REPLAY_VARIANTS))
    assert set(kernels[:2 * len(SHIPPED)]) == ({f.prep for f in SHIPPED}
                                                | {f.recur for f in SHIPPED})


# -------------------------------------------------------------------------------- build key
def test_build_key_stable():
    for cfg in all_kernels():
        assert build_key(cfg, ARCH) == build_key(cfg, ARCH)


KEY_PAIRS = {
    "prep-head_dim": (PrepConfig(64), PrepConfig(128)),
    "prep-chunk": (PrepConfig(128), PrepConfig(128, chunk=32)),
    "recur-stages": (RecurConfig(128, 128), RecurConfig(128, 128, stages=3)),
    "recur-block_v": (RecurConfig(128, 128), RecurConfig(128, 128, block_v=32)),
    "recur-head_dim_v": (RecurConfig(128, 128), RecurConfig(128, 64)),
}


@pytest.mark.parametrize("case_id", list(KEY_PAIRS))
def test_build_key_changes_with_config(case_id):
    a, b = KEY_PAIRS[case_id]
    assert build_key(a, ARCH) != build_key(b, ARCH)


def test_build_key_changes_with_arch():
    cfg = SHIPPED[0].recur
    assert build_key(cfg, "sm_90a") != build_key(cfg, "sm_100a")


def test_build_keys_of_shipped_jobs_distinct():
    keys = [build_key(c, ARCH) for c in all_kernels()]
    assert len(set(keys)) == len(keys)


UP_TO_DATE = {
    "current": (True, True, None),
    "stale-key": (True, True, "0123456789abcdef"),
    "no-cubin": (True, False, None),
    "no-manifest": (False, True, None),
}


@pytest.mark.parametrize("case_id", list(UP_TO_DATE))
def test_up_to_date(tmp_path, case_id):
    with_manifest, with_cubin, key = UP_TO_DATE[case_id]
    cfg = SHIPPED[0].prep
    if with_manifest:
        (tmp_path / f"{cfg.name}.json").write_text(
            json.dumps({"build_key": key or build_key(cfg, ARCH)}))
    if with_cubin:
        (tmp_path / f"{cfg.name}.cubin").write_bytes(b"\x7fELF")
    assert up_to_date(cfg, ARCH, tmp_path) is (case_id == "current")


# -------------------------------------------------------------------------- missing cubins
@pytest.mark.parametrize("name,arch", [("nope", ARCH), (SHIPPED[0].prep.name, "sm_00a")],
                         ids=["unknown-kernel", "unknown-arch"])
def test_load_manifest_missing(name, arch):
    with pytest.raises(CubinsMissing) as info:
        load_manifest(name, arch)
    msg = str(info.value)
    assert "make kernels" in msg and name in msg and arch in msg, msg


@pytest.mark.parametrize("d", HEAD_DIMS, ids=[f"d{d}" for d in HEAD_DIMS])
def test_select_config_precision(d):
    """"fast" (the default) picks the fp16-operand forward, "precise" the bf16 hi/lo one, at
    every head dim."""
    fast, precise = select_config(d, d, False), select_config(d, d, False, "precise")
    assert precise in PRECISE and not precise.prep.f16 and not precise.recur.f16
    assert fast == select_config(d, d, False, "fast")
    assert fast in FAST and fast.prep.f16 and fast.recur.f16
    # both have their alongside builds and segment runs
    for cfg in {fast, precise}:
        assert alongside_of(cfg) is not None
        assert dataclasses.replace(cfg.recur, outputs=False) in SEGMENT_RUNS


def test_wy_builds_are_the_fast_k2s_at_k128_and_256():
    """ladder.WY_RUNS: one WY build per fast K2 at K >= 128, each legal; wy_of finds it, and
    finds none for the precise K2s or at K = 64."""
    assert sorted(r.head_dim_k for r in WY_RUNS) == [128, 256]
    for f in FAST:
        w = wy_of(f.recur)
        if f.recur.head_dim_k >= 128:
            assert w in WY_RUNS and w.wy and supports_recur(w) == (True, "")
            stages = WY_STAGES.get(f.recur.head_dim_k, f.recur.stages)
            assert w.name == f.recur.name.replace(
                f"_s{f.recur.stages}_f16", f"_s{stages}_f16_wy")
            assert w.stages == stages
        else:
            assert w is None
    assert all(wy_of(f.recur) is None for f in PRECISE)
