"""One DSL-free spec per kernel family, and the registry of families.

A spec holds what the AOT build, the launcher and the ABI tests need of a kernel: its config
dataclass (whose `name` is the cubin's), `supports(config) -> (ok, reason)`, the argument list of
its `__call__` (kda_cute.abi), and where its DSL class lives. Which configs ship is the ladder's
business (kda_cute.ladder.all_kernels); this registry says how to build and call any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..abi import Arg
from . import checkpoints, combine, offsets, prep, recur, replay, step
from .checkpoints import CheckpointsConfig
from .combine import CombineConfig
from .offsets import OffsetsConfig
from .prep import PrepConfig
from .recur import RecurConfig
from .replay import ReplayConfig
from .step import StepConfig

HEAD_DIMS = (64, 128, 256)  # the head dims K == V every kernel family is built for


@dataclass(frozen=True)
class KernelSpec:
    family: str  # the manifest's "kind"
    config: type
    supports: Callable[[object], tuple[bool, str]]
    args: Callable[[object], list[Arg]]
    dsl_class: Callable[[object], str]  # "module:Class" of the DSL kernel for a config


SPECS: tuple[KernelSpec, ...] = tuple(
    KernelSpec(name, m_cfg, m.supports, m.args, m.dsl_class)
    for name, m_cfg, m in (("prep", PrepConfig, prep), ("recur", RecurConfig, recur),
                           ("combine", CombineConfig, combine), ("step", StepConfig, step),
                           ("offsets", OffsetsConfig, offsets),
                           ("checkpoints", CheckpointsConfig, checkpoints),
                           ("replay", ReplayConfig, replay)))
_BY_TYPE = {s.config: s for s in SPECS}


def spec_of(cfg) -> KernelSpec:
    """The spec of a kernel config (of one of SPECS' config types)."""
    try:
        return _BY_TYPE[type(cfg)]
    except KeyError:
        raise TypeError(f"not a kernel config: {type(cfg).__name__}") from None


def args_for(cfg) -> list[Arg]:
    """The argument list of any kernel config."""
    return spec_of(cfg).args(cfg)


__all__ = ["SPECS", "CheckpointsConfig", "CombineConfig", "KernelSpec", "OffsetsConfig",
           "PrepConfig", "RecurConfig", "ReplayConfig", "StepConfig", "args_for", "spec_of"]
