"""Profiles from shapes alone: count each block's work on the meta device, time it with a roofline.

The model is built (or copied) on ``torch.device("meta")``: tensors there have shapes, dtypes
and strides but no storage, so a model of billions of parameters costs no memory and its
blocks run in milliseconds. Each block runs at every micro-batch size b, exactly as the
measured profiler runs it (:mod:`autosplit.measure.profiler`: the same :class:`~autosplit.graph.Segment`
per block, its inputs turned into fresh autograd leaves, a backward seeded with ones), while

* ``torch.utils.flop_counter.FlopCounterMode`` counts the FLOPs of every ATen operator, forward
  and backward (autograd runs on meta tensors; where a backward fails, it is taken as twice the
  forward: 2× FLOPs and 2× bytes, and the block is marked ``estimated``);
* a dispatch mode records each operator's bytes moved: the bytes of its tensor inputs and
  outputs (views and aliases move nothing; broadcast dimensions are counted once);
* saved-tensor hooks record the tensors kept for backward; meta tensors have no address
  (``data_ptr()`` is 0), so a storage is known by its ``StorageImpl`` (``_cdata``).

:class:`ModelCosts` holds those counts; they do not depend on the device. A
:class:`~autosplit.specs.DeviceSpec` turns them into times, operator by operator:
t = max(flops / (peak · efficiency), bytes / (bandwidth · bandwidth efficiency), floor per
operator), summed per block (:func:`autosplit.specs.op_time_s`), and :func:`profile_from_costs` packs everything into
an ordinary :class:`~autosplit.records.Profile` with ``source="analytic"`` that the planner takes
unchanged.

What the schedules need beyond forward and backward is estimated, not counted (the profile
says ``backward_split="estimated"``): the backward splits evenly into input-gradient (B) and
weight-gradient (W) time — exact for a linear layer or convolution, whose two backward GEMMs
have the forward's FLOPs each, and the usual assumption of the zero-bubble papers; a block
reading only the model's inputs has no B (all its backward is W). Recomputation under
activation checkpointing costs the forward again, and keeps the block's inputs.

Attention: on meta, ``scaled_dot_product_attention`` would take its unfused math path, which
keeps the b·h·t² attention matrix for backward. GPUs (and PyTorch's CPU kernel) run a fused
flash attention that keeps only the output and a log-sum-exp, so with ``attention="flash"``
(the default) calls without a mask are routed to ``aten._scaled_dot_product_flash_attention``,
whose meta kernel and FLOP formula mirror the fused kernel; calls with a mask keep the math path.

What the counts leave out: kernel launch overheads beyond the spec's floor per operator (tiny
operators are latency-bound on real devices: :func:`autosplit.specs.calibrate` fits the floor),
fusion (a fused kernel moves fewer bytes than the sum of its operators), and how a
kernel's efficiency depends on its shapes (a skinny GEMM reaches less of the peak than a square
one): one efficiency per device stands for all of them, which :func:`autosplit.specs.calibrate`
fits to a measured profile.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from autosplit.errors import ArgumentTypeError
from autosplit.estimate.meta_device import build_on_meta, to_meta
from autosplit.estimate.op_counting import BlockCost, ModelCosts, count_costs
from autosplit.estimate.options import EstimateOptions
from autosplit.graph import Granularity
from autosplit.measure.profiler import check_inputs
from autosplit.measure.update_timing import UPDATE_PASSES
from autosplit.records import BlockProfile, CutProfile, DeviceInfo, Profile
from autosplit.specs import DeviceSpec, op_time_s

__all__ = [
    "build_on_meta",
    "to_meta",
    "BlockCost",
    "ModelCosts",
    "count_costs",
    "profile_from_costs",
    "analytic_profile",
    "block_flops",
]


def profile_from_costs(costs: ModelCosts, spec: DeviceSpec) -> Profile:
    """An analytic :class:`~autosplit.records.Profile` of ``costs`` on the device ``spec``.

    Block times are the roofline times of their operators (:func:`autosplit.specs.op_time_s`,
    ms); memory figures are the counted bytes; ``source`` is ``"analytic"`` and the device's
    name says which spec and efficiencies made the times.
    """
    blocks = []
    for i, name in enumerate(costs.block_names):
        row = [costs.blocks[k][i] for k in range(len(costs.microbatch_sizes))]
        blocks.append(
            BlockProfile(
                name=name,
                param_bytes=costs.param_bytes[i],
                buffer_bytes=costs.buffer_bytes[i],
                fwd_ms=tuple(_ops_ms(c.fwd_ops, spec, costs.dtype) for c in row),
                bwd_ms=tuple(_ops_ms(c.bwd_ops, spec, costs.dtype) for c in row),
                saved_bytes=tuple(c.saved_bytes for c in row),
                output_bytes=tuple(c.output_bytes for c in row),
                peak_bytes=None,
                saved_shared_bytes=tuple(c.saved_shared_bytes for c in row),
                **_estimated_split(row, spec, costs.dtype),
                update_ms=_estimated_update(costs.param_bytes[i], spec, costs.dtype),
            )
        )
    cuts = tuple(
        CutProfile(c, tensors, costs.cut_bytes[c]) for c, tensors in enumerate(costs.cut_tensors)
    )
    return Profile(
        model=costs.model,
        fingerprint=costs.fingerprint,
        blocks=tuple(blocks),
        cuts=cuts,
        microbatch_sizes=costs.microbatch_sizes,
        batch_size=costs.batch_size,
        input_shapes=costs.input_shapes,
        input_dtypes=costs.input_dtypes,
        device=DeviceInfo(
            spec.kind, spec.label(), 1 if spec.kind == "cpu" else None, int(spec.memory_bytes)
        ),
        torch_version=torch.__version__,
        source="analytic",
        warmup=0,
        repeats=0,
        seconds=costs.seconds,
        shared=costs.shared,
        backward_split="estimated",
        fsdp_units=costs.fsdp_units,
    )


def _estimated_split(row: Sequence[BlockCost], spec: DeviceSpec, dtype: str) -> dict[str, Any]:
    """A block's input- and weight-gradient, recomputation times (ms) and bytes kept when
    checkpointed, at every size: B = W = half the backward (W = all of it without an input
    gradient), recomputation = the forward (see the module docstring)."""
    bwd = [_ops_ms(c.bwd_ops, spec, dtype) for c in row]
    share = [0.5 if c.input_grad else 0.0 for c in row]
    return {
        "input_grad_ms": tuple(t * f for t, f in zip(bwd, share)),
        "weight_grad_ms": tuple(t * (1.0 - f) for t, f in zip(bwd, share)),
        "recompute_ms": tuple(_ops_ms(c.fwd_ops, spec, dtype) for c in row),
        "checkpoint_saved_bytes": tuple(c.input_bytes for c in row),
    }


def _estimated_update(param_bytes: int, spec: DeviceSpec, dtype: str
                      ) -> tuple[tuple[str, float], ...]:
    """Each optimizer's update of ``param_bytes`` as one memory-bound operator: the bytes it
    reads and writes per parameter byte (:data:`~autosplit.measure.update_timing.UPDATE_PASSES`) at
    the device's memory bandwidth (ms); 0 without parameters."""
    return tuple((name, op_time_s(0.0, passes * param_bytes, spec, dtype) * 1000.0
                  if param_bytes else 0.0) for name, passes in UPDATE_PASSES.items())


def _ops_ms(ops: Sequence[tuple[int, int]], spec: DeviceSpec, dtype: str) -> float:
    return 1000.0 * math.fsum(op_time_s(f, n, spec, dtype) for f, n in ops)


def analytic_profile(
    model: nn.Module,
    example_inputs: Any,
    spec: DeviceSpec,
    *,
    options: EstimateOptions = EstimateOptions(),
    granularity: Granularity = "block",
    leaf_modules: Sequence[type[nn.Module] | str] = (),
) -> Profile:
    """A Profile of ``model`` on the device ``spec``, from shapes alone (nothing is allocated).

    ``count_costs`` followed by ``profile_from_costs``; see those for the arguments. The
    result's ``describe()`` reads e.g. "analytic on h100-80gb (efficiency 0.50, bandwidth
    efficiency 0.80), torch …".

    Raises:
        ArgumentTypeError: an argument of the wrong type (``spec`` not a DeviceSpec, a model
            that is not an ``nn.Module``, an input that is not a tensor, ``stages=2.0`` …).
        InvalidInputError: a bad value (a micro-batch size above the batch, an unknown
            ``attention``, …) or a block that cannot run on meta.
        TraceError: the model cannot be traced.
    """
    if not isinstance(spec, DeviceSpec):
        raise ArgumentTypeError(
            "spec must be a DeviceSpec (autosplit.specs.get_spec('h100-80gb')), got "
            f"{type(spec).__name__}"
        )
    costs = count_costs(model, example_inputs, options=options, granularity=granularity,
                        leaf_modules=leaf_modules)
    return profile_from_costs(costs, spec)


def block_flops(
    model: nn.Module,
    example_inputs: Any,
    *,
    granularity: Granularity = "block",
    leaf_modules: Sequence[type[nn.Module] | str] = (),
    backward: bool = False,
) -> tuple[int, ...]:
    """Forward (or, with ``backward=True``, backward) FLOPs of each block on the whole example
    batch, counted on meta (a multiply-add is 2 FLOPs)."""
    inputs = check_inputs(example_inputs)
    costs = count_costs(model, inputs,
                        options=EstimateOptions(microbatch_sizes=(int(inputs[0].shape[0]),)),
                        granularity=granularity, leaf_modules=leaf_modules)
    return tuple(c.bwd_flops if backward else c.fwd_flops for c in costs.blocks[0])
