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

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from autosplit.errors import InvalidInputError, PlanMismatchError
from autosplit.plan_text import plan_text, summary_lines
from autosplit.record_json import FORMAT_VERSION, load_record, save_record
from autosplit.units import format_bytes, format_ms
from autosplit.validation import (
    check_block,
    check_cut,
    check_device,
    check_plan,
    check_plan_blocks,
    check_profile,
    check_shared_weight,
    check_stage,
    checked,
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
        checked(self, check_device)


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
        input_grad_ms: the part of the backward that computes the gradient of the block's
            inputs (B of the zero-bubble schedules), ms per micro-batch; 0 when no input
            needs one (the model's first block). ``None`` for profiles that did not record
            it (older ones): the planner may then take ``bwd_ms`` as one piece.
        weight_grad_ms: the part that computes the parameters' gradients (W), ms per
            micro-batch, timed after ``input_grad_ms`` with the input-gradient pass's
            intermediate gradients kept (as torch's zero-bubble stages run it): B + W is
            ``bwd_ms`` plus the cost of splitting it (torch's graph walk, noticeable on tiny
            blocks only); ``None`` as for ``input_grad_ms``. A block whose backward torch
            cannot split counts as input-gradient work only (W = 0: nothing to defer).
            Where they were measured and where estimated is ``Profile.backward_split``.
        recompute_ms: the cost of recomputing the block's forward in the backward under
            activation checkpointing (``torch.utils.checkpoint``, non-reentrant: the same
            forward again, with grad on), ms per micro-batch; ``None`` for older profiles.
        checkpoint_saved_bytes: bytes the block keeps for backward per micro-batch when it is
            checkpointed: its tensor inputs only (deduplicated by storage); ``None`` for
            older profiles.
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
    input_grad_ms: tuple[float, ...] | None = None
    weight_grad_ms: tuple[float, ...] | None = None
    recompute_ms: tuple[float, ...] | None = None
    checkpoint_saved_bytes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        checked(self, check_block)


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
        checked(self, check_cut)


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
        backward_split: how the blocks' ``input_grad_ms`` and ``weight_grad_ms`` were
            obtained: ``"measured at b=…"`` (timed at those sizes; at the other sizes those
            of the nearest of them, scaled by the ratio of the block's ``bwd_ms``),
            ``"estimated"`` (analytic profiles: see :mod:`autosplit.analytic`), or ``""``
            (not recorded: older profiles).
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
    backward_split: str = ""

    def __post_init__(self) -> None:
        checked(self, lambda p: check_profile(
            p, block_type=BlockProfile, cut_type=CutProfile, device_type=DeviceInfo))

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
        save_record(self, "profile", path)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile written by :meth:`save`.

        Raises:
            PlanFileError: the file is missing, not JSON, or a field is wrong; the message
                names the file and the field.
        """
        return load_record(cls, "profile", path)


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
        checkpoint: whether the stage runs under activation checkpointing
            (``torch.utils.checkpoint``, non-reentrant, RNG state preserved): it keeps only
            what it receives for backward and recomputes its forward in the backward. Plans
            saved before this field load with ``False``.
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
    checkpoint: bool = False

    def __post_init__(self) -> None:
        checked(self, check_stage)


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
        checked(self, check_shared_weight)

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
        replicas: d, the data-parallel replicas of every stage (1: pipeline only). With d > 1
            each replica runs ``batch_size / d`` samples in ``microbatches`` micro-batches of
            ``split_size``, and ``predicted_step_ms`` includes ``replica_sync_ms``. Plans
            saved before this field load with 1.
        replica_sync_ms: predicted exposed time of the replicas' gradient all-reduce per step
            (the stage with the most gradient bytes; 0 for one replica).
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
    replicas: int = 1
    replica_sync_ms: float = 0.0

    def __post_init__(self) -> None:
        checked(self, lambda p: check_plan(
            p, stage_type=Stage, weight_type=SharedWeight))

    @property
    def balance(self) -> tuple[int, ...]:
        """Blocks per stage (torchgpipe's form)."""
        return tuple(len(s.blocks) for s in self.stages)

    @property
    def split_points(self) -> tuple[str, ...]:
        """The first block name of every stage after the first."""
        return tuple(s.blocks[0] for s in self.stages[1:])

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
        check_plan_blocks(self.stages, block_names, model)

    def __str__(self) -> str:
        return plan_text(self)

    def summary_lines(self) -> list[str]:
        """The lines shown under the stage table: batch split, step time, bubble, speed-up."""
        return summary_lines(self)

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON."""
        save_record(self, "plan", path)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`save`.

        Raises:
            PlanFileError: the file is missing, not JSON, or a field is wrong; the message
                names the file and the field. Whether the plan fits a model is checked where
                the model is known (:meth:`check_model`, :meth:`check_blocks`).
        """
        return load_record(cls, "plan", path)
