"""The values that cross module boundaries: Profile, Plan and their parts (no torch import).

Both are frozen dataclasses with an exact JSON round trip (``save`` / ``load``), so a profile
measured on one machine can be planned on another and a plan can be committed next to the model.

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
from typing import Any, Sequence, TypeVar

from autosplit.errors import InvalidInputError, PlanFileError, PlanMismatchError
from autosplit.units import format_bytes, format_ms

__all__ = [
    "DeviceInfo",
    "BlockProfile",
    "CutProfile",
    "Profile",
    "Stage",
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

    def __post_init__(self) -> None:
        k = len(self.microbatch_sizes)
        if k == 0:
            raise InvalidInputError("a profile needs at least one micro-batch size")
        if list(self.microbatch_sizes) != sorted(set(self.microbatch_sizes)):
            raise InvalidInputError(
                f"microbatch_sizes must be distinct and ascending, got {list(self.microbatch_sizes)}"
            )
        if len(self.cuts) != max(len(self.blocks) - 1, 0):
            raise InvalidInputError("a profile needs exactly one cut between consecutive blocks")
        for block in self.blocks:
            for row in (block.fwd_ms, block.bwd_ms, block.saved_bytes, block.output_bytes):
                if len(row) != k:
                    raise InvalidInputError(
                        f"block {block.name!r} has {len(row)} measurements for {k} micro-batch sizes"
                    )

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
        """Read a profile written by :meth:`save`."""
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
            op by op on its device; transfers delay the receiver).
        single_device_ms: predicted time of the same step on one device (best measured b).
        solver: which solver produced the cut points (``"dp"``, ``"milp"``, ``"manual"`` …).
        candidates: the micro-batch sizes the planner chose among.
        profile: one line on the profile the predictions come from.
        memory_limit_bytes: per-device memory limit the plan respects, ``None`` for none.
        optimizer: the optimizer assumed by the memory model.
        bound_step_ms: (m + p − 1) · t_max, the closed form the exact solvers minimise (t_max
            the slowest stage's time per micro-batch, transfer included); equal to the
            prediction for balanced stages, above it otherwise.
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
    verification: str = ""
    step_spread: float | None = None
    single_device_spread: float | None = None

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
        lines.append(f"profile {self.profile} · solver {self.solver}")
        return lines

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON."""
        _save(self, "plan", path)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`save`."""
        return _load(cls, "plan", path)


# --------------------------------------------------------------------------- JSON round trip


def _save(value: Any, kind: str, path: str | Path) -> None:
    data = {"kind": kind, "format_version": FORMAT_VERSION, **dataclasses.asdict(value)}
    text = json.dumps(data, indent=1)
    Path(path).write_text(text + "\n")


def _load(cls: type[T], kind: str, path: str | Path) -> T:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanFileError(f"{kind} file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanFileError(f"{kind} file {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("kind") != kind:
        found = data.get("kind") if isinstance(data, dict) else type(data).__name__
        raise PlanFileError(f"{str(path)!r} is not an autosplit {kind} file (kind: {found!r})")
    if data.get("format_version") != FORMAT_VERSION:
        raise PlanFileError(
            f"{kind} file {str(path)!r} has format version {data.get('format_version')!r}; "
            f"this autosplit reads version {FORMAT_VERSION}: make it again"
        )
    try:
        return _from_json(cls, {k: v for k, v in data.items() if k not in ("kind", "format_version")})
    except (TypeError, ValueError, KeyError) as exc:
        raise PlanFileError(f"{kind} file {str(path)!r} is malformed: {exc}") from None


def _from_json(tp: Any, value: Any) -> Any:
    """Rebuild a value of (annotated) type ``tp`` from its ``json.loads`` form."""
    origin = typing.get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError(f"expected an object for {tp.__name__}, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = set(value) - names
        if unknown:
            raise KeyError(f"unknown fields {sorted(unknown)} for {tp.__name__}")
        return tp(**{k: _from_json(hints[k], v) for k, v in value.items()})
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _from_json(inner[0], value)
    if origin is tuple:
        if not isinstance(value, list):
            raise TypeError(f"expected a list, got {type(value).__name__}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_json(args[0], v) for v in value)
        return tuple(_from_json(a, v) for a, v in zip(args, value, strict=True))
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"expected an integer, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {value!r}")
        return value
    raise TypeError(f"cannot read a value of type {tp!r}")
