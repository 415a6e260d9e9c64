"""Named device specifications for planning on hardware you do not have (no torch import).

A :class:`DeviceSpec` holds a device's published figures: dense peak FLOP/s per data type, memory
size and bandwidth, and the bandwidth of the link between two such devices. With an
``efficiency`` (the share of the peak that a training step reaches) it turns counted work into
time with a roofline, applied operator by operator (see :mod:`autosplit.analytic`):

    t(op) = max(flops / (peak[dtype] · efficiency),
                bytes / (memory_bandwidth · bandwidth_efficiency))

and a block's time is the sum over its operators (eager PyTorch runs one kernel per operator).

Units: FLOP/s (``_flops_per_s``), bytes (``_bytes``), bytes per second (``_bytes_per_s``), one
direction for links. Every figure is the *dense* one (no 2:4 structured sparsity). Memory sizes
are the datasheets' decimal gigabytes (80 GB = 80·10⁹ bytes), a little below what the driver
reports, which leaves room for the CUDA context.

The default efficiencies are deliberately round guesses, not measurements: 0.5 of the Tensor
Core peak is what well-tuned large-model training reaches on A100/H100 (model FLOPs utilisation
of 40–55 % in the Megatron-LM and PaLM reports), and 0.8 of the memory bandwidth is what
streaming kernels reach. :func:`calibrate` replaces them with values fitted to one measured
profile.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from autosplit import checks
from autosplit.errors import ArgumentTypeError, InvalidInputError, PlanFileError, PlanMismatchError
from autosplit.records import Profile

__all__ = [
    "DeviceSpec",
    "KNOWN_DEVICES",
    "DEFAULT_EFFICIENCY",
    "DEFAULT_BANDWIDTH_EFFICIENCY",
    "LINKS",
    "get_spec",
    "load_spec",
    "known_names",
    "op_time_s",
    "calibrate",
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

    def __post_init__(self) -> None:
        for label in ("name", "link", "source"):
            checks.text(f"device spec field {label!r}", getattr(self, label))
        checks.one_of(f"device spec {self.name!r}: kind", self.kind, ("cuda", "cpu"))
        for f in dataclasses.fields(self):
            if f.name in ("name", "link", "source", "kind"):
                continue
            checks.positive_finite(f"device spec {self.name!r}: {f.name}", getattr(self, f.name))

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
        return (
            f"{self.name} (efficiency {self.efficiency:.2f}, bandwidth efficiency "
            f"{self.bandwidth_efficiency:.2f})"
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
    defaults) and ``source`` (default: the file's path).

    Raises:
        ArgumentTypeError: ``path`` is not a string or path.
        PlanFileError: the file is missing or not JSON, a required field is missing (the
            message names it) or a field is unknown.
        InvalidInputError: a figure is not a positive number.
    """
    checks.instance_of("path", path, (str, os.PathLike), "a file path (str or Path)")
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanFileError(f"device spec file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanFileError(f"device spec file {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PlanFileError(
            f"device spec file {str(path)!r} must hold a JSON object of fields, "
            f"got {type(data).__name__}"
        )
    missing = [name for name in _REQUIRED if name not in data]
    if missing:
        raise PlanFileError(
            f"device spec file {str(path)!r} is missing the field{'s' if len(missing) > 1 else ''} "
            f"{', '.join(missing)}: give every one of {', '.join(_REQUIRED)} "
            f"(optional: {', '.join(_OPTIONAL)})"
        )
    unknown = sorted(set(data) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise PlanFileError(
            f"device spec file {str(path)!r} has unknown field{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(unknown)}: the fields are {', '.join(_REQUIRED + _OPTIONAL)}"
        )
    data.setdefault("source", f"user-supplied: {path}")
    if isinstance(data.get("memory_bytes"), float) and float(data["memory_bytes"]).is_integer():
        data["memory_bytes"] = int(data["memory_bytes"])  # allow 80e9
    return DeviceSpec(**data)


# ------------------------------------------------------------------------------ the devices

_A100 = (
    "NVIDIA A100 Tensor Core GPU datasheet (SXM4): FP32 19.5 TFLOPS, BF16/FP16 Tensor Core "
    "312 TFLOPS dense (624 with sparsity), NVLink 600 GB/s total; "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_H100 = (
    "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): FP32 67 TFLOPS, BF16/FP16 Tensor Core "
    "1,979 TFLOPS with sparsity = 989.5 dense, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s total; "
    "https://www.nvidia.com/en-us/data-center/h100/"
)
_H200 = (
    "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): FP32 67 TFLOPS, BF16/FP16 Tensor Core "
    "1,979 TFLOPS with sparsity = 989.5 dense, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s total; "
    "https://www.nvidia.com/en-us/data-center/h200/"
)
_L4 = (
    "NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3 TFLOPS, BF16/FP16 Tensor Core 242 TFLOPS "
    "with sparsity = 121 dense, 24 GB GDDR6 at 300 GB/s, PCIe Gen4 x16 (64 GB/s total); "
    "https://www.nvidia.com/en-us/data-center/l4/"
)
_RTX4090 = (
    "NVIDIA Ada Lovelace GPU architecture whitepaper, GeForce RTX 4090 column: peak FP32 82.6 "
    "TFLOPS, peak FP16/BF16 Tensor TFLOPS with FP32 accumulate 165.2 dense (330.4 with "
    "sparsity), 24 GB GDDR6X at 1,008 GB/s, PCIe Gen4 x16, no NVLink; "
    "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
)
_CPU = (
    "NOMINAL, meant to be calibrated (autosplit calibrate): one core of an AMD EPYC Zen 5, "
    "this project's machine. Peak = FLOP per cycle × 3.6 GHz: AVX-512 with two 512-bit FMA "
    "pipes = 64 FP32 FLOP/cycle (230 GFLOP/s); AVX512_BF16 dot products = 128 bf16 FLOP/cycle "
    "(461 GFLOP/s); no native fp16 arithmetic (fp32 rate). 3.6 GHz is the sustained one-core "
    "clock that a bf16 GEMM reaching 460 GFLOP/s on this machine implies (the TSC runs at "
    "2.6 GHz). 30 GB/s is a typical one-core streaming bandwidth (a tensor copy here reads and "
    "writes ~33 GB/s). Memory: this machine's 24 GiB. Link: gloo over loopback between worker "
    "processes"
)

KNOWN_DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec("a100-40gb", 312e12, 312e12, 19.5e12, 40 * 10**9, 1555e9,
                   "nvlink3", LINKS["nvlink3"], _A100 + " (40 GB HBM2 at 1,555 GB/s)"),
        DeviceSpec("a100-80gb", 312e12, 312e12, 19.5e12, 80 * 10**9, 2039e9,
                   "nvlink3", LINKS["nvlink3"], _A100 + " (80 GB HBM2e at 2,039 GB/s)"),
        DeviceSpec("h100-80gb", 989.5e12, 989.5e12, 67e12, 80 * 10**9, 3.35e12,
                   "nvlink4", LINKS["nvlink4"], _H100),
        DeviceSpec("h200", 989.5e12, 989.5e12, 67e12, 141 * 10**9, 4.8e12,
                   "nvlink4", LINKS["nvlink4"], _H200),
        DeviceSpec("l4", 121e12, 121e12, 30.3e12, 24 * 10**9, 300e9,
                   "pcie4-x16", LINKS["pcie4-x16"], _L4),
        DeviceSpec("rtx-4090", 165.2e12, 165.2e12, 82.6e12, 24 * 10**9, 1008e9,
                   "pcie4-x16", LINKS["pcie4-x16"], _RTX4090),
        DeviceSpec("cpu-core", 460.8e9, 230.4e9, 230.4e9, 24 * 2**30, 30e9,
                   "loopback", LINKS["loopback"], _CPU, kind="cpu"),
    )
}
"""The devices known by name; ``get_spec(name)`` returns one."""


def known_names() -> list[str]:
    """Names of the known devices, in table order."""
    return list(KNOWN_DEVICES)


def get_spec(name: str) -> DeviceSpec:
    """The known device called ``name`` (case and ``_``/``-`` do not matter).

    Raises:
        ArgumentTypeError: ``name`` is not a string.
        InvalidInputError: unknown name; the message lists the known ones.
    """
    key = checks.text("name", name).strip().lower().replace("_", "-")
    try:
        return KNOWN_DEVICES[key]
    except KeyError:
        raise InvalidInputError(
            f"unknown device {name!r}: known devices are {', '.join(KNOWN_DEVICES)}; "
            "or describe yours in a JSON file (--device-spec FILE)"
        ) from None


# ------------------------------------------------------------------------------- roofline


def op_time_s(flops: float, nbytes: float, spec: DeviceSpec, dtype: str) -> float:
    """Roofline time of one operator on ``spec``: max(compute time, memory time), seconds."""
    compute = flops / (spec.peak_flops_per_s(dtype) * spec.efficiency)
    memory = nbytes / (spec.memory_bandwidth_bytes_per_s * spec.bandwidth_efficiency)
    return max(compute, memory)


# ------------------------------------------------------------------------------ calibration


class OpCosts(Protocol):
    """What :func:`calibrate` needs from counted costs (:class:`autosplit.analytic.ModelCosts`)."""

    @property
    def block_names(self) -> tuple[str, ...]: ...

    @property
    def microbatch_sizes(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> str: ...

    def ops(self, size: int, block: int) -> Sequence[tuple[float, float]]:
        """``(flops, bytes)`` of every operator of a block's forward and backward at ``size``."""
        ...


def calibrate(
    spec: DeviceSpec,
    measured: Profile,
    analytic: Profile | OpCosts,
    *,
    sizes: Sequence[int] | None = None,
    fit_bandwidth: bool | None = None,
) -> DeviceSpec:
    """A copy of ``spec`` whose efficiencies make the analytic block times match measured ones.

    The fit minimises the squared error of log block times (forward + backward, every block at
    every micro-batch size both profiles have), each block weighted by its share of the
    measured time, so that the blocks that matter for stage times dominate and a tiny block's
    noise does not.

    * ``analytic`` a :class:`~autosplit.records.Profile` made with ``spec``: the analytic times
      scale as 1/efficiency, so one factor is fitted and both efficiencies are divided by it
      (their ratio is kept).
    * ``analytic`` the counted costs (:func:`autosplit.analytic.count_costs`): the compute and
      the bandwidth efficiency are fitted separately (``fit_bandwidth=False`` keeps their
      ratio as with a profile). Where the data leave the balance between the two open (few
      memory-bound operators), a weak pull towards the spec's own balance decides.

    ``sizes`` restricts the fit to those micro-batch sizes (default: every size both have). On
    CPUs the cost per sample jumps between sizes, so calibrate on the size you will plan with.

    Raises:
        ArgumentTypeError: ``spec``, ``measured`` or ``analytic`` of the wrong type, ``sizes``
            not a list of ints, ``fit_bandwidth`` not a bool or None.
        PlanMismatchError: the two describe different models (block names differ).
        InvalidInputError: no micro-batch size in common, or no time measured.
    """
    checks.instance_of("spec", spec, DeviceSpec, "a DeviceSpec (get_spec(name))")
    checks.instance_of("measured", measured, Profile, "a Profile")
    checks.optional(checks.sequence_of, "sizes", sizes, checks.positive_int)
    checks.optional(checks.instance_of, "fit_bandwidth", fit_bandwidth, bool, "True, False or None")
    if not isinstance(analytic, Profile) and not callable(getattr(analytic, "ops", None)):
        raise ArgumentTypeError(
            "analytic must be an analytic Profile or the counted costs "
            f"(autosplit.analytic.count_costs), got {type(analytic).__name__}"
        )
    if isinstance(analytic, Profile) and analytic.device.name != spec.label():
        raise InvalidInputError(
            f"the analytic profile was made on {analytic.device.name!r}, not on the spec being "
            f"calibrated ({spec.label()!r}): make it with this spec, or pass the counted costs"
        )
    names = getattr(analytic, "block_names", None)
    if tuple(measured.block_names) != tuple(names or ()):
        raise PlanMismatchError(
            f"the measured profile ({measured.model}, {len(measured.blocks)} blocks) and the "
            f"analytic one ({len(names or ())} blocks) are not of the same model: count both "
            "from the same model and inputs"
        )
    common = [b for b in measured.microbatch_sizes if b in analytic.microbatch_sizes]
    if sizes is not None:
        absent = [b for b in sizes if b not in common]
        if absent:
            raise InvalidInputError(
                f"micro-batch sizes {absent} are not in both profiles (both have {common}): "
                "calibrate on sizes that were measured and counted"
            )
        common = [b for b in common if b in sizes]
    if not common:
        raise InvalidInputError(
            f"the measured profile has micro-batch sizes {list(measured.microbatch_sizes)} and the "
            f"analytic one {list(analytic.microbatch_sizes)}: make the analytic profile at one of "
            "the measured sizes"
        )
    targets: list[float] = []  # measured ms per (size, block)
    keys: list[tuple[int, int]] = []
    for b in common:
        k = measured.size_index(b)
        for i, block in enumerate(measured.blocks):
            t = block.fwd_ms[k] + block.bwd_ms[k]
            if t > 0:
                targets.append(t)
                keys.append((b, i))
    total = math.fsum(targets)
    if not total > 0:
        raise InvalidInputError("the measured profile has no positive block time to calibrate on")
    weights = [t / total for t in targets]

    if isinstance(analytic, Profile) or fit_bandwidth is False:
        if isinstance(analytic, Profile):
            prof = analytic
            model = [
                prof.blocks[i].fwd_ms[prof.size_index(b)]
                + prof.blocks[i].bwd_ms[prof.size_index(b)]
                for b, i in keys
            ]
        else:
            model = [
                1000.0 * math.fsum(
                    op_time_s(f, n, spec, analytic.dtype) for f, n in analytic.ops(b, i)
                )
                for b, i in keys
            ]
        pairs = [(w, t, a) for w, t, a in zip(weights, targets, model) if a > 0]
        if not pairs:
            raise InvalidInputError("the analytic profile predicts no time for the measured blocks")
        wsum = math.fsum(w for w, _, _ in pairs)
        # measured / analytic
        log_scale = math.fsum(w * math.log(t / a) for w, t, a in pairs) / wsum
        scale = math.exp(log_scale)
        efficiency = spec.efficiency / scale
        bandwidth = spec.bandwidth_efficiency / scale
        error = _weighted_rms(pairs, scale)
        how = "one factor for both efficiencies"
    else:
        efficiency, bandwidth, error = _fit_two(spec, analytic, keys, targets, weights)
        how = "compute and bandwidth efficiency fitted separately"
    note = (
        f"; calibrated on {measured.model} ({measured.describe()}, micro-batch sizes "
        f"{', '.join(map(str, common))}): {how}, weighted RMS error of log block times "
        f"{error:.3f} (×{math.exp(error):.2f})"
    )
    return dataclasses.replace(
        spec, efficiency=efficiency, bandwidth_efficiency=bandwidth, source=spec.source + note
    )


def _weighted_rms(pairs: Sequence[tuple[float, float, float]], scale: float) -> float:
    wsum = math.fsum(w for w, _, _ in pairs)
    return math.sqrt(math.fsum(w * math.log(t / (a * scale)) ** 2 for w, t, a in pairs) / wsum)


_BALANCE_PRIOR = 2e-4
"""Weight of the pull towards the spec's own compute/bandwidth balance in the two-factor fit."""


def _fit_two(
    spec: DeviceSpec,
    costs: OpCosts,
    keys: Sequence[tuple[int, int]],
    targets: Sequence[float],
    weights: Sequence[float],
) -> tuple[float, float, float]:
    """Fit (efficiency, bandwidth efficiency) by a search over the machine balance.

    With r = peak·efficiency / (bandwidth·bandwidth_efficiency) (FLOP per byte), an operator
    of intensity flops/bytes above r is compute-bound, so a block's time is
    G(r) / (peak·efficiency) with G(r) = Σ_{compute-bound} flops + r · Σ_{memory-bound} bytes.
    For a fixed r the best efficiency has a closed form (a weighted mean of log ratios); r is
    searched on a logarithmic grid around the spec's own balance r0 and refined once. A weak
    penalty, ``_BALANCE_PRIOR · ln(r / r0)²``, picks the balance nearest r0 among fits that
    are equally good (it moves r by a decade only to save ~0.1 % of squared log error).
    """
    peak = spec.peak_flops_per_s(costs.dtype)
    bw = spec.memory_bandwidth_bytes_per_s
    tables = []  # per key: ops sorted by intensity with suffix sums of flops, prefix sums of bytes
    for b, i in keys:
        ops = sorted(
            ((f / n if n > 0 else math.inf), f, n) for f, n in costs.ops(b, i) if f > 0 or n > 0
        )
        intensity = [x for x, _, _ in ops]
        prefix_bytes = [0.0]
        for _, _, n in ops:
            prefix_bytes.append(prefix_bytes[-1] + n)
        suffix_flops = [0.0] * (len(ops) + 1)
        for j in range(len(ops) - 1, -1, -1):
            suffix_flops[j] = suffix_flops[j + 1] + ops[j][1]
        tables.append((intensity, prefix_bytes, suffix_flops))

    r0 = peak * spec.efficiency / (bw * spec.bandwidth_efficiency)

    def fit(r: float) -> tuple[float, float]:
        """(log efficiency, weighted squared error + prior) for machine balance r."""
        terms = []
        for (intensity, prefix_bytes, suffix_flops), t, w in zip(tables, targets, weights):
            j = bisect.bisect_right(intensity, r)  # ops[:j] memory-bound, ops[j:] compute-bound
            g = suffix_flops[j] + r * prefix_bytes[j]
            if g > 0:
                # t_ms = 1000 · g / (peak · e)  →  log e = log(1000 g / peak) − log t
                terms.append((w, math.log(1000.0 * g / peak) - math.log(t)))
        if not terms:
            return 0.0, math.inf
        wsum = math.fsum(w for w, _ in terms)
        log_e = math.fsum(w * d for w, d in terms) / wsum
        error = math.fsum(w * (d - log_e) ** 2 for w, d in terms) / wsum
        return log_e, error + _BALANCE_PRIOR * math.log(r / r0) ** 2

    grid = [r0 * 10 ** (x / 20) for x in range(-60, 61)]  # three decades either side
    best = min(grid, key=lambda r: fit(r)[1])
    fine = [best * 10 ** (x / 400) for x in range(-20, 21)]
    r = min(fine, key=lambda r: fit(r)[1])
    log_e, err = fit(r)
    err -= _BALANCE_PRIOR * math.log(r / r0) ** 2
    efficiency = math.exp(log_e)
    bandwidth_eff = peak * efficiency / (bw * r)
    return efficiency, bandwidth_eff, math.sqrt(max(err, 0.0))


def spec_from_mapping(data: Mapping[str, Any]) -> DeviceSpec:
    """A :class:`DeviceSpec` from a mapping of its fields (:meth:`DeviceSpec.to_dict`'s form)."""
    return DeviceSpec(**dict(data))
