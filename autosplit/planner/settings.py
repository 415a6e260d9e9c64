"""What a plan depends on besides the profile: devices, memory, schedule, optimizer, link.

:class:`PlanSettings` resolves the caller's :class:`~autosplit.planner.options.PlanOptions`
against the profile and the device count, once.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from autosplit import checks
from autosplit.cost import (
    DEFAULT_LINK_BYTES_PER_S,
    OPTIMIZER_STATE,
)
from autosplit.errors import (
    InvalidInputError,
    ModelMismatchError,
)
from autosplit.planner.options import PlanOptions
from autosplit.records import Profile
from autosplit.sharding import SHARDED_MODES, replica_param_factor
from autosplit.units import parse_bytes

__all__ = ["PlanSettings", "memory_sizes"]


@dataclass(frozen=True, slots=True)
class PlanSettings:
    """Everything besides the profile that a plan depends on, checked once.

    Attributes:
        gpus: number of stages p.
        batch_size: B.
        devices: device name of each stage.
        capacity_bytes: memory of each device (bytes), or ``None`` for no limit.
        schedule: ``"auto"`` or one of :data:`autosplit.cost.SCHEDULES`.
        optimizer: name in :data:`autosplit.cost.OPTIMIZER_STATE`.
        bandwidth_bytes_per_s: link bandwidth between consecutive stages.
        speeds: relative speed of each device (block time = profiled time / speed).
        profiles: the profile each device's block times come from.
        replica_mode: how each stage's replicas keep equal (:data:`autosplit.sharding.
            REPLICA_MODES`), for what a device holds and its share of the update.
        replicas: d, the replicas of each stage (1: a pipeline alone).
    """

    gpus: int
    batch_size: int
    devices: tuple[str, ...]
    capacity_bytes: tuple[float, ...] | None
    schedule: str
    optimizer: str
    bandwidth_bytes_per_s: float
    speeds: tuple[float, ...]
    profiles: tuple[Profile, ...]
    replica_mode: str = "ddp"
    replicas: int = 1

    @property
    def param_factor(self) -> float:
        """Bytes a device holds per parameter byte of its stage at its peak: weights,
        gradients and optimizer state, whole (DDP, one replica) or sharded
        (:func:`autosplit.sharding.replica_param_factor`)."""
        return replica_param_factor(self.replica_mode, OPTIMIZER_STATE[self.optimizer],
                                    self.replicas)

    @property
    def update_share(self) -> float:
        """The share of its stage's optimizer update a device runs: 1/d with sharded
        replicas (each updates its shard), else 1."""
        return 1.0 / self.replicas if self.replica_mode in SHARDED_MODES else 1.0

    @property
    def transfers_on_cores(self) -> bool:
        """Whether a transfer between stages costs their devices compute: CPU workers, whose
        own cores copy what gloo sends (:func:`autosplit.simulator.copies_on_cores`)."""
        return all(d.split(":")[0] == "cpu" for d in self.devices)

    @classmethod
    def check(cls, profile: Profile, gpus: int, options: PlanOptions = PlanOptions()
              ) -> PlanSettings:
        """``options`` resolved for ``profile`` on ``gpus`` devices (see :func:`plan`).

        Raises:
            ArgumentTypeError: an argument of the wrong type (e.g. ``gpus="2"``, ``gpus=2.0``).
            InvalidInputError: a value out of range; the message names the argument and value.
            ModelMismatchError: a device profile is of another model.
        """
        checks.instance_of("profile", profile, Profile, "an autosplit Profile")
        checks.instance_of("options", options, PlanOptions, "an autosplit.PlanOptions")
        n = len(profile.blocks)
        gpus = checks.positive_int("gpus", gpus)
        if gpus > n:
            raise InvalidInputError(
                f"gpus={gpus} is more than the model's {n} blocks: use at most {n} devices, "
                "or trace with granularity='layer' for finer blocks"
            )
        batch = checks.positive_int("batch_size", options.batch_size or profile.batch_size)
        devices = options.devices
        if devices is None:
            kind = profile.device.kind
            devices = [f"cuda:{s}" if kind == "cuda" else "cpu" for s in range(gpus)]
        names = checks.sequence_of("devices", devices, checks.device_name, length=gpus, per="stage")
        capacity = memory_sizes(options.memory_per_gpu, gpus)
        bandwidth_bytes_per_s = options.bandwidth_bytes_per_s
        if bandwidth_bytes_per_s is None:  # measured with the profile, else the kind's default
            bandwidth = profile.link_bytes_per_s or DEFAULT_LINK_BYTES_PER_S.get(
                profile.device.kind, 5e9)
        else:
            bandwidth = checks.positive_finite(
                "bandwidth_bytes_per_s", bandwidth_bytes_per_s, "bytes/s"
            )
        speed: tuple[float, ...] = (1.0,) * gpus
        if options.speeds is not None:
            speed = checks.sequence_of(
                "speeds", options.speeds, checks.positive_finite, length=gpus, per="device"
            )
        profs = (profile,) * gpus
        if options.device_profiles is not None:
            profs = checks.sequence_of(
                "device_profiles", options.device_profiles,
                lambda name, v: checks.instance_of(name, v, Profile, "an autosplit Profile"),
                length=gpus, per="device",
            )
        for other in profs:
            if other.fingerprint != profile.fingerprint:
                raise ModelMismatchError(
                    f"device profile of {other.model} (fingerprint {other.fingerprint}) is of "
                    f"another model than {profile.model} ({profile.fingerprint})"
                )
        return cls(gpus, batch, names, capacity, options.schedule, options.optimizer, bandwidth,
                   speed, profs)


def memory_sizes(
    memory_per_gpu: float | str | Sequence[int | float | str] | None, gpus: int
) -> tuple[float, ...] | None:
    """Per-device memory (bytes) from one size or one per device; ``None``: no limit.

    Raises:
        ArgumentTypeError: not a number, string or list of them.
        InvalidInputError: a size that is not finite and ≥ 1 byte, or the wrong count.
    """
    if memory_per_gpu is None:
        return None
    if isinstance(memory_per_gpu, (str, numbers.Real)):
        return (float(parse_bytes(memory_per_gpu, "memory_per_gpu")),) * gpus
    return checks.sequence_of(
        "memory_per_gpu", memory_per_gpu, lambda name, v: float(parse_bytes(v, name)),
        length=gpus, per="device",
    )
