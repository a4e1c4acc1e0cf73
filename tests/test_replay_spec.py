"""The replay step's spec (CPU): what it supports, its arguments (the token step's, the ring
after the error words) and the names of its tiles."""

from __future__ import annotations

import dataclasses

import pytest

from kda_cute.specs import args_for, spec_of, step
from kda_cute.specs.replay import ReplayConfig, supports
from kda_cute.step_ladder import HOIST, REPLAY, REPLAY_VARIANTS, select_replay

BASE = ReplayConfig(128, 128, "float32", 64, 32, 128, unroll=2, ring=8)


def test_tiles_are_supported_and_named_apart():
    tiles = REPLAY + REPLAY_VARIANTS
    assert all(supports(c) == (True, "") for c in tiles)
    assert len({c.name for c in tiles}) == len(tiles)
    assert all(spec_of(c).family == "replay" for c in tiles)


@pytest.mark.parametrize("change, word", [
    (dict(ring=12), "ring"), (dict(ring=64), "ring"), (dict(u_dtype="bfloat16"), "u_dtype"),
    (dict(persist=2), "persist"), (dict(prep=4), "prep"), (dict(chunk=2), "chunk"),
    (dict(ahead=True), "ahead"), (dict(tpr=1, block_v=4, threads=32), "tpr"),
    (dict(block_v=48), "block_v"), (dict(ring=4), "ring"),
    (dict(hoist=8), "hoist"), (dict(hoist=-1), "hoist"), (dict(mode="flush", hoist=2), "hoist"),
    (dict(mode="verify", hoist=2), "hoist"),
])
def test_unsupported_tiles_say_why(change, word):
    ok, why = supports(dataclasses.replace(BASE, **change))
    assert not ok and word in why


def test_arguments_are_the_steps_with_the_ring_after_the_errors():
    names = [a.name for a in args_for(BASE)]
    steps = [a.name for a in step.args(BASE)]
    cut = steps.index("errors") + 1
    ring = ["ring_k", "ring_r", "ring_u", "ring_g", "cursor", "tickets"]
    assert names == steps[:cut] + ring + steps[cut:] + ["window"]
    by = {a.name: a for a in args_for(dataclasses.replace(BASE, u_dtype="float32"))}
    assert by["ring_u"].dtype == "float32" and by["ring_k"].dtype == "bfloat16"
    assert by["ring_g"].shape == ("P", "H", 8, 128) and by["cursor"].dtype == "int32"


@pytest.mark.parametrize("mode, cls", [
    ("decode", "kda_replay_sm90:KdaReplaySm90"),
    ("verify", "kda_replay_verify_sm90:KdaReplayVerifySm90"),
    ("flush", "kda_replay_flush_sm90:KdaReplayFlushSm90"),
    ("commit", "kda_replay_commit_sm90:KdaReplayCommitSm90")])
def test_each_mode_is_its_own_kernel_named_apart(mode, cls):
    tiles = [c for c in REPLAY if c.mode == mode]
    assert len(tiles) >= 3
    assert {spec_of(c).dsl_class(c) for c in tiles} == {"kernels." + cls}
    assert all(c.name.startswith("kda_replay_commit_") if mode == "commit" else
               c.name.removesuffix("_mma").removesuffix(f"_d{c.drafts}").endswith(
                   "" if mode == "decode" else "_" + mode) for c in tiles)


def test_select_replay_picks_a_tile_of_the_mode_ring_and_pool():
    for c in REPLAY:
        assert select_replay(128, 128, c.pool, c.mode, c.ring, c.drafts or min(c.ring, 16)) \
            == c or \
            c.mode == "commit"
    assert select_replay(128, 128, "float32", "verify", 16, 16).drafts == 0
    assert select_replay(128, 128, "float32", "verify", 8, 8).drafts == 0  # a ring of 8: 8
    assert select_replay(128, 128, "float32", "verify", 8, 9) is None
    assert select_replay(128, 128, "bfloat16", "commit", 16).mode == "commit"
    assert select_replay(64, 64, "float32", "decode", 16) is None
    assert select_replay(128, 128, "float32", "decode", 4) is None


def test_verify_tiles_are_two_threads_a_row():
    tile = dataclasses.replace(BASE, mode="verify")  # 64 rows of 32 lanes at 128 threads
    assert supports(tile) == (True, "")
    ok, why = supports(dataclasses.replace(BASE, mode="verify", block_v=32))
    assert not ok and "verify" in why
    ok, why = supports(dataclasses.replace(BASE, mode="replay"))
    assert not ok and "mode" in why


def test_name_encodes_the_ring_and_u_dtype():
    assert BASE.name == "kda_replay_k128_v128_f32_bv64_r32_t128_u2_l8_uh"
    assert dataclasses.replace(BASE, ring=16).name != BASE.name
    assert dataclasses.replace(BASE, u_dtype="float32").name.endswith("_uf")


def test_hoist_is_named_and_each_shipped_decode_tile_has_its_twin():
    assert dataclasses.replace(BASE, hoist=HOIST).name == BASE.name + f"_h{HOIST}"
    assert supports(dataclasses.replace(BASE, hoist=BASE.ring - 1)) == (True, "")
    decode = [c for c in REPLAY if c.mode == "decode"]
    assert {(c.pool, c.ring) for c in decode if c.hoist} == {
        ("float32", 8), ("float32", 16), ("float32", 32), ("bfloat16", 16)}
    assert all(c.hoist in (0, HOIST) for c in decode)
    for c in decode:
        assert dataclasses.replace(c, hoist=0 if c.hoist else HOIST) in REPLAY_VARIANTS
    assert not any(c.hoist for c in REPLAY + REPLAY_VARIANTS if c.mode != "decode")
