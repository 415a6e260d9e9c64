"""The joint search's numbers and what one candidate costs (numbers only, no torch).

:class:`JointProblem` holds one micro-batch size's per-block times and bytes;
:func:`stage_costs` turns a balance (blocks per stage) and a checkpoint mask into the
replay's :class:`~autosplit.schedules.StageCosts` for a schedule order, and
:func:`rank_static_bytes` gives what each rank holds all step. :mod:`autosplit.solve.joint`
searches over every balance with them; :mod:`autosplit.solve.in_flight` evaluates the same
memory for many balances at once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from autosplit import checks
from autosplit.errors import InvalidInputError
from autosplit.schedules.replay import StageCosts
from autosplit.schedules.torch_order import ScheduleOrder

__all__ = ["JointProblem", "JointSolution", "first_weight_pass", "rank_static_bytes",
           "rank_update_ms", "shared_grad_excess", "stage_costs", "stage_transient"]


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
        static_bytes: what each block holds all step (bytes): weights, optimizer state and
            buffers, and its weight gradients unless ``grad_bytes`` counts them.
        split_held_bytes: bytes each block holds between the input and the weight pass of a
            split backward, per micro-batch (in place of its ``saved_bytes``), or ``None``:
            the same as ``saved_bytes``. A stage of several blocks also holds the gradient
            at each cut inside it (``cut_bytes``), which the weight pass of the block before
            the cut reads.
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
        output_saved_bytes: of the bytes crossing the cut after each block, those the blocks
            before it save for backward anyway (N − 1 entries; counted once), or ``None``
            (none). Only with ``cut_bytes``.
        final_output_bytes: bytes of the model's output, which the last stage keeps from its
            forward until its backward (bytes per micro-batch).
        transient_bytes: bytes each block needs briefly while its backward runs beyond what it
            keeps (N entries), or ``None`` (none): a stage's backward needs the most of its
            blocks' less what the blocks after it in the stage keep (they hold it no longer
            or not yet), the last block's less the stage's output (held already).
        grad_bytes: bytes of each block's weight gradients (N entries), there from the end
            of its stage's first weight-gradient pass of the step (B, or W when split) until
            the step ends; or ``None``: counted in ``static_bytes``.
        action_ms: what the runtime costs per action beyond the compute (ms; in every F, B,
            I and W of the replay, :mod:`autosplit.measure.runtime_cost`).
        shared: weights several blocks use (tied weights): each one's user blocks, the bytes
            of ``static_bytes`` each user counts for it (the weight and its optimizer state)
            and those of ``grad_bytes`` (its gradient). A rank whose stages hold several users
            holds one copy: the others are taken off its static bytes, and its gradient is
            counted once, on the user stage whose weight pass comes first in the rank's order
            (the pass that allocates it; the others add into it).
        transfers_on_cores: whether a transfer between ranks costs both ranks compute (gloo
            between CPU workers: :attr:`~autosplit.schedules.StageCosts.transfers_on_cores`).
        update_ms: the optimizer's update of each block's parameters (N entries, ms per
            step), or ``None`` (not counted): every rank updates its stages' parameters after
            the step's last backward, so the objective is the replay plus the slowest rank's
            update (:func:`rank_update_ms`).
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
    output_saved_bytes: tuple[float, ...] | None = None
    final_output_bytes: float = 0.0
    transient_bytes: tuple[float, ...] | None = None
    grad_bytes: tuple[float, ...] | None = None
    action_ms: float = 0.0
    shared: tuple[tuple[tuple[int, ...], float, float], ...] = ()
    transfers_on_cores: bool = False
    update_ms: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.fwd_ms)
        rows = [self.bwd_ms, self.saved_bytes, self.static_bytes,
                *(r for r in (self.input_grad_ms, self.weight_grad_ms, self.input_bytes,
                              self.split_held_bytes, self.transient_bytes, self.grad_bytes,
                              self.update_ms)
                   if r)]
        if n < 1 or any(len(r) != n for r in rows):
            raise InvalidInputError(f"every per-block row needs {n} ≥ 1 entries")
        cuts = [self.comm_fwd_ms, self.comm_bwd_ms,
                *(r for r in (self.cut_bytes, self.output_saved_bytes) if r is not None)]
        if any(len(r) != n - 1 for r in cuts):
            raise InvalidInputError(f"comm_fwd_ms, comm_bwd_ms, cut_bytes and "
                                    f"output_saved_bytes need one entry per cut ({n - 1})")
        if self.output_saved_bytes is not None and self.cut_bytes is None:
            raise InvalidInputError("output_saved_bytes goes with cut_bytes")
        if (self.input_grad_ms is None) != (self.weight_grad_ms is None):
            raise InvalidInputError("input_grad_ms and weight_grad_ms go together")
        for blocks, *sizes in self.shared:
            if not blocks or any(not 0 <= i < n for i in blocks) or len(sizes) != 2 or not all(
                    math.isfinite(x) and x >= 0 for x in sizes):
                raise InvalidInputError(f"shared: blocks {blocks} of {n}, bytes {sizes}: each "
                                        "needs blocks in range and two byte counts ≥ 0")
        checks.instance_of("transfers_on_cores", self.transfers_on_cores, bool, "True or False")
        if not (math.isfinite(self.action_ms) and self.action_ms >= 0):
            raise InvalidInputError(f"action_ms must be a finite number ≥ 0, got "
                                    f"{self.action_ms}")

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
    ``cut_bytes``, each stage's output and the gradient of its input, which it sends back or
    passes to its predecessor on the same rank; each stage's transient bytes; a ``B`` action
    of a schedule that splits the others costs the blocks' whole backward)."""
    split = order.splits_backward
    ends = list(itertools.accumulate(balance))
    starts = [0, *ends[:-1]]

    def total(row: Sequence[float]) -> tuple[float, ...]:
        return tuple(math.fsum(row[a:b]) for a, b in zip(starts, ends))

    act = total(problem.saved_bytes)
    held = None if problem.split_held_bytes is None else total(problem.split_held_bytes)
    if held is not None and problem.cut_bytes is not None:  # and the gradients between blocks
        held = tuple(h + math.fsum(problem.cut_bytes[a:e - 1])
                     for h, a, e in zip(held, starts, ends))
    if split:  # the first stage's input needs no gradient: its weight pass is the backward
        assert problem.input_grad_ms is not None and problem.weight_grad_ms is not None
        bwd_in = (0.0, *total(problem.input_grad_ms)[1:])
        bwd_w = (math.fsum(problem.bwd_ms[:ends[0]]), *total(problem.weight_grad_ms)[1:])
        held = None if held is None else (act[0], *held[1:])
    else:
        bwd_in, bwd_w = total(problem.bwd_ms), (0.0,) * len(balance)
    keep = (0.0,) * len(balance) if problem.input_bytes is None else tuple(
        problem.input_bytes[a] for a in starts)
    cut = problem.cut_bytes
    out = tuple(problem.final_output_bytes if e == problem.n else
                (0.0 if cut is None else cut[e - 1]) for e in ends)
    saved_out = tuple(
        0.0 if e == problem.n or problem.output_saved_bytes is None
        else min(problem.output_saved_bytes[e - 1], out[s], act[s]) for s, e in enumerate(ends))
    sent_back = None if cut is None else tuple(cut[a - 1] if s else 0.0
                                               for s, a in enumerate(starts))
    return StageCosts(
        fwd_ms=total(problem.fwd_ms), bwd_input_ms=bwd_in, bwd_weight_ms=bwd_w,
        activation_bytes=act, input_bytes=keep, checkpoint=tuple(bool(c) for c in checkpoint),
        comm_fwd_ms=tuple(problem.comm_fwd_ms[e - 1] for e in ends[:-1]),
        comm_bwd_ms=tuple(problem.comm_bwd_ms[e - 1] for e in ends[:-1]),
        split_held_bytes=held, output_bytes=out, input_grad_bytes=sent_back,
        output_saved_bytes=saved_out,
        transient_bytes=tuple(stage_transient(problem, a, e, o)
                              for a, e, o in zip(starts, ends, out)),
        grad_bytes=None if problem.grad_bytes is None else tuple(
            g - x for g, x in zip(total(problem.grad_bytes),
                                  shared_grad_excess(problem, balance, order))),
        action_ms=problem.action_ms,
        bwd_whole_ms=total(problem.bwd_ms),
        transfers_on_cores=problem.transfers_on_cores,
    )


def first_weight_pass(order: ScheduleOrder) -> tuple[int, ...]:
    """Per stage, the position of its first weight pass (``B`` or ``W``) in its rank's
    actions: where its weight gradients are allocated."""
    pos = [0] * order.n
    for row in order.actions:
        seen: set[int] = set()
        for k, a in enumerate(row):
            if a.kind in ("B", "W") and a.stage not in seen:
                pos[a.stage] = k
                seen.add(a.stage)
    return tuple(pos)


def shared_grad_excess(problem: JointProblem, balance: Sequence[int],
                       order: ScheduleOrder) -> list[float]:
    """Per stage, the gradient bytes of shared weights that ``grad_bytes`` counts beyond one
    per rank: every user but the one on the stage whose weight pass comes first on its rank
    (ties: the first user block)."""
    stage_of = [s for s, count in enumerate(balance) for _ in range(count)]
    first = first_weight_pass(order)
    out = [0.0] * len(balance)
    for blocks, _, grad in problem.shared:
        users = [stage_of[i] for i in blocks]
        for r in {order.stage_rank[s] for s in users}:
            mine = [(first[s], u, s) for u, s in enumerate(users) if order.stage_rank[s] == r]
            keeper = min(mine)
            for item in mine:
                if item != keeper:
                    out[item[2]] += grad
    return out


def stage_transient(problem: JointProblem, first: int, end: int, output: float) -> float:
    """What a backward of the stage of blocks [first, end) needs briefly beyond what is held
    when it starts (bytes; see :attr:`JointProblem.transient_bytes`)."""
    brief = problem.transient_bytes
    if brief is None:
        return 0.0
    need, later = max(brief[end - 1] - output, 0.0), problem.saved_bytes[end - 1]
    for j in range(end - 2, first - 1, -1):
        need = max(need, brief[j] - later)
        later += problem.saved_bytes[j]
    return need


def rank_static_bytes(problem: JointProblem, balance: Sequence[int], stage_rank: Sequence[int],
                 p: int) -> list[float]:
    """Bytes each rank holds all step: its blocks' ``static_bytes`` (a shared weight once per
    rank) and, with ``cut_bytes``, m buffers on each side of every cut, between ranks or inside
    one (see :mod:`autosplit.solve.joint`)."""
    out = [0.0] * p
    start = 0
    stage_of: list[int] = []
    for s, count in enumerate(balance):
        out[stage_rank[s]] += math.fsum(problem.static_bytes[start:start + count])
        stage_of += [s] * count
        start += count
        if problem.cut_bytes is not None and s + 1 < len(balance):
            buffers = problem.m * problem.cut_bytes[start - 1]
            out[stage_rank[s]] += buffers  # the gradients coming back
            out[stage_rank[s + 1]] += buffers  # the activations coming in
    for blocks, nbytes, _ in problem.shared:
        for r in range(p):
            users = sum(stage_rank[stage_of[i]] == r for i in blocks)
            out[r] -= max(users - 1, 0) * nbytes
    return out


def rank_update_ms(problem: JointProblem, balance: Sequence[int],
                   stage_rank: Sequence[int], ranks: int) -> float:
    """The slowest rank's optimizer update (ms): max over ranks of the updates of the blocks
    of its stages (``balance``: blocks per stage, stage s on ``stage_rank[s]``); 0 without
    ``update_ms``."""
    if problem.update_ms is None:
        return 0.0
    per_rank = [0.0] * ranks
    start = 0
    for s, count in enumerate(balance):
        per_rank[stage_rank[s]] += math.fsum(problem.update_ms[start:start + count])
        start += count
    return max(per_rank)
