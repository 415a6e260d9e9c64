"""The profile records: what was measured (or estimated) per block, and on what (no torch import).

:class:`Profile` and its parts are frozen dataclasses with an exact JSON round trip, checked
field by field when built (:mod:`autosplit.validation`); :mod:`autosplit.records` re-exports
them beside the plan records. Times are milliseconds (``_ms``), sizes bytes (``_bytes``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from autosplit.errors import InvalidInputError
from autosplit.record_invariants import check_block, check_cut, check_device, check_profile
from autosplit.record_json import load_record, save_record
from autosplit.validation import checked

__all__ = ["DeviceInfo", "BlockProfile", "CutProfile", "SharedParam", "Profile", "fingerprint_of"]


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
        peak_bytes: the highest rise of allocated memory during one forward and backward of
            a micro-batch, with the block's gradients already held (every micro-batch of a
            step but the first): its saved activations and outputs, their gradients and the
            temporaries of both passes (a new weight gradient before it is added to the held
            one, weights reordered for the kernels). ``None`` for profiles that did not
            measure it (analytic ones, older ones, and older CPU ones).
        saved_shared_bytes: bytes of this block's inputs that it keeps for backward and that
            the block producing them keeps too (a stage whose first block this is keeps them
            in the buffers it receives them in, which the planner counts as such). ``None``
            means zero.
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
        split_held_bytes: bytes one micro-batch holds between the two passes of a split
            backward (from the end of the input pass to the end of the weight pass): the
            activations the weight gradients still read and the intermediate gradients torch
            keeps for them; measured with ``input_grad_ms``, ``None`` with it.
        recompute_ms: the cost of recomputing the block's forward in the backward under
            activation checkpointing (``torch.utils.checkpoint``, non-reentrant: the same
            forward again, with grad on), ms per micro-batch; ``None`` for older profiles.
        checkpoint_saved_bytes: bytes the block keeps for backward per micro-batch when it is
            checkpointed: its tensor inputs only (deduplicated by storage); ``None`` for
            older profiles.
        update_ms: ``(optimizer, ms)`` for each optimizer of
            :data:`autosplit.measure.update_timing.UPDATES`: one step of it over the block's own
            parameters (a shared one counted in its first block), once per training step
            whatever the micro-batches; ``None`` where not timed (older or estimated profiles).
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
    split_held_bytes: tuple[int, ...] | None = None
    recompute_ms: tuple[float, ...] | None = None
    checkpoint_saved_bytes: tuple[int, ...] | None = None
    update_ms: tuple[tuple[str, float], ...] | None = None

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
            from FLOPs and bytes for a device spec, see :mod:`autosplit.estimate.analytic`).
        warmup: untimed runs per block and size before timing.
        repeats: timed runs per block and size (the median is kept).
        seconds: wall time the profiling took (s).
        shared: parameters that several blocks use (empty for models without tied weights).
        loss: the loss timed with the last block (:mod:`autosplit.measure.losses`; older: ``"none"``).
        allreduce_bytes_per_s: the all-reduce bus bandwidth measured on this machine's
            backend (bytes/s, :func:`autosplit.measure.collectives.measure_allreduce`), the
            default for the replicas' gradient all-reduce; ``None`` when not measured.
        allreduce_latency_ms: what the replicas' gradient synchronisation costs whatever its
            bytes, measured with ``allreduce_bytes_per_s`` (ms,
            :func:`autosplit.measure.collectives.measure_allreduce`); 0 when not measured (older
            profiles).
        backward_split: how the blocks' ``input_grad_ms`` and ``weight_grad_ms`` were
            obtained: ``"measured at b=…"`` (timed at those sizes; at the other sizes those
            of the nearest of them, scaled by the ratio of the block's ``bwd_ms``),
            ``"estimated"`` (analytic profiles: see :mod:`autosplit.estimate.analytic`), or ``""``
            (not recorded: older profiles).
        action_ms: what torch's pipeline runtime costs per action beyond the stages' compute,
            per schedule, measured on this machine's backend (``(schedule, ms)`` pairs,
            :func:`autosplit.measure.runtime_cost.measure_action_ms`); empty when not measured (then
            0 is assumed).
        action_spread: the spread of each schedule's ``action_ms`` over the measurement's
            rounds (``(schedule, ms)`` pairs: half the interquartile range,
            :func:`autosplit.measure.runtime_cost.measure_action_spread`); empty when not measured
            (older profiles: then 0).
        link_bytes_per_s: the bandwidth of one stage's send to the next, measured between 2
            local ranks of this machine's backend (bytes/s, one direction,
            :func:`autosplit.measure.collectives.measure_link_bandwidth`), the planner's default link;
            ``None`` when not measured.
        one_stage_action_ms: what the runtime costs per action of a one-stage pipeline, as a
            plan's data-parallel replicas run it (ms,
            :func:`autosplit.measure.runtime_cost.measure_one_stage_action_ms`); ``None`` when not
            measured (then :meth:`one_stage_action` falls back on GPipe's cost).
        one_stage_action_spread: its spread over the rounds (ms, half the interquartile
            range); ``None`` when not measured.
        set_aside: timed rounds of a block's sizes set aside because the hypervisor took
            more than 5 % of the machine's CPU time during them (:mod:`autosplit.measure.steal_time`;
            their timings count only for a block left with no other round; older profiles: 0).
        fsdp_units: whether FSDP2 can shard every block as a unit: the graph calls modules
            holding all of each block's weights (:mod:`autosplit.fsdp_units`; ``False`` for a
            model captured by torch.export, whose graph reads every weight directly; older
            profiles: ``True``).
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
    loss: str = "none"
    allreduce_bytes_per_s: float | None = None
    backward_split: str = ""
    action_ms: tuple[tuple[str, float], ...] = ()
    link_bytes_per_s: float | None = None
    action_spread: tuple[tuple[str, float], ...] = ()
    set_aside: int = 0
    allreduce_latency_ms: float = 0.0
    one_stage_action_ms: float | None = None
    one_stage_action_spread: float | None = None
    fsdp_units: bool = True

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
                f"ProfileOptions(microbatch_sizes=(…, {b}))"
            ) from None

    def action_ms_of(self, schedule: str) -> float:
        """The runtime's cost per action of ``schedule`` (ms; :attr:`action_ms`); for a
        schedule the profile's measurement did not include (a profile older than the schedule's
        search) the largest cost it measured, never an optimistic 0; 0 when nothing was
        measured."""
        measured = dict(self.action_ms)
        return measured.get(schedule, max(measured.values(), default=0.0))

    def action_spread_of(self, schedule: str) -> float:
        """The spread of :meth:`action_ms_of` (ms; :attr:`action_spread`): for a
        schedule not measured the largest spread measured, 0 when none was."""
        measured = dict(self.action_spread)
        return measured.get(schedule, max(measured.values(), default=0.0))

    def one_stage_action(self) -> tuple[float, float]:
        """The runtime's cost per action of a one-stage pipeline and its spread (ms;
        :attr:`one_stage_action_ms`); where not measured, GPipe's (:meth:`action_ms_of`,
        never an optimistic 0 when the pipelines' costs were measured)."""
        if self.one_stage_action_ms is None:
            return self.action_ms_of("gpipe"), self.action_spread_of("gpipe")
        return self.one_stage_action_ms, self.one_stage_action_spread or 0.0

    def update_ms_of(self, optimizer: str) -> tuple[float, ...] | None:
        """Each block's update by ``optimizer`` (ms per step, :attr:`BlockProfile.update_ms`);
        zeros for ``"none"``; ``None`` when a block's was not timed."""
        if optimizer == "none":
            return (0.0,) * len(self.blocks)
        rows = [dict(b.update_ms) if b.update_ms is not None else {} for b in self.blocks]
        if any(optimizer not in row for row in rows):
            return None
        return tuple(row[optimizer] for row in rows)

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
