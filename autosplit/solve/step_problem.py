"""The exact step search's problem and answer, as plain numbers (ms, bytes; no torch).

:func:`autosplit.solve.exact.solve_step` answers a :class:`StepProblem` with a
:class:`StepSolution`; the symbols are those of :mod:`autosplit.solve.exact`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autosplit import checks
from autosplit.errors import InvalidInputError
from autosplit.simulator import SCHEDULES

__all__ = ["StepProblem", "StepSolution"]


@dataclass(frozen=True, slots=True)
class StepProblem:
    """Choose the balance of n ordered blocks over p stages with the smallest simulated step.

    Attributes:
        fwd: ``fwd[s][i]`` forward time of block i on device s for one micro-batch (ms).
        bwd: ``bwd[s][i]`` backward time (ms).
        comm_fwd: ``comm_fwd[i]`` time to send the activations over a cut after block i (ms),
            ``n - 1`` entries.
        comm_bwd: ``comm_bwd[i]`` time to send the gradients back over that cut (ms).
        m: micro-batches per step.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        memory: ``memory[s][i]`` bytes block i holds on stage s, or ``None`` (only used with
            ``capacity``).
        memory_first, memory_last: ``memory_first[s][i]`` (``memory_last[s][i]``) extra
            bytes when block i starts (ends) stage s, or ``None``.
        capacity: ``capacity[s]`` bytes of device s, or ``None`` (no limit).
        grad_bytes: ``grad_bytes[i]`` gradient bytes of block i, or ``None`` (only used with
            ``grad_limit``).
        grad_limit: the most gradient bytes one stage may hold, or ``None`` (no limit): the
            planner of data-parallel replicas bounds the all-reduce with it
            (:mod:`autosplit.planner.layouts`).
        action_ms: what the pipeline runtime costs per action beyond its compute (ms), added
            to every stage's forward and backward (``Profile.action_ms``). The bounds of the
            unfixed stages leave it out: they stay below every completion's step.
        transfers_on_cores: whether a transfer costs both devices compute (gloo between CPU
            workers; :func:`autosplit.simulator.simulate`'s ``transfers_on_cores``). The
            bounds leave it out: it only lengthens a step.
        update: ``update[s][i]`` the optimizer's update of block i's parameters on device s
            (ms, once per step), or ``None`` (not counted). Every stage updates after the
            pipeline's last backward: the step is the simulation plus the slowest stage's
            update, max_s Σ_{i on s} update[s][i]. The bounds leave it out: it only
            lengthens a step.
    """

    fwd: tuple[tuple[float, ...], ...]
    bwd: tuple[tuple[float, ...], ...]
    comm_fwd: tuple[float, ...]
    comm_bwd: tuple[float, ...]
    m: int
    schedule: str
    memory: tuple[tuple[float, ...], ...] | None = None
    memory_first: tuple[tuple[float, ...], ...] | None = None
    capacity: tuple[float, ...] | None = None
    memory_last: tuple[tuple[float, ...], ...] | None = None
    grad_bytes: tuple[float, ...] | None = None
    grad_limit: float | None = None
    action_ms: float = 0.0
    transfers_on_cores: bool = False
    update: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        checks.instance_of("transfers_on_cores", self.transfers_on_cores, bool, "True or False")
        if not (isinstance(self.action_ms, (int, float)) and math.isfinite(self.action_ms)
                and self.action_ms >= 0):
            raise InvalidInputError(f"action_ms must be a finite number ≥ 0 (ms), got "
                                    f"{self.action_ms!r}")
        p, n = len(self.fwd), len(self.fwd[0]) if self.fwd else 0
        if p < 1 or n < p:
            raise InvalidInputError(f"need 1 ≤ p ≤ n, got p={p} stages for n={n} blocks")
        if len(self.bwd) != p or any(len(r) != n for r in (*self.fwd, *self.bwd)):
            raise InvalidInputError("fwd and bwd must both be p × n tables (one row per stage)")
        if len(self.comm_fwd) != n - 1 or len(self.comm_bwd) != n - 1:
            raise InvalidInputError(f"comm_fwd and comm_bwd need one entry per cut ({n - 1})")
        if isinstance(self.m, bool) or not isinstance(self.m, int) or self.m < 1:
            raise InvalidInputError(f"m (micro-batches) must be a positive integer, got {self.m!r}")
        if self.schedule not in SCHEDULES:
            raise InvalidInputError(f"unknown schedule {self.schedule!r}: use one of "
                                    f"{', '.join(SCHEDULES)}")
        if self.memory is None and any(x is not None for x in (
                self.capacity, self.memory_first, self.memory_last)):
            raise InvalidInputError("capacity, memory_first and memory_last need memory as well")
        if self.update is not None and (len(self.update) != p
                                        or any(len(r) != n for r in self.update)):
            raise InvalidInputError("update must be a p × n table (one row per stage)")
        if self.grad_limit is not None and (self.grad_bytes is None or len(self.grad_bytes) != n):
            raise InvalidInputError(f"grad_limit needs grad_bytes, one entry per block ({n})")

    @property
    def n(self) -> int:
        """Number of blocks."""
        return len(self.fwd[0])

    @property
    def p(self) -> int:
        """Number of stages."""
        return len(self.fwd)


@dataclass(frozen=True, slots=True)
class StepSolution:
    """The search's answer.

    Attributes:
        balance: blocks per stage.
        step_ms: its simulated step time (ms), the slowest stage's update included.
        nodes: partial balances the search expanded (a measure of its work).
        proven: ``True`` when the search finished (the balance is the optimum); ``False``
            when it stopped at its time limit (the best balance found by then).
    """

    balance: tuple[int, ...]
    step_ms: float
    nodes: int
    proven: bool = True
