"""Every call's checks, each raising ValueError / TypeError that names the argument the caller
passed, what was expected and what was got, before anything is planned or launched: `base`
(what every call shares), `prefill` (fwd's, and fla's chunk_kda through it) and `step` (the
serving steps'). The package holds the names its callers use; the rest are in the modules."""

from . import step
from .base import INDEX_DTYPES, POOL_DTYPES, capturing, err, flag, has_address, tensor
from .prefill import forward, metadata, options, seqlens, validate, workspace

__all__ = ["INDEX_DTYPES", "POOL_DTYPES", "capturing", "err", "flag", "forward", "has_address",
           "metadata", "options", "seqlens", "step", "tensor", "validate", "workspace"]
