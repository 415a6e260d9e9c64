"""Replay a schedule's action order as a discrete-event simulation (pure numbers, no torch).

Symbols: p ranks, v stages per rank, n = p·v stages, m micro-batches, s a stage, i a
micro-batch, r a rank. Costs per stage and micro-batch (ms): ``F_s`` forward, ``B_s`` backward
for the input (the gradient sent upstream), ``W_s`` backward for the weights; a full backward
costs ``B_s + W_s``. With activation checkpointing on stage s the forward is recomputed in the
backward: a full backward or an input backward costs ``F_s`` more.

The model of one training step (as :mod:`autosplit.simulator`, generalised to several stages
per rank and a split backward):

* Each rank runs one action at a time, in torch's order (:class:`ScheduleOrder`), and starts an
  action as soon as the rank is free *and* the action's inputs are there.
* ``F(s, i)`` needs ``F(s-1, i)`` plus the forward transfer over cut s-1 (``comm_fwd_ms[s-1]``);
  ``F(0, i)`` needs nothing.
* The backward of (s, i) — ``B`` or ``I`` — needs ``F(s, i)`` and, unless s is the last stage,
  the backward of (s+1, i) (its ``B`` or ``I``) plus the backward transfer over cut s
  (``comm_bwd_ms[s]``). The loss is part of the last stage's forward.
* ``W(s, i)`` needs ``I(s, i)``.
* A transfer between stages on the same rank (ZB-V's turn of the V) costs nothing; any other
  starts once the sender has posted its send and the receiver its receive, each where torch's
  order posts it (:attr:`ScheduleOrder.sends`, :attr:`ScheduleOrder.posts`: when the rank has
  finished the actions before the post; a send right after the action that computed what it
  sends, except in DualPipeV's overlapped pairs, which post the forward's send after the
  pair's backward), and takes its time. gloo and NCCL match a send with its receive before
  moving the bytes: measured between 2 gloo CPU workers, a receive of 6 MiB posted 50 ms after
  its send still took the whole transfer (2.2–3.0 ms).
* Where the ranks' own cores make the copies (``transfers_on_cores``: gloo between CPU
  workers), a transfer costs both ends its time of compute: the sender is busy for it right
  after posting the send (its next action starts that much later at the earliest), and the
  receiver for the part of the transfer's window, ``[a, a + t)`` with a its start and t its
  time, that falls before the rank is free (``clamp(free − a, 0, t)``, added to the action
  that needs it): it pays nothing for a transfer it was waiting for anyway. Measured between 2
  gloo CPU workers of one thread, 24 MiB sent and received while both computed slowed each
  rank's compute by 11 ms, the transfers' own time (2.4 GB/s). Elsewhere (NCCL between GPUs)
  a transfer occupies neither rank's compute.

Memory in flight (bytes), per rank, summed over its stages: micro-batch i holds stage s's saved
activations ``activation_bytes[s]`` from the end of ``F(s, i)`` until the end of its last
backward on s (``B``, or ``W`` when split: the weight gradient still needs the layer inputs),
half-open ``[F.end, last.end)``. With checkpointing only the stage input ``input_bytes[s]`` is
kept over that interval, and the recomputed activations ``activation_bytes[s]`` are held from
the start of the backward (``B`` or ``I``) until the same end. Between the two passes of a split
backward, ``[I.end, W.end)``, the activations give way to what the weight pass needs,
``split_held_bytes[s]`` (the activations the weight gradients read and the intermediate
gradients torch keeps for them).

A stage's output, ``output_bytes[s]`` (the last stage's: the model's output), is kept by
torch's stage from the end of its forward until the end of its backward (``B`` or ``I``: the
stage's ``fwd_cache``), and, where the next stage is on another rank and the runtime waits for
its sends only when the step ends (:attr:`ScheduleOrder.holds_sends`), until the step ends.
The part of it the stage saves for backward anyway, ``output_saved_bytes[s]`` (an output its
last layer keeps, as a ReLU does), is counted once: within the activations while they are
held, then by the send. The gradient of the input of each backward (``B`` or ``I``),
``input_grad_bytes[s]``, is held until the step ends where the runtime keeps its backward
sends so; a split backward's input pass also leaves that gradient on the buffer the input was
received in (its ``.grad``) until the step ends, whatever the runtime.

A backward (``B`` or ``I``) needs ``transient_bytes[s]`` more while it runs, above what the
rank holds when it starts (the gradients and temporaries of its layers); that is part of the
peak, not of the level after it. The stage's weight gradients, ``grad_bytes[s]``, are there
from the end of its first action that computes them (``B``, or ``W`` when split) until the
step ends: a step starts without them (``zero_grad(set_to_none=True)``, as
:class:`autosplit.distributed.Trainer` does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autosplit import checks
from autosplit.errors import InvalidInputError
from autosplit.schedules.torch_order import Kind, ScheduleOrder, torch_order

__all__ = ["StageCosts", "TimedAction", "Timeline", "replay", "send_copies", "sends_held",
           "simulate_schedule"]


def _per(
    name: str, values: Sequence[float], n: int | None, per: str, unit: str
) -> tuple[float, ...]:
    return checks.sequence_of(
        name, values, lambda k, x: checks.non_negative_finite(k, x, unit),
        length=n, per=per, allow_empty=n == 0,
    )


@dataclass(frozen=True, slots=True)
class StageCosts:
    """Per-stage costs of one micro-batch (n stages, n - 1 cuts; cut c is between s = c, c+1).

    Attributes:
        fwd_ms: ``F_s``, forward time (ms).
        bwd_input_ms: ``B_s``, backward time for the stage's input (ms).
        bwd_weight_ms: ``W_s``, backward time for the stage's weights (ms); default 0 each
            (then a split backward ``I`` costs all of it and ``W`` nothing).
        activation_bytes: bytes the forward keeps for the backward (bytes); default 0 each.
        input_bytes: bytes of the stage's input, what checkpointing keeps (bytes); default 0.
        checkpoint: whether stage s recomputes its forward in the backward; default off.
        comm_fwd_ms: forward transfer over each cut (ms); default 0.
        comm_bwd_ms: gradient transfer back over each cut (ms); default 0.
        split_held_bytes: bytes a micro-batch holds between the input and the weight pass of
            a split backward, in place of ``activation_bytes`` (bytes); default: the same as
            ``activation_bytes``.
        output_bytes: bytes of each stage's output, what it sends to the next stage (the last
            stage's: the model's output) (bytes); default 0 each.
        output_saved_bytes: the part of ``output_bytes`` within ``activation_bytes`` (bytes,
            at most either); default 0 each.
        input_grad_bytes: bytes each backward sends to the previous stage, the gradient of
            the stage's input (bytes); default 0 each.
        transient_bytes: bytes a backward of the stage needs briefly above what the rank
            holds when it starts (bytes); default 0 each.
        grad_bytes: bytes of the stage's weight gradients, allocated by its first weight
            gradient pass of the step (bytes); default 0 each.
        action_ms: what the runtime costs per action beyond the stage's compute (ms, in every
            action's duration; :mod:`autosplit.measure.runtime_cost`); default 0.
        bwd_whole_ms: the backward run whole, in one pass, as a ``B`` action of a schedule that
            splits the others (DualPipeV's) runs it (ms); default: ``bwd_input_ms`` +
            ``bwd_weight_ms`` (one pass costs less than the two, by 10–13 % on ResNet50's and
            GPT small's stages).
        transfers_on_cores: whether a transfer between ranks costs both ranks compute (the
            ranks' cores copy it: gloo between CPU workers; see the module docstring);
            default off.

    Raises:
        ArgumentTypeError, InvalidInputError: a value that is not a finite number ≥ 0, or a
            length other than n (n - 1 for the cuts).
    """

    fwd_ms: tuple[float, ...]
    bwd_input_ms: tuple[float, ...]
    bwd_weight_ms: tuple[float, ...] | None = None
    activation_bytes: tuple[float, ...] | None = None
    input_bytes: tuple[float, ...] | None = None
    checkpoint: tuple[bool, ...] | None = None
    comm_fwd_ms: tuple[float, ...] | None = None
    comm_bwd_ms: tuple[float, ...] | None = None
    split_held_bytes: tuple[float, ...] | None = None
    output_bytes: tuple[float, ...] | None = None
    input_grad_bytes: tuple[float, ...] | None = None
    output_saved_bytes: tuple[float, ...] | None = None
    transient_bytes: tuple[float, ...] | None = None
    grad_bytes: tuple[float, ...] | None = None
    action_ms: float = 0.0
    bwd_whole_ms: tuple[float, ...] | None = None
    transfers_on_cores: bool = False

    def __post_init__(self) -> None:
        fwd = _per("fwd_ms", self.fwd_ms, None, "stage", "ms")
        n = len(fwd)
        fields = {
            "fwd_ms": fwd,
            "bwd_input_ms": _per("bwd_input_ms", self.bwd_input_ms, n, "stage", "ms"),
        }
        for name, length, per, unit in (
            ("bwd_weight_ms", n, "stage", "ms"), ("activation_bytes", n, "stage", "bytes"),
            ("input_bytes", n, "stage", "bytes"), ("output_bytes", n, "stage", "bytes"),
            ("input_grad_bytes", n, "stage", "bytes"),
            ("output_saved_bytes", n, "stage", "bytes"), ("transient_bytes", n, "stage", "bytes"),
            ("grad_bytes", n, "stage", "bytes"),
            ("comm_fwd_ms", n - 1, "cut", "ms"),
            ("comm_bwd_ms", n - 1, "cut", "ms"),
        ):
            given = getattr(self, name)
            fields[name] = (0.0,) * length if given is None else _per(name, given, length, per,
                                                                      unit)
        for s, (out, saved) in enumerate(zip(fields["output_bytes"], fields["output_saved_bytes"])):
            if saved > min(out, fields["activation_bytes"][s]) * (1 + 1e-12):
                raise InvalidInputError(
                    f"output_saved_bytes[{s}] = {saved} is more than output_bytes[{s}] or "
                    f"activation_bytes[{s}]: it is the part of the output the stage saves")
        fields["split_held_bytes"] = fields["activation_bytes"] if self.split_held_bytes is None \
            else _per("split_held_bytes", self.split_held_bytes, n, "stage", "bytes")
        flags = (False,) * n if self.checkpoint is None else checks.sequence_of(
            "checkpoint", self.checkpoint, _flag, length=n, per="stage")
        fields["action_ms"] = checks.non_negative_finite("action_ms", self.action_ms, "ms")
        fields["bwd_whole_ms"] = tuple(
            i + w for i, w in zip(fields["bwd_input_ms"], fields["bwd_weight_ms"])
        ) if self.bwd_whole_ms is None else _per("bwd_whole_ms", self.bwd_whole_ms, n, "stage",
                                                 "ms")
        fields["transfers_on_cores"] = _flag("transfers_on_cores", self.transfers_on_cores)
        for name, value in {**fields, "checkpoint": flags}.items():
            object.__setattr__(self, name, value)

    @property
    def n(self) -> int:
        """Number of stages."""
        return len(self.fwd_ms)

    def duration_ms(self, kind: Kind, s: int) -> float:
        """Time of one action of ``kind`` on stage s (ms), recomputation and the runtime's
        cost per action included."""
        recompute = self.fwd_ms[s] if self.checkpoint[s] else 0.0  # type: ignore[index]
        if kind == "F":
            return self.fwd_ms[s] + self.action_ms
        if kind == "W":
            return self.bwd_weight_ms[s] + self.action_ms  # type: ignore[index]
        if kind == "B":
            return recompute + self.bwd_whole_ms[s] + self.action_ms  # type: ignore[index]
        return recompute + self.bwd_input_ms[s] + self.action_ms


@dataclass(frozen=True, slots=True)
class TimedAction:
    """One action of the simulated step.

    Attributes:
        rank: the rank that runs it; stage: global stage s; microbatch: i.
        kind: ``"F"``, ``"B"``, ``"I"`` or ``"W"`` (see :class:`~autosplit.schedules.Action`).
        start_ms, end_ms: when it starts and ends (ms from the step's start).
    """

    rank: int
    stage: int
    kind: Kind
    microbatch: int
    start_ms: float
    end_ms: float


@dataclass(frozen=True, slots=True)
class Timeline:
    """The simulated timeline of one training step.

    Attributes:
        order: the replayed action order (schedule, p, v, m, stage placement).
        step_ms: makespan, the end of the last action on any rank (ms).
        actions: ``actions[r]`` is rank r's actions with their times, in execution order.
        busy_ms: ``busy_ms[r]`` is rank r's total compute time (ms).
        memory: ``memory[r]`` is rank r's bytes in flight as a step function: ``(t_ms,
            bytes)`` pairs, the bytes held from ``t_ms`` until the next pair's time; starts
            at ``(0.0, 0.0)``.
        peak_bytes: ``peak_bytes[r]``, the largest bytes in flight on rank r (bytes).
    """

    order: ScheduleOrder
    step_ms: float
    actions: tuple[tuple[TimedAction, ...], ...]
    busy_ms: tuple[float, ...]
    memory: tuple[tuple[tuple[float, float], ...], ...]
    peak_bytes: tuple[float, ...]

    @property
    def idle_ms(self) -> tuple[float, ...]:
        """``step_ms - busy_ms[r]`` per rank (ms)."""
        return tuple(self.step_ms - b for b in self.busy_ms)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the p ranks over the step, ``1 - Σ busy / (p · step)`` (0 if empty)."""
        if self.step_ms <= 0:
            return 0.0
        return 1.0 - math.fsum(self.busy_ms) / (len(self.busy_ms) * self.step_ms)


def _flag(name: str, value: object) -> bool:
    return checks.instance_of(name, value, bool, "True or False")


def simulate_schedule(schedule: str, p: int, v: int, m: int, costs: StageCosts) -> Timeline:
    """:func:`replay` of torch's order for ``schedule`` (see :func:`torch_order`)."""
    return replay(torch_order(schedule, p, v, m), costs)


def replay(order: ScheduleOrder, costs: StageCosts) -> Timeline:
    """Simulate one training step: each rank runs ``order``'s actions with ``costs``.

    Raises:
        ArgumentTypeError: ``order`` or ``costs`` of the wrong type.
        InvalidInputError: ``costs`` has not one entry per stage of ``order`` (p·v).
    """
    checks.instance_of("order", order, ScheduleOrder, "a ScheduleOrder (see torch_order)")
    checks.instance_of("costs", costs, StageCosts, "a StageCosts")
    if costs.n != order.n:
        raise InvalidInputError(
            f"costs has {costs.n} stages but the schedule runs p·v = {order.p}·{order.v} = "
            f"{order.n}: give one entry per stage"
        )
    n, place = order.n, order.stage_rank
    hop_f = [0.0 if place[c] == place[c + 1] else costs.comm_fwd_ms[c] for c in range(n - 1)]
    hop_b = [0.0 if place[c] == place[c + 1] else costs.comm_bwd_ms[c] for c in range(n - 1)]
    # where each rank posts its receives: ("F", s, i) stage s's input, ("G", s, i) the gradient
    # of its output, after `before` of the rank's actions (not given: right before the action)
    posted = [{(what, s, i): before for what, s, i, before in row} for row in order.posts]
    # where each send is posted: ("F", s, i) stage s's output, ("G", s, i) the gradient of its
    # input, after `after` of its rank's actions (not given: when the action computing it ends)
    sent = {(what, s, i): after for row in order.sends for what, s, i, after in row}
    # end times: ("F", s, i); ("G", s, i), the input gradient (B or I); ("W", s, i)
    end: dict[tuple[str, int, int], float] = {}
    # what each rank's sends cost it, by the number of its actions before their posting (ms)
    copies = send_copies(order, hop_f, hop_b) if costs.transfers_on_cores else None
    timed: list[list[TimedAction]] = [[] for _ in order.actions]
    free = [0.0] * order.p
    cursor = [0] * order.p
    remaining = sum(len(row) for row in order.actions)

    def start(r: int, key: tuple[str, int, int], receive: tuple[str, int, int]) -> float:
        """When the transfer of ``key``'s output to rank r starts: once the sender has posted
        the send and rank r the receive (each when its rank finished the actions before the
        post); for a stage on rank r, when the output is there."""
        if place[key[1]] == r:
            return end[key]  # the same rank: nothing moves
        before = min(posted[r].get(receive, cursor[r]) if posted else cursor[r], cursor[r])
        post = timed[r][before - 1].end_ms if before else 0.0
        after = sent.get(key, 0)
        send = timed[place[key[1]]][after - 1].end_ms if after else 0.0
        return max(end[key], send, post)

    def available(r: int, key: tuple[str, int, int]) -> bool:
        """Whether ``key``'s output is timed and, from another rank, its send posted."""
        q = place[key[1]]
        return key in end and (q == r or cursor[q] >= sent.get(key, 0))

    while remaining:
        progressed = False
        for r, row in enumerate(order.actions):
            while cursor[r] < len(row):
                a = row[cursor[r]]
                s, i = a.stage, a.microbatch
                if a.kind == "F":
                    needs = [] if s == 0 else [(("F", s - 1, i), hop_f[s - 1], ("F", s, i))]
                elif a.kind == "W":
                    needs = [(("G", s, i), 0.0, ("", s, i))]
                else:
                    needs = [(("F", s, i), 0.0, ("", s, i))]
                    if s < n - 1:
                        needs.append((("G", s + 1, i), hop_b[s], ("G", s, i)))
                if not all(available(r, key) for key, _, _ in needs):
                    break
                windows = [(start(r, key, receive), hop) for key, hop, receive in needs]
                ready = max((at + hop for at, hop in windows), default=0.0)
                begin = max(free[r], ready)
                # the part of each copy made while the rank was busy (copies: on its core)
                busy = math.fsum(min(max(free[r] - at, 0.0), hop) for at, hop in windows
                                 ) if copies is not None else 0.0
                finish = begin + costs.duration_ms(a.kind, s) + busy
                mark = "G" if a.kind in ("B", "I") else a.kind
                end[mark, s, i] = finish
                timed[r].append(TimedAction(r, s, a.kind, i, begin, finish))
                cursor[r] += 1
                free[r] = finish + (copies[r].get(cursor[r], 0.0) if copies else 0.0)
                remaining -= 1
                progressed = True
        assert progressed, f"order {order.schedule!r} deadlocked at {cursor}"  # internal
    memory, peaks = _memory(order, costs, timed)
    return Timeline(
        order=order,
        step_ms=max((row[-1].end_ms for row in timed if row), default=0.0),
        actions=tuple(tuple(row) for row in timed),
        busy_ms=tuple(math.fsum(t.end_ms - t.start_ms for t in row) for row in timed),
        memory=memory,
        peak_bytes=peaks,
    )


def send_copies(order: ScheduleOrder, hop_f: Sequence[float], hop_b: Sequence[float]
                ) -> list[dict[int, float]]:
    """Per rank, the time its sends to other ranks take (ms) by where they are posted: the
    number of the rank's actions before the posting (:attr:`ScheduleOrder.sends`; not given:
    right after the action that computes what is sent). ``hop_f``/``hop_b``: each cut's
    forward and backward transfer (ms; stage c's output and stage c + 1's input gradient)."""
    place = order.stage_rank
    sent = {(what, s, i): after for row in order.sends for what, s, i, after in row}
    copies: list[dict[int, float]] = [{} for _ in order.actions]
    for r, row in enumerate(order.actions):
        for k, a in enumerate(row):
            s = a.stage
            if a.kind == "F" and s + 1 < order.n and place[s + 1] != r:
                key, hop = ("F", s, a.microbatch), hop_f[s]
            elif a.kind in ("B", "I") and s > 0 and place[s - 1] != r:
                key, hop = ("G", s, a.microbatch), hop_b[s - 1]
            else:
                continue
            after = sent.get(key, k + 1)
            copies[r][after] = copies[r].get(after, 0.0) + hop
    return copies


def _memory(
    order: ScheduleOrder, costs: StageCosts, timed: list[list[TimedAction]]
) -> tuple[tuple[tuple[tuple[float, float], ...], ...], tuple[float, ...]]:
    """Bytes in flight per rank over time, and their peaks (see the module docstring).

    Changes are applied in each rank's execution order (an action's start, then its end), so
    at equal times a free at one action's end comes before an allocation at the next one's
    start, and the peak counts bytes held even for an instant (a zero-time action) and a
    backward's transient bytes on top of what is held when it starts.
    """
    last = {(a.stage, a.microbatch): a.kind for row in order.actions for a in row
            if a.kind in ("B", "W")}
    sent = sends_held(order)
    bwd_held = order.holds_sends[1]
    curves, peaks = [], []
    for row in timed:
        held = peak = 0.0
        graded: set[int] = set()  # stages whose weight gradients this step has made
        curve = [(0.0, 0.0)]
        for t in row:
            s = t.stage
            ckpt = costs.checkpoint[s]  # type: ignore[index]
            act = costs.activation_bytes[s]  # type: ignore[index]
            out = costs.output_bytes[s]  # type: ignore[index]
            both = 0.0 if ckpt else costs.output_saved_bytes[s]  # type: ignore[index]
            kept = costs.input_bytes[s] if ckpt else act  # type: ignore[index]
            between = costs.split_held_bytes[s] - act  # type: ignore[index]
            changes: list[tuple[float, float]] = []
            if t.kind in ("B", "I"):
                if ckpt:
                    changes.append((t.start_ms, act))  # the recomputed activations
                brief = costs.transient_bytes[s]  # type: ignore[index]
                peak = max(peak, held + (act if ckpt else 0.0) + brief)
            end = 0.0  # every change at the action's end, as one
            if t.kind == "F":
                end += kept + out - both  # the output: in the stage's cache, or sent
            elif t.kind == "I" or (t.kind == "B" and bwd_held):
                end += costs.input_grad_bytes[s]  # type: ignore[index]  # kept until the end
            if t.kind in ("B", "I") and not sent[s]:
                end -= out - both  # the stage's cache lets the output go
            if t.kind == "I":
                end += between  # what the weight pass needs instead of the activations
            if t.kind in ("B", "W") and s not in graded:
                graded.add(s)
                end += costs.grad_bytes[s]  # type: ignore[index]  # until the step ends
            if t.kind != "F" and last[s, t.microbatch] == t.kind:
                end -= kept + (act if ckpt else 0.0) + (between if t.kind == "W" else 0.0)
                if sent[s]:
                    end += both  # the send still holds the part of the output saved
            if end:
                changes.append((t.end_ms, end))
            for when, delta in changes:
                held += delta
                peak = max(peak, held)
                if curve[-1][0] == when:
                    curve[-1] = (when, held)
                else:
                    curve.append((when, held))
        curves.append(tuple(curve))
        peaks.append(peak)
    return tuple(curves), tuple(peaks)


def sends_held(order: ScheduleOrder) -> tuple[bool, ...]:
    """Per stage: whether its output goes to a stage on another rank by a send that the
    runtime holds until the step ends (:attr:`ScheduleOrder.holds_sends`)."""
    place, held = order.stage_rank, order.holds_sends[0]
    return tuple(held and s + 1 < order.n and place[s] != place[s + 1] for s in range(order.n))
