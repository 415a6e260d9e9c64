"""The values that cross module boundaries: Profile, Plan and their parts (no torch import).

Both are frozen dataclasses with an exact JSON round trip (``save`` / ``load``), so a profile
measured on one machine can be planned on another and a plan can be committed next to the model.

Every record checks its fields when it is built (``__post_init__``, with the helpers of
:mod:`autosplit.validation`): finite times ≥ 0, byte counts ≥ 0, sizes ≥ 1, per-size rows
aligned with ``microbatch_sizes``, stages numbered in order, unique block names, known schedule
and optimizer, m = ceil(B / b). A bad record built in Python is an ``InvalidInputError``; a bad
file is a :class:`~autosplit.errors.PlanFileError` naming the file and the field's path, e.g.
``plan file 'p.json': stages[1].blocks is empty``. Whether a plan's blocks are a given model's is
:meth:`Plan.check_blocks`.

Symbols used throughout autosplit: p stages, m micro-batches, b micro-batch size (``split_size``),
B = m·b batch size. Times are milliseconds (``_ms``), sizes bytes (``_bytes``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from autosplit.errors import InvalidInputError, PlanFileError, PlanMismatchError
from autosplit.units import format_bytes, format_ms
from autosplit.validation import (
    KNOWN_OPTIMIZERS,
    KNOWN_SCHEDULES,
    RecordError,
    check_bytes,
    check_choice,
    check_count,
    check_length,
    check_ms,
    check_row,
    check_size,
    check_text,
    check_unique,
    join_path,
    show,
)

__all__ = [
    "DeviceInfo",
    "BlockProfile",
    "CutProfile",
    "Profile",
    "Stage",
    "SharedParam",
    "SharedWeight",
    "Plan",
    "fingerprint_of",
    "FORMAT_VERSION",
]

FORMAT_VERSION = 1
T = TypeVar("T")


def fingerprint_of(blocks: Sequence[tuple[str, Sequence[tuple[str, Sequence[int]]]]]) -> str:
    """A short hash of the block names and the (name, shape) of every parameter in each block.

    Two models with the same fingerprint can share profiles and plans.
    """
    canonical = json.dumps(
        [[name, [[pname, list(shape)] for pname, shape in params]] for name, params in blocks],
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """What a profile was measured on.

    Attributes:
        kind: ``"cpu"`` or ``"cuda"``.
        name: human description, e.g. ``"cpu worker (1 thread)"`` or the GPU's name.
        threads: intra-op threads of a CPU worker, ``None`` on CUDA.
        memory_bytes: memory of the device when known (CUDA total memory), else ``None``.
    """

    kind: str
    name: str
    threads: int | None = None
    memory_bytes: int | None = None

    def __post_init__(self) -> None:
        _checked(self, _check_device)


@dataclass(frozen=True, slots=True)
class BlockProfile:
    """Measurements of one block; every tuple is aligned with ``Profile.microbatch_sizes``.

    Attributes:
        name: block name (the module path of its first node, e.g. ``"layer3.0"``).
        param_bytes: bytes of the parameters the block owns.
        buffer_bytes: bytes of the buffers the block owns (BatchNorm statistics, …).
        fwd_ms: forward time of one micro-batch, median of repeats.
        bwd_ms: backward time of one micro-batch, median of repeats.
        saved_bytes: bytes kept alive for backward per micro-batch (deduplicated by storage,
            parameters excluded, and without inputs that the block producing them already
            keeps: summed over consecutive blocks, it is what the whole run keeps).
        output_bytes: bytes of the block's outputs per micro-batch.
        peak_bytes: on CUDA, the measured peak allocation above the resting level during the
            block's forward and backward; ``None`` elsewhere.
        saved_shared_bytes: bytes of this block's inputs that it keeps for backward and that
            the block producing them keeps too; a stage whose first block this is holds them
            again (its received copy). ``None`` means zero.
        fwd_iqr_ms: interquartile range of the forward repeats at each size (ms): the spread
            of ``fwd_ms``; ``None`` for profiles that did not record it (older or analytic).
        bwd_iqr_ms: the same for ``bwd_ms``.
    """

    name: str
    param_bytes: int
    buffer_bytes: int
    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    saved_bytes: tuple[int, ...]
    output_bytes: tuple[int, ...]
    peak_bytes: tuple[int, ...] | None = None
    saved_shared_bytes: tuple[int, ...] | None = None
    fwd_iqr_ms: tuple[float, ...] | None = None
    bwd_iqr_ms: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        _checked(self, _check_block)


@dataclass(frozen=True, slots=True)
class CutProfile:
    """A cut candidate between block ``index`` and ``index + 1``.

    Attributes:
        index: the cut lies after block ``index``.
        tensors: names of every tensor live across the cut (skip connections included).
        bytes: total bytes of those tensors per micro-batch, aligned with the profile's sizes.
    """

    index: int
    tensors: tuple[str, ...]
    bytes: tuple[int, ...]

    def __post_init__(self) -> None:
        _checked(self, _check_cut)


@dataclass(frozen=True, slots=True)
class SharedParam:
    """A parameter that several blocks use (a tied embedding and output layer …).

    Attributes:
        name: its qualified name in the model (the first of its names, ``"embed.weight"``).
        blocks: indices of the blocks that use it (directly or through a module), ascending;
            the first of them counts it in its ``param_bytes``.
        bytes: its size in bytes.
    """

    name: str
    blocks: tuple[int, ...]
    bytes: int


@dataclass(frozen=True, slots=True)
class Profile:
    """Per-block measurements of a model on one kind of device.

    Attributes:
        model: the model's class name.
        fingerprint: see :func:`fingerprint_of`.
        blocks: one entry per block, in execution order.
        cuts: ``len(blocks) - 1`` cut candidates.
        microbatch_sizes: the sizes b that were measured, ascending.
        batch_size: the batch size B of the example inputs.
        input_shapes: shapes of the example inputs (full batch).
        input_dtypes: dtypes of the example inputs, e.g. ``"torch.float32"``.
        device: what was measured on.
        torch_version: ``torch.__version__`` at measurement.
        source: ``"measured"`` (timings from running the blocks) or ``"analytic"`` (estimated
            from FLOPs and bytes for a device spec, see :mod:`autosplit.analytic`).
        warmup: untimed runs per block and size before timing.
        repeats: timed runs per block and size (the median is kept).
        seconds: wall time the profiling took (s).
        shared: parameters that several blocks use (empty for models without tied weights).
    """

    model: str
    fingerprint: str
    blocks: tuple[BlockProfile, ...]
    cuts: tuple[CutProfile, ...]
    microbatch_sizes: tuple[int, ...]
    batch_size: int
    input_shapes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    device: DeviceInfo
    torch_version: str
    source: str = "measured"
    warmup: int = 1
    repeats: int = 3
    seconds: float = 0.0
    shared: tuple[SharedParam, ...] = ()

    def __post_init__(self) -> None:
        _checked(self, _check_profile)

    @property
    def block_names(self) -> tuple[str, ...]:
        """Names of the blocks, in order."""
        return tuple(b.name for b in self.blocks)

    def size_index(self, b: int) -> int:
        """Position of micro-batch size ``b`` in ``microbatch_sizes``.

        Raises:
            InvalidInputError: ``b`` was not measured; the message lists what was.
        """
        try:
            return self.microbatch_sizes.index(b)
        except ValueError:
            raise InvalidInputError(
                f"micro-batch size {b} was not profiled; measured sizes are "
                f"{list(self.microbatch_sizes)}: pick one of them or profile with "
                f"microbatch_sizes=[…, {b}]"
            ) from None

    def describe(self) -> str:
        """One line: how and where this profile was made."""
        return f"{self.source} on {self.device.name}, torch {self.torch_version}"

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON."""
        _save(self, "profile", path)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile written by :meth:`save`.

        Raises:
            PlanFileError: the file is missing, not JSON, or a field is wrong; the message
                names the file and the field.
        """
        return _load(cls, "profile", path)


@dataclass(frozen=True, slots=True)
class Stage:
    """One pipeline stage of a plan.

    Attributes:
        index: stage number s, 0-based.
        device: where it runs, e.g. ``"cuda:1"`` or ``"cpu"``.
        blocks: names of its blocks, in order.
        compute_ms: forward + backward time of one micro-batch on this stage.
        forward_ms: the forward part of ``compute_ms``.
        send_bytes: bytes sent forward to the next stage per micro-batch (the same amount of
            gradient comes back); 0 for the last stage.
        send_ms: transfer time of one micro-batch across the outgoing cut, forward and backward.
        memory_bytes: predicted peak memory of the stage's device.
        block_sum_ms: when the stage was verified, the sum of its blocks' profiled times that
            the search used (``compute_ms`` is then the stage's blocks timed together);
            ``None`` when not verified.
        verified_spread: when verified, the relative spread of ``compute_ms`` (half its
            interquartile range over its median, a fraction); ``None`` when not verified.
    """

    index: int
    device: str
    blocks: tuple[str, ...]
    compute_ms: float
    forward_ms: float
    send_bytes: int
    send_ms: float
    memory_bytes: int
    block_sum_ms: float | None = None
    verified_spread: float | None = None

    def __post_init__(self) -> None:
        _checked(self, _check_stage)


SHARED_MODES = ("one stage", "all-reduce")


@dataclass(frozen=True, slots=True)
class SharedWeight:
    """How a plan keeps a parameter that several stages use equal (a tied embedding …).

    Attributes:
        name: the parameter's qualified name in the model.
        stages: the stages that use it, ascending.
        mode: ``"one stage"`` (every user is on one stage: nothing to do) or ``"all-reduce"``
            (``autosplit run`` keeps a copy per rank holding a user and sums the copies'
            gradients over those ranks after each step's backward; in one process,
            :func:`autosplit.partition` and emitted code keep one parameter that other
            devices read through a differentiable ``.to()``).
        bytes: its size in bytes.
        sync_ms: predicted time of the gradient all-reduce per step (0 for ``"one stage"``).
    """

    name: str
    stages: tuple[int, ...]
    mode: str
    bytes: int
    sync_ms: float = 0.0

    def __post_init__(self) -> None:
        _checked(self, _check_shared_weight)

    def describe(self) -> str:
        """One line: where the weight is used and how it is kept equal."""
        where = " and ".join(
            [", ".join(map(str, self.stages[:-1])), str(self.stages[-1])]
            if len(self.stages) > 1 else [str(self.stages[0])]
        )
        stages = f"stage{'s' if len(self.stages) > 1 else ''} {where}"
        if self.mode == "one stage":
            return f"shared weight {self.name}: {stages}, one copy ({format_bytes(self.bytes)})"
        return (
            f"shared weight {self.name}: {stages}, gradients all-reduced each step "
            f"({format_bytes(self.bytes)}, {format_ms(self.sync_ms)})"
        )


@dataclass(frozen=True, slots=True)
class Plan:
    """Where to cut a model, how to place it and how to feed it.

    Attributes:
        model: the model's class name.
        fingerprint: the model's fingerprint (see :func:`fingerprint_of`).
        stages: the stages, in pipeline order.
        split_size: micro-batch size b.
        microbatches: number of micro-batches m = ceil(B / b).
        batch_size: the batch size B the plan was made for.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        predicted_step_ms: predicted time of one training step (forward + backward of B): the
            event simulation of the schedule (forward and backward of every micro-batch placed
            op by op on its device; transfers delay the receiver), plus the all-reduce of
            the weights shared across stages (``shared``).
        single_device_ms: predicted time of the same step on one device (best measured b).
        solver: which solver produced the cut points (``"dp"``, ``"milp"``, ``"manual"`` …).
        candidates: the micro-batch sizes the planner chose among.
        profile: one line on the profile the predictions come from.
        memory_limit_bytes: per-device memory limit the plan respects, ``None`` for none.
        optimizer: the optimizer assumed by the memory model.
        bound_step_ms: (m + p − 1) · t_max, the closed form the exact solvers minimise (t_max
            the slowest stage's time per micro-batch, transfer included); equal to the
            prediction for balanced stages, above it otherwise.
        shared: the parameters several blocks use and how each is kept equal (empty for
            models without tied weights; plans saved before this field load with none).
        verification: how the stage times were verified (timed together, interleaved, how
            many rounds), or ``""`` when the prediction comes from block sums alone.
        step_spread: relative spread of ``predicted_step_ms`` from the verified stage times'
            spreads (a fraction), ``None`` when not verified.
        single_device_spread: relative spread of ``single_device_ms`` when the whole model
            was timed in one piece, else ``None``.
    """

    model: str
    fingerprint: str
    stages: tuple[Stage, ...]
    split_size: int
    microbatches: int
    batch_size: int
    schedule: str
    predicted_step_ms: float
    single_device_ms: float
    solver: str
    candidates: tuple[int, ...]
    profile: str
    memory_limit_bytes: int | None = None
    optimizer: str = "sgd"
    bound_step_ms: float = 0.0
    shared: tuple[SharedWeight, ...] = ()
    verification: str = ""
    step_spread: float | None = None
    single_device_spread: float | None = None

    def __post_init__(self) -> None:
        _checked(self, _check_plan)

    @property
    def balance(self) -> tuple[int, ...]:
        """Blocks per stage (torchgpipe's form)."""
        return tuple(len(s.blocks) for s in self.stages)

    @property
    def split_points(self) -> tuple[str, ...]:
        """The first block name of every stage after the first."""
        return tuple(s.blocks[0] for s in self.stages[1:])

    def to_split_spec(self, model: Any = None) -> dict[str, Any]:
        """The cuts as ``torch.distributed.pipelining``'s ``{fqn: SplitPoint.BEGINNING}``.

        For ``pipeline(model, mb_args, split_spec=plan.to_split_spec(model))``. Every stage
        after the first must begin where a submodule's forward begins (the block's name is that
        submodule's qualified name). Without ``model`` only the block names are checked; with
        it (recommended) each cut is checked against the traced model: the stage must begin
        with the submodule's first operation, and the submodule must be called once.

        Raises:
            InvalidInputError: a cut does not fall on a module boundary; the message names the
                stage and the block. Such plans run with ``autosplit.distributed`` (Trainer,
                ``autosplit run``), which splits between any two blocks.
            PlanMismatchError: ``model`` is not the model this plan was made for.
        """
        from torch.distributed.pipelining import SplitPoint

        fix = (
            "make a plan whose stages start at submodules (e.g. granularity='block' or a "
            "manual split), or run this plan with autosplit.distributed / `autosplit run`, "
            "which split between any two blocks"
        )
        for index, name in enumerate(self.split_points, start=1):
            if not name or name == "ops" or "#" in name:
                raise InvalidInputError(
                    f"stage {index} begins with block {name!r}, which is not a module boundary "
                    f"(a repeated call or loose operations): {fix}"
                )
        if model is not None:
            from autosplit.distributed import split_spec_problems

            problems = split_spec_problems(model, self)
            if problems:
                raise InvalidInputError(f"{'; '.join(problems)}: {fix}")
        return {name: SplitPoint.BEGINNING for name in self.split_points}

    @property
    def bubble_fraction(self) -> float:
        """Share of device time spent idle during a step: 1 − Σ busy / (p · step)."""
        busy = sum(s.compute_ms for s in self.stages) * self.microbatches
        total = len(self.stages) * self.predicted_step_ms
        return max(0.0, 1.0 - busy / total) if total > 0 else 0.0

    @property
    def speedup(self) -> float:
        """Predicted speed-up over one device."""
        return self.single_device_ms / self.predicted_step_ms if self.predicted_step_ms else 0.0

    def check_model(self, fingerprint: str, model: str = "") -> None:
        """Raise :class:`PlanMismatchError` unless the plan was made for this model."""
        if fingerprint != self.fingerprint:
            raise PlanMismatchError(
                f"this plan was made for another model ({self.model}, fingerprint "
                f"{self.fingerprint}); this model{' ' + model if model else ''} has fingerprint "
                f"{fingerprint}: make a new plan for it"
            )

    def check_blocks(self, block_names: Sequence[str], model: str = "") -> None:
        """Raise :class:`PlanMismatchError` unless the stages' blocks, concatenated in order,
        are exactly ``block_names`` (the traced model's blocks).

        The message names the stage and the block: one the model does not have, one held
        twice, one out of order, or a model block that no stage holds.
        """
        names = list(block_names)
        known = set(names)
        planned = {name for stage in self.stages for name in stage.blocks}
        fix = ": make a new plan for this model"
        of = f"the model{' ' + model if model else ''}"
        held: dict[str, int] = {}
        pos = 0
        for stage in self.stages:
            s = stage.index
            for name in stage.blocks:
                if name not in known:
                    raise PlanMismatchError(f"stage {s} holds block {name!r}, which {of} does "
                                            f"not have (its blocks: {show(names)}){fix}")
                if name in held:
                    raise PlanMismatchError(f"stage {s} holds block {name!r} again (stage "
                                            f"{held[name]} holds it){fix}")
                held[name] = s
                expected = names[pos]  # pos < len(names): the names so far are distinct and known
                if name != expected and expected not in planned:
                    raise PlanMismatchError(f"block {expected!r} of {of} is in no stage (stage "
                                            f"{s} holds {name!r} in its place){fix}")
                if name != expected:
                    raise PlanMismatchError(f"stage {s} holds block {name!r} where {of} has "
                                            f"{expected!r}: the plan's blocks are out of "
                                            f"order{fix}")
                pos += 1
        if pos < len(names):
            missing, last = names[pos:], self.stages[-1]
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise PlanMismatchError(
                f"block {missing[0]!r}{more} of {of} is in no stage (the last, stage "
                f"{last.index}, ends with {last.blocks[-1]!r}){fix}"
            )

    def __str__(self) -> str:
        from autosplit.claims import spread_text

        rows = [("stage", "device", "blocks", "compute/mb", "memory", "sends/mb")]
        for s in self.stages:
            span = s.blocks[0] if len(s.blocks) == 1 else f"{s.blocks[0]} … {s.blocks[-1]}"
            rows.append(
                (
                    str(s.index),
                    s.device,
                    f"{span} ({len(s.blocks)})",
                    format_ms(s.compute_ms) + spread_text(s.verified_spread),
                    format_bytes(s.memory_bytes),
                    format_bytes(s.send_bytes) if s.index < len(self.stages) - 1 else "–",
                )
            )
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines + self.summary_lines())

    def summary_lines(self) -> list[str]:
        """The lines shown under the stage table: batch split, step time, bubble, speed-up."""
        from autosplit.claims import ratio_with_spread, spread_text

        p = len(self.stages)
        claim = ratio_with_spread(
            self.single_device_ms, self.single_device_spread, self.predicted_step_ms,
            self.step_spread,
        ) if self.single_device_ms > 0 and self.predicted_step_ms > 0 else None
        over_one = claim.text if claim else "–"
        how = "verified stage times" if self.verification else "block sums"
        lines = [
            f"batch {self.batch_size} → {self.microbatches} micro-batch"
            f"{'es' if self.microbatches != 1 else ''} of {self.split_size} "
            f"(chosen from {', '.join(map(str, self.candidates))}) · schedule {self.schedule}",
            f"predicted step {format_ms(self.predicted_step_ms)}{spread_text(self.step_spread)} "
            f"({how}) · bubble {self.bubble_fraction:.0%} · "
            f"vs one device: {over_one} (ideal ×{p:.2f})",
        ]
        if self.verification:
            lines.append(f"verified: {self.verification}")
        if self.speedup < 1 and claim is not None and not claim.within_noise:
            lines.append(
                "pipelining does not pay off here: one device is predicted faster (transfers and "
                "the bubble cost more than the split saves); try fewer devices or a larger batch"
            )
        if self.memory_limit_bytes is not None:
            lines.append(
                f"memory limit {format_bytes(self.memory_limit_bytes)} per device · optimizer "
                f"{self.optimizer}"
            )
        lines += [weight.describe() for weight in self.shared]
        lines.append(f"profile {self.profile} · solver {self.solver}")
        return lines

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON."""
        _save(self, "plan", path)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`save`.

        Raises:
            PlanFileError: the file is missing, not JSON, or a field is wrong; the message
                names the file and the field. Whether the plan fits a model is checked where
                the model is known (:meth:`check_model`, :meth:`check_blocks`).
        """
        return _load(cls, "plan", path)


# --------------------------------------------------------------------------- invariants
# Each check raises RecordError with the field's path inside the record; the constructor adds
# the record's name, and the JSON reader the path of the enclosing record and the file.


def _checked(record: Any, check: Callable[[Any], None]) -> None:
    try:
        check(record)
    except RecordError as exc:
        raise RecordError(exc.path, exc.problem, type(record).__name__) from None


def _check_device(d: DeviceInfo) -> None:
    check_text(d.kind, "kind")
    check_text(d.name, "name", empty=True)
    if d.threads is not None:
        check_size(d.threads, "threads")
    if d.memory_bytes is not None:
        check_bytes(d.memory_bytes, "memory_bytes")


def _rows(block: BlockProfile) -> dict[str, Sequence[Any]]:
    """The per-size measurements of ``block`` by field name (absent optional ones left out)."""
    rows = {"fwd_ms": block.fwd_ms, "bwd_ms": block.bwd_ms, "saved_bytes": block.saved_bytes,
            "output_bytes": block.output_bytes, "peak_bytes": block.peak_bytes,
            "saved_shared_bytes": block.saved_shared_bytes, "fwd_iqr_ms": block.fwd_iqr_ms,
            "bwd_iqr_ms": block.bwd_iqr_ms}
    return {name: row for name, row in rows.items() if row is not None}


def _check_block(b: BlockProfile) -> None:
    check_text(b.name, "name")
    check_bytes(b.param_bytes, "param_bytes")
    check_bytes(b.buffer_bytes, "buffer_bytes")
    for field, row in _rows(b).items():
        check_row(row, field, check_ms if field.endswith("_ms") else check_bytes)
        check_length(row, field, len(b.fwd_ms), "values in fwd_ms")


def _check_cut(c: CutProfile) -> None:
    check_count(c.index, "index")
    check_row(c.tensors, "tensors", lambda v, path: check_text(v, path))
    check_row(c.bytes, "bytes", check_bytes)


def _check_profile(p: Profile) -> None:
    check_text(p.model, "model", empty=True)
    check_text(p.fingerprint, "fingerprint", empty=True)
    check_row(p.microbatch_sizes, "microbatch_sizes", check_size, nonempty=True)
    if list(p.microbatch_sizes) != sorted(set(p.microbatch_sizes)):
        raise RecordError("microbatch_sizes", f"is {list(p.microbatch_sizes)}: the sizes must be "
                                              "distinct and ascending")
    check_size(p.batch_size, "batch_size")
    k = len(p.microbatch_sizes)
    check_row(p.blocks, "blocks", _is(BlockProfile), nonempty=True)
    for i, block in enumerate(p.blocks):
        for field, row in _rows(block).items():
            check_length(row, f"blocks[{i}].{field}", k, "microbatch_sizes")
    check_unique([(f"blocks[{i}].name", b.name) for i, b in enumerate(p.blocks)], "block names")
    check_row(p.cuts, "cuts", _is(CutProfile))
    n = len(p.blocks)
    if len(p.cuts) != n - 1:
        raise RecordError("cuts", f"has {len(p.cuts)} entries for {n} blocks: a profile has one "
                                  f"cut between consecutive blocks ({n - 1})")
    for i, cut in enumerate(p.cuts):
        if cut.index != i:
            raise RecordError(f"cuts[{i}].index", f"is {cut.index}: cuts must be numbered 0 … "
                                                  f"{n - 2} in order")
        check_length(cut.bytes, f"cuts[{i}].bytes", k, "microbatch_sizes")
    check_row(p.input_shapes, "input_shapes", lambda v, path: check_row(v, path, check_count))
    check_row(p.input_dtypes, "input_dtypes", lambda v, path: check_text(v, path))
    check_length(p.input_dtypes, "input_dtypes", len(p.input_shapes), "input_shapes")
    if not isinstance(p.device, DeviceInfo):
        raise RecordError("device", f"is {show(p.device)}: expected a DeviceInfo")
    check_text(p.torch_version, "torch_version", empty=True)
    check_text(p.source, "source")
    check_count(p.warmup, "warmup")
    check_count(p.repeats, "repeats")
    check_ms(p.seconds, "seconds")


def _check_stage(s: Stage) -> None:
    check_count(s.index, "index")
    check_text(s.device, "device")
    check_row(s.blocks, "blocks", lambda v, path: check_text(v, path), nonempty=True)
    for field in ("compute_ms", "forward_ms", "send_ms"):
        check_ms(getattr(s, field), field)
    if s.forward_ms > s.compute_ms * (1 + 1e-9) + 1e-12:
        raise RecordError("forward_ms", f"is {s.forward_ms}, more than compute_ms "
                                        f"{s.compute_ms} (forward + backward)")
    check_bytes(s.send_bytes, "send_bytes")
    check_bytes(s.memory_bytes, "memory_bytes")
    for field in ("block_sum_ms", "verified_spread"):
        if getattr(s, field) is not None:
            check_ms(getattr(s, field), field)


def _check_shared_weight(w: SharedWeight) -> None:
    check_text(w.name, "name")
    check_row(w.stages, "stages", check_count, nonempty=True)
    if list(w.stages) != sorted(set(w.stages)):
        raise RecordError("stages", f"is {list(w.stages)}: stages must be distinct and ascending")
    check_choice(w.mode, "mode", SHARED_MODES)
    check_bytes(w.bytes, "bytes")
    check_ms(w.sync_ms, "sync_ms")


def _check_plan(p: Plan) -> None:
    check_text(p.model, "model", empty=True)
    check_text(p.fingerprint, "fingerprint", empty=True)
    check_row(p.stages, "stages", _is(Stage), nonempty=True)
    for i, stage in enumerate(p.stages):
        if stage.index != i:
            raise RecordError(f"stages[{i}].index", f"is {stage.index}: stages must be numbered "
                                                    f"0 … {len(p.stages) - 1} in order")
    check_unique([(f"stages[{i}].blocks[{j}]", name) for i, stage in enumerate(p.stages)
                  for j, name in enumerate(stage.blocks)], "block names")
    check_size(p.split_size, "split_size")
    check_size(p.batch_size, "batch_size")
    check_size(p.microbatches, "microbatches")
    if p.split_size > p.batch_size:
        raise RecordError("split_size", f"is {p.split_size}, larger than batch_size "
                                        f"{p.batch_size}")
    m = -(-p.batch_size // p.split_size)
    if p.microbatches != m:
        raise RecordError("microbatches", f"is {p.microbatches}: a batch of {p.batch_size} in "
                                          f"micro-batches of {p.split_size} makes {m} "
                                          "(ceil(batch_size / split_size))")
    check_choice(p.schedule, "schedule", KNOWN_SCHEDULES)
    check_choice(p.optimizer, "optimizer", KNOWN_OPTIMIZERS)
    for field in ("predicted_step_ms", "single_device_ms", "bound_step_ms"):
        check_ms(getattr(p, field), field)
    check_text(p.solver, "solver")
    check_row(p.candidates, "candidates", check_size, nonempty=True)
    if p.split_size not in p.candidates:
        raise RecordError("candidates", f"is {show(list(p.candidates))}: it must hold split_size "
                                        f"{p.split_size}, the size chosen among them")
    check_text(p.profile, "profile", empty=True)
    if p.memory_limit_bytes is not None:
        check_bytes(p.memory_limit_bytes, "memory_limit_bytes")
    check_row(p.shared, "shared", _is(SharedWeight))
    for i, weight in enumerate(p.shared):
        if weight.stages[-1] >= len(p.stages):
            raise RecordError(f"shared[{i}].stages", f"is {list(weight.stages)}: the plan has "
                                                     f"{len(p.stages)} stages")
    check_text(p.verification, "verification", empty=True)
    for field in ("step_spread", "single_device_spread"):
        if getattr(p, field) is not None:
            check_ms(getattr(p, field), field)


def _is(cls: type) -> Callable[[Any, str], None]:
    def check(value: Any, path: str) -> None:
        if not isinstance(value, cls):
            raise RecordError(path, f"is {show(value)}: expected a {cls.__name__}")

    return check


# --------------------------------------------------------------------------- JSON round trip


def _save(value: Any, kind: str, path: str | Path) -> None:
    data = {"kind": kind, "format_version": FORMAT_VERSION, **dataclasses.asdict(value)}
    text = json.dumps(data, indent=1, allow_nan=False)
    Path(path).write_text(text + "\n")


def _load(cls: type[T], kind: str, path: str | Path) -> T:
    """Read a record of ``kind`` from ``path``; every problem is a :class:`PlanFileError`
    naming the file and, for a bad value, the field's path."""
    path = Path(path)
    where = f"{kind} file {str(path)!r}"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PlanFileError(f"{where} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanFileError(f"{where} cannot be read: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanFileError(f"{where} is not valid JSON: {exc}") from None
    except RecursionError:
        raise PlanFileError(f"{where} is nested too deeply to be an autosplit {kind}") from None
    except ValueError as exc:  # e.g. an integer with more digits than Python converts
        raise PlanFileError(f"{where} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("kind") != kind:
        found = show(data.get("kind")) if isinstance(data, dict) else f"a {type(data).__name__}"
        raise PlanFileError(f"{str(path)!r} is not an autosplit {kind} file (kind: {found})")
    version = data.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        raise PlanFileError(
            f"{where} has format version {show(version)}; this autosplit reads version "
            f"{FORMAT_VERSION}: make it again"
        )
    try:
        fields = {k: v for k, v in data.items() if k not in ("kind", "format_version")}
        return _from_json(cls, fields)
    except RecordError as exc:
        raise PlanFileError(f"{where}: {exc.bare()}") from None


def _from_json(tp: Any, value: Any, path: str = "") -> Any:
    """Rebuild a value of (annotated) type ``tp`` from its ``json.loads`` form.

    Raises:
        RecordError: a value has the wrong type, a field is missing or unknown, or a record's
            invariant does not hold; the error's path is ``path`` and the place below it.
    """
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise RecordError(path, f"is {show(value)}: expected an object (a {tp.__name__})")
        hints = typing.get_type_hints(tp)
        fields = dataclasses.fields(tp)
        for key in value:
            if key not in hints:
                raise RecordError(join_path(path, str(key)), f"is not a field of a {tp.__name__} "
                                  f"(its fields: {', '.join(f.name for f in fields)})")
        kwargs = {k: _from_json(hints[k], v, join_path(path, k)) for k, v in value.items()}
        for f in fields:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required and f.name not in value:
                raise RecordError(join_path(path, f.name), "is missing")
        try:
            return tp(**kwargs)
        except RecordError as exc:
            raise exc.within(path) from None
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _from_json(inner[0], value, path)
    if origin is tuple:
        if not isinstance(value, list):
            raise RecordError(path, f"is {show(value)}: expected a list")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_json(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise RecordError(path, f"has {len(value)} items: expected {len(args)}")
        return tuple(_from_json(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RecordError(path, f"is {show(value)}: expected a number")
        try:
            return float(value)
        except OverflowError:
            raise RecordError(path, "is too large: expected a finite number") from None
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise RecordError(path, f"is {show(value)}: expected an integer")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise RecordError(path, f"is {show(value)}: expected a string")
        return value
    raise TypeError(f"cannot read a value of type {tp!r}")  # internal: a record field's type
