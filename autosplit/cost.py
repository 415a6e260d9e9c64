"""The cost model: stage time, transfer time, memory and step time (no torch import).

Symbols: p stages, m micro-batches, b micro-batch size, B = m·b batch size, s stage index.

* Stage time per micro-batch (ms) = Σ over its blocks of fwd(b) + bwd(b), measured at that b,
  + the transfer of what crosses its outgoing cut, forward activations and backward gradients:
  2 · bytes(b) / bandwidth.
* GPipe step time with a bottleneck stage time t_max: (m + p − 1) · t_max — the pipeline fills
  in p − 1 ticks and then emits one micro-batch per tick (GPipe, Huang et al. 2019, §2.3).
* Memory of stage s (bytes) = parameters · (2 + optimizer state factor) (weights, gradients and
  the optimizer's state) + buffers + bytes saved for backward · micro-batches in flight
  (GPipe: m; 1F1B: min(m, p − s)) + m receive buffers at each of its cuts (its input, and
  the gradient of its output: torch.distributed.pipelining allocates one per micro-batch) + the
  transient: the most any one of its blocks needs beyond what it saves while it runs a
  micro-batch (:func:`block_transient_bytes`), less what the blocks after it in the stage save
  (not yet saved in its forward, freed before its backward).
* Replicas (a layout of p stages × d data-parallel replicas, d | B): each replica of a stage
  runs B/d samples in micro-batches of b, then the stage's d replicas all-reduce its gradients
  (:func:`replica_sync_ms`). Step = pipeline step of B/d + the all-reduce of the stage with the
  most gradient bytes (the stages' all-reduces run at once, over disjoint groups).
"""

from __future__ import annotations

import math

from autosplit.errors import InvalidInputError
from autosplit.records import BlockProfile, Profile
from autosplit.simulator import warmup_forwards
from autosplit.validation import KNOWN_SCHEDULES

__all__ = [
    "OPTIMIZER_STATE",
    "SCHEDULES",
    "optimizer_factor",
    "in_flight",
    "block_time_ms",
    "block_memory_bytes",
    "block_transient_bytes",
    "transfer_ms",
    "allreduce_ms",
    "whole_update_ms",
    "replica_sync_ms",
    "step_ms",
    "single_device_ms",
]

OPTIMIZER_STATE = {
    "none": 0,
    "sgd": 0,
    "sgd-momentum": 1,
    "adagrad": 1,
    "adam": 2,
    "adamw": 2,
    "adam-mixed": 6,
}
"""Optimizer state per parameter, in parameter sizes (Adam keeps two moments). ``adam-mixed``
is mixed-precision Adam on 16-bit parameters: an fp32 master copy and two fp32 moments are
12 bytes per 2-byte parameter, 6 parameter sizes (16 bytes per parameter in all)."""

SCHEDULES = KNOWN_SCHEDULES
"""Every schedule a plan may name (:mod:`autosplit.schedules`); :func:`in_flight` knows GPipe's
and 1F1B's counts, the others' memory comes from the replay."""


DEFAULT_LINK_BYTES_PER_S = {
    # Between CPU workers in one process a "transfer" is a no-op; between processes it is a
    # loopback gloo send: 1.7-2.3 GB/s for 1-64 MiB on the development machines
    # (autosplit.measure.collectives.measure_link_bandwidth, which `autosplit plan` runs).
    "cpu": 1.7e9,
    # PCIe 4.0 x16 peer-to-peer copies reach ~20–25 GB/s; 16 GB/s is a conservative default
    # when the link has not been measured.
    "cuda": 16e9,
}
"""Link bandwidth (bytes/s) assumed between consecutive stages when none is given."""


def optimizer_factor(optimizer: str) -> int:
    """Bytes per parameter byte held in training: weights + gradients + optimizer state."""
    try:
        return 2 + OPTIMIZER_STATE[optimizer]
    except KeyError:
        raise InvalidInputError(
            f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZER_STATE)}"
        ) from None


def in_flight(schedule: str, m: int, p: int, s: int) -> int:
    """Micro-batches whose activations stage s holds at its peak."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return warmup_forwards(m, p, s)
    raise InvalidInputError(f"unknown schedule {schedule!r}: use one of {', '.join(SCHEDULES)}")


def block_time_ms(block: BlockProfile, k: int) -> float:
    """Forward + backward time of one micro-batch through ``block`` at size index ``k``."""
    return block.fwd_ms[k] + block.bwd_ms[k]


def block_memory_bytes(block: BlockProfile, k: int, factor: int, micro_batches: int) -> float:
    """Bytes ``block`` holds at its stage's peak (without the transient)."""
    return block.param_bytes * factor + block.buffer_bytes + block.saved_bytes[k] * micro_batches


def block_transient_bytes(block: BlockProfile, k: int) -> float:
    """Bytes ``block`` needs briefly while it runs one micro-batch at size index k, beyond the
    activations it saves (which :func:`block_memory_bytes` counts): its measured peak less
    what it saves (outputs, their gradients, its inputs' gradient, new weight gradients
    before they are added to the held ones, the kernels' temporaries), and at least its
    outputs; its outputs alone where the profile did not measure the peak."""
    outputs = float(block.output_bytes[k])
    if block.peak_bytes is None:
        return outputs
    return max(outputs, float(block.peak_bytes[k] - block.saved_bytes[k]))


def allreduce_ms(nbytes: float, ranks: int, bandwidth_bytes_per_s: float) -> float:
    """Time of a ring all-reduce of ``nbytes`` over ``ranks`` ranks, in ms.

    Each rank sends and receives 2·(k − 1)/k · n bytes (k ranks, n bytes; Patarasuk & Yuan,
    "Bandwidth optimal all-reduce algorithms for clusters of workstations", 2009); latency
    is left out. 0 for a single rank.
    """
    if bandwidth_bytes_per_s <= 0:
        raise InvalidInputError(f"bandwidth must be positive, got {bandwidth_bytes_per_s}")
    if ranks <= 1:
        return 0.0
    return 2.0 * (ranks - 1) / ranks * nbytes / bandwidth_bytes_per_s * 1000.0


def replica_sync_ms(
    grad_bytes: float, replicas: int, bandwidth_bytes_per_s: float, overlap: float = 0.0,
    latency_ms: float = 0.0,
) -> float:
    """Exposed time (ms) of the gradient synchronisation among a stage's d data-parallel
    replicas.

    With G the stage's gradient bytes, d the replicas, W the all-reduce bandwidth (bytes/s), α
    the synchronisation's latency (ms, what it costs whatever its bytes:
    :func:`autosplit.measure.collectives.measure_allreduce`) and o the overlapped share:
    (1 − o) · (α + 2 · (d − 1)/d · G / W) (a ring all-reduce, Patarasuk & Yuan 2009, as
    :func:`allreduce_ms`); 0 for one replica. ``overlap`` o = 0, the default, is
    the conservative choice: the all-reduce starts after the step's last backward and nothing
    hides it. PyTorch DDP's gradient buckets start all-reducing during the backward (Li et al.,
    "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020, §3.2.3),
    so in practice part of it hides (o up to 1); whether it does on a given machine is a
    measurement, not a default: on 2 gloo CPU ranks of one thread each it does not
    (``benchmarks/allreduce_overlap.py``: DDP's step is longer than backward + all-reduce).
    """
    if not 0.0 <= overlap <= 1.0:
        raise InvalidInputError(f"overlap must be within [0, 1], got {overlap}")
    if not (math.isfinite(latency_ms) and latency_ms >= 0):
        raise InvalidInputError(f"latency_ms must be a finite number ≥ 0, got {latency_ms}")
    if replicas <= 1:
        return 0.0
    return (1.0 - overlap) * (latency_ms
                              + allreduce_ms(grad_bytes, replicas, bandwidth_bytes_per_s))


def transfer_ms(nbytes: float, bandwidth_bytes_per_s: float) -> float:
    """Forward send plus backward gradient of ``nbytes`` over the link, in ms."""
    if bandwidth_bytes_per_s <= 0:
        raise InvalidInputError(f"bandwidth must be positive, got {bandwidth_bytes_per_s}")
    return 2.0 * nbytes / bandwidth_bytes_per_s * 1000.0


def step_ms(bottleneck_ms: float, m: int, p: int) -> float:
    """Predicted GPipe/1F1B step time: (m + p − 1) · t_max."""
    return (m + p - 1) * bottleneck_ms


def single_device_ms(profile: Profile, batch_size: int, optimizer: str = "sgd"
                     ) -> tuple[float, int]:
    """Best predicted step on one device over the measured sizes, then the whole model's
    update by ``optimizer`` (where the profile timed it): (ms, b)."""
    best = (math.inf, 0)
    for k, b in enumerate(profile.microbatch_sizes):
        if b > batch_size:
            continue
        m = math.ceil(batch_size / b)
        t = m * sum(block_time_ms(blk, k) for blk in profile.blocks)
        best = min(best, (t, -b))
    return best[0] + whole_update_ms(profile, optimizer), -best[1]


def whole_update_ms(profile: Profile, optimizer: str) -> float:
    """The update of every block's parameters by ``optimizer`` on one device (ms per step;
    :meth:`Profile.update_ms_of`), 0 where the profile did not time it."""
    row = profile.update_ms_of(optimizer)
    return math.fsum(row) if row is not None else 0.0
