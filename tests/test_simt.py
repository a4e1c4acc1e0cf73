"""The fp32 CUDA-core forward (ladder.SIMT) on the H200 against the float64 reference.

It is the accuracy baseline (fp32 products throughout) the tensor-core ladder is compared with,
reachable through fwd(config=...). The ladder's own configs run in test_forward.py.
"""

import pytest
import torch

from kda_cute.testing import assert_errors as _assert
from kda_cute.testing import check_tokens_past_the_last_sequence, errors, make_inputs

pytestmark = pytest.mark.gpu


SIMT_CASES = {
    "fixed-K128": dict(B=2, T=100, H=2, K=128),
    "fixed-K64-unbounded": dict(B=2, T=37, H=2, K=64, gate="unbounded"),
    "fixed-K256": dict(B=1, T=70, H=2, K=256),
    "varlen-K128": dict(seqlens=[1, 15, 17, 0, 70, 33], H=2, K=128),
    "strong-decay": dict(B=1, T=300, H=2, K=128, gate="unbounded", g_shift=20.0),
    "bar-T4096": dict(B=1, T=4096, H=4, K=128),
    "bf16-state": dict(B=2, T=50, H=2, K=128, state_dtype=torch.bfloat16),
}


def _simt(K):
    from kda_cute.ladder import SIMT
    (cfg,) = [c for c in SIMT if c.prep.head_dim_k == K]
    return cfg


@pytest.mark.parametrize("name", list(SIMT_CASES))
def test_simt_forward(name):
    kw = SIMT_CASES[name]
    _assert(errors(make_inputs(seed=len(name) + 31, **kw), config=_simt(kw["K"])))


def test_simt_tokens_past_the_last_sequence():
    check_tokens_past_the_last_sequence(_simt(128))
