import pytest

from kda_cute import api


@pytest.fixture(autouse=True)
def _no_replay_across_tests():
    """fwd's recorded launches (api._plans) stay with the test that made them: a later test
    may patch what they were recorded under, or reuse the addresses of freed tensors."""
    api._plans.clear()
    yield
    api._plans.clear()
