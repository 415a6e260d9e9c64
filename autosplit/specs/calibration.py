"""Fit a device spec's efficiencies so that analytic block times match a measured profile.

:func:`calibrate` is the one entry point; see its docstring for the fit and its weights.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from autosplit import checks
from autosplit.errors import ArgumentTypeError, InvalidInputError, ModelMismatchError
from autosplit.records import Profile
from autosplit.specs.device_spec import DeviceSpec, op_time_s

__all__ = ["OpCosts", "calibrate"]


class OpCosts(Protocol):
    """What :func:`calibrate` needs from counted costs (:class:`autosplit.estimate.analytic.ModelCosts`)."""

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
    fit_overhead: bool | None = None,
) -> DeviceSpec:
    """A copy of ``spec`` whose efficiencies make the analytic block times match measured ones.

    The fit minimises the squared error of log block times (forward + backward, every block at
    every micro-batch size both profiles have), each block weighted by its share of the
    measured time, so that the blocks that matter for stage times dominate and a tiny block's
    noise does not.

    * ``analytic`` a :class:`~autosplit.records.Profile` made with ``spec``: the analytic times
      scale as 1/efficiency, so one factor is fitted and both efficiencies are divided by it
      (their ratio is kept). Operators held at the spec's floor (``op_overhead_s``) do not
      scale, so with a floor this fit is approximate: pass the counted costs instead.
    * ``analytic`` the counted costs (:func:`autosplit.estimate.analytic.count_costs`): the compute and
      the bandwidth efficiency are fitted separately (``fit_bandwidth=False`` keeps their
      ratio as with a profile). Where the data leave the balance between the two open (few
      memory-bound operators), a weak pull towards the spec's own balance decides. With the
      counted costs the floor under every operator, ``op_overhead_s``, is fitted with them
      (``fit_overhead=False`` keeps the spec's): a device that small operators leave idle
      between kernels takes about the same time whatever the micro-batch size, which no
      efficiency can follow (:func:`_fit_floor`). The fit keeps the floor only where it
      lowers the error by 5 % (:data:`FLOOR_GAIN`).

    ``sizes`` restricts the fit to those micro-batch sizes (default: every size both have). On
    CPUs the cost per sample jumps between sizes, so calibrate on the size you will plan with.

    Raises:
        ArgumentTypeError: ``spec``, ``measured`` or ``analytic`` of the wrong type, ``sizes``
            not a list of ints, ``fit_bandwidth`` not a bool or None.
        ModelMismatchError: the two describe different models (block names differ).
        InvalidInputError: no micro-batch size in common, or no time measured.
    """
    checks.instance_of("spec", spec, DeviceSpec, "a DeviceSpec (get_spec(name))")
    checks.instance_of("measured", measured, Profile, "a Profile")
    checks.optional(checks.sequence_of, "sizes", sizes, checks.positive_int)
    checks.optional(checks.instance_of, "fit_bandwidth", fit_bandwidth, bool, "True, False or None")
    checks.optional(checks.instance_of, "fit_overhead", fit_overhead, bool, "True, False or None")
    if not isinstance(analytic, Profile) and not callable(getattr(analytic, "ops", None)):
        raise ArgumentTypeError(
            "analytic must be an analytic Profile or the counted costs "
            f"(autosplit.estimate.analytic.count_costs), got {type(analytic).__name__}"
        )
    if isinstance(analytic, Profile) and analytic.device.name != spec.label():
        raise InvalidInputError(
            f"the analytic profile was made on {analytic.device.name!r}, not on the spec being "
            f"calibrated ({spec.label()!r}): make it with this spec, or pass the counted costs"
        )
    names = getattr(analytic, "block_names", None)
    if tuple(measured.block_names) != tuple(names or ()):
        raise ModelMismatchError(
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
        overhead = spec.op_overhead_s
    else:
        floorless = dataclasses.replace(spec, op_overhead_s=0.0)
        efficiency, bandwidth, error = _fit_two(floorless, analytic, keys, targets, weights)
        how = "compute and bandwidth efficiency fitted separately"
        overhead = 0.0
        if fit_overhead is not False:
            fitted = _fit_floor(floorless, analytic, keys, targets, weights, efficiency,
                                bandwidth)
            if fitted[3] < FLOOR_GAIN * error:
                efficiency, bandwidth, overhead, error = fitted
                how += f", with a floor of {overhead * 1e6:.1f} µs per operator"
            else:
                how += ", no floor per operator (none lowered the error by 5 %)"
        elif spec.op_overhead_s > 0:
            overhead = spec.op_overhead_s
            efficiency, bandwidth, error = _fit_floor(
                floorless, analytic, keys, targets, weights, efficiency, bandwidth,
                overheads=(overhead,))[:3]  # the spec's floor, kept
            how += f", the spec's floor of {overhead * 1e6:.1f} µs per operator kept"
    note = (
        f"; calibrated on {measured.model} ({measured.describe()}, micro-batch sizes "
        f"{', '.join(map(str, common))}): {how}, weighted RMS error of log block times "
        f"{error:.3f} (×{math.exp(error):.2f})"
    )
    return dataclasses.replace(
        spec, efficiency=efficiency, bandwidth_efficiency=bandwidth, op_overhead_s=overhead,
        source=spec.source + note,
    )


def _weighted_rms(pairs: Sequence[tuple[float, float, float]], scale: float) -> float:
    wsum = math.fsum(w for w, _, _ in pairs)
    return math.sqrt(math.fsum(w * math.log(t / (a * scale)) ** 2 for w, t, a in pairs) / wsum)


FLOOR_GAIN = 0.95
"""A fitted floor per operator is kept only where the error falls below this share of the
floorless fit's (a floor of nanoseconds that shaves rounding off the fit says nothing)."""

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


def _fit_floor(
    spec: DeviceSpec,
    costs: OpCosts,
    keys: Sequence[tuple[int, int]],
    targets: Sequence[float],
    weights: Sequence[float],
    efficiency: float,
    bandwidth_eff: float,
    overheads: Sequence[float] | None = None,
) -> tuple[float, float, float, float]:
    """Fit (efficiency, bandwidth efficiency, floor per operator) together; return them with
    the weighted RMS error of log block times.

    A block's time is Σ_ops max(flops / (peak·e), bytes / (bandwidth·e_b), L) (ms·1000): no
    closed form, so a grid in log e, log e_b and log L (``overheads``: only those floors) is
    refined three times around its best point, starting from the floorless fit (e, e_b). Both
    efficiencies stay at most 1: with a floor the remaining time of small operators can be
    fitted by a device faster than its peak, which no device is. The same weak pull towards
    the spec's own balance as :func:`_fit_two` decides between equal fits.
    """
    peak = spec.peak_flops_per_s(costs.dtype)
    bw = spec.memory_bandwidth_bytes_per_s
    flops, nbytes, owner = [], [], []
    for k, (b, i) in enumerate(keys):
        for f, n in costs.ops(b, i):
            if f <= 0 and n <= 0:
                continue  # a view: no kernel, no floor
            flops.append(f)
            nbytes.append(n)
            owner.append(k)
    f_arr, n_arr = np.asarray(flops, dtype=float), np.asarray(nbytes, dtype=float)
    own = np.asarray(owner, dtype=np.intp)
    log_t = np.log(np.asarray(targets, dtype=float))
    w = np.asarray(weights, dtype=float) / math.fsum(weights)
    r0 = peak * spec.efficiency / (bw * spec.bandwidth_efficiency)
    per_op = float(np.exp(log_t).sum() / 1000.0 / max(len(f_arr), 1))  # s per op, measured

    def error(log_e: float, log_eb: float, floor: float) -> float:
        op = np.maximum(np.maximum(f_arr / (peak * math.exp(log_e)),
                                   n_arr / (bw * math.exp(log_eb))), floor)
        block = np.bincount(own, weights=op, minlength=len(log_t)) * 1000.0
        with np.errstate(divide="ignore"):
            d = np.log(block) - log_t
        if not np.all(np.isfinite(d)):
            return math.inf
        r = peak * math.exp(log_e) / (bw * math.exp(log_eb))
        return float(w @ (d * d)) + _BALANCE_PRIOR * math.log(r / r0) ** 2

    centre = (math.log(efficiency), math.log(bandwidth_eff),
              math.log(per_op) if overheads is None else math.log(overheads[0]))
    spans = (math.log(30.0), math.log(30.0), math.log(1000.0))
    best = (math.inf, *centre)
    for _ in range(4):
        axes = [np.linspace(c - s, c + s, 11) for c, s in zip(best[1:] if best[0] < math.inf
                                                               else centre, spans)]
        axes[0], axes[1] = np.minimum(axes[0], 0.0), np.minimum(axes[1], 0.0)  # at most peak
        floors = np.exp(axes[2]) if overheads is None else np.asarray(overheads, dtype=float)
        for le in axes[0]:
            for leb in axes[1]:
                for floor in floors:
                    e = error(float(le), float(leb), float(floor))
                    if e < best[0]:
                        best = (e, float(le), float(leb), math.log(float(floor)))
        spans = tuple(s / 4 for s in spans)
    err, log_e, log_eb, log_floor = best
    r = peak * math.exp(log_e) / (bw * math.exp(log_eb))
    err -= _BALANCE_PRIOR * math.log(r / r0) ** 2
    return math.exp(log_e), math.exp(log_eb), math.exp(log_floor), math.sqrt(max(err, 0.0))
