"""K2 on bf16 warpgroup MMA (config.EXPERIMENTAL) on the H200 against the float64 reference.

Kept in its own file, which pytest runs last, so that a fault in the unproven kernel cannot take
the shipped kernels' results down with it. The ladder picks these configs only once this passes.
"""

import pytest
import torch

from kda_cute.testing import cuda_ready, errors, make_inputs
from tests.test_gpu_forward import _assert, check_tokens_past_the_last_sequence

ok, why = cuda_ready()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ok, reason=why)]


TC_CASES = {
    "fixed-K128": dict(B=2, T=100, H=2, K=128),
    "fixed-K64-unbounded": dict(B=2, T=37, H=2, K=64, gate="unbounded"),
    "fixed-K256": dict(B=1, T=70, H=2, K=256),
    "varlen-K128": dict(seqlens=[1, 15, 17, 0, 70, 33], H=2, K=128),
    "strong-decay": dict(B=1, T=300, H=2, K=128, gate="unbounded", g_shift=20.0),
    "bar-T4096": dict(B=1, T=4096, H=4, K=128),
    "bf16-state": dict(B=2, T=50, H=2, K=128, state_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", list(TC_CASES))
def test_wgmma_recurrence(name):
    from kda_cute.config import EXPERIMENTAL
    kw = TC_CASES[name]
    (cfg,) = [c for c in EXPERIMENTAL if c.prep.head_dim_k == kw["K"]]
    _assert(errors(make_inputs(seed=len(name) + 31, **kw), config=cfg))


def test_wgmma_tokens_past_the_last_sequence():
    check_tokens_past_the_last_sequence("wgmma")
