"""Cuts and per-stage recomputation for one schedule order, exactly (numbers only, no torch).

Symbols: N blocks, p ranks, v stages per rank, S = p·v stages, m micro-batches, s a stage,
r a rank, c_s ∈ {0, 1} whether stage s is checkpointed. Per stage, summed over its blocks
(ms per micro-batch): F_s forward, B_s full backward, I_s / W_s its input / weight parts
(zero-bubble schedules); a checkpointed stage recomputes F_s in its backward.

The objective is the step of :func:`autosplit.schedules.replay` on the schedule's own order
(:class:`~autosplit.schedules.ScheduleOrder`) for the stage costs of a balance (blocks per
stage) and a checkpoint mask, among those whose memory fits every rank:

    memory_r = Σ_{s on r} static_s + m · (bytes of each cut between ranks that r sends or
               receives: torch's receive buffers) + peak in-flight bytes of rank r (the
               replay's ``peak_bytes``)

The in-flight bytes depend only on the rank's action order, not on the times (a rank runs one
action at a time), so :class:`_MemoryModel` evaluates them exactly and vectorised over every
balance. The search:

* enumerates every balance (numpy, C(N−1, S−1) of them) and every checkpoint mask (no mask
  when checkpointing is not offered), keeping those that fit;
* bounds each from below by the larger of (a) the busiest rank, max_r (head_r + m · Σ_{s on r}
  (F_s + D_s + c_s F_s) + tail_r), with D_s = B_s (or I_s + W_s when the backward is split),
  head_r = Σ_{s < s_min(r)} F_s (rank r's first forward waits for the stages before it) and,
  for schedules that do not split the backward, tail_r = Σ_{s < s_min(r)} (B_s + c_s F_s)
  (its last backward still has to reach stage 0), and (b) one micro-batch's round trip
  Σ_s (F_s + G_s), G_s the input-gradient work; both ≤ the replay, whose durations only add;
* replays candidates in increasing bound and stops when the bound reaches the best step.

Ties: steps within a relative 1e-9 are equal; fewer checkpointed stages win, then the
lexicographically smallest balance, then the smallest mask.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autosplit.errors import InvalidInputError
from autosplit.schedules.replay import StageCosts, replay
from autosplit.schedules.torch_order import ScheduleOrder

__all__ = ["JointProblem", "JointSolution", "brute_force_joint", "solve_joint", "stage_costs"]

TIE_RTOL = 1e-9
MAX_BALANCES = 2_000_000
"""More balances than this are not enumerated (:class:`InvalidInputError`)."""


@dataclass(frozen=True, slots=True)
class JointProblem:
    """The numbers of one micro-batch size; every row has one entry per block (N).

    Attributes:
        fwd_ms, bwd_ms: forward and full backward time of each block (ms per micro-batch).
        input_grad_ms, weight_grad_ms: the backward's input and weight parts (ms), or
            ``None`` when not measured (then no schedule may split the backward).
        saved_bytes: bytes each block keeps for backward per micro-batch.
        input_bytes: bytes a checkpointed stage that starts at this block keeps (its input),
            or ``None``: checkpointing is not offered.
        static_bytes: weights, gradients, optimizer state and buffers of each block (bytes).
        split_held_bytes: bytes each block holds between the input and the weight pass of a
            split backward, per micro-batch (in place of its ``saved_bytes``), or ``None``:
            the same as ``saved_bytes``.
        cut_bytes: bytes crossing the cut after each block per micro-batch (N − 1 entries), or
            ``None``. Given, a cut between stages on different ranks costs the receiving rank
            m buffers for the activations and the sending rank m buffers for their gradients,
            held all step (torch.distributed.pipelining allocates one per micro-batch; a
            stage's received input is that buffer); what a stage sends is kept as the runtime
            keeps it (:attr:`~autosplit.schedules.ScheduleOrder.holds_sends`), and a split
            backward's input pass leaves the gradient of the stage's input on its buffer until
            the end of the step.
        comm_fwd_ms, comm_bwd_ms: transfer over the cut after each block (N − 1 entries, ms).
        m: micro-batches.
        capacity_bytes: memory each rank may use for the above (bytes), or ``None``.
    """

    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    input_grad_ms: tuple[float, ...] | None
    weight_grad_ms: tuple[float, ...] | None
    saved_bytes: tuple[float, ...]
    input_bytes: tuple[float, ...] | None
    static_bytes: tuple[float, ...]
    comm_fwd_ms: tuple[float, ...]
    comm_bwd_ms: tuple[float, ...]
    m: int
    capacity_bytes: tuple[float, ...] | None = None
    split_held_bytes: tuple[float, ...] | None = None
    cut_bytes: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.fwd_ms)
        rows = [self.bwd_ms, self.saved_bytes, self.static_bytes,
                *(r for r in (self.input_grad_ms, self.weight_grad_ms, self.input_bytes,
                              self.split_held_bytes) if r)]
        if n < 1 or any(len(r) != n for r in rows):
            raise InvalidInputError(f"every per-block row needs {n} ≥ 1 entries")
        cuts = [self.comm_fwd_ms, self.comm_bwd_ms,
                *(r for r in (self.cut_bytes,) if r is not None)]
        if any(len(r) != n - 1 for r in cuts):
            raise InvalidInputError(f"comm_fwd_ms, comm_bwd_ms and cut_bytes need one entry "
                                    f"per cut ({n - 1})")
        if (self.input_grad_ms is None) != (self.weight_grad_ms is None):
            raise InvalidInputError("input_grad_ms and weight_grad_ms go together")

    @property
    def n(self) -> int:
        """Number of blocks N."""
        return len(self.fwd_ms)


@dataclass(frozen=True, slots=True)
class JointSolution:
    """The best balance and checkpoint mask of one schedule order.

    Attributes:
        balance: blocks per stage (S entries); checkpoint: per stage.
        step_ms: the replayed step (ms); memory_bytes: per rank, static + peak in flight.
        proven: ``False`` when the time limit stopped the search (best found).
    """

    balance: tuple[int, ...]
    checkpoint: tuple[bool, ...]
    step_ms: float
    memory_bytes: tuple[float, ...]
    proven: bool = True


def stage_costs(problem: JointProblem, balance: Sequence[int], checkpoint: Sequence[bool],
                order: ScheduleOrder) -> StageCosts:
    """The replay's :class:`StageCosts` of ``balance`` for ``order`` (its split backward; with
    ``cut_bytes``, what each stage sends forward to a stage on another rank and the gradient of
    its input, which it sends back or passes to its predecessor on the same rank)."""
    split = order.splits_backward
    place = order.stage_rank
    ends = list(itertools.accumulate(balance))
    starts = [0, *ends[:-1]]

    def total(row: Sequence[float]) -> tuple[float, ...]:
        return tuple(math.fsum(row[a:b]) for a, b in zip(starts, ends))

    if split:
        assert problem.input_grad_ms is not None and problem.weight_grad_ms is not None
        bwd_in, bwd_w = total(problem.input_grad_ms), total(problem.weight_grad_ms)
    else:
        bwd_in, bwd_w = total(problem.bwd_ms), (0.0,) * len(balance)
    act = total(problem.saved_bytes)
    keep = (0.0,) * len(balance) if problem.input_bytes is None else tuple(
        problem.input_bytes[a] for a in starts)
    held = None if problem.split_held_bytes is None else total(problem.split_held_bytes)
    sent_out = sent_back = None
    if problem.cut_bytes is not None:  # only what crosses to another rank is sent
        sent_out = tuple(problem.cut_bytes[e - 1] if s + 1 < len(ends)
                         and place[s] != place[s + 1] else 0.0 for s, e in enumerate(ends))
        # the gradient of a stage's input, sent back or (next to its predecessor) passed on
        sent_back = tuple(problem.cut_bytes[a - 1] if s else 0.0 for s, a in enumerate(starts))
    return StageCosts(
        fwd_ms=total(problem.fwd_ms), bwd_input_ms=bwd_in, bwd_weight_ms=bwd_w,
        activation_bytes=act, input_bytes=keep, checkpoint=tuple(bool(c) for c in checkpoint),
        comm_fwd_ms=tuple(problem.comm_fwd_ms[e - 1] for e in ends[:-1]),
        comm_bwd_ms=tuple(problem.comm_bwd_ms[e - 1] for e in ends[:-1]),
        split_held_bytes=held, output_bytes=sent_out, input_grad_bytes=sent_back,
    )


def _rank_static(problem: JointProblem, balance: Sequence[int], stage_rank: Sequence[int],
                 p: int) -> list[float]:
    """Bytes each rank holds all step: its blocks' ``static_bytes`` and, with ``cut_bytes``,
    m receive buffers on each side of every cut between ranks."""
    out = [0.0] * p
    start = 0
    for s, count in enumerate(balance):
        out[stage_rank[s]] += math.fsum(problem.static_bytes[start:start + count])
        start += count
        if problem.cut_bytes is not None and s + 1 < len(balance) \
                and stage_rank[s] != stage_rank[s + 1]:
            buffers = problem.m * problem.cut_bytes[start - 1]
            out[stage_rank[s]] += buffers  # the gradients coming back
            out[stage_rank[s + 1]] += buffers  # the activations coming in
    return out


def _replayed(problem: JointProblem, order: ScheduleOrder, balance: Sequence[int],
              mask: Sequence[bool]) -> tuple[float, tuple[float, ...]]:
    """Replayed step (ms) and memory per rank (bytes) of one candidate."""
    timeline = replay(order, stage_costs(problem, balance, mask, order))
    static = _rank_static(problem, balance, order.stage_rank, order.p)
    return timeline.step_ms, tuple(a + b for a, b in zip(static, timeline.peak_bytes))


def _fits(problem: JointProblem, memory: Sequence[float]) -> bool:
    cap = problem.capacity_bytes
    return cap is None or all(x <= c * (1 + 1e-12) for x, c in zip(memory, cap))


def _masks(s: int, checkpointing: bool) -> list[tuple[bool, ...]]:
    if not checkpointing:
        return [(False,) * s]
    masks = list(itertools.product((False, True), repeat=s))
    return sorted(masks, key=lambda c: (sum(c), c))


def _better(step: float, key: tuple, best: tuple[float, tuple] | None) -> bool:
    if best is None or step < best[0] * (1 - TIE_RTOL):
        return True
    return step <= best[0] * (1 + TIE_RTOL) and key < best[1]


def brute_force_joint(problem: JointProblem, order: ScheduleOrder,
                      checkpointing: bool = False) -> JointSolution | None:
    """Replay every balance and mask (the tests' oracle); ``None`` when nothing fits."""
    s_count = order.n
    best: tuple[float, tuple] | None = None
    found = None
    for cuts in itertools.combinations(range(1, problem.n), s_count - 1):
        edges = (0, *cuts, problem.n)
        balance = tuple(b - a for a, b in zip(edges, edges[1:]))
        for mask in _masks(s_count, checkpointing):
            step, memory = _replayed(problem, order, balance, mask)
            key = (sum(mask), balance, mask)
            if _fits(problem, memory) and _better(step, key, best):
                best, found = (step, key), JointSolution(balance, mask, step, memory)
    return found


class _MemoryModel:
    """Peak in-flight bytes per rank for many candidates at once (see the module docstring).

    For each rank, after every change the replay applies, the number of micro-batches holding
    each stage's saved bytes (``held``: from the end of F to the end of the last backward),
    recomputed activations (``recomputing``: from the start of B/I to that end), what the
    weight pass needs in their place (``between``: from the end of I to the end of W), and
    what was sent and is kept until the step ends (:attr:`ScheduleOrder.holds_sends`):
    ``sent_out``, forwards ended, and ``sent_back``, input gradients (every I; every B where
    the runtime keeps its backward sends)."""

    def __init__(self, order: ScheduleOrder) -> None:
        last = {(a.stage, a.microbatch): a.kind for row in order.actions for a in row
                if a.kind in ("B", "W")}
        fwd_held, bwd_held = order.holds_sends
        self.rows: list[tuple[np.ndarray, ...]] = []
        for row in order.actions:
            counts = np.zeros((5, order.n))  # held, recomputing, between, sent out, sent back
            snaps = [counts.copy()]
            for a in row:
                s = a.stage
                if a.kind in ("B", "I"):
                    counts[1, s] += 1
                    snaps.append(counts.copy())
                if a.kind == "F":
                    counts[0, s] += 1
                    counts[3, s] += fwd_held
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
                snaps.append(counts.copy())
            stacked = np.array(snaps)
            self.rows.append(tuple(stacked[:, j] for j in range(5)))

    def peaks(self, kept: np.ndarray, recomputed: np.ndarray, between: np.ndarray | None = None,
              sent_out: np.ndarray | None = None, sent_back: np.ndarray | None = None
              ) -> np.ndarray:
        """C × S bytes per micro-batch → C × p peak bytes: ``kept``, ``recomputed``,
        ``between`` (the split backward's held bytes less the activations), ``sent_out`` and
        ``sent_back`` (what each stage sends forward and backward; the last three default 0)."""
        out = []
        for h, r, w, f, g in self.rows:
            level = kept @ h.T + recomputed @ r.T
            for row, counts in ((between, w), (sent_out, f), (sent_back, g)):
                if row is not None:
                    level = level + row @ counts.T
            out.append(np.max(level, axis=1))
        return np.stack(out, axis=1)


def _balances(n: int, s: int) -> np.ndarray:
    count = math.comb(n - 1, s - 1)
    if count > MAX_BALANCES:
        raise InvalidInputError(f"{count} ways to cut {n} blocks into {s} stages: more than "
                                f"{MAX_BALANCES} to enumerate; use fewer stages per rank")
    cuts = np.array(list(itertools.combinations(range(1, n), s - 1)), dtype=np.int64)
    cuts = cuts.reshape(count, s - 1)
    return np.hstack([np.zeros((count, 1), np.int64), cuts, np.full((count, 1), n)])


def _sequence(order: ScheduleOrder) -> list[tuple[int, str, int, int]]:
    """Every action as (rank, kind, stage, micro-batch) in the order :func:`replay` times
    them (which depends on the order only, not on the durations)."""
    n, done, out = order.n, set(), []
    cursor = [0] * order.p
    while any(c < len(row) for c, row in zip(cursor, order.actions)):
        for r, row in enumerate(order.actions):
            while cursor[r] < len(row):
                a = row[cursor[r]]
                s, i = a.stage, a.microbatch
                if a.kind == "F":
                    needs = [] if s == 0 else [("F", s - 1, i)]
                elif a.kind == "W":
                    needs = [("G", s, i)]
                else:
                    needs = [("F", s, i)] + ([("G", s + 1, i)] if s < n - 1 else [])
                if any(key not in done for key in needs):
                    break
                done.add(("G" if a.kind in ("B", "I") else a.kind, s, i))
                out.append((r, a.kind, s, i))
                cursor[r] += 1
    return out


def _steps(order: ScheduleOrder, sequence: list[tuple[int, str, int, int]],
           dur: dict[str, np.ndarray], hop_f: np.ndarray, hop_b: np.ndarray) -> np.ndarray:
    """:func:`replay`'s step for C candidates at once: ``dur[kind]`` C × S durations,
    ``hop_f``/``hop_b`` C × (S − 1) transfers (0 between stages of one rank)."""
    n = order.n
    free = [np.zeros(len(hop_f)) for _ in range(order.p)]
    end: dict[tuple[str, int, int], np.ndarray] = {}
    for r, kind, s, i in sequence:
        if kind == "F":
            ready = end["F", s - 1, i] + hop_f[:, s - 1] if s else None
        elif kind == "W":
            ready = end["G", s, i]
        else:
            ready = end["F", s, i]
            if s < n - 1:
                ready = np.maximum(ready, end["G", s + 1, i] + hop_b[:, s])
        begin = free[r] if ready is None else np.maximum(free[r], ready)
        free[r] = begin + dur[kind][:, s]
        end["G" if kind in ("B", "I") else kind, s, i] = free[r]
    return np.max(np.stack(free), axis=0)


def solve_joint(problem: JointProblem, order: ScheduleOrder, checkpointing: bool = False,
                time_limit_s: float | None = None) -> JointSolution | None:
    """The fastest replayed step over every balance into ``order.n`` stages and (with
    ``checkpointing``) every checkpoint mask that fits; ``None`` when nothing fits.

    Every candidate whose bound is below the best step so far is timed exactly, vectorised
    (:func:`_steps`, the replay's arithmetic over all balances at once); the winner is then
    replayed (:func:`replay`) for the step and memory it reports.

    Raises:
        InvalidInputError: more stages than blocks, a split backward without its
            measurements, checkpointing without ``input_bytes``, or too many balances.
    """
    split = order.splits_backward
    if order.n > problem.n:
        raise InvalidInputError(f"{order.n} stages for {problem.n} blocks: too many stages")
    if split and problem.input_grad_ms is None:
        raise InvalidInputError(f"schedule {order.schedule!r} splits the backward, but the "
                                "profile has no input_grad_ms / weight_grad_ms")
    if checkpointing and problem.input_bytes is None:
        raise InvalidInputError("checkpointing needs input_bytes (checkpoint_saved_bytes)")
    started = time.perf_counter()
    edges = _balances(problem.n, order.n)
    first, end = edges[:, :-1], edges[:, 1:]

    def sums(row: Sequence[float]) -> np.ndarray:
        prefix = np.concatenate([[0.0], np.cumsum(np.asarray(row, dtype=float))])
        return prefix[end] - prefix[first]

    f = sums(problem.fwd_ms)
    if split:
        g, w = sums(problem.input_grad_ms), sums(problem.weight_grad_ms)  # type: ignore[arg-type]
    else:
        g, w = sums(problem.bwd_ms), np.zeros_like(f)
    act = sums(problem.saved_bytes)
    between = None if problem.split_held_bytes is None or not split else \
        sums(problem.split_held_bytes) - act
    keep = np.zeros_like(act) if problem.input_bytes is None else np.asarray(
        problem.input_bytes, dtype=float)[first]
    place = np.asarray(order.stage_rank)
    same = place[:-1] == place[1:]
    cut = end[:, :-1] - 1  # the block each cut follows
    hop_f = np.where(same, 0.0, np.asarray(problem.comm_fwd_ms, dtype=float)[cut])
    hop_b = np.where(same, 0.0, np.asarray(problem.comm_bwd_ms, dtype=float)[cut])
    at_cut = sent_out = sent_back = None
    if problem.cut_bytes is not None:  # per micro-batch, C × (S − 1)
        at_cut = np.asarray(problem.cut_bytes, dtype=float)[cut]
        sent_out = np.hstack([at_cut * ~same, np.zeros((len(at_cut), 1))])  # to another rank
        sent_back = np.hstack([np.zeros((len(at_cut), 1)), at_cut])  # its input's gradient
    on = [place == r for r in range(order.p)]
    below = [np.arange(order.n) < np.flatnonzero(o).min() for o in on]
    model, sequence = _MemoryModel(order), _sequence(order)
    cap = None if problem.capacity_bytes is None else np.asarray(problem.capacity_bytes)
    static = sums(problem.static_bytes)
    if at_cut is not None:  # receive buffers on both sides of a cut between ranks
        buffers = problem.m * at_cut * ~same
        static[:, :-1] += buffers
        static[:, 1:] += buffers
    static_r = np.stack([static[:, o].sum(axis=1) for o in on], axis=1)
    best: tuple[float, tuple] | None = None
    chosen: tuple[tuple[int, ...], tuple[bool, ...]] | None = None
    proven = True
    for mask in _masks(order.n, checkpointing):
        if time_limit_s is not None and time.perf_counter() - started > time_limit_s:
            proven = False
            break
        c = np.asarray(mask, dtype=float)
        recompute = f * c
        memory = static_r + model.peaks(act * (1 - c) + keep * c, act * c, between,
                                        sent_out, sent_back)
        ok = np.ones(len(f), bool) if cap is None else np.all(memory <= cap * (1 + 1e-12), 1)
        work = problem.m * (f + g + w + recompute)
        bound = np.sum(f + g + recompute, axis=1)
        for r in range(order.p):
            rank = work[:, on[r]].sum(axis=1) + (f * below[r]).sum(axis=1)
            if not split:
                rank = rank + ((g + recompute) * below[r]).sum(axis=1)
            bound = np.maximum(bound, rank)
        if best is not None:
            ok &= bound <= best[0] * (1 + TIE_RTOL)
        rows = np.flatnonzero(ok)
        if not len(rows):
            continue
        dur = {"F": f[rows], "W": w[rows], "I": recompute[rows] + g[rows],
               "B": recompute[rows] + g[rows] + w[rows]}
        steps = _steps(order, sequence, dur, hop_f[rows], hop_b[rows])
        low = steps.min()
        row = int(rows[np.flatnonzero(steps <= low * (1 + TIE_RTOL))[0]])
        balance = tuple(int(x) for x in np.diff(edges[row]))
        key = (sum(mask), balance, mask)
        if _better(float(low), key, best):
            best, chosen = (float(low), key), (balance, mask)
    if chosen is None:
        return None
    step, memory = _replayed(problem, order, *chosen)
    return JointSolution(chosen[0], chosen[1], step, memory, proven)
