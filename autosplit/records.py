"""The values that cross module boundaries: Profile, Plan and their parts (no torch import).

The plan records live here; the profile records in :mod:`autosplit.profile_records`, re-exported.

Both are frozen dataclasses with an exact JSON round trip (``save`` / ``load``), so a profile
measured on one machine can be planned on another and a plan can be committed next to the model.

Every record checks its fields when it is built (``__post_init__``, with
:mod:`autosplit.record_invariants` and the field checks of :mod:`autosplit.validation`): finite
times ≥ 0, byte counts ≥ 0, sizes ≥ 1, per-size rows aligned with ``microbatch_sizes``, stages
numbered in order, unique block names, known schedule and optimizer, m = ceil(B / b) and at
most :data:`~autosplit.record_invariants.MAX_MICROBATCHES`. A bad record built in Python is
an ``InvalidInputError``; a bad file is a :class:`~autosplit.errors.PlanFileError` naming the
file and the field's path, e.g. ``plan file 'p.json': stages[1].blocks is empty``. Whether a
plan's blocks are a given model's is :meth:`Plan.check_blocks`.

Symbols used throughout autosplit: p stages, m micro-batches, b micro-batch size (``split_size``),
B = m·b batch size. Times are milliseconds (``_ms``), sizes bytes (``_bytes``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from autosplit.errors import PlanMismatchError
from autosplit.plan_against_model import check_plan_blocks
from autosplit.plan_text import describe_shared, plan_text, summary_lines
from autosplit.profile_records import (
    BlockProfile,
    CutProfile,
    DeviceInfo,
    Profile,
    SharedParam,
    fingerprint_of,
)
from autosplit.record_invariants import check_plan, check_shared_weight, check_stage
from autosplit.record_json import FORMAT_VERSION, Groups, load_record, save_record
from autosplit.validation import checked

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
    "PLAN_GROUPS",
]


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
        weight_grad_ms: the weight-gradient part (W) of the backward in ``compute_ms``, which a
            zero-bubble schedule runs apart (ms per micro-batch); 0 when not split (plans
            saved before this field load with 0).
        whole_backward_ms: the backward in one pass (ms per micro-batch), what a ``B`` action
            of a schedule that splits its other backwards (DualPipeV) costs, where it differs
            from the two passes in ``compute_ms``; ``None``: the same (plans saved before this
            field load with ``None``).
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
    weight_grad_ms: float = 0.0
    whole_backward_ms: float | None = None

    def __post_init__(self) -> None:
        checked(self, check_stage)


@dataclass(frozen=True, slots=True)
class SharedWeight:
    """How a plan keeps a parameter that several stages use equal (a tied embedding …).

    Attributes:
        name: the parameter's qualified name in the model.
        stages: the stages that use it, ascending.
        mode: ``"one stage"`` (every user is on one stage: nothing to do), ``"one rank"``
            (the users are on several stages of one rank, as a V-shaped schedule's first and
            last: that rank's stages use one parameter, nothing to sum) or ``"all-reduce"``
            (``autosplit run`` keeps a copy per rank holding a user and sums the copies'
            gradients over those ranks after each step's backward; in one process,
            :func:`autosplit.partition` and emitted code keep one parameter that other
            devices read through a differentiable ``.to()``).
        bytes: its size in bytes.
        sync_ms: predicted time of the gradient all-reduce per step (0 unless
            ``"all-reduce"``).
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
        return describe_shared([self])


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
        schedule: one of :data:`autosplit.validation.KNOWN_SCHEDULES` (torch's schedule
            classes: :mod:`autosplit.schedules`).
        predicted_step_ms: predicted time of one training step (forward + backward of B): the
            event simulation of the schedule (forward and backward of every micro-batch placed
            op by op on its device; transfers delay the receiver), plus the all-reduce of
            the weights shared across stages (``shared``).
        single_device_ms: predicted time of the same step on one device (best measured b).
        single_device_split: how that one device runs the batch: in micro-batches of this
            many samples, their gradients accumulated (``batch_size``: the whole batch at
            once); ``None`` when not recorded (plans saved before this field).
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
            spreads and the runtime's cost per action's (``Profile.action_spread``; a
            fraction), ``None`` when not verified.
        single_device_spread: relative spread of ``single_device_ms`` when the whole model
            was timed in one piece, else ``None``.
        replicas: d, the data-parallel replicas of every stage (1: pipeline only). With d > 1
            each replica runs ``batch_size / d`` samples in ``microbatches`` micro-batches of
            ``split_size``, and ``predicted_step_ms`` includes ``replica_sync_ms``. Plans
            saved before this field load with 1.
        replica_sync_ms: predicted exposed time of the replicas' gradient all-reduce per step
            (the stage with the most gradient bytes; 0 for one replica).
        allreduce_bytes_per_s: the bandwidth that all-reduce was costed at (bytes/s), ``None``
            for one replica.
        placement: which mesh dimension is inner, i.e. on consecutive devices numbered node
            by node: ``"pp-inner"`` (a replica's stages together: mesh ("dp", "pp")) or
            ``"dp-inner"`` (a stage's replicas together: mesh ("pp", "dp")); ``""`` when
            planned without a topology (:mod:`autosplit.topology`).
        devices_per_node: G of the topology planned for, ``None`` without one.
        stages_per_rank: v, the stages each pipeline rank holds (stage s on rank s mod p/v;
            ZB-V and DualPipeV place them in a V); 1: one stage per rank.
        action_ms: what torch's pipeline runtime costs per action beyond the stages' compute
            (ms, ``Profile.action_ms`` of the plan's schedule), in every action of the
            predicted step; 0 when not measured (plans saved before this field load with 0).
        update_ms: the optimizer's update after the last backward (and the all-reduces),
            once per step: the slowest rank's (ms, from :attr:`BlockProfile.update_ms` of
            ``optimizer``), included in ``predicted_step_ms``; 0 when the profile did not time
            it (plans saved before this field load with 0).
        replica_mode: how each stage's replicas keep equal (:data:`autosplit.sharding.
            REPLICA_MODES`): ``"ddp"`` (whole copies, gradients all-reduced), ``"fsdp2"``
            (``fully_shard`` along "dp", resharding after forward) or ``"fsdp2-no-reshard"``;
            ``replica_sync_ms`` is then its all-gathers and reduce-scatter. Plans saved
            before this field load with ``"ddp"``.
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
    allreduce_bytes_per_s: float | None = None
    placement: str = ""
    devices_per_node: int | None = None
    stages_per_rank: int = 1
    action_ms: float = 0.0
    single_device_split: int | None = None
    update_ms: float = 0.0
    replica_mode: str = "ddp"

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
        total = len(self.stages) // self.stages_per_rank * self.predicted_step_ms
        return max(0.0, 1.0 - busy / total) if total > 0 else 0.0

    @property
    def sync_after_ms(self) -> float:
        """What runs after the pipeline's last backward and no schedule hides (ms): the
        all-reduce of every weight shared across stages (``shared``) and, with replicas, of
        the replicas' gradients (``replica_sync_ms``). ``predicted_step_ms`` is the schedule's
        simulation plus this and the update (:attr:`after_pipeline_ms`)."""
        shared = math.fsum(w.sync_ms for w in self.shared)
        return shared + (self.replica_sync_ms if self.replicas > 1 else 0.0)

    @property
    def after_pipeline_ms(self) -> float:
        """All that runs after the pipeline's last backward (ms): :attr:`sync_after_ms`, then
        the optimizer's update (``update_ms``)."""
        return self.sync_after_ms + self.update_ms

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
        save_record(self, "plan", path, PLAN_GROUPS)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`save`.

        Raises:
            PlanFileError: the file is missing, not JSON, or a field is wrong; the message
                names the file and the field. Whether the plan fits a model is checked where
                the model is known (:meth:`check_model`, :meth:`check_blocks`).
        """
        return load_record(cls, "plan", path, PLAN_GROUPS)


PLAN_GROUPS: Groups = {
    "layout": ("stages", "split_size", "microbatches", "batch_size", "schedule",
               "stages_per_rank", "replicas", "replica_mode", "placement", "devices_per_node",
               "shared", "optimizer", "memory_limit_bytes"),
    "prediction": ("predicted_step_ms", "step_spread", "bound_step_ms", "action_ms",
                   "replica_sync_ms", "allreduce_bytes_per_s", "update_ms", "single_device_ms",
                   "single_device_split", "single_device_spread"),
    "provenance": ("model", "fingerprint", "solver", "candidates", "profile", "verification"),
}
"""The groups of a plan file (format 2): how the model is laid out and fed, what is predicted
of it, and where it comes from. Every :class:`Plan` field is in exactly one."""
