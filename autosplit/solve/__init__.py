"""Partition solvers: pure functions on numbers. Nothing in this package imports torch.

* :func:`solve_dp`: the exact dynamic program (the planner's solver).
* :func:`solve_milp` / :func:`build_milp`: the same problem as a PuLP MILP (an independent
  oracle, and a model to extend with constraints a DP cannot express). PuLP is imported only
  when they are called.
* :func:`uniform`, :func:`by_parameters`, :func:`block_partition`, :func:`manual`: the peers'
  heuristics, as baselines.
"""

from autosplit.solve.baselines import block_partition, by_parameters, manual, uniform
from autosplit.solve.dp import balance, min_capacity, solve_dp
from autosplit.solve.milp import MilpResult, build_milp, solve_milp
from autosplit.solve.problem import Partition, PartitionProblem, evaluate

__all__ = [
    "MilpResult",
    "Partition",
    "PartitionProblem",
    "balance",
    "block_partition",
    "build_milp",
    "by_parameters",
    "evaluate",
    "manual",
    "min_capacity",
    "solve_dp",
    "solve_milp",
    "uniform",
]
