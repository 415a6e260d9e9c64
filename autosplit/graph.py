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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch import fx, nn

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
from autosplit.errors import InvalidInputError
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
    ) -> None:
        self.module = module
        self.blocks = tuple(blocks)
        self.model_name = model_name
        self.traced = traced
        self.node_block: dict[str, int] = {
            node: block.index for block in self.blocks for node in block.nodes
        }
        self.inputs = tuple(n.name for n in module.graph.nodes if n.op == "placeholder")
        self.cuts = self._crossings()
        self.fingerprint = fingerprint_of([(b.name, b.params) for b in self.blocks])

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
            if node.name in names and node.op == "call_module":
                for buf in self.module.get_submodule(str(node.target)).buffers():
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

    def _crossings(self) -> tuple[Cut, ...]:
        g = self.to_networkx()
        order = [n.name for n in self.module.graph.nodes]
        last_use: dict[str, int] = {}
        for name in order:
            produced = g.nodes[name]["block"]
            users = [g.nodes[v]["block"] for v in g.successors(name)]
            if users and max(users) > produced:
                last_use[name] = max(users)
        cuts = []
        for i in range(len(self.blocks) - 1):
            live = tuple(
                name for name in order
                if name in last_use and g.nodes[name]["block"] <= i < last_use[name]
            )
            cuts.append(Cut(i, live))
        return tuple(cuts)

    def extract(self, first: int, end: int) -> Segment:
        """A GraphModule running blocks ``first … end-1``; it shares the model's modules."""
        if not 0 <= first < end <= len(self.blocks):
            raise InvalidInputError(
                f"block range {first}…{end - 1} is outside the model's {len(self.blocks)} blocks"
            )
        names = {n for b in self.blocks[first:end] for n in b.nodes}
        nodes = [n for n in self.module.graph.nodes if n.name in names]
        inputs: list[fx.Node] = []
        for node in nodes:
            for arg in node.all_input_nodes:
                if arg.name not in names and arg not in inputs:
                    inputs.append(arg)
        outputs = [n for n in nodes if any(u.name not in names for u in n.users)]
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


def trace(
    model: nn.Module,
    *,
    granularity: Granularity = "block",
    leaf_modules: Iterable[type[nn.Module] | str] = (),
    example_inputs: Sequence[Any] | None = None,
) -> BlockGraph:
    """Capture ``model`` as a :class:`BlockGraph`.

    Args:
        model: the model; it is not modified and its modules are shared, not copied.
        granularity: ``"block"`` (submodules below containers, small ops merged into the
            block before them) or ``"layer"`` (every leaf module and op run its own block).
        leaf_modules: module classes or qualified names that tracing must not enter (the
            fix for submodules with data-dependent control flow).
        example_inputs: only used to check the fallback for untraceable models.

    Raises:
        ArgumentTypeError: ``model`` is not an ``nn.Module``, ``granularity`` not a string, or
            ``leaf_modules`` not a list of module classes and names.
        InvalidInputError: an unknown granularity, or a model without operations.
        TraceError: the model can neither be traced nor treated as a sequence of children.
    """
    checks.instance_of("model", model, nn.Module, "a torch.nn.Module")
    checks.one_of("granularity", granularity, ("block", "layer"))
    name = type(model).__name__
    leaves = leaf_module_list(leaf_modules)
    try:
        gm = symbolic_trace(model, leaves)
    except Exception as exc:  # noqa: BLE001 - fx raises many kinds of errors from user code
        gm = sequential_fallback(model, example_inputs, exc)
        blocks = [
            Block(i, n.target, (n.name,), owned_params(model, [n], set()))  # type: ignore[arg-type]
            for i, n in enumerate(n for n in gm.graph.nodes if n.op == "call_module")
        ]
        return BlockGraph(gm, blocks, name, traced=False)
    blocks = group_blocks(model, gm, granularity)
    if not blocks:
        raise InvalidInputError(f"model {name} has no operations to split (empty model)")
    return BlockGraph(gm, blocks, name)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _attr_of(module: nn.Module, target: str) -> Any:
    """The attribute ``target`` (``"a.b.weight"``) of ``module``, or ``None``."""
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj
