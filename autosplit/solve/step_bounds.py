"""Lower bounds on 1F1B's and GPipe's simulated step for the exact search (numbers, no torch).

:mod:`autosplit.solve.exact` explains the search and each bound; this module holds the path
arguments (:func:`device_1f1b`, :func:`stage_g`, :func:`pair_gain`) and the suffix tables
(:class:`Tables`) that bound every completion of a partial balance. Each bound is the length
of one path through the schedule's dependency graph, so it never exceeds the simulation
(``tests/test_exact.py`` checks them against the simulator on random pipelines). Times in ms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from autosplit.simulator import warmup_forwards

__all__ = ["MEMORY_RTOL", "Tables", "device_1f1b", "pair_gain", "pairs", "stage_g",
           "update_prefix"]

MEMORY_RTOL = 1e-12
"""The DP's tolerance on memory limits."""


class StepProblem(Protocol):
    """What the tables read of :class:`autosplit.solve.exact.StepProblem` (see there)."""

    fwd: Sequence[Sequence[float]]
    bwd: Sequence[Sequence[float]]
    comm_fwd: Sequence[float]
    comm_bwd: Sequence[float]
    m: int
    schedule: str
    memory: Sequence[Sequence[float]] | None
    memory_first: Sequence[Sequence[float]] | None
    memory_last: Sequence[Sequence[float]] | None
    capacity: Sequence[float] | None
    grad_bytes: Sequence[float] | None
    grad_limit: float | None
    update: Sequence[Sequence[float]] | None

    @property
    def n(self) -> int: ...

    @property
    def p(self) -> int: ...


def device_1f1b(f: np.ndarray | float, b: np.ndarray | float, trip: np.ndarray, m: int,
                 w: int) -> np.ndarray:
    """Lower bound (ms) on 1F1B's busy span of one device, from its first op's start to its
    last op's end: f, b its forward and backward time, ``trip`` ≤ the round trip of a
    micro-batch through the later stages and cuts, w its warm-up forwards.

    The first backward B(0) waits for F(0)'s round trip while the device runs w − 1 forwards;
    then (m − w) backward-forward pairs; the last backward B(m − 1) waits for F(m − 1)'s round
    trip while the device runs w − 1 backwards. With w = m there are no pairs, and B(m − 1)
    waits for F(m − 1) (the device's m-th forward) or follows B(0)'s m − 1 backwards.
    """
    if m > w:
        return (f + np.maximum(trip, (w - 1) * f) + (m - w) * (f + b)
                + np.maximum(trip, (w - 1) * b) + b)
    return b + np.maximum(f + np.maximum(trip, (m - 1) * f) + (m - 1) * b, m * f + trip)


def stage_g(f: np.ndarray | float, b: np.ndarray | float, m: int, p: int,
             s: int) -> np.ndarray:
    """g_s (ms): what 1F1B's step adds to Σ t + Σ transfers for stage s's own ops, at least.

    The path down with micro-batch 0, back up to B(s, 0), through stage s's remaining ops and
    up with micro-batch m − 1 skips only the w_s − 1 warm-up forwards; the mirror path (all m
    forwards, down and back with micro-batch m − 1) skips w_s − 1 backwards: step ≥ Σ t + Σ
    transfers + (m − 1) · max(f_s, b_s) + (m − w_s) · min(f_s, b_s), w_s = min(m, p − s).
    """
    w = warmup_forwards(m, p, s)
    return (m - 1) * np.maximum(f, b) + (m - w) * np.minimum(f, b)


def _pair_js(jmax: int, m: int, w2: int) -> set[int]:
    """The j where :func:`pair_gain`'s path can be longest: 0, m − w2 (clipped) and jmax."""
    return {0, min(jmax, max(m - w2, 0)), jmax}


def _drain(j: int, f2: np.ndarray | float, b2: np.ndarray | float, m: int,
           w2: int) -> np.ndarray | float:
    """Device s2's ops after B(s2, j) (ms): m − 1 − j backwards, (m − w2 − j)⁺ forwards."""
    return (m - 1 - j) * b2 + max(m - w2 - j, 0) * f2


def pair_gain(t1: np.ndarray | float, jmax: int, f2: np.ndarray | float,
              b2: np.ndarray | float, m: int, w2: int) -> np.ndarray | float:
    """What 1F1B's step adds to Σ t + Σ transfers, at least, on a path through two devices
    s2 < s1 (ms): down with micro-batch 0 and back up to B(s1, 0), through device s1's ops up
    to B(s1, j) (j forward-backward pairs, t1 = f + b each, j ≤ ``jmax`` = m − w_{s1}), up
    with micro-batch j to B(s2, j) and through device s2's remaining ops (:func:`_drain`),
    then up with micro-batch m − 1. Linear in j between j = 0, m − w2 and ``jmax``, so the
    largest value is at one of them."""
    values = [j * t1 + _drain(j, f2, b2, m, w2) for j in _pair_js(jmax, m, w2)]
    if all(isinstance(v, float) for v in values):
        return max(values)
    return np.maximum.reduce(values)


def pairs(f: list[float], b: list[float], fk: np.ndarray, bk: np.ndarray,
          rest_max: np.ndarray, m: int, p: int,
          fixed: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """The largest :func:`pair_gain` over pairs s2 < s1 with s2 fixed or the current stage
    k = len(f) (fk, bk per child), s1 any later stage; an unfixed s1's t is at least
    ``rest_max`` and its j at most m − w_{k+1} (w shrinks along the pipeline). ``fixed`` is
    the largest gain of the pairs within stages 0 … k-1 (the parent's second answer).

    Returns:
        (the bound's gain per child, the largest gain within stages 0 … k per child).
    """
    k = len(f)
    w = [warmup_forwards(m, p, s) for s in range(p)]
    later = [(rest_max, m - w[k + 1])] if k + 1 < p else []
    found = []
    for t1, jmax in [(fk + bk, m - w[k]), *later]:
        drains: dict[int, float] = {}  # the fixed s2's terms gathered per j
        for s2 in range(k):
            for j in _pair_js(jmax, m, w[s2]):
                drains[j] = max(drains.get(j, -math.inf), _drain(j, f[s2], b[s2], m, w[s2]))
        out = np.full_like(fk, fixed)
        for j, drain in drains.items():
            out = np.maximum(out, j * t1 + drain)
        found.append(out)
    within = found[0]
    out = np.maximum.reduce(found)
    for t1, jmax in later:
        out = np.maximum(out, pair_gain(t1, jmax, fk, bk, m, w[k]))
    return out, within


def update_prefix(problem: StepProblem) -> np.ndarray | None:
    """Prefix sums of each device's update per block (p × (n + 1)), ``None`` without one."""
    if problem.update is None:
        return None
    return np.array([np.concatenate(([0.0], np.cumsum(r))) for r in problem.update])


class Tables:
    """Prefix sums and the suffix DPs the bounds use (numpy, O(p · n²) element work)."""

    def __init__(self, problem: StepProblem) -> None:
        n, p = problem.n, problem.p
        self.f = np.array([np.concatenate(([0.0], np.cumsum(r))) for r in problem.fwd])
        self.b = np.array([np.concatenate(([0.0], np.cumsum(r))) for r in problem.bwd])
        self.cf = np.append(np.asarray(problem.comm_fwd, dtype=float), 0.0)  # cf[n-1]: no cut
        self.cb = np.append(np.asarray(problem.comm_bwd, dtype=float), 0.0)
        self.u = update_prefix(problem)
        self.fits = self._fits(problem)
        # rest_max[r][e] / rest_sum[r][e]: blocks e … n-1 on stages r … p-1, memory respected:
        # the smallest possible slowest t, and the smallest Σ t + Σ transfers between them;
        # rest_g[r][e]: the smallest possible largest g_s (:func:`stage_g`, 1F1B);
        # rest_dev[r][e]: 1F1B, a lower bound on max over the stages s ≥ r of device s's bound
        # counted from stage r's start (Σ_{r≤q<s} t_q + transfers, then s's busy span with
        # its round trip ≥ its cut + rest_sum): min over stage r's end e' of
        # max(r's busy span, t_r + cut + rest_dev[r + 1][e']), exact for one device and a
        # lower bound for all of them at once (each completion's max is ≥ both terms).
        self.rest_max = np.full((p + 1, n + 1), np.inf)
        self.rest_sum = np.full((p + 1, n + 1), np.inf)
        self.rest_g = np.full((p + 1, n + 1), np.inf)
        self.rest_dev = np.full((p + 1, n + 1), np.inf)
        self.rest_max[p, n] = self.rest_sum[p, n] = self.rest_g[p, n] = 0.0
        self.rest_dev[p, n] = 0.0
        start = np.arange(n + 1)[:, None]
        end = np.arange(n + 1)[None, :]
        comm = np.append(0.0, self.cf + self.cb)  # comm[x] for a cut before block x (x ≥ 1)
        comm[n] = 0.0
        for r in range(p - 1, -1, -1):
            ok = (end > start) & self.fits[r]
            if r == p - 1:
                ok &= end == n
            fr = self.f[r][None, :] - self.f[r][:, None]  # fr[e][e']: blocks e … e'-1
            br = self.b[r][None, :] - self.b[r][:, None]
            t = np.where(ok, fr + br, np.inf)  # inf where stage r cannot hold the blocks
            tc = t + comm[None, :]
            self.rest_max[r] = np.maximum(t, self.rest_max[r + 1][None, :]).min(axis=1)
            self.rest_sum[r] = (tc + self.rest_sum[r + 1][None, :]).min(axis=1)
            if problem.schedule != "1f1b":
                continue
            g = stage_g(fr, br, problem.m, problem.p, r)
            g = np.where(ok, g, np.inf)
            self.rest_g[r] = np.maximum(g, self.rest_g[r + 1][None, :]).min(axis=1)
            trip = comm + self.rest_sum[r + 1]  # inf where no completion fits
            busy = device_1f1b(fr, br, trip[None, :], problem.m, min(problem.m, p - r))
            self.rest_dev[r] = np.maximum(busy, tc + self.rest_dev[r + 1][None, :]).min(axis=1)

    @staticmethod
    def _fits(problem: StepProblem) -> np.ndarray:
        """``fits[s][i][e]``: blocks i … e-1 fit on device s (and within ``grad_limit``)."""
        n, p = problem.n, problem.p
        out = np.ones((p, n + 1, n + 1), dtype=bool)
        if problem.grad_limit is not None and problem.grad_bytes is not None:
            grads = np.concatenate(([0.0], np.cumsum(problem.grad_bytes)))
            out &= (grads[None, :] - grads[:, None] <= problem.grad_limit)[None]
        if problem.memory is None or problem.capacity is None:
            return out
        for s in range(p):
            mem = np.concatenate(([0.0], np.cumsum(problem.memory[s])))
            first, last = np.zeros(n + 1), np.zeros(n + 1)
            if problem.memory_first is not None:
                first[:n] = problem.memory_first[s]  # first[i]: block i starts the stage
            if problem.memory_last is not None:
                last[1:] = problem.memory_last[s]  # last[e]: block e - 1 ends the stage
            held = mem[None, :] - mem[:, None] + first[:, None] + last[None, :]
            out[s] &= held <= problem.capacity[s] * (1 + MEMORY_RTOL)
        return out
