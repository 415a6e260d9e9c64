"""Each rank's action order, taken from torch.distributed.pipelining's own schedule classes.

Symbols: p ranks, v stages per rank, n = p·v stages, m micro-batches, s a stage, i a
micro-batch. Action kinds follow torch's ``_ComputationType``: ``F`` forward, ``B`` full
backward, ``I`` backward for the stage's input (the gradient sent upstream), ``W`` backward for
the stage's weights (``B`` = ``I`` then ``W`` in one go).

How the order is obtained, without a process group:

* The schedule classes compute every rank's order in their constructor from nothing but
  ``stage.group_size``, ``stage.group_rank``, ``stage.num_stages`` and ``len(stages)``. We
  construct the class for rank 0 with v lightweight stand-in stages carrying those attributes
  (no module, no device, no communication) and read what the runtime executes:
  ``pipeline_order_with_comms[r]`` for the ``_PipelineScheduleRuntime`` classes (looped BFS,
  interleaved 1F1B, interleaved zero-bubble, ZB-V, DualPipeV), keeping its compute actions.
  ``OVERLAP_F_B`` (DualPipeV) runs its sub-actions one after the other, so it is flattened.
  Its ``RECV_F`` and ``RECV_B`` actions say where each receive is posted (:attr:`ScheduleOrder.
  posts`): torch places them as early as its lowering allows, often one action ahead. Its
  ``SEND_F`` and ``SEND_B`` actions say where each send is posted (:attr:`ScheduleOrder.sends`):
  right after the action that computed what is sent, except in an ``OVERLAP_F_B``, whose
  forward's output is sent only after the pair's backward has run.
* ``ScheduleGPipe`` and ``Schedule1F1B`` run hand-written loops, not an action list (their
  ``pipeline_order`` is documentation only, and for 1F1B's last rank it lists micro-batches
  1 … m instead of 0 … m-1 in torch 2.14). For them we run the loop itself,
  ``_step_microbatches``, once per rank with a stand-in stage that records each
  ``forward_one_chunk`` and ``backward_one_chunk`` call and has nothing to send or receive,
  and records where the loop posts each receive (right before the action that needs it) and
  each send (right after the action that computed it).

When torch refuses (p, v, m) (e.g. 1F1B with m < p, ZB-V with v ≠ 2), its message becomes a
:class:`~autosplit.errors.ScheduleUnavailableError`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal

from autosplit import checks
from autosplit.errors import ScheduleUnavailableError

__all__ = ["SCHEDULES", "SEARCHED", "SPLIT_BACKWARD", "Action", "ScheduleOrder", "torch_class_name", "torch_order"]

SCHEDULES = ("gpipe", "1f1b", "looped-bfs", "interleaved-1f1b", "interleaved-zb", "zbv",
             "dualpipev")
"""Schedule names, each run by one of torch's classes (see :func:`torch_class_name`)."""

SPLIT_BACKWARD = ("interleaved-zb", "zbv", "dualpipev")
"""The schedules that run a backward as an input-gradient then a weight-gradient pass."""

SEARCHED = (("gpipe", 1), ("1f1b", 1), ("looped-bfs", 2), ("interleaved-1f1b", 2),
            ("interleaved-zb", 2), ("zbv", 2), ("dualpipev", 2))
"""The (schedule, v) pairs ``"auto"`` searches: every schedule torch's runtime runs, the
multi-stage ones with 2 stages per rank (v = 3, 4 of the looped schedules are not searched:
the runtime's cost per action is measured per schedule, not per v)."""

_CLASSES = {
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
# "gpipe" and "1f1b" pick a class by v, as autosplit.distributed.stage_module.build_schedule does
_SINGLE = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
_MULTI = {"gpipe": "ScheduleLoopedBFS", "1f1b": "ScheduleInterleaved1F1B"}

Kind = Literal["F", "B", "I", "W"]


@dataclass(frozen=True, slots=True)
class Action:
    """One compute action of a rank.

    Attributes:
        kind: ``"F"`` forward, ``"B"`` full backward, ``"I"`` input-gradient backward,
            ``"W"`` weight-gradient backward.
        stage: global stage index s, 0 ≤ s < n.
        microbatch: micro-batch index i, 0 ≤ i < m.
    """

    kind: Kind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"  # torch's notation: 2F0, 1I3


@dataclass(frozen=True, slots=True)
class ScheduleOrder:
    """Every rank's compute actions, in the order torch's runtime executes them.

    Attributes:
        schedule: the autosplit name (one of :data:`SCHEDULES`).
        torch_class: the torch class that runs it, e.g. ``"ScheduleInterleaved1F1B"``.
        p: ranks; v: stages per rank; m: micro-batches.
        stage_rank: ``stage_rank[s]`` is the rank holding stage s (n = p·v entries).
        actions: ``actions[r]`` is rank r's actions in execution order.
        posts: ``posts[r]``, the receives rank r posts: ``(what, stage, microbatch, before)``,
            ``what`` ``"F"`` for stage ``stage``'s forward input (from stage − 1) or ``"G"``
            for the gradient of its output (from stage + 1), posted after ``before`` of the
            rank's actions. A transfer starts once its receive is posted (gloo and NCCL match
            a send with its receive before moving the bytes). Empty (an order built by hand):
            every receive is posted right before the action that needs it.
        sends: ``sends[r]``, the sends rank r posts: ``(what, stage, microbatch, after)``,
            ``what`` ``"F"`` for stage ``stage``'s output (to stage + 1) or ``"G"`` for the
            gradient of its input (to stage − 1), posted after ``after`` of the rank's
            actions. Empty (an order built by hand), or a send not listed: posted right after
            the action that computed it.
    """

    schedule: str
    torch_class: str
    p: int
    v: int
    m: int
    stage_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    posts: tuple[tuple[tuple[str, int, int, int], ...], ...] = ()
    sends: tuple[tuple[tuple[str, int, int, int], ...], ...] = ()

    @property
    def n(self) -> int:
        """Number of stages, p·v."""
        return self.p * self.v

    @property
    def splits_backward(self) -> bool:
        """Whether some backward runs as ``I`` then ``W`` (zero-bubble schedules)."""
        return any(a.kind == "W" for row in self.actions for a in row)

    @property
    def holds_sends(self) -> tuple[bool, bool]:
        """Whether the runtime keeps what it sends forward (a stage's outputs) and backward
        (the gradients of its inputs) until the step ends: an asynchronous send holds its
        tensor until it is waited for, and the action-list runtime of the multi-stage classes
        waits for every send at the end of the step; ``ScheduleGPipe`` waits for its forward
        sends when its forwards are done and for its backward sends at the end;
        ``Schedule1F1B`` waits for each send one step of its loop later."""
        if self.torch_class == "ScheduleGPipe":
            return False, True
        if self.torch_class == "Schedule1F1B":
            return False, False
        return True, True


def torch_class_name(schedule: str, v: int) -> str:
    """The torch class that runs ``schedule`` with v stages per rank.

    ``"gpipe"``/``"1f1b"`` are ``ScheduleGPipe``/``Schedule1F1B`` for v = 1 and
    ``ScheduleLoopedBFS``/``ScheduleInterleaved1F1B`` for v > 1 (as ``autosplit run`` builds
    them); every other name is one class.
    """
    checks.one_of("schedule", schedule, SCHEDULES)
    if schedule in _SINGLE:
        return (_SINGLE if v == 1 else _MULTI)[schedule]
    return _CLASSES[schedule]


def torch_order(schedule: str, p: int, v: int, m: int) -> ScheduleOrder:
    """Torch's action order for ``schedule`` on p ranks, v stages per rank, m micro-batches.

    Raises:
        ArgumentTypeError, InvalidInputError: an unknown schedule, or p, v, m not integers ≥ 1.
        ScheduleUnavailableError: torch's class refuses (p, v, m); the message gives torch's
            reason.
    """
    p = checks.positive_int("p (ranks)", p)
    v = checks.positive_int("v (stages per rank)", v)
    m = checks.positive_int("m (micro-batches)", m)
    checks.one_of("schedule", schedule, SCHEDULES)
    return _torch_order(schedule, p, v, m)


@functools.lru_cache(maxsize=256)
def _torch_order(schedule: str, p: int, v: int, m: int) -> ScheduleOrder:
    name = torch_class_name(schedule, v)
    from torch.distributed.pipelining import schedules as torch_schedules

    cls = getattr(torch_schedules, name)
    try:
        if name in _SINGLE.values():
            recorded = [_record_single(cls, p, r, m) for r in range(p)]
            actions = [done for done, _, _ in recorded]
            posts = [posted for _, posted, _ in recorded]
            sends = [sent for _, _, sent in recorded]
            stage_rank = tuple(range(p))
        else:
            built = cls([_stand_in(p, v, k) for k in range(v)], m)
            rows = [built.pipeline_order_with_comms[r] for r in range(p)]
            actions = [_compute_actions(row) for row in rows]
            posts = [_comms(row, ("RECV_F", "RECV_B")) for row in rows]
            sends = [_comms(row, ("SEND_F", "SEND_B")) for row in rows]
            stage_rank = tuple(built.stage_index_to_group_rank[s] for s in range(p * v))
    except (ValueError, AssertionError, RuntimeError) as exc:
        reason = " ".join(str(exc).split("\n\n")[0].split())
        raise ScheduleUnavailableError(
            f"schedule {schedule!r} ({name}) cannot run p={p} ranks × v={v} stages per rank "
            f"with m={m} micro-batches: {reason}",
            schedule=schedule, p=p, v=v, m=m, reason=reason,
        ) from None
    return ScheduleOrder(schedule, name, p, v, m, stage_rank, tuple(actions),
                         tuple(tuple(row) for row in posts), tuple(tuple(row) for row in sends))


def _stand_in(p: int, v: int, k: int, rank: int = 0) -> SimpleNamespace:
    """What a schedule's constructor reads of a ``PipelineStage``: sizes and rank, no module."""
    return SimpleNamespace(
        num_stages=p * v, group_size=p, group_rank=rank, submod=None,
        stage_index=rank + k * p, stage_index_to_group_rank={}, is_first=rank + k * p == 0,
        is_last=False,
    )


def _compute_actions(row: list[Any]) -> tuple[Action, ...]:
    out: list[Action] = []
    for a in row:
        for sub in a.sub_actions if a.sub_actions is not None else (a,):
            kind = sub.computation_type.value
            if kind in ("F", "B", "I", "W"):
                out.append(Action(kind, sub.stage_index, sub.microbatch_index))
    return tuple(out)


def _comms(row: list[Any], kinds: tuple[str, str]) -> tuple[tuple[str, int, int, int], ...]:
    """The receives (``kinds`` ``RECV_F``, ``RECV_B``: :attr:`ScheduleOrder.posts`) or the sends
    (``SEND_F``, ``SEND_B``: :attr:`ScheduleOrder.sends`) of one rank's lowered actions, each
    with the number of compute actions before it."""
    out, before = [], 0
    for a in row:
        kind = a.computation_type.value
        if kind in kinds:
            out.append(("F" if kind == kinds[0] else "G", a.stage_index, a.microbatch_index,
                        before))
        for sub in a.sub_actions if a.sub_actions is not None else (a,):
            before += sub.computation_type.value in ("F", "B", "I", "W")
    return tuple(out)


_Comms = tuple[tuple[str, int, int, int], ...]


def _record_single(cls: type, p: int, rank: int, m: int
                   ) -> tuple[tuple[Action, ...], _Comms, _Comms]:
    """Rank ``rank``'s actions, the receives it posts (:attr:`ScheduleOrder.posts`) and the
    sends (:attr:`ScheduleOrder.sends`), recorded by running the class's own loop on a
    stand-in. The loop fires a send or a receive where it asks the stage for it, or later
    with no compute between."""
    done: list[Action] = []
    posts: list[tuple[str, int, int, int]] = []
    sends: list[tuple[str, int, int, int]] = []
    stage = _stand_in(p, 1, 0, rank)

    def comm(into: list[tuple[str, int, int, int]], what: str, i: int, crosses: bool
             ) -> list[Any]:
        if crosses:
            into.append((what, rank, i, len(done)))
        return []

    stage.get_fwd_recv_ops = lambda i: comm(posts, "F", i, rank > 0)
    stage.get_bwd_recv_ops = lambda i: comm(posts, "G", i, rank < p - 1)
    stage.get_fwd_send_ops = lambda i: comm(sends, "F", i, rank < p - 1)
    stage.get_bwd_send_ops = lambda i: comm(sends, "G", i, rank > 0)
    stage.forward_one_chunk = lambda i, *args, **kwargs: done.append(Action("F", rank, i))
    stage.backward_one_chunk = lambda i, **kwargs: done.append(Action("B", rank, i))
    stage.perform_reduce_grad = lambda *args: None
    schedule = cls(stage, m)
    schedule._initialize_stage = lambda *args, **kwargs: None  # no shapes to infer: no tensors
    schedule._step_microbatches(None, None, None, None, return_outputs=False)
    return tuple(done), tuple(posts), tuple(sends)
