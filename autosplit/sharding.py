"""Sharded replicas (FSDP2 along "dp"): what they hold and what they exchange (no torch).

Symbols: d replicas of a stage, P_s its parameter bytes, G_s = P_s its gradient bytes, S_s its
optimizer state bytes (``OPTIMIZER_STATE`` parameter sizes per parameter byte), m the
micro-batches per replica, W the collective bandwidth (bytes/s), α the latency of one
collective (ms). Units: each block of the stage wrapped by ``fully_shard``, plus the stage as
the root (:mod:`autosplit.distributed.sharding`).

What is assumed is what torch's ``PipelineStage`` does with an FSDP2 module
(``torch/distributed/pipelining/stage.py``, torch 2.14), which ``autosplit run`` uses for every
layout, one stage included: every micro-batch's backward runs with ``set_requires_gradient_
sync(False)`` and ``set_reshard_after_backward(False)``, and the gradients are reduce-scattered
once, in ``perform_reduce_grad`` after the stage's last backward. So, per device:

* **Memory** (:func:`replica_param_factor`): the sharded parameters P_s/d and optimizer state
  S_s/d all step; from a unit's first backward to the step's end its gathered parameters P
  (kept: no reshard after backward) and its unsharded gradients G (accumulated over the m
  micro-batches, reduce-scattered only at the end): P_s/d + S_s/d + P_s + G_s. The sharded
  gradients G_s/d appear only as the unsharded ones are freed (and the Trainer drops them at
  the next step's start). At the reduce-scatter one unit's gradients are also copied into
  its flat input, and at an all-gather one unit's output is allocated before it is used: the
  largest unit's bytes briefly (:func:`gather_transient_bytes`). The peak is not "everything
  divided by d": only the weights' and state's resting copies are; with SGD (no state)
  FSDP2 holds more than DDP (2 + 1/d against 2 parameter sizes).
* **Time** (:func:`fsdp_sync_ms`): a ring all-gather or reduce-scatter of n bytes over d ranks
  moves (d − 1)/d · n per rank, half an all-reduce. Without resharding after forward
  (``"fsdp2-no-reshard"``) every unit is gathered once, in the first forward. With it
  (``"fsdp2"``) a unit's forward frees what it gathered, its first backward gathers again and
  then keeps it; so every forward that follows a forward (or starts the step) gathers, and
  the first backward after a forward gathers: m + 1 gathers for GPipe's F…F B…B, and for
  1F1B's warm-up forwards, alternating steady state and cool-down alike. Then one
  reduce-scatter of G_s. Each collective pays α. The planner charges every collective
  exposed (o = 0) unless told an overlap o, the share of the all-gathers hidden behind
  compute, as for DDP's all-reduce; the reduce-scatter runs after the last backward, where
  nothing hides it.

Measured (``benchmarks/results/fsdp_check.md``, gloo ranks of one CPU thread, Adam, data
parallel ×2 and 2 stages × 2 replicas): the predicted memory per device is within −6.0 % to
+6.9 % of one step's (torch's profiler; the same step measured 2 MiB apart in two runs);
FSDP2's forward and backward took longer than the compute and its collectives one after the
other (o = −0.66 and −0.76): on CPU workers nothing hides them, and FSDP2's own copies into
and out of its flat buffers (not modelled) cost more again.
"""

from __future__ import annotations

from autosplit.errors import InvalidInputError

__all__ = ["REPLICA_MODES", "SHARDED_MODES", "fsdp_sync_ms", "gather_count",
           "gather_transient_bytes", "mode_label", "replica_param_factor"]

REPLICA_MODES = ("ddp", "fsdp2", "fsdp2-no-reshard")
"""How a stage's d replicas keep equal: DDP (whole copies, one all-reduce of the gradients),
FSDP2 resharding after forward (torch's default), FSDP2 keeping the gathered parameters."""

SHARDED_MODES = REPLICA_MODES[1:]


def mode_label(mode: str) -> str:
    """How tables name a replica mode: ``"DDP"``, ``"FSDP2"``, ``"FSDP2 (no reshard)"``."""
    _check_mode(mode)
    return {"ddp": "DDP", "fsdp2": "FSDP2", "fsdp2-no-reshard": "FSDP2 (no reshard)"}[mode]


def _check_mode(mode: str) -> None:
    if mode not in REPLICA_MODES:
        raise InvalidInputError(f"replica_mode={mode!r}: use one of {', '.join(REPLICA_MODES)}")


def replica_param_factor(mode: str, state: int, replicas: int) -> float:
    """Bytes held per parameter byte by one replica of a stage at its peak: DDP's
    2 + state (weights, gradients, optimizer state); FSDP2's 2 + (1 + state)/d (see the
    module's docstring). ``state`` in parameter sizes per parameter
    (:data:`autosplit.cost.OPTIMIZER_STATE`)."""
    _check_mode(mode)
    if mode == "ddp" or replicas <= 1:
        return 2.0 + state
    return 2.0 + (1.0 + state) / replicas


def gather_transient_bytes(mode: str, unit_bytes: float, replicas: int) -> float:
    """What one sharded replica needs briefly beyond its held bytes: one unit's gathered
    parameters or flat gradients (``unit_bytes``, the largest unit's parameter bytes); 0 for
    DDP and for one replica."""
    _check_mode(mode)
    return 0.0 if mode == "ddp" or replicas <= 1 else float(unit_bytes)


def gather_count(mode: str, microbatches: int) -> int:
    """All-gathers of every unit per step: 1 without resharding after forward, m + 1 with it
    (torch's schedules; see the module's docstring); 0 for DDP."""
    _check_mode(mode)
    if mode == "ddp":
        return 0
    return 1 if mode == "fsdp2-no-reshard" else microbatches + 1


def fsdp_sync_ms(mode: str, param_bytes: float, replicas: int, microbatches: int,
                 bandwidth_bytes_per_s: float, latency_ms: float = 0.0,
                 overlap: float = 0.0) -> float:
    """Exposed collective time (ms) per step of one stage's d sharded replicas:
    (1 − o) · (n_g · (α + (d − 1)/d · P_s / W)) + α + (d − 1)/d · G_s / W, n_g from
    :func:`gather_count` (G_s = P_s; the reduce-scatter runs after the last backward, where
    nothing hides it); 0 for one replica. ``overlap`` o in [0, 1] is the share of the
    all-gathers hidden behind compute."""
    _check_mode(mode)
    if mode == "ddp":
        raise InvalidInputError("replica_mode='ddp': its cost is autosplit.cost.replica_sync_ms")
    if not 0.0 <= overlap <= 1.0:
        raise InvalidInputError(f"overlap must be within [0, 1], got {overlap}")
    if bandwidth_bytes_per_s <= 0:
        raise InvalidInputError(f"bandwidth must be positive, got {bandwidth_bytes_per_s}")
    if replicas <= 1:
        return 0.0
    one = latency_ms + (replicas - 1) / replicas * param_bytes / bandwidth_bytes_per_s * 1e3
    return (1.0 - overlap) * gather_count(mode, microbatches) * one + one
