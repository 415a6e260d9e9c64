"""What a plan is searched under, as the caller gives it: one record for every planner.

:class:`PlanOptions` is checked when made, field by field; what depends on the profile and the
device count (lengths, the blocks, the batch) is checked by
:meth:`autosplit.planner.PlanSettings.check`, which resolves the defaults against the profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autosplit import checks
from autosplit.cost import OPTIMIZER_STATE, SCHEDULES
from autosplit.errors import InvalidInputError
from autosplit.records import Profile
from autosplit.sharding import REPLICA_MODES

__all__ = ["PlanOptions", "SOLVERS"]

SOLVERS = ("dp", "milp", "auto")


@checks.known_options
@dataclass(frozen=True, slots=True)
class PlanOptions:
    """The options of :func:`autosplit.plan` and the planners beside it.

    Attributes:
        batch_size: B; ``None``: the profile's example batch size.
        memory_per_gpu: per-device memory limit, bytes or a string like ``"16GiB"``, or one
            per device; ``None``: no limit.
        schedule: ``"auto"`` searches the schedule, stages per rank v and each stage's
            recomputation with the cuts and b (:mod:`autosplit.planner.schedules`);
            ``"gpipe"`` (default) or ``"1f1b"`` fix the schedule (one stage per device, no
            recomputation); ``"looped-bfs"``, ``"interleaved-1f1b"``, ``"interleaved-zb"``,
            ``"zbv"`` or ``"dualpipev"`` fix it for the joint search. ``"auto"`` on devices
            of different speeds or profiles compares GPipe and 1F1B.
        optimizer: ``"sgd"``, ``"sgd-momentum"``, ``"adam"`` … (state held per parameter, and
            the update timed per block: ``BlockProfile.update_ms``).
        split_size: fix the micro-batch size b (must have been profiled); ``None`` chooses.
        bandwidth_bytes_per_s: link bandwidth between consecutive stages (bytes/s); ``None``:
            the profile's measured link, else :data:`autosplit.cost.DEFAULT_LINK_BYTES_PER_S`.
        solver: the min-max solver whose cut seeds the exact search: ``"dp"`` (dynamic
            program), ``"milp"`` (PuLP/CBC, same min-max optimum) or ``"auto"`` (the DP). The
            plan is the same either way: the exact search on the simulated step decides.
        time_limit_s: time limit of the MILP solver (s).
        devices: device names for the stages; ``None``: ``cuda:0…`` or ``cpu``, as measured.
        speeds: relative speed of each device; ``None``: all 1.0.
        device_profiles: one profile per device (same model, same sizes) for devices of
            different kinds; block times then come from each device's own profile.
        allreduce_bandwidth_bytes_per_s: the replicas' all-reduce bandwidth (bytes/s);
            ``None``: the profile's measured one, else the link's.
        allreduce_latency_ms: the all-reduce's latency α (ms); ``None``: the profile's
            measured one with its measured bandwidth, else 0.
        allreduce_overlap: o in [0, 1], the share of the all-reduce hidden behind the backward.
        replica_mode: how replicas keep equal (:data:`autosplit.sharding.REPLICA_MODES`), or
            ``"auto"``: the fastest that fits.
    """

    batch_size: int | None = None
    memory_per_gpu: float | str | Sequence[int | float | str] | None = None
    schedule: str = "gpipe"
    optimizer: str = "sgd"
    split_size: int | None = None
    bandwidth_bytes_per_s: float | None = None
    solver: str = "dp"
    time_limit_s: float | None = None
    devices: Sequence[str] | None = None
    speeds: Sequence[float] | None = None
    device_profiles: Sequence[Profile] | None = None
    allreduce_bandwidth_bytes_per_s: float | None = None
    allreduce_latency_ms: float | None = None
    allreduce_overlap: float = 0.0
    replica_mode: str = "auto"

    def __post_init__(self) -> None:
        for name in ("memory_per_gpu", "devices", "speeds", "device_profiles"):
            value = getattr(self, name)
            if isinstance(value, list):  # lengths are checked against the devices later
                object.__setattr__(self, name, tuple(value))
        checks.optional(checks.positive_int, "batch_size", self.batch_size)
        checks.one_of("schedule", self.schedule, ("auto", *SCHEDULES))
        checks.one_of("optimizer", self.optimizer, OPTIMIZER_STATE)
        checks.optional(checks.positive_int, "split_size", self.split_size)
        checks.optional(checks.positive_finite, "bandwidth_bytes_per_s",
                        self.bandwidth_bytes_per_s, "bytes/s")
        checks.one_of("solver", self.solver, SOLVERS)
        checks.optional(checks.positive_finite, "time_limit_s", self.time_limit_s, "s")
        checks.optional(checks.positive_finite, "allreduce_bandwidth_bytes_per_s",
                        self.allreduce_bandwidth_bytes_per_s, "bytes/s")
        checks.optional(checks.non_negative_finite, "allreduce_latency_ms",
                        self.allreduce_latency_ms, "ms")
        overlap = checks.non_negative_finite("allreduce_overlap", self.allreduce_overlap)
        if overlap > 1:
            raise InvalidInputError(f"allreduce_overlap={overlap} is above 1: it is the share of "
                                    "the all-reduce hidden behind the backward, within [0, 1]")
        checks.one_of("replica_mode", self.replica_mode, ("auto", *REPLICA_MODES))

    @property
    def uniform_devices(self) -> bool:
        """Whether the devices are left as measured: no names, speeds or device profiles."""
        return self.devices is None and self.speeds is None and self.device_profiles is None
