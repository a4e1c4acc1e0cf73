"""The experimental configs (ladder.EXPERIMENTAL: chunk 32) on the H200 against the float64
reference. Kept in a file pytest runs after the shipped configs' tests."""

import pytest
import torch

from kda_cute.ladder import EXPERIMENTAL
from kda_cute.testing import assert_errors as _assert
from kda_cute.testing import check_tokens_past_the_last_sequence, errors, make_inputs

pytestmark = pytest.mark.gpu

CASES = {
    "fixed": dict(B=2, T=100, H=2),
    "unbounded": dict(B=2, T=77, H=2, gate="unbounded"),
    "strong-decay": dict(B=1, T=300, H=2, gate="unbounded", g_shift=20.0),
    "varlen": dict(seqlens=[1, 15, 17, 0, 70, 33, 64, 31], H=2),
    "bar-T4096": dict(B=1, T=4096, H=4),
    "bf16-state": dict(B=2, T=50, H=2, state_dtype=torch.bfloat16),
    "no-activations": dict(B=1, T=90, H=2, gate="none", qk_l2norm=False, beta_sigmoid=False),
}
IDS = [f"{c.prep.name}-{c.recur.name}" for c in EXPERIMENTAL]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("cfg", EXPERIMENTAL, ids=IDS)
def test_experimental_forward(cfg, name):
    kw = dict(CASES[name], K=cfg.prep.head_dim_k)
    _assert(errors(make_inputs(seed=len(name) + 7, **kw), config=cfg))


@pytest.mark.parametrize("cfg", [c for c in EXPERIMENTAL if c.prep.head_dim_k == 128],
                         ids=lambda c: c.recur.name)
def test_experimental_tokens_past_the_last_sequence(cfg):
    check_tokens_past_the_last_sequence(cfg)
