"""Partition solvers: pure functions on numbers. Nothing in this package imports torch."""

from autosplit.solve.dp import balance, min_capacity, solve_dp
from autosplit.solve.problem import Partition, PartitionProblem, evaluate

__all__ = ["balance", "solve_dp", "min_capacity", "evaluate", "Partition", "PartitionProblem"]
