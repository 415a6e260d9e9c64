"""Cuts and per-stage recomputation for one schedule order, exactly (numbers only, no torch).

Symbols: N blocks, p ranks, v stages per rank, S = p·v stages, m micro-batches, s a stage,
r a rank, c_s ∈ {0, 1} whether stage s is checkpointed. Per stage, summed over its blocks
(ms per micro-batch): F_s forward, B_s full backward, I_s / W_s its input / weight parts
(zero-bubble schedules); a checkpointed stage recomputes F_s in its backward. The first
stage's input needs no gradient, so torch's stage runs its whole backward in the weight pass:
I_0 = 0, W_0 = B_0, and nothing is held in place of its activations between the two.

The objective is the step of :func:`autosplit.schedules.replay` on the schedule's own order
(:class:`~autosplit.schedules.ScheduleOrder`) for the stage costs of a balance (blocks per
stage) and a checkpoint mask, plus the slowest rank's optimizer update after it
(``JointProblem.update_ms``; the bounds below leave it out), among those whose memory fits
every rank:

    memory_r = Σ_{s on r} static_s + m · (bytes of each cut that r's stages send or
               receive: torch's per micro-batch buffers) + peak in-flight bytes of rank r
               (the replay's ``peak_bytes``: activations, outputs and gradients held, and a
               backward's transient bytes while it runs)

Torch's stages keep one buffer per micro-batch for what comes in at a cut, the activations
on the later stage and the gradients on the earlier one, from step to step. At a cut between
ranks they are receive buffers; at a cut inside a rank (ZB-V's turn of the V) the runtime
hands the output and the gradient over by reference, and those buffers hold the last ones
handed over until the next step replaces them — the same bytes. Measured: ZB-V's middle rank
at the tutorial's size held 215 MiB more than a model without them predicted (−16 %).

The in-flight bytes depend only on the rank's action order, not on the times (a rank runs one
action at a time), so :class:`_MemoryModel` evaluates them exactly and vectorised over every
balance. The search:

* enumerates every balance (numpy, C(N−1, S−1) of them) and every checkpoint mask (no mask
  when checkpointing is not offered), keeping those that fit;
* bounds each from below by the larger of (a) the busiest rank, max_r (head_r + m · Σ_{s on r}
  (F_s + D_s + c_s F_s) + tail_r), with D_s = B_s (or I_s + W_s when the backward is split;
  F_s and B_s or I_s each with the runtime's cost per action, ``action_ms``),
  head_r = Σ_{s < s_min(r)} F_s (rank r's first forward waits for the stages before it) and,
  for schedules that do not split the backward, tail_r = Σ_{s < s_min(r)} (B_s + c_s F_s)
  (its last backward still has to reach stage 0), and (b) one micro-batch's round trip
  Σ_s (F_s + G_s), G_s the input-gradient work, and (c) the balance's replay without
  recomputation (computed once for every balance: recomputing only lengthens a backward);
  all ≤ the replay, whose durations only add;
* with a memory limit, weighs each rank's memory once per pattern of checkpointed stages on
  it (2^v patterns: a rank's memory depends on its own stages' masks only) and keeps the masks
  whose every rank's pattern is a smallest fitting one on some balance (a pattern with a
  fitting proper subset recomputes more for nothing); with none, only the mask-free replay
  (no mask beats it, and it wins the ties);
* takes the masks with the fewest checkpointed stages first and, once a step is known, bounds
  and replays only the balances that fit and whose bound does not exceed it.

Ties: steps within a relative 1e-9 are equal; fewer checkpointed stages win, then the
lexicographically smallest balance, then the smallest mask.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence

import numpy as np

from autosplit.errors import InvalidInputError
from autosplit.schedules.replay import replay, send_copies
from autosplit.schedules.torch_order import ScheduleOrder
from autosplit.solve.in_flight import InFlight, stage_transients
from autosplit.solve.joint_problem import (
    JointProblem,
    JointSolution,
    first_weight_pass,
    rank_static_bytes,
    rank_update_ms,
    stage_costs,
)

__all__ = ["JointProblem", "JointSolution", "brute_force_joint", "solve_joint", "stage_costs"]

TIE_RTOL = 1e-9
MAX_BALANCES = 2_000_000
"""More balances than this are not enumerated (:class:`InvalidInputError`)."""


def _replayed(problem: JointProblem, order: ScheduleOrder, balance: Sequence[int],
              mask: Sequence[bool]) -> tuple[float, tuple[float, ...]]:
    """Replayed step (ms) and memory per rank (bytes) of one candidate."""
    timeline = replay(order, stage_costs(problem, balance, mask, order))
    static = rank_static_bytes(problem, balance, order.stage_rank, order.p)
    update = rank_update_ms(problem, balance, order.stage_rank, order.p)
    return timeline.step_ms + update, tuple(a + b for a, b in zip(static, timeline.peak_bytes))


def _shared_once_per_rank(problem: JointProblem, order: ScheduleOrder, end: np.ndarray,
                          static_r: np.ndarray, grads: np.ndarray | None) -> None:
    """Take a shared weight's extra copies off ``static_r`` (C × p) and its extra gradients
    off ``grads`` (C × S), in place, for the C balances whose stage ends are ``end``: as
    :func:`rank_static_bytes` and :func:`shared_grad_excess` do for one."""
    place = np.asarray(order.stage_rank)
    first = np.asarray(first_weight_pass(order))
    for blocks, nbytes, grad in problem.shared:
        stage = np.stack([(end <= i).sum(axis=1) for i in blocks], axis=1)  # C × users
        held, users = place[stage], len(blocks)
        key = first[stage] * users + np.arange(users)  # the keeper: first weight pass, then user
        for r in range(order.p):
            mine = held == r
            static_r[:, r] -= np.maximum(mine.sum(axis=1) - 1, 0) * nbytes
            if grads is None or not grad:
                continue
            extra = mine.copy()
            extra[np.arange(len(stage)), np.where(mine, key, np.iinfo(np.int64).max).argmin(
                axis=1)] = False
            rows, cols = np.nonzero(extra)
            np.add.at(grads, (rows, stage[rows, cols]), -grad)


def _fits(problem: JointProblem, memory: Sequence[float]) -> bool:
    cap = problem.capacity_bytes
    return cap is None or all(x <= c * (1 + 1e-12) for x, c in zip(memory, cap))


def _masks(s: int, checkpointing: bool) -> list[tuple[bool, ...]]:
    if not checkpointing:
        return [(False,) * s]
    masks = list(itertools.product((False, True), repeat=s))
    return sorted(masks, key=lambda c: (sum(c), c))


def _minimal_patterns(fits: np.ndarray, on: Sequence[np.ndarray]
                      ) -> tuple[np.ndarray, list[tuple[bool, ...]]]:
    """Where a rank's pattern of checkpointed stages is worth replaying, and the masks made of
    such patterns only.

    ``fits[j, x, r]``: pattern j (bit k: rank r's k-th stage checkpointed) fits rank r on
    balance x. A pattern with a fitting proper subset never wins on that balance: the subset
    fits too (the other ranks' memory does not depend on it) and recomputes less, so its step
    is no longer and it has fewer checkpointed stages. Returns ``fits`` kept to the minimal
    fitting patterns, and every mask whose each rank's pattern is minimal on some balance,
    fewest checkpointed stages first (as :func:`_masks` orders them)."""
    minimal = fits.copy()
    for j in range(1, len(fits)):
        sub = (j - 1) & j
        while True:  # every proper subset of j
            minimal[j] &= ~fits[sub]
            if sub == 0:
                break
            sub = (sub - 1) & j
    useful = minimal.any(axis=1)  # pattern × rank
    stages = [np.flatnonzero(o_r) for o_r in on]
    choices = [[j for j in range(min(len(fits), 1 << len(idx))) if useful[j, r]]
               for r, idx in enumerate(stages)]
    masks = []
    for combo in itertools.product(*choices):
        mask = [False] * sum(len(idx) for idx in stages)
        for j, idx in zip(combo, stages):
            for k, s in enumerate(idx):
                mask[s] = bool(j >> k & 1)
        masks.append(tuple(mask))
    return minimal, sorted(masks, key=lambda c: (sum(c), c))


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
        balance = tuple(b - a for a, b in itertools.pairwise(edges))
        for mask in _masks(s_count, checkpointing):
            step, memory = _replayed(problem, order, balance, mask)
            key = (sum(mask), balance, mask)
            if _fits(problem, memory) and _better(step, key, best):
                best, found = (step, key), JointSolution(balance, mask, step, memory)
    return found


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
    n, done, out, place = order.n, set(), [], order.stage_rank
    sent = {(what, s, i): after for row in order.sends for what, s, i, after in row}
    cursor = [0] * order.p

    def available(r: int, key: tuple[str, int, int]) -> bool:
        q = place[key[1]]
        return key in done and (q == r or cursor[q] >= sent.get(key, 0))

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
                if not all(available(r, key) for key in needs):
                    break
                done.add(("G" if a.kind in ("B", "I") else a.kind, s, i))
                out.append((r, a.kind, s, i))
                cursor[r] += 1
    return out


def _steps(order: ScheduleOrder, sequence: list[tuple[int, str, int, int]],
           dur: dict[str, np.ndarray], hop_f: np.ndarray, hop_b: np.ndarray,
           on_cores: bool = False) -> np.ndarray:
    """:func:`replay`'s step for C candidates at once: ``dur[kind]`` C × S durations,
    ``hop_f``/``hop_b`` C × (S − 1) transfers (0 between stages of one rank). A transfer
    between ranks starts once the sender has posted its send (:attr:`ScheduleOrder.sends`;
    not given: when the action computing it ends) and the receiver its receive
    (:attr:`ScheduleOrder.posts`; none given: right before the action that needs it).
    ``on_cores``: transfers cost both ranks compute, as
    :attr:`~autosplit.schedules.StageCosts.transfers_on_cores` (the sender's right after its
    posting, the receiver's for the part of the transfer made before it is free)."""
    n, place = order.n, order.stage_rank
    posted = [{(what, s, i): before for what, s, i, before in row} for row in order.posts]
    sent = {(what, s, i): after for row in order.sends for what, s, i, after in row}
    copies = send_copies(order, hop_f.T, hop_b.T) if on_cores else None
    free = [np.zeros(len(hop_f)) for _ in range(order.p)]
    ends: list[list[np.ndarray]] = [[] for _ in range(order.p)]  # each rank's actions' ends
    end: dict[tuple[str, int, int], np.ndarray] = {}

    def start(r: int, key: tuple[str, int, int], receive: tuple[str, int, int]) -> np.ndarray:
        if place[key[1]] == r:
            return end[key]  # the same rank: nothing moves
        done = len(ends[r])
        before = min(posted[r].get(receive, done), done) if posted else done
        post = ends[r][before - 1] if before else 0.0
        after = sent.get(key, 0)
        send = ends[place[key[1]]][after - 1] if after else end[key]
        return np.maximum(np.maximum(end[key], send), post)

    for r, kind, s, i in sequence:
        windows = []
        if kind == "F":
            windows = [(start(r, ("F", s - 1, i), ("F", s, i)), hop_f[:, s - 1])] if s else []
            ready = windows[0][0] + windows[0][1] if s else None
        elif kind == "W":
            ready = end["G", s, i]
        else:
            ready = end["F", s, i]
            if s < n - 1:
                windows = [(start(r, ("G", s + 1, i), ("G", s, i)), hop_b[:, s])]
                ready = np.maximum(ready, windows[0][0] + windows[0][1])
        begin = free[r] if ready is None else np.maximum(free[r], ready)
        finish = begin + dur[kind][:, s]
        if copies is not None:
            for at, hop in windows:  # the part of the copy made while the rank was busy
                finish = finish + np.minimum(np.maximum(free[r] - at, 0.0), hop)
        ends[r].append(finish)
        end["G" if kind in ("B", "I") else kind, s, i] = finish
        free[r] = finish + copies[r].get(len(ends[r]), 0.0) if copies else finish
    return np.max(np.stack([row[-1] if row else np.zeros(len(hop_f)) for row in ends]), axis=0)


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
    act = sums(problem.saved_bytes)
    between = None
    if split:
        g, w = sums(problem.input_grad_ms), sums(problem.weight_grad_ms)  # type: ignore[arg-type]
        g[:, 0], w[:, 0] = 0.0, sums(problem.bwd_ms)[:, 0]  # the first stage: one weight pass
        if problem.split_held_bytes is not None:
            between = sums(problem.split_held_bytes) - act
            if problem.cut_bytes is not None:  # the gradients between the stage's blocks
                inner = np.concatenate([[0.0], np.cumsum(problem.cut_bytes)])
                between += inner[end - 1] - inner[first]
            between[:, 0] = 0.0
    else:
        g, w = sums(problem.bwd_ms), np.zeros_like(f)
    whole = sums(problem.bwd_ms)  # a B action: the backward in one pass
    keep = np.zeros_like(act) if problem.input_bytes is None else np.asarray(
        problem.input_bytes, dtype=float)[first]
    place = np.asarray(order.stage_rank)
    same = place[:-1] == place[1:]
    cut = end[:, :-1] - 1  # the block each cut follows
    hop_f = np.where(same, 0.0, np.asarray(problem.comm_fwd_ms, dtype=float)[cut])
    hop_b = np.where(same, 0.0, np.asarray(problem.comm_bwd_ms, dtype=float)[cut])
    at_cut = sent_back = None
    # each stage's output, C × S: the last stage's is the model's; the others' are what
    # crosses their cut, unknown (0, as the replay counts it) without cut_bytes
    output = np.zeros(act.shape)
    output[:, -1] = float(problem.final_output_bytes)
    saved_out = np.zeros(act.shape)  # the part of it the stage saves anyway
    if problem.cut_bytes is not None:  # per micro-batch, C × (S − 1)
        at_cut = np.asarray(problem.cut_bytes, dtype=float)[cut]
        output[:, :-1] = at_cut
        if problem.output_saved_bytes is not None:
            saved_out[:, :-1] = np.asarray(problem.output_saved_bytes, dtype=float)[cut]
            saved_out = np.minimum(np.minimum(saved_out, output), act)
        sent_back = np.hstack([np.zeros((len(at_cut), 1)), at_cut])  # its input's gradient
    sent = np.append(~same, False) & order.holds_sends[0]  # outputs held until the step ends
    running = stage_transients(problem, first, end, output)
    grads = None if problem.grad_bytes is None else sums(problem.grad_bytes)
    on = [place == r for r in range(order.p)]
    below = [np.arange(order.n) < np.flatnonzero(o).min() for o in on]
    model, sequence = InFlight(order), _sequence(order)
    cap = None if problem.capacity_bytes is None else np.asarray(problem.capacity_bytes)
    static = sums(problem.static_bytes)
    if at_cut is not None:  # per micro-batch buffers on both sides of every cut (see above)
        buffers = problem.m * at_cut
        static[:, :-1] += buffers
        static[:, 1:] += buffers
    static_r = np.stack([static[:, o].sum(axis=1) for o in on], axis=1)
    _shared_once_per_rank(problem, order, end, static_r, grads)
    # every micro-batch has an F and a B or I on each stage, each with the runtime's cost
    fo, go, o = f + problem.action_ms, g + problem.action_ms, problem.action_ms
    bo = whole + o
    # a micro-batch's backward on a stage: B, or I then W; its gradient to the stage before
    # comes with B or I (bounds take the cheaper, which the replay may not)
    back, grad = np.minimum(bo, go + w + o), np.minimum(bo, go)
    # the replay of every balance without recomputation: recomputing only lengthens a
    # backward and the replay's durations only add, so it bounds every mask from below
    no_mask = _steps(order, sequence, {"F": fo, "W": w + o, "I": go, "B": bo}, hop_f, hop_b,
                     problem.transfers_on_cores)
    # every rank updates its stages' parameters after the last backward: the slowest adds
    update = np.zeros(len(f))
    if problem.update_ms is not None:
        u = sums(problem.update_ms)
        update = np.max([u[:, o].sum(axis=1) for o in on], axis=0)
    no_mask = no_mask + update

    def memory(rows: np.ndarray, c: np.ndarray) -> np.ndarray:
        """The rows' memory per rank (bytes), R × p, under the checkpoint mask c."""
        both = saved_out[rows] * (1 - c)  # counted once: in the activations, then by the send
        return static_r[rows] + model.peaks(
            act[rows] * (1 - c) + keep[rows] * c - both * sent, act[rows] * c,
            None if between is None else between[rows], output[rows] * sent,
            None if sent_back is None else sent_back[rows], running[rows],
            (output[rows] - both) * ~sent, None if grads is None else grads[rows])

    # a rank's memory depends on its own stages' masks only (its actions touch no other
    # stage): what fits is weighed once per pattern of checkpointed stages on a rank (2^v
    # patterns, each on every rank at once), then a mask fits where each rank's pattern does
    slot = np.zeros(order.n, np.int64)  # a stage's place among its rank's stages
    for o_r in on:
        slot[o_r] = np.arange(int(o_r.sum()))
    fits = None
    # no memory limit: recomputation never shortens a step, and fewer checkpointed stages
    # win the ties, so the mask-free replay is the answer
    masks = [(False,) * order.n]
    if cap is not None:
        every = np.arange(len(f))
        fits = np.stack([
            memory(every, ((j >> slot) & 1).astype(float)) <= cap * (1 + 1e-12)
            for j in range(1 << int(slot.max() + 1) if checkpointing else 1)])
        fits, masks = _minimal_patterns(fits, on)
    best: tuple[float, tuple] | None = None
    chosen: tuple[tuple[int, ...], tuple[bool, ...]] | None = None
    proven = True
    for mask in masks:
        if time_limit_s is not None and time.perf_counter() - started > time_limit_s:
            proven = False
            break
        c = np.asarray(mask, dtype=float)
        recompute = f * c
        rows = np.arange(len(f))
        if best is not None:  # only where the mask-free replay leaves a chance
            rows = np.flatnonzero(no_mask <= best[0] * (1 + TIE_RTOL))
        if fits is not None and len(rows):
            pattern = np.asarray(mask, np.int64) << slot
            ok = np.ones(len(rows), bool)
            for r in range(order.p):
                ok &= fits[int(pattern[on[r]].sum()), rows, r]
            rows = rows[ok]
        if best is not None and len(rows):
            rec = recompute[rows]
            work = problem.m * (fo[rows] + back[rows] + rec)
            bound = np.sum(fo[rows] + grad[rows] + rec, axis=1)
            for r in range(order.p):
                rank = work[:, on[r]].sum(axis=1) + (fo[rows] * below[r]).sum(axis=1)
                if not split:
                    rank = rank + ((go[rows] + rec) * below[r]).sum(axis=1)
                bound = np.maximum(bound, rank)
            rows = rows[bound <= best[0] * (1 + TIE_RTOL)]
        if not len(rows):
            continue
        if any(mask):
            dur = {"F": fo[rows], "W": w[rows] + o, "I": recompute[rows] + go[rows],
                   "B": recompute[rows] + bo[rows]}
            steps = _steps(order, sequence, dur, hop_f[rows], hop_b[rows],
                           problem.transfers_on_cores) + update[rows]
        else:  # replayed already
            steps = no_mask[rows]
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
