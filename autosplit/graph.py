"""Capture a model as an ordered list of blocks with torch.fx.

A *block* is a contiguous run of graph nodes that the planner never splits: by default one
"leaf-ish" submodule (a ResNet Bottleneck, a transformer layer, a top-level Conv2d …) together
with the small parameter-free operations that follow it. ``granularity="layer"`` makes every
leaf module its own block.

A *cut* lies between block i and block i + 1; it knows every tensor live across it: values
produced at or before block i (model inputs included) that something after block i — a later
block or the model's output — still reads. A skip connection over the cut is one more tensor.

Models that torch.fx cannot trace fall back, with a warning, to their top-level children when
they are an ``nn.Sequential`` or verifiably call their children one after the other; otherwise a
:class:`~autosplit.errors.TraceError` names the failing construct and the fix.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autosplit import checks
from autosplit.blocks import (
    Block,
    Granularity,
    group_blocks,
    leaf_module_list,
    owned_params,
    sequential_fallback,
    symbolic_trace,
)
from autosplit.blocks import module_path as _module_path  # noqa: F401 (used by distributed)
from autosplit.capture.exported import export_graph
from autosplit.capture.signature import InputSignature, call_arguments
from autosplit.capture.values import size_chain, value_kinds
from autosplit.errors import InvalidInputError, TraceError
from autosplit.records import SharedParam, fingerprint_of

__all__ = [
    "Block",
    "Cut",
    "BlockGraph",
    "Segment",
    "SharedParam",
    "trace",
    "Granularity",
    "leaf_module_list",
]

_INPUT_BLOCK = -1


@dataclass(frozen=True, slots=True)
class Cut:
    """The cut after block ``index``: the fx values that cross it."""

    index: int
    tensors: tuple[str, ...]


class BlockGraph:
    """A traced model split into blocks.

    Attributes:
        module: the ``fx.GraphModule``; it holds the model's own submodules and parameters.
        blocks: the blocks in execution order.
        cuts: ``len(blocks) - 1`` cut candidates.
        inputs: names of the graph's placeholders, in call order.
        traced: ``False`` when the graph was built from the top-level children (fallback).
        model_name: the model's class name.
    """

    def __init__(
        self,
        module: fx.GraphModule,
        blocks: Sequence[Block],
        model_name: str,
        traced: bool = True,
        *,
        signature: InputSignature | None = None,
        output_spec: pytree.TreeSpec | None = None,
        capture: Capture | None = None,
    ) -> None:
        self.module = module
        self.blocks = tuple(blocks)
        self.model_name = model_name
        self.traced = traced
        self.node_block: dict[str, int] = {
            node: block.index for block in self.blocks for node in block.nodes
        }
        self.inputs = tuple(n.name for n in module.graph.nodes if n.op == "placeholder")
        self.signature = signature or InputSignature.positional(self.inputs)
        self.output_spec = output_spec
        self.capture = capture
        self.kinds = value_kinds(module.graph)
        self.bools = frozenset(n.name for n in module.graph.nodes if n.meta.get("autosplit_bool"))
        self._nodes = {n.name: n for n in module.graph.nodes}
        self._consumers = self._consumer_blocks()
        self.cuts = self._crossings()
        self.fingerprint = fingerprint_of([(b.name, b.params) for b in self.blocks])

    def __reduce__(self) -> Any:
        # A GraphModule pickles as its generated code, which is traced again on loading: node
        # names change and unused nodes go. A graph captured here is captured again instead.
        if self.capture is None:
            return object.__reduce__(self)
        return (_recapture, (self.capture,))

    def with_module(self, module: fx.GraphModule) -> BlockGraph:
        """The same blocks over another copy of the module (same graph, other tensors)."""
        return BlockGraph(module, self.blocks, self.model_name, self.traced,
                          signature=self.signature, output_spec=self.output_spec,
                          capture=self.capture)

    @property
    def returns_loss(self) -> bool:
        """Whether the model's output holds a 0-dimensional floating tensor (its own loss)."""
        leaves, _ = self.output_leaves()
        return any(isinstance(x, fx.Node) and x.meta.get("autosplit_scalar") for x in leaves)

    @property
    def training(self) -> bool | None:
        """The mode the graph was captured in where the capture fixed it (torch.export fixes
        dropout and BatchNorm to it), else ``None`` (a traced graph follows the model's)."""
        return None if self.capture is None or self.capture.front != "export" \
            else self.capture.training

    @property
    def block_names(self) -> tuple[str, ...]:
        """Names of the blocks, in order."""
        return tuple(b.name for b in self.blocks)

    def _block_of(self, node: fx.Node) -> int:
        if node.op == "placeholder":
            return _INPUT_BLOCK
        if node.op == "output":
            return len(self.blocks)
        return self.node_block[node.name]

    def buffer_bytes(self, i: int) -> int:
        """Bytes of the buffers (BatchNorm statistics, …) of the modules block ``i`` calls."""
        names = set(self.blocks[i].nodes)
        total, seen = 0, set()
        for node in self.module.graph.nodes:
            if node.name not in names:
                continue
            if node.op == "call_module":
                buffers = list(self.module.get_submodule(str(node.target)).buffers())
            elif node.op == "get_attr":
                attr = _attr_of(self.module, str(node.target))
                buffers = [attr] if isinstance(attr, torch.Tensor) \
                    and not isinstance(attr, nn.Parameter) else []
            else:
                continue
            for buf in buffers:
                if id(buf) not in seen:
                    seen.add(id(buf))
                    total += buf.numel() * buf.element_size()
        return total

    def block_parameters(self, i: int) -> dict[int, nn.Parameter]:
        """The parameters block ``i`` uses (via ``get_attr`` or a called module), by ``id``."""
        names = set(self.blocks[i].nodes)
        found: dict[int, nn.Parameter] = {}
        for node in self.module.graph.nodes:
            if node.name not in names:
                continue
            if node.op == "call_module":
                params = list(self.module.get_submodule(str(node.target)).parameters())
            elif node.op == "get_attr":
                attr = _attr_of(self.module, str(node.target))
                params = [attr] if isinstance(attr, nn.Parameter) else []
            else:
                continue
            found.update((id(p), p) for p in params)
        return found

    @functools.cached_property
    def shared_params(self) -> tuple[SharedParam, ...]:
        """Parameters that more than one block uses (tied weights), in order of first use.

        A parameter object counts once however many names reach it (``head.weight`` tied to
        ``embed.weight`` is one :class:`SharedParam` named ``embed.weight``).
        """
        users: dict[int, list[int]] = {}
        objects: dict[int, nn.Parameter] = {}
        for block in self.blocks:
            for key, param in self.block_parameters(block.index).items():
                users.setdefault(key, []).append(block.index)
                objects[key] = param
        names = {id(p): n for n, p in self.module.named_parameters()}
        return tuple(
            SharedParam(names[key], tuple(blocks), _nbytes(objects[key]))
            for key, blocks in users.items() if len(blocks) > 1
        )

    def to_networkx(self) -> nx.DiGraph:
        """The fx data-flow graph; each node carries its ``block`` index (-1 inputs, n output)."""
        g = nx.DiGraph()
        for node in self.module.graph.nodes:
            g.add_node(node.name, block=self._block_of(node), op=node.op)
            for arg in node.all_input_nodes:
                g.add_edge(arg.name, node.name)
        return g

    def _consumer_blocks(self) -> dict[str, int]:
        """Value → the last block that reads it (``len(blocks)``: the model's output).

        A size is computed again where it is used, from the tensors it was computed from: the
        readers of a size count as readers of those tensors, and a size reaches no cut."""
        last: dict[str, int] = {}
        for node in reversed(self.module.graph.nodes):
            reads = [last.get(u.name, -2) if self.kinds[u.name] == "size" else self._block_of(u)
                     for u in node.users]
            if reads:
                last[node.name] = max(reads)
        return last

    def _crossings(self) -> tuple[Cut, ...]:
        produced = {n.name: self._block_of(n) for n in self.module.graph.nodes}
        cuts = []
        for i in range(len(self.blocks) - 1):
            live = tuple(
                name for name, block in produced.items()
                if self.kinds[name] != "size" and block <= i < self._consumers.get(name, -2)
            )
            cuts.append(Cut(i, live))
        return tuple(cuts)

    def blocked_cuts(self) -> tuple[int, ...]:
        """The cuts a value that is neither a tensor nor a size crosses (no stage boundary may
        lie there)."""
        return tuple(c.index for c in self.cuts
                     if any(self.kinds[name] == "other" for name in c.tensors))

    def _segment(self, first: int, end: int,
                 ) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node]]:
        """(the nodes a segment of blocks ``first … end-1`` runs, sizes it computes again
        first; the values it reads; the values it makes for later), in graph order."""
        names = {n for b in self.blocks[first:end] for n in b.nodes}
        own = [n for n in self.module.graph.nodes if n.name in names]
        again: dict[fx.Node, None] = {}
        for node in own:
            for arg in node.all_input_nodes:
                if arg.name not in names and self.kinds[arg.name] == "size":
                    again.update(dict.fromkeys(size_chain(arg, self.kinds)[0]))
        order = {n: i for i, n in enumerate(self.module.graph.nodes)}
        nodes = sorted(again, key=order.__getitem__) + own
        inside = set(nodes)
        inputs: list[fx.Node] = []
        for node in nodes:
            for arg in node.all_input_nodes:
                if arg not in inside and arg not in inputs:
                    inputs.append(arg)
        outputs = [n for n in own if self.kinds[n.name] != "size"
                   and self._consumers.get(n.name, -2) >= end]
        return nodes, inputs, outputs

    def boundary(self, first: int, end: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(reads, makes) of blocks ``first … end-1``: the inputs and outputs of
        :meth:`extract`, in that order."""
        _, inputs, outputs = self._segment(first, end)
        return tuple(n.name for n in inputs), tuple(n.name for n in outputs)

    def extract(self, first: int, end: int) -> Segment:
        """A GraphModule running blocks ``first … end-1``; it shares the model's modules."""
        if not 0 <= first < end <= len(self.blocks):
            raise InvalidInputError(
                f"block range {first}…{end - 1} is outside the model's {len(self.blocks)} blocks"
            )
        nodes, inputs, outputs = self._segment(first, end)
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for arg in inputs:
            env[arg] = graph.placeholder(arg.name)
        for node in nodes:
            env[node] = graph.node_copy(node, lambda a: env[a])
        graph.output(tuple(env[n] for n in outputs))
        graph.lint()
        module = fx.GraphModule(self.module, graph, f"Blocks_{first}_{end - 1}")
        return Segment(
            module, tuple(a.name for a in inputs), tuple(n.name for n in outputs), first, end
        )

    def output_leaves(self) -> tuple[list[Any], pytree.TreeSpec]:
        """The model's output as (leaves: ``fx.Node`` or constants, pytree structure), in the
        model's own output type (a ModelOutput, dict, namedtuple …)."""
        structure = self.output_structure()
        if self.output_spec is not None and self.capture is not None \
                and self.capture.front == "export":
            return list(structure), self.output_spec
        leaves, spec = pytree.tree_flatten(_plain(structure))
        return leaves, self.output_spec or spec

    def output_structure(self) -> Any:
        """The graph's output argument: a (nested) structure of ``fx.Node`` objects."""
        return next(n for n in self.module.graph.nodes if n.op == "output").args[0]


@dataclass(frozen=True, slots=True)
class Segment:
    """A contiguous run of blocks as a module: ``module(*inputs) -> tuple(outputs)``.

    Attributes:
        module: GraphModule whose placeholders are named after the fx values it reads.
        inputs: names of the values it reads (model inputs or values made by earlier blocks).
        outputs: names of the values it makes that something later reads, in graph order.
        first: first block index; end: one past the last block index.
    """

    module: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    first: int
    end: int


# ----------------------------------------------------------------------------------- tracing


@dataclass(frozen=True)
class Capture:
    """How a graph was captured, to capture it again (in a timing process, for another mode).

    Attributes:
        model: the model.
        front: ``"fx"`` (torch.fx symbolic tracing) or ``"export"`` (torch.export).
        granularity, leaf_modules: as given to :func:`trace`.
        args, kwargs: the example call (``None``: none was given).
        training: the model's mode when it was captured.
    """

    model: nn.Module
    front: str
    granularity: Granularity
    leaf_modules: tuple[Any, ...]
    args: tuple[Any, ...] | None
    kwargs: dict[str, Any] | None
    training: bool


def _recapture(capture: Capture) -> BlockGraph:
    was = capture.model.training
    capture.model.train(capture.training)
    try:
        return trace(capture.model, granularity=capture.granularity,
                     leaf_modules=capture.leaf_modules, example_inputs=capture.args,
                     example_kwargs=capture.kwargs, front=capture.front)
    finally:
        capture.model.train(was)


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
                               training=model.training)
    fx_error: Exception | None = None
    if front != "export" and not kwargs:
        try:
            gm = symbolic_trace(model, leaves, _defaults_beyond(model, len(args) if given else None))
        except Exception as exc:  # noqa: BLE001 - fx raises many kinds of errors from user code
            fx_error = exc
        else:
            spec = _output_spec(model, args, gm) if given else None
            graph = _grouped(model, gm, granularity, name, recipe(front="fx"), output_spec=spec)
            if not graph.blocked_cuts() or not given:
                return graph
    if front == "fx" and fx_error is not None:
        raise fx_error
    if given:
        try:
            gm, signature, out_spec = export_graph(model, args, kwargs)
        except TraceError as exc:
            if fx_error is None:
                raise
            raise TraceError(
                f"{exc}; torch.fx cannot trace it either ({_reason(fx_error)}): mark the "
                "submodule that fails as a leaf (--leaf-modules NAME, "
                "leaf_modules=[NAME]) so that torch.fx can trace around it"
            ) from exc
        return _grouped(model, gm, granularity, name, recipe(front="export"),
                        signature=signature, output_spec=out_spec)
    assert fx_error is not None
    gm = sequential_fallback(model, None, fx_error)
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
    traced, _ = pytree.tree_flatten(_plain(structure))
    return spec if len(leaves) == len(traced) else None


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _plain(structure: Any) -> Any:
    """fx's immutable containers in an output structure as the dict and list they were."""
    if isinstance(structure, dict):
        return {k: _plain(v) for k, v in structure.items()}
    if isinstance(structure, list):
        return [_plain(v) for v in structure]
    if isinstance(structure, tuple) and not hasattr(structure, "_fields"):
        return tuple(_plain(v) for v in structure)
    return structure


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _attr_of(module: nn.Module, target: str) -> Any:
    """The attribute ``target`` (``"a.b.weight"``) of ``module``, or ``None``."""
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj
