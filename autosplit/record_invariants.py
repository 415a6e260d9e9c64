"""The records' invariants: what makes a Profile, a Plan and their parts whole (no torch import).

Each ``check_*`` takes one record and raises :class:`~autosplit.validation.RecordError` naming
the field by its path inside it (``stages[1].blocks``); the records call them from
``__post_init__`` (through :func:`~autosplit.validation.checked`), and pass their part classes
in, so that this module needs none of them. The field checks they are made of are
:mod:`autosplit.validation`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autosplit.sharding import REPLICA_MODES
from autosplit.validation import (
    KNOWN_OPTIMIZERS,
    KNOWN_SCHEDULES,
    SHARED_MODES,
    RecordError,
    check_bytes,
    check_choice,
    check_count,
    check_flag,
    check_length,
    check_ms,
    check_row,
    check_size,
    check_text,
    check_unique,
    is_a,
    show,
)

__all__ = ["MAX_MICROBATCHES", "check_device", "check_block", "check_cut", "check_profile",
           "check_stage", "check_shared_weight", "check_plan"]

MAX_MICROBATCHES = 10_000
"""The most micro-batches per step a record may describe (a plan's m, a profile's batch over
its smallest size): the schedules are simulated micro-batch by micro-batch."""


def _check_per_schedule(pairs: Any, field: str, unit: str, what: str) -> None:
    """``(schedule, value)`` pairs: each a known schedule once, with a finite number ≥ 0."""
    if not isinstance(pairs, tuple):
        raise RecordError(field, f"is {show(pairs)}: expected a list of pairs")
    seen = set()
    for i, pair in enumerate(pairs):
        where = f"{field}[{i}]"
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise RecordError(where, f"is {show(pair)}: expected [schedule, {unit}]")
        check_choice(pair[0], f"{where}[0]", KNOWN_SCHEDULES)
        if pair[0] in seen:
            raise RecordError(f"{where}[0]", f"is {pair[0]!r} again: one entry per schedule")
        seen.add(pair[0])
        check_ms(pair[1], f"{where}[1]", what)


def _check_bandwidth(value: Any, path: str) -> None:
    """``None`` or a bandwidth (bytes/s): a finite number > 0."""
    if value is not None:
        check_ms(value, path, "bandwidths")
        if value == 0:
            raise RecordError(path, "is 0: a bandwidth must be > 0")


def check_device(d: Any) -> None:
    """The fields of a DeviceInfo."""
    check_text(d.kind, "kind")
    check_text(d.name, "name", empty=True)
    if d.threads is not None:
        check_size(d.threads, "threads")
    if d.memory_bytes is not None:
        check_bytes(d.memory_bytes, "memory_bytes")


def _rows(block: Any) -> dict[str, Sequence[Any]]:
    """The per-size measurements of ``block`` by field name (absent optional ones left out)."""
    rows = {"fwd_ms": block.fwd_ms, "bwd_ms": block.bwd_ms, "saved_bytes": block.saved_bytes,
            "output_bytes": block.output_bytes, "peak_bytes": block.peak_bytes,
            "saved_shared_bytes": block.saved_shared_bytes, "fwd_iqr_ms": block.fwd_iqr_ms,
            "bwd_iqr_ms": block.bwd_iqr_ms, "input_grad_ms": block.input_grad_ms,
            "weight_grad_ms": block.weight_grad_ms, "split_held_bytes": block.split_held_bytes,
            "recompute_ms": block.recompute_ms,
            "checkpoint_saved_bytes": block.checkpoint_saved_bytes}
    return {name: row for name, row in rows.items() if row is not None}


def check_block(b: Any) -> None:
    """The fields of a BlockProfile: every per-size row as long as ``fwd_ms``."""
    check_text(b.name, "name")
    check_bytes(b.param_bytes, "param_bytes")
    check_bytes(b.buffer_bytes, "buffer_bytes")
    for field, row in _rows(b).items():
        check_row(row, field, check_ms if field.endswith("_ms") else check_bytes)
        check_length(row, field, len(b.fwd_ms), "values in fwd_ms")
    if b.update_ms is not None:
        check_row(b.update_ms, "update_ms", _check_update)
        check_unique([(f"update_ms[{i}]", name) for i, (name, _) in enumerate(b.update_ms)],
                     "optimizer names")


def _check_update(value: Any, path: str) -> None:
    """One ``(optimizer name, ms)`` pair of ``BlockProfile.update_ms``."""
    if not (isinstance(value, tuple) and len(value) == 2):
        raise RecordError(path, f"is {show(value)}: give an (optimizer, ms) pair")
    check_text(value[0], f"{path}[0]")
    check_ms(value[1], f"{path}[1]")


def check_cut(c: Any) -> None:
    """The fields of a CutProfile."""
    check_count(c.index, "index")
    check_row(c.tensors, "tensors", lambda v, path: check_text(v, path))
    check_row(c.bytes, "bytes", check_bytes)


def check_profile(p: Any, *, block_type: type, cut_type: type, device_type: type) -> None:
    """The fields of a Profile whose parts are of the classes ``block_type``, ``cut_type``
    and ``device_type``: rows aligned with ``microbatch_sizes``, one cut between consecutive
    blocks."""
    check_text(p.model, "model", empty=True)
    check_text(p.fingerprint, "fingerprint", empty=True)
    check_row(p.microbatch_sizes, "microbatch_sizes", check_size, nonempty=True)
    if list(p.microbatch_sizes) != sorted(set(p.microbatch_sizes)):
        raise RecordError("microbatch_sizes", f"is {list(p.microbatch_sizes)}: the sizes must be "
                                              "distinct and ascending")
    check_size(p.batch_size, "batch_size")
    if -(-p.batch_size // p.microbatch_sizes[0]) > MAX_MICROBATCHES:
        raise RecordError("batch_size", f"is {p.batch_size}: in micro-batches of "
                                        f"{p.microbatch_sizes[0]} it makes more than the "
                                        f"{MAX_MICROBATCHES:,} micro-batches a step may have")
    k = len(p.microbatch_sizes)
    check_row(p.blocks, "blocks", is_a(block_type), nonempty=True)
    for i, block in enumerate(p.blocks):
        for field, row in _rows(block).items():
            check_length(row, f"blocks[{i}].{field}", k, "microbatch_sizes")
    check_unique([(f"blocks[{i}].name", b.name) for i, b in enumerate(p.blocks)], "block names")
    check_row(p.cuts, "cuts", is_a(cut_type))
    n = len(p.blocks)
    if len(p.cuts) != n - 1:
        raise RecordError("cuts", f"has {len(p.cuts)} entries for {n} blocks: a profile has one "
                                  f"cut between consecutive blocks ({n - 1})")
    for i, cut in enumerate(p.cuts):
        if cut.index != i:
            raise RecordError(f"cuts[{i}].index", f"is {cut.index}: cuts must be numbered 0 … "
                                                  f"{n - 2} in order")
        check_length(cut.bytes, f"cuts[{i}].bytes", k, "microbatch_sizes")
    check_row(p.input_shapes, "input_shapes", lambda v, path: check_row(v, path, check_count))
    check_row(p.input_dtypes, "input_dtypes", lambda v, path: check_text(v, path))
    check_length(p.input_dtypes, "input_dtypes", len(p.input_shapes), "input_shapes")
    if not isinstance(p.device, device_type):
        raise RecordError("device", f"is {show(p.device)}: expected a {device_type.__name__}")
    check_text(p.torch_version, "torch_version", empty=True)
    check_text(p.source, "source")
    check_flag(p.fsdp_units, "fsdp_units")
    if p.loss not in ("mse", "none", "model"):  # autosplit.measure.losses.LOSSES
        raise RecordError("loss", f"is {show(p.loss)}: expected 'mse', 'model' or 'none'")
    check_count(p.warmup, "warmup")
    check_count(p.repeats, "repeats")
    check_count(p.set_aside, "set_aside")
    check_ms(p.seconds, "seconds")
    _check_bandwidth(p.allreduce_bytes_per_s, "allreduce_bytes_per_s")
    _check_bandwidth(p.link_bytes_per_s, "link_bytes_per_s")
    check_text(p.backward_split, "backward_split", empty=True)
    _check_per_schedule(p.action_ms, "action_ms", "ms", "times")
    _check_per_schedule(p.action_spread, "action_spread", "ms", "spreads")
    check_ms(p.allreduce_latency_ms, "allreduce_latency_ms")
    for field in ("one_stage_action_ms", "one_stage_action_spread"):
        if getattr(p, field) is not None:
            check_ms(getattr(p, field), field)
    split = [b.input_grad_ms is None for b in p.blocks] + [
        b.weight_grad_ms is None for b in p.blocks]
    if len(set(split)) > 1:
        raise RecordError("blocks", "give input_grad_ms and weight_grad_ms for every block or "
                                    "for none")


def check_stage(s: Any) -> None:
    """The fields of a Stage: its forward part no longer than its compute time."""
    check_count(s.index, "index")
    check_text(s.device, "device")
    check_row(s.blocks, "blocks", lambda v, path: check_text(v, path), nonempty=True)
    for field in ("compute_ms", "forward_ms", "send_ms"):
        check_ms(getattr(s, field), field)
    if s.forward_ms > s.compute_ms * (1 + 1e-9) + 1e-12:
        raise RecordError("forward_ms", f"is {s.forward_ms}, more than compute_ms "
                                        f"{s.compute_ms} (forward + backward)")
    check_bytes(s.send_bytes, "send_bytes")
    check_bytes(s.memory_bytes, "memory_bytes")
    for field in ("block_sum_ms", "verified_spread", "whole_backward_ms"):
        if getattr(s, field) is not None:
            check_ms(getattr(s, field), field)
    check_flag(s.checkpoint, "checkpoint")
    check_ms(s.weight_grad_ms, "weight_grad_ms")
    if s.weight_grad_ms > (s.compute_ms - s.forward_ms) * (1 + 1e-9) + 1e-12:
        raise RecordError("weight_grad_ms", f"is {s.weight_grad_ms}, more than the backward "
                                            f"{s.compute_ms - s.forward_ms} (compute - forward)")


def check_shared_weight(w: Any) -> None:
    """The fields of a SharedWeight."""
    check_text(w.name, "name")
    check_row(w.stages, "stages", check_count, nonempty=True)
    if list(w.stages) != sorted(set(w.stages)):
        raise RecordError("stages", f"is {list(w.stages)}: stages must be distinct and ascending")
    check_choice(w.mode, "mode", SHARED_MODES)
    check_bytes(w.bytes, "bytes")
    check_ms(w.sync_ms, "sync_ms")


def check_plan(p: Any, *, stage_type: type, weight_type: type) -> None:
    """The fields of a Plan whose parts are of the classes ``stage_type`` and
    ``weight_type``: stages numbered in order, unique blocks, m = ceil(B / b), ``split_size``
    among the candidates."""
    check_text(p.model, "model", empty=True)
    check_text(p.fingerprint, "fingerprint", empty=True)
    check_row(p.stages, "stages", is_a(stage_type), nonempty=True)
    for i, stage in enumerate(p.stages):
        if stage.index != i:
            raise RecordError(f"stages[{i}].index", f"is {stage.index}: stages must be numbered "
                                                    f"0 … {len(p.stages) - 1} in order")
    check_unique([(f"stages[{i}].blocks[{j}]", name) for i, stage in enumerate(p.stages)
                  for j, name in enumerate(stage.blocks)], "block names")
    check_size(p.split_size, "split_size")
    check_size(p.batch_size, "batch_size")
    check_size(p.microbatches, "microbatches")
    check_size(p.replicas, "replicas")
    if p.batch_size % p.replicas:
        raise RecordError("replicas", f"is {p.replicas}: it must divide batch_size "
                                      f"{p.batch_size} (each replica runs an equal share)")
    share = p.batch_size // p.replicas
    per = f"the share {share} of each of {p.replicas} replicas" if p.replicas > 1 else (
        f"a batch of {p.batch_size}")
    if p.split_size > share:
        raise RecordError("split_size", f"is {p.split_size}, larger than "
                                        f"{'batch_size' if p.replicas == 1 else per} {share}")
    m = -(-share // p.split_size)
    if m > MAX_MICROBATCHES:
        raise RecordError("batch_size", f"is {p.batch_size}: {per} in micro-batches of "
                                        f"{p.split_size} makes {m}, above the "
                                        f"{MAX_MICROBATCHES:,} a step may have")
    if p.microbatches != m:
        rule = ("ceil(batch_size / split_size)" if p.replicas == 1
                else "ceil(batch_size / replicas / split_size)")
        raise RecordError("microbatches", f"is {p.microbatches}: {per} in micro-batches of "
                                          f"{p.split_size} makes {m} ({rule})")
    check_choice(p.schedule, "schedule", KNOWN_SCHEDULES)
    check_size(p.stages_per_rank, "stages_per_rank")
    if len(p.stages) % p.stages_per_rank:
        raise RecordError("stages_per_rank", f"is {p.stages_per_rank}: it must divide the "
                                             f"{len(p.stages)} stages")
    check_choice(p.optimizer, "optimizer", KNOWN_OPTIMIZERS)
    for field in ("predicted_step_ms", "single_device_ms", "bound_step_ms", "replica_sync_ms",
                  "action_ms", "update_ms"):
        check_ms(getattr(p, field), field)
    _check_bandwidth(p.allreduce_bytes_per_s, "allreduce_bytes_per_s")
    check_choice(p.placement, "placement", ("", "pp-inner", "dp-inner"))
    check_choice(p.replica_mode, "replica_mode", REPLICA_MODES)
    if p.devices_per_node is not None:
        check_size(p.devices_per_node, "devices_per_node")
    check_text(p.solver, "solver")
    check_row(p.candidates, "candidates", check_size, nonempty=True)
    if p.split_size not in p.candidates:
        raise RecordError("candidates", f"is {show(list(p.candidates))}: it must hold split_size "
                                        f"{p.split_size}, the size chosen among them")
    check_text(p.profile, "profile", empty=True)
    if p.memory_limit_bytes is not None:
        check_bytes(p.memory_limit_bytes, "memory_limit_bytes")
    check_row(p.shared, "shared", is_a(weight_type))
    for i, weight in enumerate(p.shared):
        if weight.stages[-1] >= len(p.stages):
            raise RecordError(f"shared[{i}].stages", f"is {list(weight.stages)}: the plan has "
                                                     f"{len(p.stages)} stages")
    check_text(p.verification, "verification", empty=True)
    for field in ("step_spread", "single_device_spread"):
        if getattr(p, field) is not None:
            check_ms(getattr(p, field), field)
    if p.single_device_split is not None:
        check_size(p.single_device_split, "single_device_split")
        if p.single_device_split > p.batch_size:
            raise RecordError("single_device_split", f"is {p.single_device_split}: above "
                                                     f"batch_size {p.batch_size}")
