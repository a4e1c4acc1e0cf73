"""kda-cute: Kimi Delta Attention forward kernels for Hopper, CuTe DSL compiled ahead of time."""

from .api import Problem, chunk_kda, clear_caches, fwd, validate, workspace_bytes
from .config import SHIPPED, FwdConfig, PrepConfig, RecurConfig, select_config

__all__ = [
    "SHIPPED", "FwdConfig", "PrepConfig", "Problem", "RecurConfig", "chunk_kda", "clear_caches",
    "fwd", "select_config", "validate", "workspace_bytes",
]
__version__ = "0.1.0"
