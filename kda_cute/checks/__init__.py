"""Every call's checks, each raising ValueError / TypeError that names the argument the caller
passed, what was expected and what was got, before anything is planned or launched:

- `base`: what every call shares (tensors, pools and slot tables, switches, the gate
  parameters, the scalars);
- `prefill`: a prefill's (fwd, and fla's chunk_kda through it);
- `step`: a serving step's (decode, verify, commit, the dense token-by-token forward).
"""

from . import step
from .base import (
    GATE_DTYPES,
    INDEX_DTYPES,
    POOL_DTYPES,
    capturing,
    err,
    flag,
    flags,
    gate_params,
    has_address,
    index_table,
    index_words,
    is_wide,
    null_min,
    pool,
    scalars,
    tensor,
)
from .prefill import (
    CHECKPOINT_ARGS,
    addresses,
    forward,
    metadata,
    options,
    problem,
    require_cuda,
    seqlens,
    validate,
    workspace,
)

__all__ = [
    "CHECKPOINT_ARGS", "GATE_DTYPES", "INDEX_DTYPES", "POOL_DTYPES", "addresses", "capturing",
    "err", "flag", "flags", "forward", "gate_params", "has_address", "index_table",
    "index_words", "is_wide", "metadata", "null_min", "options", "pool", "problem",
    "require_cuda", "scalars", "seqlens", "step", "tensor", "validate", "workspace",
]
