"""The exact search for the cut that minimises the *simulated* step time (numbers, no torch).

Symbols: n blocks, p stages (stage s on device s), m micro-batches; f_s, b_s the forward and
backward time of one micro-batch on stage s (ms), cf_c, cb_c the forward and backward transfer
over cut c (ms), t_s = f_s + b_s (each with the runtime's cost per action,
``StepProblem.action_ms``). The objective is :func:`autosplit.simulator.simulate`'s
``step_ms`` for the balance, GPipe or 1F1B, plus the slowest stage's optimizer update
(``StepProblem.update``: every stage updates its own parameters after the last backward);
:func:`step_times` evaluates it for many balances at once with the simulator's own arithmetic
(same operations in the same order). The bounds below leave the update out: they stay below
the objective.

Why not the min-max DP alone: the DP minimises t_max, but the simulated step is a longest path
through the schedule's dependency graph. For GPipe the path has a closed form (proved by
``tests/test_exact.py`` against the simulator on random instances): each device runs all its
forwards, then all its backwards, each receive posted when the device gets to the op (so a
transfer adds to the receiving op: f'_s = f_s + cf_{s−1}, b'_s = b_s + cb_s, see
:mod:`autosplit.simulator`), so the longest path fills the pipeline once forward and once
backward and spends its m − 1 remaining forward and backward ticks on the slowest stages,

    step_gpipe = Σ_s t_s + Σ_c (cf_c + cb_c) + (m − 1) · (max_s f'_s + max_s b'_s),

which is not a function of t_max alone (the slowest forward and backward may sit on different
stages, and Σ_s t_s depends on the cut when devices differ). For 1F1B the longest path zigzags
between stages and has no such form. So the search is a branch and bound over the balances:

* stages are fixed left to right, stage 0's block count first, each level's children in
  increasing block count: the search visits balances in lexicographic order;
* a child is pruned when its stage exceeds the device's memory, when no split of the remaining
  blocks fits, or when a lower bound on every completion's simulated step is not below the best
  step found (ties: see below). The bounds, all ≤ the simulation for every completion (derived
  for transfers that overlap the receiver's earlier ops, ready at the sender's end plus their
  time: the simulation, whose receives wait to be posted, is never shorter):
  - GPipe: the closed form with Σ_s t_s + Σ_c (cf_c + cb_c) of the unfixed stages replaced by
    their smallest possible value (a min-sum DP over the remaining blocks, ``rest_sum``) and
    max f + max b by max(fixed max f + fixed max b, the remaining blocks' smallest possible
    slowest stage, ``rest_max``);
  - 1F1B, per stage s: device s cannot start before its first input arrives
    (pre_s = Σ_{r<s} f_r + cf_r), is busy m · t_s, waits before its first backward until that
    micro-batch's round trip R_s through the later stages is back, less the w_s − 1 warm-up
    forwards it runs meanwhile (w_s = min(m, p − s)), and its last backward still has to travel
    back to stage 0 (post_s = Σ_{r<s} b_r + cb_r): step ≥ pre_s + post_s + m · t_s +
    max(R_s − (w_s − 1) · f_s, 0), with the unfixed part of R_s bounded below by ``rest_sum``
    and the unfixed stages' t by ``rest_max``; and, for all stages at once (a path argument,
    :func:`stage_g`; checked against the simulator by ``tests/test_exact.py``),
    step ≥ Σ_s t_s + Σ_c (cf_c + cb_c) + max_s g_s with
    g_s = (m − 1) · max(f_s, b_s) + (m − w_s) · min(f_s, b_s) (GPipe's form with 1F1B's
    warm-up), the unfixed g's bounded by ``rest_g``, their smallest possible largest g;
    the unfixed devices' own bounds, all at once, by a suffix DP over their ends (``rest_dev``:
    each unfixed device s waits for the stages before it and for its own round trip); and
    paths through two devices s2 < s1, device s1's first forward-backward pairs then device
    s2's remaining backwards (:func:`~autosplit.solve.step_bounds.pair_gain`), which decide
    when m ≤ p (early stages run all their forwards first);
* complete balances are simulated exactly (vectorised over siblings).

Small instances (at most ``_EXHAUSTIVE_MAX`` = 50,000 balances, e.g. ResNet50's 19 blocks on
8 stages) skip the search: every balance that fits is simulated, vectorised, with the same tie
rule; that is faster there than the search's per-node work.

The search is seeded with a balance (the planner passes the min-max DP's or MILP's cut), improved
by steepest descent over single-cut moves before the search starts, so that the first bound is
already tight. Ties: two steps within a relative 1e-9 are equal, and among equal
steps the lexicographically smallest balance wins (deterministic plans).
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Sequence

import numpy as np

from autosplit.errors import InvalidInputError
from autosplit.simulator import schedule_order, warmup_forwards
from autosplit.solve.step_bounds import Tables, device_1f1b, pairs, stage_g, update_prefix
from autosplit.solve.step_problem import StepProblem, StepSolution

__all__ = ["TIE_RTOL", "StepProblem", "StepSolution", "solve_step", "step_times"]

TIE_RTOL = 1e-9
"""Steps within this relative difference are equal; the smaller balance then wins."""

_LEAF_BATCH = 64  # complete balances simulated together (fewer, larger simulations)

_EXHAUSTIVE_MAX = 50_000
"""Up to this many balances (C(n − 1, p − 1)) every one is simulated instead of searched:
faster than the branch and bound on small models (ResNet50's 19 blocks on 8 stages: 31,824)."""


@functools.lru_cache(maxsize=64)
def _op_order(schedule: str, m: int, p: int) -> tuple[tuple[str, int, int], ...]:
    """Every op (kind, stage, micro-batch) once, in an order that respects each device's
    schedule and every data dependency: the simulator's event loop without the times."""
    orders = [schedule_order(schedule, m, p, s) for s in range(p)]
    done: set[tuple[str, int, int]] = set()
    cursor, out = [0] * p, []
    while len(out) < 2 * m * p:
        for s in range(p):
            while cursor[s] < len(orders[s]):
                kind, i = orders[s][cursor[s]]
                if kind == "F":
                    ready = s == 0 or ("F", s - 1, i) in done
                else:
                    ready = ("F", s, i) in done and (s == p - 1 or ("B", s + 1, i) in done)
                if not ready:
                    break
                done.add((kind, s, i))
                out.append((kind, s, i))
                cursor[s] += 1
    return tuple(out)


def _simulate_many(fwd: np.ndarray, bwd: np.ndarray, cf: np.ndarray, cb: np.ndarray,
                   m: int, schedule: str, on_cores: bool = False) -> np.ndarray:
    """Step times (ms) of N pipelines at once: ``fwd``/``bwd`` are p × N stage times, ``cf``/
    ``cb`` (p − 1) × N transfer times, ``on_cores`` as :func:`simulate`'s
    ``transfers_on_cores``. The same max and + as :func:`simulate`, in its order."""
    p, count = fwd.shape
    last = np.zeros((p, count))  # each device's last op's end: where it posts a receive
    free = np.zeros((p, count))  # and when it is free, its sends' copies made (on_cores)
    end_f: dict[tuple[int, int], np.ndarray] = {}
    end_b: dict[tuple[int, int], np.ndarray] = {}
    for kind, s, i in _op_order(schedule, m, p):  # a receive posted when the device is free
        at = hop = None
        if kind == "F":
            ready = None
            if s:
                at, hop = np.maximum(last[s], end_f[s - 1, i]), cf[s - 1]
                ready = at + hop
        else:
            ready = end_f[s, i]
            if s < p - 1:
                at, hop = np.maximum(last[s], end_b[s + 1, i]), cb[s]
                ready = np.maximum(ready, at + hop)
        start = free[s] if ready is None else np.maximum(free[s], ready)
        end = start + (fwd[s] if kind == "F" else bwd[s])
        if on_cores and at is not None:  # the part of the copy made while the device was busy
            end = end + np.minimum(np.maximum(free[s] - at, 0.0), hop)
        (end_f if kind == "F" else end_b)[s, i] = last[s] = end
        sends = (kind == "F" and s < p - 1) or (kind == "B" and s > 0)
        free[s] = end + (cf[s] if kind == "F" else cb[s - 1]) if on_cores and sends else end
    return last.max(axis=0)


def step_times(problem: StepProblem, balances: Sequence[Sequence[int]]) -> np.ndarray:
    """The simulated step (ms) of each balance, vectorised (memory is not checked)."""
    tables = Tables.__new__(Tables)  # prefix sums only
    tables.f = np.array([np.concatenate(([0.0], np.cumsum(r))) for r in problem.fwd])
    tables.b = np.array([np.concatenate(([0.0], np.cumsum(r))) for r in problem.bwd])
    tables.cf = np.append(np.asarray(problem.comm_fwd, dtype=float), 0.0)
    tables.cb = np.append(np.asarray(problem.comm_bwd, dtype=float), 0.0)
    tables.u = update_prefix(problem)
    bal = np.asarray(balances, dtype=np.int64).reshape(-1, problem.p)
    if bal.size and (bal.min() < 1 or np.any(bal.sum(axis=1) != problem.n)):
        raise InvalidInputError(
            f"every balance needs {problem.p} positive counts summing to {problem.n}"
        )
    return _evaluate(problem, tables, bal)


def _evaluate(problem: StepProblem, tables: Tables, bal: np.ndarray) -> np.ndarray:
    p = problem.p
    bounds = np.concatenate((np.zeros((len(bal), 1), dtype=np.int64), np.cumsum(bal, axis=1)), 1)
    rows = np.arange(p)[:, None]
    a = problem.action_ms
    fwd = tables.f[rows, bounds.T[1:]] - tables.f[rows, bounds.T[:-1]] + a
    bwd = tables.b[rows, bounds.T[1:]] - tables.b[rows, bounds.T[:-1]] + a
    ends = bounds.T[1:-1] - 1
    steps = _simulate_many(fwd, bwd, tables.cf[ends], tables.cb[ends], problem.m,
                           problem.schedule, problem.transfers_on_cores)
    if tables.u is None:
        return steps
    update = tables.u[rows, bounds.T[1:]] - tables.u[rows, bounds.T[:-1]]
    return steps + update.max(axis=0)


def solve_step(
    problem: StepProblem,
    seed: Sequence[int] | None = None,
    cutoff: float = math.inf,
    time_limit_s: float | None = None,
) -> StepSolution | None:
    """The balance with the smallest simulated step, within memory (branch and bound).

    Args:
        problem: the blocks, devices, schedule and limits.
        seed: a feasible balance to start from (e.g. the min-max DP's cut); optional.
        cutoff: only a step below ``cutoff · (1 − 1e-9)`` counts (the planner passes the best
            step of the micro-batch sizes already searched, which win ties).
        time_limit_s: stop after this long (s) and return the best balance found, marked
            ``proven=False``; ``None`` searches to the end. The search is exact when it ends;
            only its running time depends on the instance (1F1B's bounds are looser than
            GPipe's, so thousands of blocks on many stages can take long).

    Returns:
        The lexicographically smallest balance among those whose step equals the smallest
        (within :data:`TIE_RTOL`), or ``None`` when no balance fits or none beats ``cutoff``.
    """
    tables = Tables(problem)
    if math.comb(problem.n - 1, problem.p - 1) <= _EXHAUSTIVE_MAX:
        return _exhaustive(problem, tables, cutoff)
    deadline = math.inf if time_limit_s is None else time.perf_counter() + time_limit_s
    return _Search(problem, tables, seed, cutoff, deadline).run()


def _exhaustive(problem: StepProblem, tables: Tables, cutoff: float) -> StepSolution | None:
    """Every balance that fits, simulated in chunks of 8,192, in lexicographic order: the
    first whose step is within :data:`TIE_RTOL` of the smallest (the search's answer)."""
    n, p = problem.n, problem.p
    cuts = np.array(list(itertools.combinations(range(1, n), p - 1)), dtype=np.int64)
    ends = np.pad(cuts, ((0, 0), (1, 1)), constant_values=((0, 0), (0, n)))
    fits = np.all([tables.fits[s][ends[:, s], ends[:, s + 1]] for s in range(p)], axis=0)
    balances = np.diff(ends, axis=1)[fits]
    steps = np.concatenate([_evaluate(problem, tables, balances[i:i + 8192])
                            for i in range(0, len(balances), 8192)] or [np.empty(0)])
    if not len(balances) or not steps.min() < cutoff * (1 - TIE_RTOL):
        return None
    first = int(np.flatnonzero(steps <= steps.min() * (1 + TIE_RTOL))[0])
    return StepSolution(tuple(int(c) for c in balances[first]), float(steps[first]),
                        len(balances))


class _Search:
    """Depth-first branch and bound in lexicographic order (see the module docstring)."""

    def __init__(self, problem: StepProblem, tables: Tables, seed: Sequence[int] | None,
                 cutoff: float, deadline: float = math.inf) -> None:
        self.problem, self.t = problem, tables
        self.deadline, self.stopped = deadline, False
        self.best: tuple[int, ...] | None = None
        self.best_ms = cutoff
        self.seed: tuple[int, ...] | None = None
        self.nodes = 0
        self.pending: list[list[int]] = []  # complete balances not simulated yet
        if seed is not None:
            seed = tuple(int(c) for c in seed)
            ms = float(_evaluate(problem, tables, np.asarray([seed]))[0])
            if self._feasible(seed) and ms < cutoff * (1 - TIE_RTOL):
                self.best, self.best_ms, self.seed = seed, ms, seed
                self._descend()

    def _descend(self) -> None:
        """Improve the seed by steepest descent over single-cut moves (±1, ±2, ±4 … blocks),
        so that the search starts with a tight incumbent (the min-max cut can be far from the
        simulated optimum). Only its running time depends on it: the search stays exact."""
        assert self.best is not None
        p = self.problem.p
        steps = [d * sign for d in (1, 2, 4, 8, 16, 32, 64) for sign in (1, -1)]
        while True:
            cuts = np.cumsum(self.best)[:-1]
            moved = np.repeat(cuts[None, :], len(steps) * (p - 1), axis=0)
            moved[np.arange(len(moved)), np.repeat(np.arange(p - 1), len(steps))] += np.tile(
                steps, p - 1)
            bounds = np.concatenate((np.zeros((len(moved), 1), dtype=np.int64), moved,
                                     np.full((len(moved), 1), self.problem.n)), axis=1)
            bal = np.diff(bounds, axis=1)
            bal = bal[(bal >= 1).all(axis=1)]
            rows = [tuple(int(c) for c in r) for r in bal]
            rows = [r for r in rows if self._feasible(r)]
            if not rows:
                return
            ms = _evaluate(self.problem, self.t, np.asarray(rows))
            i = int(np.argmin(ms))
            if not ms[i] < self.best_ms * (1 - TIE_RTOL):
                return
            self.best = self.seed = rows[i]
            self.best_ms = float(ms[i])

    def _feasible(self, balance: tuple[int, ...]) -> bool:
        start = 0
        for s, count in enumerate(balance):
            if not self.t.fits[s][start][start + count]:
                return False
            start += count
        return True

    def run(self) -> StepSolution | None:
        self._expand(0, 0, [], [], [])
        self._flush()
        if self.best is None:
            return None
        return StepSolution(self.best, self.best_ms, self.nodes, proven=not self.stopped)

    def _keep(self, bound: np.ndarray, counts: np.ndarray, prefix: list[int]) -> np.ndarray:
        """Children whose bound leaves room: strictly better, or equal and lexicographically
        before the incumbent (only the seed can be after the search position)."""
        tol = TIE_RTOL * self.best_ms if math.isfinite(self.best_ms) else 0.0
        better = bound < self.best_ms - tol
        if self.seed is None or self.best != self.seed:
            return better
        k = len(prefix)
        head = tuple(prefix)
        if head != self.seed[:k]:
            if head > self.seed[:k]:
                return better
            return bound <= self.best_ms + tol
        return better | ((counts <= self.seed[k]) & (bound <= self.best_ms + tol))

    def _expand(self, k: int, j: int, counts: list[int], f: list[float], b: list[float],
                fixed_pairs: float = 0.0) -> None:
        """Fix stage k's block count, given stages 0 … k-1 (``counts``, their ``f``, ``b``,
        and the largest two-device gain among them, ``fixed_pairs``)."""
        problem, t = self.problem, self.t
        n, p, m = problem.n, problem.p, problem.m
        self.nodes += 1
        if self.stopped or (self.nodes % 64 == 1 and time.perf_counter() > self.deadline):
            self.stopped = True
            return
        ends = np.arange(j + 1, n - (p - 1 - k) + 1) if k < p - 1 else np.array([n])
        fk = t.f[k][ends] - t.f[k][j] + problem.action_ms
        bk = t.b[k][ends] - t.b[k][j] + problem.action_ms
        last = k == p - 1
        cfk = np.zeros(len(ends)) if last else t.cf[ends - 1]
        cbk = np.zeros(len(ends)) if last else t.cb[ends - 1]
        ok = t.fits[k][j][ends] & np.isfinite(t.rest_sum[k + 1][ends])
        rest_sum = np.where(ok, t.rest_sum[k + 1][ends], 0.0)  # pruned below when not ok
        rest_max = np.where(ok, t.rest_max[k + 1][ends], 0.0)
        cuts = [t.cf[c] + t.cb[c] for c in np.cumsum(counts) - 1] if counts else []
        fixed = math.fsum(f) + math.fsum(b) + math.fsum(cuts)  # pre_k + post_k
        after = fk + bk + cfk + cbk + rest_sum  # R_{k-1} less the fixed stages
        within = np.zeros(len(ends))  # two-device gains within stages 0 … k (1F1B)
        if problem.schedule == "gpipe":
            slow = np.maximum(max(f, default=0.0), fk) + np.maximum(max(b, default=0.0), bk)
            bound = fixed + after + (m - 1) * np.maximum(slow, rest_max)
        else:
            after_k = cfk + cbk + rest_sum
            bound = np.maximum.reduce([
                fixed + device_1f1b(fk, bk, after_k, m, warmup_forwards(m, p, k)),
                fixed + fk + bk + cfk + cbk + m * rest_max,
                # a path down with micro-batch 0, through one device's m forwards (or, on the
                # way back, m backwards) and back with micro-batch m − 1
                fixed + after + (m - 1) * np.maximum(
                    np.maximum(max(f + b, default=0.0), np.maximum(fk, bk)), rest_max / 2
                ),
            ])
            gk = stage_g(fk, bk, m, p, k)
            gfix = max((stage_g(f[s], b[s], m, p, s) for s in range(k)), default=0.0)
            rest_g = np.where(ok, t.rest_g[k + 1][ends], 0.0)
            bound = np.maximum(bound, fixed + after + np.maximum(np.maximum(gk, gfix), rest_g))
            rest_dev = np.where(ok, t.rest_dev[k + 1][ends], 0.0)
            bound = np.maximum(bound, fixed + fk + bk + cfk + cbk + rest_dev)
            gain, within = pairs(f, b, fk, bk, rest_max, m, p, fixed_pairs)
            bound = np.maximum(bound, fixed + after + gain)
            tail = 0.0  # Σ t and transfers of the fixed stages after s
            for s in range(k - 1, -1, -1):
                pre_post = math.fsum(f[:s]) + math.fsum(b[:s]) + math.fsum(cuts[:s])
                trip = tail + cuts[s] + after
                busy = device_1f1b(f[s], b[s], trip, m, warmup_forwards(m, p, s))
                bound = np.maximum(bound, pre_post + busy)
                tail += f[s] + b[s] + cuts[s]
        bound = np.where(ok, bound, np.inf)
        sizes = ends - j
        keep = np.flatnonzero(ok & self._keep(bound, sizes, counts))
        if k >= p - 2:
            self._leaves(counts, ends[keep])
            return
        for idx in keep:
            if not self._keep(bound[idx:idx + 1], sizes[idx:idx + 1], counts)[0]:
                continue  # the incumbent improved since the children were listed
            self._expand(k + 1, int(ends[idx]), counts + [int(sizes[idx])],
                         f + [float(fk[idx])], b + [float(bk[idx])], float(within[idx]))

    def _leaves(self, counts: list[int], ends: np.ndarray) -> None:
        """Queue every complete balance whose stage p-2 (or p-1) ends at ``ends``; they are
        simulated in batches of :data:`_LEAF_BATCH` (one vectorised simulation for many
        siblings' leaves), in the order found."""
        if not len(ends):
            return
        problem = self.problem
        n, p = problem.n, problem.p
        j = sum(counts)
        rows = [counts + [int(e - j)] + ([n - int(e)] if len(counts) < p - 1 else []) for e in ends]
        self.pending += [r for r in rows if self._feasible(tuple(r))]
        if len(self.pending) >= _LEAF_BATCH:
            self._flush()

    def _flush(self) -> None:
        """Simulate the queued balances and keep the best (ties: the smaller balance)."""
        if not self.pending:
            return
        rows, self.pending = self.pending, []
        steps = _evaluate(self.problem, self.t, np.asarray(rows))
        for row, ms in zip(rows, steps.tolist()):
            balance = tuple(row)
            tol = TIE_RTOL * self.best_ms if math.isfinite(self.best_ms) else 0.0
            if ms < self.best_ms - tol or (
                self.best is not None and ms <= self.best_ms + tol and balance < self.best
            ):
                self.best, self.best_ms = balance, ms
