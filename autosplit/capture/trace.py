"""How a model is captured: torch.fx when it traces, torch.export otherwise.

torch.fx symbolic tracing is tried first for a positional call: its graph keeps the calls to
the model's own modules (readable emitted code, a BatchNorm that follows ``model.train()``).
A call with keyword inputs, or a model fx cannot trace (a decorated forward, control flow on
shapes: every Hugging Face model), is captured with torch.export from the example call
(:mod:`autosplit.capture.exported`). A model neither captures, but that is an
``nn.Sequential`` or calls its children one after the other, is split at its children.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autosplit import checks
from autosplit.blocks import (
    Block,
    group_blocks,
    leaf_module_list,
    owned_params,
    sequential_fallback,
    symbolic_trace,
)
from autosplit.capture.exported import export_graph
from autosplit.capture.layers import Granularity
from autosplit.capture.signature import call_arguments
from autosplit.capture.values import value_kinds
from autosplit.errors import InvalidInputError, TraceError
from autosplit.graph import BlockGraph, Capture, plain_structure

__all__ = ["Capture", "trace"]


def _recapture(capture: Capture) -> BlockGraph:
    model = capture.model
    if model is None:
        raise TraceError("this graph was pickled without its model, so it cannot be captured "
                         "again: capture the model in this process (autosplit.trace)")
    was = model.training
    model.train(capture.training)
    try:
        return trace(model, granularity=capture.granularity,
                     leaf_modules=capture.leaf_modules, example_inputs=capture.args,
                     example_kwargs=capture.kwargs, front=capture.front)
    finally:
        model.train(was)


def trace(
    model: nn.Module,
    *,
    granularity: Granularity = "block",
    leaf_modules: Iterable[type[nn.Module] | str] = (),
    example_inputs: Any = None,
    example_kwargs: dict[str, Any] | None = None,
    front: str | None = None,
) -> BlockGraph:
    """Capture ``model`` as a :class:`BlockGraph`.

    torch.fx traces the model when it can and the call is positional: its graph keeps the
    calls to the model's own modules. Otherwise (keyword inputs, a decorated forward, control
    flow on shapes: every Hugging Face model) torch.export captures the example call.

    Args:
        model: the model; it is not modified and its modules are shared, not copied.
        granularity: ``"block"`` (the repeated layers and the modules around them, small ops
            merged into the block before them) or ``"layer"`` (every leaf module its own
            block).
        leaf_modules: module classes or qualified names that tracing must not enter (the
            fix for submodules with data-dependent control flow).
        example_inputs: a tensor or tuple of the positional inputs of one call.
        example_kwargs: the keyword inputs of that call.
        front: ``"fx"`` or ``"export"`` to use that capture only (default: as above).

    Raises:
        ArgumentTypeError: ``model`` is not an ``nn.Module``, ``granularity`` not a string, or
            ``leaf_modules`` not a list of module classes and names.
        InvalidInputError: an unknown granularity, or a model without operations.
        TraceError: the model can neither be traced nor exported (the message names the
            construct and the option that helps).
    """
    checks.instance_of("model", model, nn.Module, "a torch.nn.Module")
    checks.one_of("granularity", granularity, ("block", "layer"))
    name = type(model).__name__
    leaves = leaf_module_list(leaf_modules)
    given = example_inputs is not None or bool(example_kwargs)
    args, kwargs = call_arguments(example_inputs, example_kwargs) if given else ((), {})
    recipe = functools.partial(Capture, model, granularity=granularity, leaf_modules=leaves,
                               args=args if given else None, kwargs=kwargs if given else None,
                               training=model.training, rebuild=_recapture)
    fx_error: Exception | None = None
    if front != "export" and not kwargs:
        try:
            gm = symbolic_trace(model, leaves, _defaults_beyond(model, len(args) if given else None))
        except Exception as exc:  # noqa: BLE001 - fx raises many kinds of errors from user code
            fx_error = exc
        else:
            if given:
                _observe_kinds(model, gm, args)
            spec = _output_spec(model, args, gm) if given else None
            graph = _grouped(model, gm, granularity, name, recipe(front="fx"), output_spec=spec)
            if not graph.blocked_cuts() or not given:
                return graph
    if front == "fx" and fx_error is not None:
        raise fx_error
    export_error: TraceError | None = None
    if given:
        try:
            gm, signature, out_spec = export_graph(model, args, kwargs)
        except TraceError as exc:
            if fx_error is None:
                raise
            export_error = exc
        else:
            return _grouped(model, gm, granularity, name, recipe(front="export"),
                            signature=signature, output_spec=out_spec)
    assert fx_error is not None
    try:
        gm = sequential_fallback(model, None if kwargs else args or None, fx_error)
    except TraceError:
        if export_error is None:
            raise
        raise TraceError(
            f"{export_error}; torch.fx cannot trace it either ({_reason(fx_error)}): mark the "
            "submodule that fails as a leaf (--leaf-modules NAME, leaf_modules=[NAME]) so "
            "that torch.fx can trace around it"
        ) from export_error
    blocks = [
        Block(i, n.target, (n.name,), owned_params(model, [n], set()))  # type: ignore[arg-type]
        for i, n in enumerate(n for n in gm.graph.nodes if n.op == "call_module")
    ]
    return BlockGraph(gm, blocks, name, traced=False)


def _grouped(model: nn.Module, gm: fx.GraphModule, granularity: Granularity, name: str,
             capture: Capture, **extra: Any) -> BlockGraph:
    """The graph's nodes grouped into blocks; blocks a non-tensor value crosses between are
    joined, so that no cut a stage boundary cannot lie at is ever offered."""
    blocks = group_blocks(model, gm, granularity)
    if not blocks:
        raise InvalidInputError(f"model {name} has no operations to split (empty model)")
    graph = BlockGraph(gm, blocks, name, capture=capture, **extra)
    while blocked := graph.blocked_cuts():
        graph = BlockGraph(gm, _joined(graph.blocks, set(blocked)), name, capture=capture,
                           **extra)
    return graph


def _joined(blocks: Sequence[Block], cuts: set[int]) -> list[Block]:
    """``blocks`` with block i and i + 1 made one for every cut i in ``cuts``."""
    out: list[Block] = []
    for block in blocks:
        if out and block.index - 1 in cuts:
            prev = out[-1]
            out[-1] = Block(prev.index, prev.name, prev.nodes + block.nodes,
                            prev.params + block.params)
        else:
            out.append(block)
    return [Block(i, b.name, b.nodes, b.params) for i, b in enumerate(out)]


def _defaults_beyond(model: nn.Module, given: int | None) -> dict[str, Any]:
    """The forward's parameters with a default that a positional call of ``given`` inputs
    leaves out (all with a default when ``given`` is None), at their defaults: torch.fx
    traces them as constants, not as inputs."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return {}
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    skip = given if given is not None else sum(p.default is p.empty for p in positional)
    return {p.name: p.default for p in positional[skip:] if p.default is not p.empty
            and not isinstance(p.default, torch.Tensor)}


def _output_spec(model: nn.Module, args: tuple[Any, ...], gm: fx.GraphModule,
                 ) -> pytree.TreeSpec | None:
    """The model's own output structure where torch.fx's graph lost its type (fx returns an
    ``OrderedDict`` or a dict subclass as a plain dict): from one run of two rows in eval mode
    without gradients (the model's state and random numbers are left as they were); ``None``
    where the graph's structure is the model's."""
    structure = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if not any(isinstance(x, dict) for x in pytree.tree_flatten(
            structure, is_leaf=lambda x: isinstance(x, dict))[0]):
        return None
    was = model.training
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng():
            out = model(*(x[:2] if isinstance(x, torch.Tensor) and x.dim() else x for x in args))
    except Exception:  # noqa: BLE001 - then the traced structure stands
        return None
    finally:
        model.train(was)
    leaves, spec = pytree.tree_flatten(out)
    traced, _ = pytree.tree_flatten(plain_structure(structure))
    return spec if len(leaves) == len(traced) else None


def _observe_kinds(model: nn.Module, gm: fx.GraphModule, args: tuple[Any, ...]) -> None:
    """Mark each node of a traced graph with what its value is in a run of two rows of the
    example (eval mode, no gradients, the model's state and random numbers left as they
    were): ``meta["autosplit_kind"]`` of :mod:`autosplit.capture.values`. A value that is not a
    tensor and not read from a shape (a tuple, a Python number from ``.item()``) is then
    known, and no cut is offered where it is live."""
    static = value_kinds(gm.graph)
    seen: dict[str, str] = {}

    class _Observer(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            if isinstance(value, torch.Tensor) or n.op in ("placeholder", "output"):
                seen[n.name] = "tensor"
            else:
                seen[n.name] = "size" if static[n.name] == "size" else "other"
            return value

    was = model.training
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng():
            _Observer(gm).run(*(x[:2] if isinstance(x, torch.Tensor) and x.dim() else x
                                for x in args))
    except Exception:  # noqa: BLE001 - the static reading of the graph stands
        return
    finally:
        model.train(was)
    for node in gm.graph.nodes:
        if node.name in seen and seen[node.name] != "tensor":
            node.meta["autosplit_kind"] = seen[node.name]


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
