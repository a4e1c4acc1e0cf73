"""Plans: what a forward will launch, from metadata alone.

`plan(problem, options, device)` is pure (no driver call, no tensor touched: the problem's
metadata, the options, the device's properties and the kernels' manifests) and cached by its
arguments. A Plan lists named steps (plans.steps): kernel launches with each argument's source,
a memset, the torch-side steps; `Plan.describe()` says in words what runs. kda_cute.launch runs
a plan against a call's tensors.
"""

from __future__ import annotations

import functools

from ..ladder import config_for
from ..problem import Options, Problem
from .device import H200, DeviceInfo, device_info
from .prefill import forward_plan
from .steps import Plan
from .workspace import workspace_bytes


@functools.lru_cache(maxsize=256)
def _plan(problem: Problem, options: Options, device: DeviceInfo) -> Plan:
    return forward_plan(problem, options, config_for(problem, options), device)


def plan(problem: Problem, options: Options | None = None,
         device: DeviceInfo = H200) -> Plan:
    """The forward plan of `problem` under `options` (default Options()) on `device` (a
    DeviceInfo: `device_info(torch_device)`, or H200 to plan without one)."""
    return _plan(problem, options if options is not None else Options(), device)


def clear() -> None:
    _plan.cache_clear()


__all__ = ["H200", "DeviceInfo", "Plan", "clear", "device_info", "plan", "workspace_bytes"]
