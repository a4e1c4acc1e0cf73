"""The GPU tests' gate, in one place: a test marked `gpu` skips, with the reason, where
kda-cute's kernels cannot run (no CUDA device, not a Hopper GPU, cubins not built)."""

import pytest

from kda_cute.testing import cuda_ready


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    ok, why = cuda_ready()
    if not ok:
        skip = pytest.mark.skip(reason=why)
        for item in gpu:
            item.add_marker(skip)
