"""Peak memory in flight per rank for many candidate balances at once (numpy, no torch).

The in-flight bytes of :func:`autosplit.schedules.replay` depend only on each rank's action
order, not on the times (a rank runs one action at a time): :class:`InFlight` counts, after
every change the replay applies, how many micro-batches hold each kind of bytes of each
stage, so that a C × S matrix of bytes per micro-batch gives the C × p peaks in one product
per rank (a rank's actions touch its own stages only).
:func:`stage_transients` is :func:`~autosplit.solve.joint_problem.stage_transient` for every
stage of C balances.
"""

from __future__ import annotations

import numpy as np

from autosplit.schedules.torch_order import ScheduleOrder
from autosplit.solve.joint_problem import JointProblem

__all__ = ["InFlight", "stage_transients"]


class InFlight:
    """Peak in-flight bytes per rank for many candidates at once (see the module docstring).

    For each rank, after every change the replay applies, the number of micro-batches holding
    each stage's saved bytes (``held``: from the end of F to the end of the last backward),
    recomputed activations (``recomputing``: from the start of B/I to that end), what the
    weight pass needs in their place (``between``: from the end of I to the end of W), what
    was sent and is kept until the step ends (:attr:`ScheduleOrder.holds_sends`):
    ``sent_out``, forwards ended, and ``sent_back``, input gradients (every I; every B where
    the runtime keeps its backward sends), the outputs in the stages' caches (``cached``: from
    the end of F to the end of B/I), the backward running (``running``: at its start) and the
    weight gradients made (``graded``: from the end of the stage's first B or W)."""

    KINDS = 8

    def __init__(self, order: ScheduleOrder) -> None:
        last = {(a.stage, a.microbatch): a.kind for row in order.actions for a in row
                if a.kind in ("B", "W")}
        fwd_held, bwd_held = order.holds_sends
        rows: list[tuple[np.ndarray, ...]] = []
        for row in order.actions:
            # held, recomputing, between, sent out, sent back, running, cached, graded
            counts = np.zeros((self.KINDS, order.n))
            snaps = [counts.copy()]
            for a in row:
                s = a.stage
                if a.kind in ("B", "I"):
                    counts[1, s] += 1
                    counts[5, s] = 1
                    snaps.append(counts.copy())
                    counts[5, s] = 0
                    counts[6, s] -= 1
                if a.kind == "F":
                    counts[0, s] += 1
                    counts[3, s] += fwd_held
                    counts[6, s] += 1
                elif a.kind == "I":
                    counts[2, s] += 1
                    counts[4, s] += 1
                elif a.kind == "B":
                    counts[4, s] += bwd_held
                if a.kind != "F" and last[s, a.microbatch] == a.kind:
                    counts[0, s] -= 1
                    counts[1, s] -= 1
                    if a.kind == "W":
                        counts[2, s] -= 1
                if a.kind in ("B", "W"):
                    counts[7, s] = 1
                snaps.append(counts.copy())
            stacked = np.array(snaps)
            rows.append(tuple(stacked[:, j] for j in range(self.KINDS)))
        # per rank, its stages' counts of every kind side by side: (kinds · stages) × changes
        self.stages = [np.flatnonzero(np.asarray(order.stage_rank) == r) for r in range(order.p)]
        self.counts = [np.concatenate([c[:, idx] for c in row], axis=1).T
                       for row, idx in zip(rows, self.stages)]

    def peaks(self, kept: np.ndarray, recomputed: np.ndarray, between: np.ndarray | None = None,
              sent_out: np.ndarray | None = None, sent_back: np.ndarray | None = None,
              running: np.ndarray | None = None, cached: np.ndarray | None = None,
              grads: np.ndarray | None = None) -> np.ndarray:
        """C × S bytes per micro-batch → C × p peak bytes: ``kept``, ``recomputed``,
        ``between`` (the split backward's held bytes less the activations), ``sent_out`` and
        ``sent_back`` (what each stage sends forward and backward), ``running`` (a backward's
        transient), ``cached`` (the output a stage keeps until its backward, less what is
        counted otherwise) and ``grads`` (bytes per stage, once); the last six default 0."""
        zero = np.zeros_like(kept)
        kinds = [kept, recomputed, *(zero if x is None else x
                                     for x in (between, sent_out, sent_back, running, cached,
                                               grads))]
        out = []
        for idx, counts in zip(self.stages, self.counts):  # a rank counts its own stages only
            level = np.concatenate([x[:, idx] for x in kinds], axis=1) @ counts
            out.append(np.max(level, axis=1))
        return np.stack(out, axis=1)


def stage_transients(problem: JointProblem, first: np.ndarray, end: np.ndarray,
                      output: np.ndarray) -> np.ndarray:
    """:func:`~autosplit.solve.joint_problem.stage_transient` of every stage of C balances at once (C × S bytes)."""
    if problem.transient_bytes is None:
        return np.zeros(first.shape)
    brief = np.asarray(problem.transient_bytes, dtype=float)
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(problem.saved_bytes, dtype=float))])
    value = brief + prefix[1:]  # block j's need less what blocks (j, end) keep, + prefix[end]
    n = len(brief)
    upto = np.full((n + 1, n + 1), -np.inf)  # upto[a, b]: the most value[j] for a ≤ j < b
    for a in range(n):
        upto[a, a + 1:] = np.maximum.accumulate(value[a:])
    inner = upto[first, end - 1] - prefix[end]
    return np.maximum(np.maximum(inner, brief[end - 1] - output), 0.0)
