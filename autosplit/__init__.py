"""autosplit: split a PyTorch model across several devices automatically.

    pm = autosplit.partition(model, (x,), gpus=2)   # trace, profile, plan, build
    out = pm(x)                                     # pipelined forward
    print(pm.plan)                                  # stages, cut points, split_size, predictions

The torch-free parts (``autosplit.solve``, ``autosplit.records`` (Profile, Plan), the errors) import
without torch; everything else is loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autosplit.errors import (
    ArgumentTypeError,
    AutosplitError,
    CodegenError,
    InfeasiblePlanError,
    InvalidInputError,
    ModelFileError,
    PlanFileError,
    PlanMismatchError,
    RankFailedError,
    TraceError,
)
from autosplit.records import BlockProfile, CutProfile, DeviceInfo, Plan, Profile, Stage

if TYPE_CHECKING:
    from autosplit.graph import BlockGraph, trace
    from autosplit.pipeline import PipelinedModule, partition
    from autosplit.planner import plan
    from autosplit.profiler import profile

__version__ = "0.1.0"

_LAZY = {
    "partition": "autosplit.pipeline",
    "PipelinedModule": "autosplit.pipeline",
    "profile": "autosplit.profiler",
    "plan": "autosplit.planner",
    "plan_with_balance": "autosplit.planner",
    "trace": "autosplit.graph",
    "BlockGraph": "autosplit.graph",
    "compare": "autosplit.comparison",
    "baseline_plans": "autosplit.comparison",
    "manual_plan": "autosplit.comparison",
    "simulate": "autosplit.simulator",
    "simulate_plan": "autosplit.simulator",
    "emit": "autosplit.codegen",
    "analytic_profile": "autosplit.analytic",
    "build_on_meta": "autosplit.analytic",
    "DeviceSpec": "autosplit.specs",
    "get_spec": "autosplit.specs",
    "load_spec": "autosplit.specs",
    "calibrate": "autosplit.specs",
}

__all__ = [
    "partition",
    "profile",
    "plan",
    "plan_with_balance",
    "trace",
    "compare",
    "baseline_plans",
    "manual_plan",
    "simulate",
    "simulate_plan",
    "emit",
    "analytic_profile",
    "build_on_meta",
    "DeviceSpec",
    "get_spec",
    "load_spec",
    "calibrate",
    "PipelinedModule",
    "BlockGraph",
    "Profile",
    "BlockProfile",
    "CutProfile",
    "DeviceInfo",
    "Plan",
    "Stage",
    "AutosplitError",
    "InvalidInputError",
    "ArgumentTypeError",
    "TraceError",
    "InfeasiblePlanError",
    "PlanMismatchError",
    "PlanFileError",
    "CodegenError",
    "ModelFileError",
    "RankFailedError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autosplit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
