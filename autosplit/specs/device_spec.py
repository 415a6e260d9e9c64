"""What a device can do: :class:`DeviceSpec`, its JSON file, and the roofline time of one operator.

See :mod:`autosplit.specs` for the model (t(op) = max(flops / (peak · efficiency),
bytes / (bandwidth · bandwidth efficiency))), the units and the default efficiencies.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autosplit import checks
from autosplit.errors import RecordFileError

__all__ = [
    "DEFAULT_BANDWIDTH_EFFICIENCY",
    "DEFAULT_EFFICIENCY",
    "LINKS",
    "DeviceSpec",
    "load_spec",
    "op_time_s",
    "spec_from_mapping",
]

DEFAULT_EFFICIENCY = 0.5
"""Share of the dense peak FLOP/s reached by matmul-heavy training (see the module docstring)."""

DEFAULT_BANDWIDTH_EFFICIENCY = 0.8
"""Share of the memory bandwidth reached by memory-bound (elementwise, normalisation) kernels."""

_DTYPES = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
}

LINKS: dict[str, float] = {
    # one direction, bytes/s; NVIDIA quotes NVLink as the sum of both directions
    "nvlink4": 450e9,  # H100/H200 SXM: 900 GB/s total (18 links × 50 GB/s)
    "nvlink3": 300e9,  # A100 SXM: 600 GB/s total (12 links × 50 GB/s)
    "pcie5-x16": 64e9,  # PCIe Gen5 x16: 128 GB/s total
    "pcie4-x16": 32e9,  # PCIe Gen4 x16: 64 GB/s total
    "loopback": 5e9,  # two CPU worker processes over gloo on one machine (a conservative figure)
    # between nodes, per device (one NIC per GPU, as in DGX/HGX nodes)
    "infiniband-ndr": 50e9,  # 400 Gb/s NDR InfiniBand (ConnectX-7) per GPU
    "infiniband-hdr": 25e9,  # 200 Gb/s HDR InfiniBand (ConnectX-6) per GPU
    "ethernet-100g": 12.5e9,  # 100 Gb/s Ethernet
    "ethernet-25g": 3.125e9,  # 25 Gb/s Ethernet, a common link between CPU servers
}
"""Link bandwidths in one direction (bytes/s), by link name."""


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """Published figures of one kind of device, and how much of them training reaches.

    Attributes:
        name: short name, e.g. ``"h100-80gb"``.
        peak_bf16_flops_per_s: dense bf16 peak (Tensor Cores where the device has them), FLOP/s.
        peak_fp16_flops_per_s: dense fp16 peak, FLOP/s (with fp32 accumulation, as PyTorch
            computes).
        peak_fp32_flops_per_s: dense fp32 peak without TF32 (PyTorch's default for matmuls),
            FLOP/s.
        memory_bytes: device memory, bytes.
        memory_bandwidth_bytes_per_s: device memory bandwidth, bytes/s.
        link: name of the link between two devices, e.g. ``"nvlink4"``.
        link_bandwidth_bytes_per_s: that link's bandwidth in one direction, bytes/s.
        source: where the figures come from (URL or text), and what any calibration used.
        kind: ``"cuda"`` or ``"cpu"``: the kind of device a plan for it names.
        efficiency: share of the peak FLOP/s that compute-bound operators reach (0 < e; above
            1 only when a calibration found the peak figure too low).
        bandwidth_efficiency: share of the memory bandwidth that memory-bound operators reach.
        op_overhead_s: the least time an operator takes, seconds: eager PyTorch launches one
            kernel per operator, and a kernel shorter than the host's time to dispatch and
            launch it leaves the device waiting for the next (0: no floor). Measured on one
            H200 under torch 2.11, ResNet50's blocks took about the same time summed at every
            micro-batch size from 20 to 60 (41.0–42.3 ms; benchmarks/results/gpu_analytic.md):
            a floor, not a roofline.

    Raises:
        ArgumentTypeError: a figure that is not a number (a string, a bool), or a name that is
            not a string.
        InvalidInputError: a figure that is not finite and > 0, an empty name, an unknown kind.
    """

    name: str
    peak_bf16_flops_per_s: float
    peak_fp16_flops_per_s: float
    peak_fp32_flops_per_s: float
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    link: str
    link_bandwidth_bytes_per_s: float
    source: str
    kind: str = "cuda"
    efficiency: float = DEFAULT_EFFICIENCY
    bandwidth_efficiency: float = DEFAULT_BANDWIDTH_EFFICIENCY
    op_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for label in ("name", "link", "source"):
            checks.text(f"device spec field {label!r}", getattr(self, label))
        checks.one_of(f"device spec {self.name!r}: kind", self.kind, ("cuda", "cpu"))
        for f in dataclasses.fields(self):
            if f.name in ("name", "link", "source", "kind", "op_overhead_s"):
                continue
            checks.positive_finite(f"device spec {self.name!r}: {f.name}", getattr(self, f.name))
        checks.non_negative_finite(f"device spec {self.name!r}: op_overhead_s",
                                   self.op_overhead_s)

    def peak_flops_per_s(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (``"bf16"``, ``"torch.float16"``, ``"fp32"`` …).

        Types without a figure of their own (float64, integers) use the fp32 peak.
        """
        key = _DTYPES.get(str(dtype).lower(), "fp32")
        return {
            "bf16": self.peak_bf16_flops_per_s,
            "fp16": self.peak_fp16_flops_per_s,
            "fp32": self.peak_fp32_flops_per_s,
        }[key]

    def label(self) -> str:
        """``"h100-80gb (efficiency 0.50, bandwidth efficiency 0.80)"``: what a profile is on."""
        floor = (f", at least {self.op_overhead_s * 1e6:.1f} µs per operator"
                 if self.op_overhead_s > 0 else "")
        return (
            f"{self.name} (efficiency {self.efficiency:.2f}, bandwidth efficiency "
            f"{self.bandwidth_efficiency:.2f}{floor})"
        )

    def to_dict(self) -> dict[str, Any]:
        """The spec as a plain dictionary (the JSON form)."""
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        """Write the spec as a JSON object of its fields (readable by :func:`load_spec`)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


_REQUIRED = tuple(
    f.name for f in dataclasses.fields(DeviceSpec)
    if f.default is dataclasses.MISSING and f.name != "source"
)
_OPTIONAL = tuple(f.name for f in dataclasses.fields(DeviceSpec) if f.name not in _REQUIRED)


def load_spec(path: str | Path) -> DeviceSpec:
    """Read a device spec from a JSON object of :class:`DeviceSpec`'s fields.

    Required: ``name``, the three ``peak_*_flops_per_s``, ``memory_bytes``,
    ``memory_bandwidth_bytes_per_s``, ``link``, ``link_bandwidth_bytes_per_s``. Optional:
    ``kind`` (default ``"cuda"``), ``efficiency``, ``bandwidth_efficiency`` (the documented
    defaults), ``op_overhead_s`` (default 0) and ``source`` (default: the file's path).

    Raises:
        ArgumentTypeError: ``path`` is not a string or path.
        RecordFileError: the file is missing or not JSON, a required field is missing (the
            message names it) or a field is unknown.
        InvalidInputError: a figure is not a positive number.
    """
    checks.instance_of("path", path, (str, os.PathLike), "a file path (str or Path)")
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RecordFileError(f"device spec file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordFileError(f"device spec file {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise RecordFileError(
            f"device spec file {str(path)!r} must hold a JSON object of fields, "
            f"got {type(data).__name__}"
        )
    missing = [name for name in _REQUIRED if name not in data]
    if missing:
        raise RecordFileError(
            f"device spec file {str(path)!r} is missing the field{'s' if len(missing) > 1 else ''} "
            f"{', '.join(missing)}: give every one of {', '.join(_REQUIRED)} "
            f"(optional: {', '.join(_OPTIONAL)})"
        )
    unknown = sorted(set(data) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise RecordFileError(
            f"device spec file {str(path)!r} has unknown field{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(unknown)}: the fields are {', '.join(_REQUIRED + _OPTIONAL)}"
        )
    data.setdefault("source", f"user-supplied: {path}")
    if isinstance(data.get("memory_bytes"), float) and float(data["memory_bytes"]).is_integer():
        data["memory_bytes"] = int(data["memory_bytes"])  # allow 80e9
    return DeviceSpec(**data)


# ------------------------------------------------------------------------------- roofline


def op_time_s(flops: float, nbytes: float, spec: DeviceSpec, dtype: str) -> float:
    """Roofline time of one operator on ``spec``, with its floor: max(compute time, memory
    time, ``spec.op_overhead_s``), seconds; 0 for an operator that neither computes nor moves
    a byte (a view: no kernel)."""
    if flops <= 0 and nbytes <= 0:
        return 0.0
    compute = flops / (spec.peak_flops_per_s(dtype) * spec.efficiency)
    memory = nbytes / (spec.memory_bandwidth_bytes_per_s * spec.bandwidth_efficiency)
    return max(compute, memory, spec.op_overhead_s)


def spec_from_mapping(data: Mapping[str, Any]) -> DeviceSpec:
    """A :class:`DeviceSpec` from a mapping of its fields (:meth:`DeviceSpec.to_dict`'s form)."""
    return DeviceSpec(**dict(data))
