"""The replay step's spec (CPU): what it supports, its arguments (the token step's, the ring
after the error words) and the names of its tiles."""

from __future__ import annotations

import dataclasses

import pytest

from kda_cute.specs import args_for, spec_of, step
from kda_cute.specs.replay import ReplayConfig, supports
from kda_cute.step_ladder import REPLAY, REPLAY_VARIANTS

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
    (dict(block_v=48), "block_v"),
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


def test_verify_tiles_are_their_own_kernel():
    verify = [c for c in REPLAY_VARIANTS if c.verify]
    assert verify and all(c.name.endswith("_verify") for c in verify)
    assert {spec_of(c).dsl_class(c) for c in verify} == {
        "kernels.kda_replay_verify_sm90:KdaReplayVerifySm90"}
    assert spec_of(BASE).dsl_class(BASE) == "kernels.kda_replay_sm90:KdaReplaySm90"


def test_name_encodes_the_ring_and_u_dtype():
    assert BASE.name == "kda_replay_k128_v128_f32_bv64_r32_t128_u2_l8_uh"
    assert dataclasses.replace(BASE, ring=16).name != BASE.name
    assert dataclasses.replace(BASE, u_dtype="float32").name.endswith("_uf")
