"""autosplit: split a PyTorch model across several devices automatically.

    pm = autosplit.partition(model, (x,), gpus=2)   # trace, profile, plan, build
    out = pm(x)                                     # pipelined forward
    print(pm.plan)                                  # stages, cut points, split_size, predictions
"""

from autosplit import solve
from autosplit.errors import (
    AutosplitError,
    InfeasiblePlanError,
    InvalidInputError,
    PlanFileError,
    PlanMismatchError,
    TraceError,
)
from autosplit.graph import BlockGraph, trace
from autosplit.partition import PipelinedModule, partition
from autosplit.plan import BlockProfile, CutProfile, DeviceInfo, Plan, Profile, Stage
from autosplit.planner import plan
from autosplit.profile import profile

__version__ = "0.1.0"

__all__ = [
    "partition",
    "profile",
    "plan",
    "trace",
    "solve",
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
    "TraceError",
    "InfeasiblePlanError",
    "PlanMismatchError",
    "PlanFileError",
    "__version__",
]
