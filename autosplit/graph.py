"""A model captured as an ordered list of blocks, and the cuts between them.

A *block* is a contiguous run of graph nodes that the planner never splits: by default one
"leaf-ish" submodule (a ResNet Bottleneck, a transformer layer, a top-level Conv2d …) together
with the small parameter-free operations that follow it. ``granularity="layer"`` makes every
leaf module its own block.

A *cut* lies between block i and block i + 1; it knows every tensor live across it: values
produced at or before block i (model inputs included) that something after block i — a later
block or the model's output — still reads. A skip connection over the cut is one more tensor.

Only tensors cross a cut: a size read from a shape is computed again where it is used
(:mod:`autosplit.capture.values`). How a model becomes a graph is :mod:`autosplit.capture`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autosplit.blocks import (
    Block,
    Granularity,
    leaf_module_list,
)
from autosplit.capture.signature import InputSignature
from autosplit.capture.values import size_chain, value_kinds
from autosplit.errors import InvalidInputError
from autosplit.records import SharedParam, fingerprint_of

__all__ = [
    "Block",
    "Cut",
    "BlockGraph",
    "Segment",
    "SharedParam",
    "Capture",
    "Granularity",
    "leaf_module_list",
    "plain_structure",
]

_INPUT_BLOCK = -1


@dataclass(frozen=True, slots=True)
class Cut:
    """The cut after block ``index``: the fx values that cross it."""

    index: int
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class Capture:
    """How a graph was captured, to capture it again (in a timing process, for another mode).

    Attributes:
        model: the model (``None`` in a copy that was pickled: it cannot be captured again).
        front: ``"fx"`` (torch.fx symbolic tracing) or ``"export"`` (torch.export).
        granularity, leaf_modules: as given to :func:`trace`.
        args, kwargs: the example call (``None``: none was given).
        training: the model's mode when it was captured.
        rebuild: ``rebuild(capture) -> BlockGraph`` captures it again (for a timing process,
            which cannot load a GraphModule's names, and for the other training mode).
    """

    model: nn.Module | None
    front: str
    granularity: Granularity
    leaf_modules: tuple[Any, ...]
    args: tuple[Any, ...] | None
    kwargs: dict[str, Any] | None
    training: bool
    rebuild: Callable[[Capture], BlockGraph]


def _parts(module: fx.GraphModule) -> nn.Module:
    """A plain module holding ``module``'s submodules, parameters, buffers and tensors."""
    parts = nn.Module()
    parts._modules = dict(module._modules)
    parts._parameters = dict(module._parameters)
    parts._buffers = dict(module._buffers)
    for name, value in vars(module).items():
        if isinstance(value, torch.Tensor):
            setattr(parts, name, value)
    return parts


@dataclass(frozen=True, slots=True)
class _Ref:
    """A node named in a pickled node's arguments."""

    name: str


@dataclass(frozen=True, slots=True)
class _OpName:
    """An operator named in a pickled node (``aten::add.Tensor``; operators do not pickle)."""

    qualified: str

    def resolve(self) -> Any:
        namespace, _, rest = self.qualified.partition("::")
        name, _, overload = rest.partition(".")
        return getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")


def _detached(graph: fx.Graph) -> tuple[tuple[Any, ...], ...]:
    """``graph`` as flat records ``(op, name, target, args, kwargs, meta)``, nodes named by
    :class:`_Ref`, meta the ``autosplit_*`` keys: it pickles without the module that owns it
    and without recursing along the node list."""
    def ref(node: fx.Node) -> Any:
        return _Ref(node.name)

    def target(node: fx.Node) -> Any:
        if isinstance(node.target, torch._ops.OpOverload):
            return _OpName(node.target.name())
        return node.target

    return tuple((n.op, n.name, target(n), fx.node.map_arg(n.args, ref),
                  fx.node.map_arg(n.kwargs, ref),
                  {k: v for k, v in n.meta.items() if k.startswith("autosplit_")})
                 for n in graph.nodes)


def _attached(records: tuple[tuple[Any, ...], ...]) -> fx.Graph:
    """The graph of :func:`_detached`'s records: the same node names, in the same order."""
    graph, nodes = fx.Graph(), {}

    def node_of(value: Any) -> Any:
        return pytree.tree_map_only(_Ref, lambda r: nodes[r.name], value)

    for op, name, target, args, kwargs, meta in records:
        if isinstance(target, _OpName):
            target = target.resolve()
        node = graph.create_node(op, target, node_of(args), node_of(kwargs), name=name)
        assert node.name == name, (node.name, name)
        node.meta.update(meta)
        nodes[name] = node
    return graph


def _unpickled(parts: nn.Module, graph: tuple[tuple[Any, ...], ...], blocks: Sequence[Block],
               model_name: str, traced: bool, signature: InputSignature | None,
               output_spec: pytree.TreeSpec | None, capture: Capture | None) -> BlockGraph:
    return BlockGraph(fx.GraphModule(parts, _attached(graph)), blocks, model_name, traced,
                      signature=signature, output_spec=output_spec, capture=capture)


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
        # names change and unused nodes go. The graph itself travels instead, with the
        # module's own parts; the model stays here (a timing process need not import it).
        capture = None if self.capture is None else dataclasses.replace(
            self.capture, model=None, args=None, kwargs=None)
        return (_unpickled, (_parts(self.module), _detached(self.module.graph), self.blocks,
                             self.model_name, self.traced, self.signature, self.output_spec,
                             capture))

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

    def recomputed(self, first: int, end: int) -> list[fx.Node]:
        """The sizes that a segment of blocks ``first … end-1`` computes again, from tensors
        it reads, because an earlier block made them (see :meth:`extract`), in graph order."""
        names = {n for b in self.blocks[first:end] for n in b.nodes}
        return [n for n in self._segment(first, end)[0] if n.name not in names]

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
        leaves, spec = pytree.tree_flatten(plain_structure(structure))
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


def plain_structure(structure: Any) -> Any:
    """fx's immutable containers in an output structure as the dict and list they were."""
    if isinstance(structure, dict):
        return {k: plain_structure(v) for k, v in structure.items()}
    if isinstance(structure, list):
        return [plain_structure(v) for v in structure]
    if isinstance(structure, tuple) and not hasattr(structure, "_fields"):
        return tuple(plain_structure(v) for v in structure)
    return structure


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _attr_of(module: nn.Module, target: str) -> Any:
    """The attribute ``target`` (``"a.b.weight"``) of ``module``, or ``None``."""
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj

