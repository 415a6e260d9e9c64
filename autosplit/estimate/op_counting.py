"""Count each block's work on the meta device: FLOPs and bytes moved per operator, bytes saved.

See :mod:`autosplit.estimate.analytic` for what is counted and how; :func:`count_costs` returns the
device-independent :class:`ModelCosts` that a device spec turns into times.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from autosplit import checks
from autosplit.capture.trace import trace
from autosplit.errors import InvalidInputError
from autosplit.estimate.meta_device import META, model_dtype, to_meta
from autosplit.estimate.options import EstimateOptions
from autosplit.fsdp_units import shardable
from autosplit.graph import BlockGraph, Granularity
from autosplit.measure.budget import default_microbatch_sizes
from autosplit.measure.profiler import check_inputs, check_microbatch_sizes
from autosplit.measure.tensor_trees import fresh_leaves, nbytes, tensor_leaves
from autosplit.records import SharedParam

__all__ = [
    "BlockCost",
    "ModelCosts",
    "count_costs",
]


# Operators that move no data: views and aliases (``OpOverload.is_view`` covers most), plus
# the few that alias without being marked as views, and metadata queries.
_NO_TRAFFIC = {
    "aten::detach", "aten::_unsafe_view", "aten::alias", "aten::lift_fresh", "aten::_reshape_alias",
    "aten::sym_size", "aten::sym_stride", "aten::sym_numel", "aten::sym_storage_offset",
    "aten::is_same_size", "aten::is_contiguous", "prim::device", "prim::layout",
    "aten::_local_scalar_dense", "aten::set_", "aten::resize_",
}


@dataclass(frozen=True, slots=True)
class BlockCost:
    """The work of one block on one micro-batch (device independent).

    Attributes:
        fwd_flops: FLOPs of the forward (a multiply-add is 2 FLOPs).
        bwd_flops: FLOPs of the backward.
        fwd_bytes: bytes the forward's operators read and write, summed over operators.
        bwd_bytes: the same for the backward.
        fwd_ops: ``(flops, bytes)`` of each forward operator with FLOPs, then one entry
            ``(0, bytes)`` for all its operators without FLOPs.
        bwd_ops: the same for the backward.
        saved_bytes: bytes kept for backward (parameters excluded, storages counted once,
            inputs already kept by the block that made them excluded; as the profiler).
        saved_shared_bytes: bytes of this block's inputs that it and their producer both keep.
        output_bytes: bytes of the block's outputs.
        estimated: ``True`` when the backward could not run on meta and is 2× the forward.
        input_bytes: bytes of the block's tensor inputs (storages counted once): what it
            keeps for backward when checkpointed.
        input_grad: whether an input of the block needs a gradient (not for a block reading
            only the model's inputs).
    """

    fwd_flops: int
    bwd_flops: int
    fwd_bytes: int
    bwd_bytes: int
    fwd_ops: tuple[tuple[int, int], ...]
    bwd_ops: tuple[tuple[int, int], ...]
    saved_bytes: int
    saved_shared_bytes: int
    output_bytes: int
    estimated: bool = False
    input_bytes: int = 0
    input_grad: bool = True


@dataclass(frozen=True, slots=True)
class ModelCosts:
    """Counted work of every block at every micro-batch size: the device-independent half of an
    analytic profile (:func:`profile_from_costs` adds a device).

    Attributes:
        model: the model's class name.
        fingerprint: the traced model's fingerprint (equal to a measured profile's).
        block_names: the blocks, in order.
        param_bytes: bytes of the parameters each block owns (in ``dtype``).
        buffer_bytes: bytes of the buffers each block owns.
        param_count: parameters of the whole model.
        microbatch_sizes: the sizes b counted, ascending.
        blocks: ``blocks[k][i]``: block i at size ``microbatch_sizes[k]``.
        cut_tensors: names of the tensors crossing each cut.
        cut_bytes: ``cut_bytes[c][k]``: bytes crossing cut c at size index k.
        batch_size: B of the example inputs.
        input_shapes: shapes of the example inputs (full batch).
        input_dtypes: their dtypes as counted (floating inputs take ``dtype`` when given).
        dtype: the floating dtype the model was counted in, e.g. ``"torch.float32"``; it picks
            the peak FLOP/s of a device spec.
        seconds: wall time the counting took (s).
        shared: parameters that several blocks use (tied weights), in ``dtype``.
        fsdp_units: whether FSDP2 can shard every block as a unit (:mod:`autosplit.fsdp_units`).
    """

    model: str
    fingerprint: str
    block_names: tuple[str, ...]
    param_bytes: tuple[int, ...]
    buffer_bytes: tuple[int, ...]
    param_count: int
    microbatch_sizes: tuple[int, ...]
    blocks: tuple[tuple[BlockCost, ...], ...]
    cut_tensors: tuple[tuple[str, ...], ...]
    cut_bytes: tuple[tuple[int, ...], ...]
    batch_size: int
    input_shapes: tuple[tuple[int, ...], ...]
    input_dtypes: tuple[str, ...]
    dtype: str
    seconds: float = 0.0
    shared: tuple[SharedParam, ...] = ()
    fsdp_units: bool = True

    def at(self, size: int) -> tuple[BlockCost, ...]:
        """The block costs at micro-batch size ``size``.

        Raises:
            InvalidInputError: ``size`` was not counted; the message lists what was.
        """
        if size not in self.microbatch_sizes:
            raise InvalidInputError(
                f"micro-batch size {size} was not counted; counted sizes are "
                f"{list(self.microbatch_sizes)}"
            )
        return self.blocks[self.microbatch_sizes.index(size)]

    def ops(self, size: int, block: int) -> tuple[tuple[int, int], ...]:
        """``(flops, bytes)`` of every operator of block ``block``'s forward and backward."""
        cost = self.at(size)[block]
        return cost.fwd_ops + cost.bwd_ops

    def flops(self, size: int) -> tuple[tuple[int, int], ...]:
        """``(forward, backward)`` FLOPs of each block at micro-batch size ``size``."""
        return tuple((c.fwd_flops, c.bwd_flops) for c in self.at(size))


class _Traffic(TorchDispatchMode):
    """Records ``(flops, bytes)`` per ATen operator into ``self.sink`` (when not ``None``).

    It must be entered *inside* a FlopCounterMode: it sees every operator first and reads the
    counter's total before and after passing the operator on, so decompositions that the
    counter performs are charged to the operator that was called.
    """

    def __init__(self, counter: FlopCounterMode) -> None:
        super().__init__()
        self.counter = counter
        self.sink: list[tuple[int, int]] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.sink is None:
            return func(*args, **kwargs)
        before = self.counter.get_total_flops()
        out = func(*args, **kwargs)
        flops = self.counter.get_total_flops() - before
        name = func._schema.name if hasattr(func, "_schema") else str(func)
        moved = 0
        if not (getattr(func, "is_view", False) or name in _NO_TRAFFIC):
            moved = sum(_distinct_bytes(t) for t in tensor_leaves((args, kwargs)))
            moved += sum(_distinct_bytes(t) for t in tensor_leaves(out))
        if flops or moved:
            self.sink.append((int(flops), int(moved)))
        return out


class _FusedAttention(TorchFunctionMode):
    """Routes mask-free ``F.scaled_dot_product_attention`` calls to the fused flash kernel."""

    _NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            bound = dict(zip(self._NAMES, args), **kwargs)
            q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
            if (
                bound.get("attn_mask") is None
                and not bound.get("enable_gqa", False)
                and all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v))
                and q.shape[:2] == k.shape[:2] == v.shape[:2]  # type: ignore[union-attr]
                and q.shape[-1] == k.shape[-1] == v.shape[-1]  # type: ignore[union-attr]
            ):
                return torch.ops.aten._scaled_dot_product_flash_attention(
                    q, k, v,
                    float(bound.get("dropout_p", 0.0)),
                    bool(bound.get("is_causal", False)),
                    False,
                    scale=bound.get("scale"),
                )[0]
        return func(*args, **kwargs)


def _distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements a kernel touches: broadcast (stride-0) dimensions count once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage that works on meta (where ``data_ptr()`` is 0)."""
    return int(t.untyped_storage()._cdata)


def _compress(ops: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Operators with FLOPs as they are, operators without FLOPs summed into one entry."""
    with_flops = tuple(op for op in ops if op[0] > 0)
    memory = sum(n for f, n in ops if f == 0)
    return with_flops + (((0, memory),) if memory else ())


def count_costs(
    model: nn.Module,
    example_inputs: Any,
    *,
    options: EstimateOptions = EstimateOptions(),
    granularity: Granularity = "block",
    leaf_modules: Sequence[type[nn.Module] | str] = (),
) -> ModelCosts:
    """Count FLOPs, bytes moved, bytes saved and crossing bytes of each block, on meta.

    Args:
        model: the model, on any device; it is neither run nor changed (a meta copy is used,
            made without copying parameter data). Build big models with :func:`build_on_meta`.
        example_inputs: a tensor or tuple of tensors (any device, meta included); dimension 0
            is the batch B. Only shapes and dtypes are used.
        options: the sizes, the dtype and the attention kernel counted
            (:class:`~autosplit.estimate.options.EstimateOptions`).
        granularity: see :func:`autosplit.capture.trace.trace`.
        leaf_modules: see :func:`autosplit.capture.trace.trace`.

    Raises:
        InvalidInputError: bad inputs or sizes, or a block that cannot run on meta (an
            operator without a meta kernel, or data-dependent shapes).
        TraceError: the model cannot be traced.
    """
    start = time.perf_counter()
    checks.instance_of("model", model, nn.Module, "a torch.nn.Module")
    checks.instance_of("options", options, EstimateOptions, "an autosplit EstimateOptions")
    dtype, attention = options.dtype, options.attention
    checks.one_of("granularity", granularity, ("block", "layer"))
    inputs = check_inputs(example_inputs)
    batch = int(inputs[0].shape[0])
    if options.microbatch_sizes is None:
        sizes = sorted(default_microbatch_sizes(batch, options.stages))
    else:
        sizes = sorted(check_microbatch_sizes(options.microbatch_sizes, batch))

    meta_inputs = tuple(
        torch.empty(
            tuple(x.shape),
            dtype=dtype if dtype is not None and x.is_floating_point() else x.dtype,
            device=META,
        )
        for x in inputs
    )
    work = to_meta(model, dtype)
    work.train(model.training)
    graph = trace(
        work, granularity=granularity, leaf_modules=leaf_modules, example_inputs=meta_inputs
    )
    counted_dtype = dtype if dtype is not None else model_dtype(work)

    params = dict(graph.module.named_parameters())
    param_bytes = tuple(
        sum(params[p].numel() * params[p].element_size() for p, _ in block.params if p in params)
        for block in graph.blocks
    )
    param_count = sum(p.numel() for p in graph.module.parameters())
    buffer_bytes = tuple(graph.buffer_bytes(i) for i in range(len(graph.blocks)))

    per_size: list[tuple[BlockCost, ...]] = []
    cut_bytes: list[list[int]] = [[] for _ in graph.cuts]
    segments = [graph.extract(i, i + 1) for i in range(len(graph.blocks))]
    for b in sizes:
        mb = tuple(x[:b].clone() for x in meta_inputs)  # meta: no data, own storage
        costs, env = _count_size(graph, segments, mb, b, fused=attention == "flash")
        per_size.append(costs)
        for cut in graph.cuts:
            cut_bytes[cut.index].append(sum(nbytes(env[name]) for name in cut.tensors))
    return ModelCosts(
        model=graph.model_name,
        fingerprint=graph.fingerprint,
        block_names=graph.block_names,
        param_bytes=param_bytes,
        buffer_bytes=buffer_bytes,
        param_count=int(param_count),
        microbatch_sizes=tuple(sizes),
        blocks=tuple(per_size),
        cut_tensors=tuple(cut.tensors for cut in graph.cuts),
        cut_bytes=tuple(tuple(row) for row in cut_bytes),
        batch_size=batch,
        input_shapes=tuple(tuple(x.shape) for x in inputs),
        input_dtypes=tuple(str(x.dtype) for x in meta_inputs),
        dtype=str(counted_dtype),
        seconds=round(time.perf_counter() - start, 3),
        shared=graph.shared_params,
        fsdp_units=shardable(graph.module, graph.block_names),
    )


def _count_size(
    graph: BlockGraph, segments: Sequence[Any], inputs: Sequence[torch.Tensor], b: int, fused: bool
) -> tuple[tuple[BlockCost, ...], dict[str, Any]]:
    """Run every block once at micro-batch size b on meta; see the module docstring."""
    env: dict[str, Any] = dict(zip(graph.inputs, inputs))
    param_storages = {_storage_key(p) for p in graph.module.parameters()}
    saved_before: set[int] = set()
    alive: list[torch.Tensor] = []  # keeps saved storages alive so that their keys stay unique
    results = []
    counter = FlopCounterMode(display=False)
    traffic = _Traffic(counter)
    routing = _FusedAttention() if fused else contextlib.nullcontext()
    with torch.device("meta"), counter, traffic, routing:
        for seg in segments:
            name = graph.blocks[seg.first].name
            storages: dict[int, int] = {}

            def pack(t: torch.Tensor, storages: dict[int, int] = storages) -> torch.Tensor:
                key = _storage_key(t)
                if key not in param_storages:
                    storages[key] = t.untyped_storage().nbytes()
                    alive.append(t)
                return t

            args = fresh_leaves(
                [env[n] for n in seg.inputs], [n not in graph.inputs for n in seg.inputs]
            )
            fwd: list[tuple[int, int]] = []
            bwd: list[tuple[int, int]] = []
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    traffic.sink = fwd
                    outputs = seg.module(*args)
            except Exception as exc:  # the user's model on meta
                raise _meta_error(graph, name, b, exc) from exc
            finally:
                traffic.sink = None
            grads_for = [t for t in tensor_leaves(outputs) if t.requires_grad]
            seeds = [torch.ones_like(t) for t in grads_for]
            estimated = False
            if grads_for:
                try:
                    traffic.sink = bwd
                    torch.autograd.backward(grads_for, seeds)
                except Exception:  # noqa: BLE001  an operator without a meta backward: 2× forward
                    bwd = [(2 * f, 2 * n) for f, n in fwd]
                    estimated = True
                finally:
                    traffic.sink = None
            inputs_here = {
                _storage_key(v) for v in (env[n] for n in seg.inputs) if isinstance(v, torch.Tensor)
            }
            shared = sum(n for k, n in storages.items() if k in inputs_here and k in saved_before)
            saved_before.update(storages)
            results.append(
                BlockCost(
                    fwd_flops=sum(f for f, _ in fwd),
                    bwd_flops=sum(f for f, _ in bwd),
                    fwd_bytes=sum(n for _, n in fwd),
                    bwd_bytes=sum(n for _, n in bwd),
                    fwd_ops=_compress(fwd),
                    bwd_ops=_compress(bwd),
                    saved_bytes=sum(storages.values()) - shared,
                    saved_shared_bytes=shared,
                    output_bytes=nbytes(outputs),
                    estimated=estimated,
                    input_bytes=sum({
                        _storage_key(v): v.untyped_storage().nbytes() for v in
                        (env[n] for n in seg.inputs) if isinstance(v, torch.Tensor)
                    }.values()),
                    input_grad=any(n not in graph.inputs for n in seg.inputs),
                )
            )
            for out_name, value in zip(seg.outputs, outputs):
                env[out_name] = value.detach() if isinstance(value, torch.Tensor) else value
    return tuple(results), env


def _meta_error(graph: BlockGraph, block: str, b: int, exc: Exception) -> InvalidInputError:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return InvalidInputError(
        f"{graph.model_name}: block {block!r} cannot run on the meta device at micro-batch {b} "
        f"({type(exc).__name__}: {message}). Operators with data-dependent shapes (nonzero, "
        "masked_select, .item()) or without a meta kernel cannot be counted; mark the module as "
        "a leaf or measure it with autosplit.profile instead"
    )
