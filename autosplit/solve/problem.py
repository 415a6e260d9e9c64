"""The partition problem every solver answers, as plain numbers (no torch).

Symbols: n blocks in a fixed order, p stages; stage s (0-based) runs on device s and holds a
contiguous, non-empty range of blocks. A *balance* is the number of blocks per stage, e.g.
``(9, 10)`` for 19 blocks on 2 stages (torchgpipe's form).

Time of stage s = Σ costs[s][i] over its blocks + comm[j] where j is the last block of the stage
(the cost of sending what crosses the cut after block j); the last stage sends nothing.
Memory of stage s = Σ memory[s][i] over its blocks + memory_first[s][j] for its first block j
(what a stage holds only because it starts there, e.g. the buffers it receives its input in)
+ memory_last[s][k] for its last block k (what it holds only because it ends there, e.g. the
buffers it receives the gradients of its output in), which must not exceed capacity[s].
Costs are per-device so that heterogeneous devices and stage-dependent memory (1F1B keeps
p − s micro-batches in flight on stage s) are the same problem.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from autosplit import checks
from autosplit.errors import InvalidInputError

__all__ = ["PartitionProblem", "Partition", "evaluate"]


def _row(values: Sequence[float], what: str) -> tuple[float, ...]:
    return checks.sequence_of(what, values, checks.non_negative_finite, allow_empty=True)


@dataclass(frozen=True, slots=True)
class PartitionProblem:
    """Split n ordered blocks into p contiguous stages.

    Attributes:
        costs: ``costs[s][i]`` time of block i when on stage s (any unit, e.g. ms).
        comm: ``comm[i]`` time charged to the sending stage for a cut after block i
            (``len(comm) == n - 1``), same unit as ``costs``.
        memory: ``memory[s][i]`` bytes block i needs when on stage s, or ``None``.
        capacity: ``capacity[s]`` bytes available on stage s's device, or ``None`` (no limit).
        memory_first: ``memory_first[s][i]`` extra bytes when block i is the first block of
            stage s, or ``None`` (zero); only used together with ``memory``.
        memory_last: ``memory_last[s][i]`` extra bytes when block i is the last block of
            stage s, or ``None`` (zero); only used together with ``memory``.
    """

    costs: tuple[tuple[float, ...], ...]
    comm: tuple[float, ...]
    memory: tuple[tuple[float, ...], ...] | None = None
    capacity: tuple[float, ...] | None = None
    memory_first: tuple[tuple[float, ...], ...] | None = None
    memory_last: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        p = len(self.costs)
        if p < 1:
            raise InvalidInputError("a partition problem needs at least one stage (0 < 1)")
        n = len(self.costs[0])
        if n < 1:
            raise InvalidInputError("a partition problem needs at least one block (0 < 1)")
        if p > n:
            raise InvalidInputError(
                f"cannot split {n} blocks into {p} non-empty stages: use at most {n} stages"
            )
        if any(len(row) != n for row in self.costs):
            raise InvalidInputError("every stage's cost row must have one entry per block")
        if len(self.comm) != n - 1:
            raise InvalidInputError(
                f"comm must have one entry per cut, len(comm) == {n - 1}, got {len(self.comm)}"
            )
        if self.memory is not None and (
                len(self.memory) != p or any(len(row) != n for row in self.memory)):
            raise InvalidInputError("memory must be a p × n table (one row per stage)")
        for name in ("memory_first", "memory_last"):
            table = getattr(self, name)
            if table is None:
                continue
            if self.memory is None:
                raise InvalidInputError(f"{name} needs memory as well")
            if len(table) != p or any(len(row) != n for row in table):
                raise InvalidInputError(f"{name} must be a p × n table (one row per stage)")
        if self.capacity is not None and len(self.capacity) != p:
            raise InvalidInputError(f"capacity must have one entry per stage ({p})")

    @classmethod
    def build(
        cls,
        costs: Sequence[float] | Sequence[Sequence[float]],
        parts: int,
        *,
        comm: Sequence[float] | None = None,
        memory: Sequence[float] | Sequence[Sequence[float]] | None = None,
        capacity: float | Sequence[float] | None = None,
    ) -> PartitionProblem:
        """Build a problem, broadcasting per-block rows and a scalar capacity to every stage.

        Raises:
            ArgumentTypeError: a value that is not a number, or rows that are not lists.
            InvalidInputError: a negative or non-finite value, an empty or ragged table.
        """
        parts = checks.positive_int("parts", parts)
        cost_rows = _table(costs, parts, "costs")
        n = len(cost_rows[0])
        comm_row = _row(comm, "comm") if comm is not None else (0.0,) * max(n - 1, 0)
        mem_rows = _table(memory, parts, "memory") if memory is not None else None
        if capacity is None:
            cap_row = None
        elif isinstance(capacity, (int, float)) and not isinstance(capacity, bool):
            cap_row = (checks.non_negative_finite("capacity", capacity),) * parts
        else:
            cap_row = _row(capacity, "capacity")
        if (mem_rows is None) != (cap_row is None):
            raise InvalidInputError("memory and capacity must be given together")
        return cls(cost_rows, comm_row, mem_rows, cap_row)

    @property
    def n(self) -> int:
        """Number of blocks."""
        return len(self.costs[0])

    @property
    def p(self) -> int:
        """Number of stages."""
        return len(self.costs)


def _table(
    values: Sequence[float] | Sequence[Sequence[float]], parts: int, what: str
) -> tuple[tuple[float, ...], ...]:
    values = list(checks.as_sequence(what, values))
    if not values:
        raise InvalidInputError(f"{what} is empty: there must be at least one block")
    if not isinstance(values[0], Iterable) or isinstance(values[0], (str, bytes)):
        row = _row(values, what)
        return (row,) * parts
    if len(values) != parts:
        raise InvalidInputError(f"{what} has {len(values)} rows, expected one per stage ({parts})")
    return tuple(_row(r, f"{what}[{s}]") for s, r in enumerate(values))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Partition:
    """A solved (or scored) partition.

    Attributes:
        balance: blocks per stage, summing to n.
        stage_times: time of each stage including its outgoing comm (problem units).
        stage_memory: memory of each stage (bytes), zeros when the problem has none.
        bottleneck: the largest stage time.
    """

    balance: tuple[int, ...]
    stage_times: tuple[float, ...]
    stage_memory: tuple[float, ...]
    bottleneck: float

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """``(first, end)`` block index range of each stage (end exclusive)."""
        out, start = [], 0
        for count in self.balance:
            out.append((start, start + count))
            start += count
        return tuple(out)


def evaluate(problem: PartitionProblem, balance: Sequence[int]) -> Partition:
    """Score a given balance on a problem (no feasibility check on memory).

    Raises:
        ArgumentTypeError: ``problem`` is not a :class:`PartitionProblem`, or an entry of
            ``balance`` is not an int.
        InvalidInputError: ``balance`` has entries < 1, the wrong length, or the wrong sum.
    """
    checks.instance_of("problem", problem, PartitionProblem, "a PartitionProblem")
    balance = checks.sequence_of("balance", balance, checks.positive_int)
    if len(balance) != problem.p or sum(balance) != problem.n:
        raise InvalidInputError(
            f"balance {list(balance)} must have {problem.p} positive entries summing to {problem.n}"
        )
    times, mems, start = [], [], 0
    for s, count in enumerate(balance):
        end = start + count
        t = math.fsum(problem.costs[s][start:end])
        if end < problem.n:
            t += problem.comm[end - 1]
        times.append(t)
        held = math.fsum(problem.memory[s][start:end]) if problem.memory else 0.0
        if problem.memory_first is not None:
            held += problem.memory_first[s][start]
        if problem.memory_last is not None:
            held += problem.memory_last[s][end - 1]
        mems.append(held)
        start = end
    return Partition(balance, tuple(times), tuple(mems), max(times))
