"""K1 alone on the H200: its workspace against the float64 chunked twin (skips without a GPU)."""

import pytest

from kda_cute.testing import cuda_ready, make_inputs, prep_errors

ok, why = cuda_ready()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ok, reason=why)]

CASES = {
    "fixed-K128": dict(B=2, T=37, H=3, K=128),
    "fixed-K64-unbounded": dict(B=2, T=20, H=2, K=64, gate="unbounded"),
    "fixed-K256-none": dict(B=1, T=40, H=2, K=256, gate="none"),
    "varlen": dict(seqlens=[5, 0, 33, 16, 1], H=2, K=128),
}


@pytest.mark.parametrize("name", list(CASES))
def test_prep_matches_chunked_twin(name):
    res = prep_errors(make_inputs(seed=len(name), **CASES[name]))
    # fp32 arithmetic on bf16 inputs: only fp32 rounding separates K1 from the float64 twin
    assert all(e < 1e-5 for e in res.values()), res
