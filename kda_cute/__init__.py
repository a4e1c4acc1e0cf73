"""kda-cute: Kimi Delta Attention kernels for Hopper (prefill, decode, verify against a state
pool), CuTe DSL compiled ahead of time."""

import os

from .api import clear_caches, describe, fwd, validate, workspace_bytes
from .context import combine as context_combine
from .context import context_finish, context_summary
from .errors import DeviceValueError
from .fla_forms import (
    check_chunk_kda,
    check_fused_recurrent_kda_fwd,
    chunk_kda,
    fused_recurrent_kda_fwd,
)
from .ladder import SHIPPED, FwdConfig, select_config
from .launch import Bound, bind, run
from .plans import Plan, plan
from .problem import Call, Options, Problem, StepCall, StepOptions, StepProblem
from .replay import Ring, new_ring, replay_commit, replay_decode, replay_flush, replay_verify
from .serving import check_errors, commit, decode, recurrent, verify
from .specs import PrepConfig, RecurConfig, StepConfig

__all__ = [
    "SHIPPED", "Bound", "Call", "DeviceValueError", "FwdConfig", "Options", "Plan", "PrepConfig",
    "Problem", "RecurConfig", "Ring", "StepCall", "StepConfig", "StepOptions", "StepProblem",
    "bind", "check_chunk_kda", "check_errors", "check_fused_recurrent_kda_fwd", "chunk_kda",
    "clear_caches", "commit", "context_combine", "context_finish", "context_summary", "decode",
    "describe", "fused_recurrent_kda_fwd", "fwd", "new_ring",
    "plan", "recurrent", "replay_commit", "replay_decode", "replay_flush", "replay_verify", "run",
    "select_config", "validate", "verify", "workspace_bytes"
]
__version__ = "0.1.0"

if os.environ.get("KDA_CUTE_FLA", "0") != "0":
    # fla's chunk_kda and fused_recurrent_kda_fwd dispatch to kda-cute (needs fla-core >= 0.6)
    from .integrations import fla as _fla

    _fla.register()
