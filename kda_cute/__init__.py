"""kda-cute: Kimi Delta Attention forward kernels for Hopper, CuTe DSL compiled ahead of time."""

from .api import chunk_kda, clear_caches, describe, fwd, validate, workspace_bytes
from .ladder import SHIPPED, FwdConfig, select_config
from .launch import Bound, bind, run
from .plans import Plan, plan
from .problem import Call, Options, Problem
from .specs import PrepConfig, RecurConfig

__all__ = [
    "SHIPPED", "Bound", "Call", "FwdConfig", "Options", "Plan", "PrepConfig", "Problem",
    "RecurConfig", "bind", "chunk_kda", "clear_caches", "describe", "fwd", "plan", "run",
    "select_config", "validate", "workspace_bytes",
]
__version__ = "0.1.0"
