"""The stage boundary: what each stage of a plan runs, receives, sends and passes through.

Every runtime — :func:`autosplit.partition` in one process, the emitted code and
:mod:`autosplit.distributed` — takes the stages of a plan from :func:`stage_layout` and never
re-derives them. For stage s (blocks ``first … end-1``):

* ``receives``: the values crossing the cut before it, in ``Cut.tensors`` order (stage 0:
  the model's inputs, in call order); ``sources`` says which stage made each (-1: a model input).
* ``reads`` / ``makes``: what its blocks read from outside / make for later (the inputs and
  outputs of ``graph.extract(first, end)``, in that order).
* ``sends``: the values crossing the cut after it (the last stage: the model's output leaves,
  see :class:`OutputLayout`); ``passes``: those it receives and sends unchanged (a skip
  connection or a model input jumping over the stage).

The rules decided here, once:

* **Only tensors cross stages.** A size (an ``int`` from ``x.size(0)``, a shape) is computed
  again in the stage that uses it (:mod:`autosplit.capture.values`), and no cut lies where
  another kind of value is live. A value of another type that still reaches a cut, or that
  is a computed leaf of the model's output, raises :class:`CutValueError` naming the value,
  the block that made it and the cut. Constants in the output structure
  (``return x, None``) are kept as they are.
* **Micro-batches** (:func:`split`): every tensor leaf is split along dimension 0 with
  ``tensor.split(b)``; non-tensor leaves are repeated; 0-d tensors and leaves of different
  row counts are refused. With ``count`` the batch must hold exactly ``count · b`` rows
  (torch.distributed.pipelining needs equal micro-batches).
* **Outputs** (:func:`concat`): the micro-batches' outputs are concatenated leaf by leaf
  along dimension 0. A 0-d floating output (the model's own loss, a mean over rows) is the
  mean of the micro-batches' losses weighted by their rows: the full batch's loss when every
  row weighs the same (a loss over tokens that ignores padding weighs rows by their tokens,
  and then differs by that weighting).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autosplit.capture.trace import trace
from autosplit.errors import CutValueError, InvalidInputError
from autosplit.graph import BlockGraph, Granularity
from autosplit.records import Plan

__all__ = [
    "block_ranges",
    "CutValueError",
    "StageSpec",
    "OutputLayout",
    "StageLayout",
    "stage_layout",
    "graph_for_plan",
    "run_stage",
    "split",
    "move",
    "concat",
]

MODEL_INPUT = -1
"""``StageSpec.sources`` entry of a value that is one of the model's inputs."""


@dataclass(frozen=True, slots=True)
class StageSpec:
    """Stage ``index``: blocks ``first … end-1`` and the fx values crossing its boundary.

    Attributes:
        index: the stage number s.
        first, end: first block index and one past the last.
        receives: values crossing the cut before it, in order (stage 0: the model's inputs).
        sources: for each received value, the stage that made it (``MODEL_INPUT``: -1).
        reads: values its blocks read that are made outside them (a subset of ``receives``),
            in the order of the extracted segment's placeholders.
        makes: values its blocks make that a later stage or the model's output reads, in
            graph order (the extracted segment's outputs).
        sends: values crossing the cut after it, in order; for the last stage the model's
            output leaves (a value returned twice appears twice).
        passes: values received and sent unchanged, in ``sends`` order.
    """

    index: int
    first: int
    end: int
    receives: tuple[str, ...]
    sources: tuple[int, ...]
    reads: tuple[str, ...]
    makes: tuple[str, ...]
    sends: tuple[str, ...]
    passes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class OutputLayout:
    """How the last stage's values form the model's output.

    Attributes:
        spec: the output's pytree structure (tuple, dict, single tensor …).
        leaves: per leaf, the fx value it is (``None``: a constant, kept from ``constants``).
        constants: per leaf, the constant where ``leaves`` holds ``None``.
    """

    spec: pytree.TreeSpec
    leaves: tuple[str | None, ...]
    constants: tuple[Any, ...]

    @property
    def names(self) -> tuple[str, ...]:
        """The fx values of the output, leaf order (the last stage's ``sends``)."""
        return tuple(name for name in self.leaves if name is not None)

    def build(self, values: Sequence[Any]) -> Any:
        """The model's output from the values of :attr:`names`, in order."""
        it = iter(values)
        leaves = [next(it) if name is not None else const
                  for name, const in zip(self.leaves, self.constants)]
        return pytree.tree_unflatten(leaves, self.spec)


@dataclass(frozen=True, slots=True)
class StageLayout:
    """Every stage of a plan on one traced graph, and the output structure.

    Attributes:
        stages: one :class:`StageSpec` per stage, in pipeline order.
        output: how the last stage's ``sends`` form the model's output.
        inputs: the model's inputs (fx placeholder names), in call order.
        block_names: names of the graph's blocks, in order (for messages).
        producers: fx value → index of the block making it (-1: a model input).
        origins: fx value → what made it, for messages (``"size()"``, ``"input 'x'"`` …).
        bools: the values known to be boolean tensors (an attention mask): they travel between
            ranks as bytes, which every backend sends.
    """

    stages: tuple[StageSpec, ...]
    output: OutputLayout
    inputs: tuple[str, ...]
    block_names: tuple[str, ...]
    producers: Mapping[str, int]
    origins: Mapping[str, str]
    bools: frozenset[str] = frozenset()

    @property
    def balance(self) -> tuple[int, ...]:
        """Blocks per stage."""
        return tuple(s.end - s.first for s in self.stages)

    def stage_of_block(self, block: int) -> int:
        """The stage holding block ``block``."""
        return next(s.index for s in self.stages if s.first <= block < s.end)

    def check_sent(self, stage: int, values: Sequence[Any]) -> None:
        """Refuse a value that is not a tensor among what stage ``stage`` sends.

        Raises:
            CutValueError: naming the value, the block that made it and the cut.
        """
        spec = self.stages[stage]
        for name, value in zip(spec.sends, values):
            if isinstance(value, torch.Tensor):
                continue
            block = self.producers.get(name, MODEL_INPUT)
            made = "the model's input" if block < 0 else f"block {self.block_names[block]!r}"
            what = f"{_article(type(value).__name__)} from {self.origins.get(name, name)}"
            if stage == len(self.stages) - 1:
                where = "is part of the model's output, gathered from the last stage"
            else:
                where = (f"crosses the cut before stage {stage + 1} (after block "
                         f"{self.block_names[spec.end - 1]!r})")
            raise CutValueError(
                f"value {name!r} ({what}) produced by {made} {where}: only tensors can cross "
                "stages; choose cut points it does not cross, or compute it from a tensor in "
                "the stage that uses it"
            )


def block_ranges(balance: Sequence[int]) -> list[tuple[int, int]]:
    """``[(first, end), …]``: the block range ``first ≤ i < end`` of each stage of a balance
    (blocks per stage). The one place a balance becomes block ranges."""
    ranges, first = [], 0
    for count in balance:
        ranges.append((first, first + count))
        first += count
    return ranges


def stage_layout(graph: BlockGraph, plan: Plan | Sequence[int]) -> StageLayout:
    """The stages of ``plan`` (or of a balance: blocks per stage) on ``graph``.

    Raises:
        InvalidInputError: the balance is not positive block counts summing to the graph's
            number of blocks.
    """
    balance = tuple(plan.balance) if isinstance(plan, Plan) else tuple(plan)
    n = len(graph.blocks)
    if not balance or any(isinstance(c, bool) or not isinstance(c, int) or c < 1
                          for c in balance) or sum(balance) != n:
        raise InvalidInputError(
            f"balance {list(balance)} does not split the model's {n} blocks: give positive "
            f"block counts per stage that sum to {n}"
        )
    output = _output_layout(graph)
    producers = {name: -1 for name in graph.inputs}
    producers.update(graph.node_block)
    stage_of_block = [s for s, count in enumerate(balance) for _ in range(count)]
    specs = []
    for s, (first, end) in enumerate(block_ranges(balance)):
        receives = graph.inputs if s == 0 else graph.cuts[first - 1].tensors
        sends = output.names if end == n else graph.cuts[end - 1].tensors
        reads, makes = _boundary(graph, first, end)
        sources = tuple(MODEL_INPUT if producers[v] < 0 else stage_of_block[producers[v]]
                        for v in receives)
        passes = tuple(v for v in sends if v in receives)
        assert set(reads) <= set(receives), f"stage {s} reads values it does not receive"
        assert set(sends) <= set(receives) | set(makes), f"stage {s} sends what it lacks"
        specs.append(StageSpec(s, first, end, tuple(receives), sources, reads, makes,
                               tuple(sends), passes))
    return StageLayout(
        stages=tuple(specs),
        output=output,
        inputs=graph.inputs,
        block_names=graph.block_names,
        producers=types.MappingProxyType(producers),
        origins=types.MappingProxyType(_origins(graph)),
        bools=graph.bools,
    )


def graph_for_plan(
    model: nn.Module,
    plan: Plan,
    *,
    granularity: Granularity | None = None,
    leaf_modules: Sequence[type[nn.Module] | str] = (),
    example_inputs: Any = None,
    example_kwargs: dict[str, Any] | None = None,
) -> BlockGraph:
    """Trace ``model`` the way ``plan`` was made and check that the plan is this model's.

    ``granularity=None`` tries ``"block"`` and then ``"layer"`` and keeps the one whose
    fingerprint is the plan's. A model only torch.export captures needs the example call
    (``example_inputs``, ``example_kwargs``) it is run with.

    Raises:
        PlanMismatchError: the plan was made for another model, or its stages do not hold
            exactly the model's blocks in order.
    """
    choices: Sequence[Granularity] = (granularity,) if granularity else ("block", "layer")
    graph = None
    for choice in choices:
        graph = trace(model, granularity=choice, leaf_modules=leaf_modules,
                      example_inputs=example_inputs, example_kwargs=example_kwargs)
        if graph.fingerprint == plan.fingerprint:
            break
    assert graph is not None
    plan.check_model(graph.fingerprint, graph.model_name)
    plan.check_blocks(graph.block_names, graph.model_name)
    return graph


def run_stage(
    layout: StageLayout,
    stage: int,
    body: Callable[..., Sequence[Any]],
    received: Sequence[Any],
) -> tuple[Any, ...]:
    """Run stage ``stage`` on the values it receives; return the values it sends.

    ``body(*reads) -> makes`` runs the stage's blocks (``graph.extract(first, end).module``
    or a functional call of it). Passed-through values are returned unchanged.

    Raises:
        InvalidInputError: ``received`` does not hold one value per ``receives``.
        CutValueError: a value it sends is not a tensor.
    """
    spec = layout.stages[stage]
    if len(received) != len(spec.receives):
        raise InvalidInputError(
            f"stage {stage} takes {len(spec.receives)} values ({', '.join(spec.receives)}), "
            f"got {len(received)}"
        )
    env = dict(zip(spec.receives, received))
    env.update(zip(spec.makes, body(*(env[name] for name in spec.reads))))
    values = tuple(env[name] for name in spec.sends)
    layout.check_sent(stage, values)
    return values


def split(
    values: Any, size: int, *, count: int | None = None, what: str = "inputs"
) -> list[Any]:
    """``values`` (a tensor or any structure of them) as micro-batches of ``size`` rows.

    Tensor leaves are split along dimension 0 (the last micro-batch may be smaller unless
    ``count`` is given); other leaves are repeated in every micro-batch.

    Args:
        values: the batch.
        size: the micro-batch size b (rows).
        count: the number of micro-batches m the batch must hold exactly (m · b rows).
        what: what ``values`` are, for messages (``"inputs"``, ``"targets"``).

    Raises:
        InvalidInputError: no tensor leaf, a 0-d tensor, leaves of different row counts, or
            (with ``count``) a batch that is not m · b rows.
    """
    leaves, spec = pytree.tree_flatten(values)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not tensors:
        raise InvalidInputError(f"the {what} hold no tensor to split into micro-batches")
    rows = {x.shape[0] if x.dim() else None for x in tensors}
    if count is not None and rows != {count * size}:
        shown = ", ".join(str(r) if r is not None else "no" for r in sorted(rows, key=str))
        raise InvalidInputError(
            f"the {what} have {shown} rows; the plan runs {count} micro-batches of {size} = "
            f"{count * size} rows (torch.distributed.pipelining needs equal micro-batches): "
            "give a batch of that size or make a plan for yours"
        )
    if None in rows:
        raise InvalidInputError(
            f"the {what} include a 0-dimensional tensor: every tensor needs the batch in "
            "dimension 0"
        )
    if len(rows) > 1:
        raise InvalidInputError(
            f"the {what} have different numbers of rows ({', '.join(map(str, sorted(rows)))}): "
            "every tensor needs the same batch in dimension 0"
        )
    m = -(-rows.pop() // size)
    chunks = [list(x.split(size)) if isinstance(x, torch.Tensor) else [x] * m for x in leaves]
    return [pytree.tree_unflatten([c[i] for c in chunks], spec) for i in range(m)]


def move(value: Any, device: torch.device) -> Any:
    """``value`` (a tensor or structure) with its tensors on ``device`` (non-blocking copies;
    a tensor already there is returned as is)."""
    def one(t: torch.Tensor) -> torch.Tensor:
        return t if t.device == device else t.to(device, non_blocking=True)

    return pytree.tree_map_only(torch.Tensor, one, value)


def concat(per_microbatch: Sequence[Any], rows: Sequence[int] | None = None) -> Any:
    """The micro-batches' outputs joined leaf by leaf along dimension 0 (see the module
    docstring: non-tensor leaves are constants, taken from the first micro-batch).

    A 0-dimensional floating leaf (the model's own loss, a mean over its rows) becomes the
    mean of the micro-batches' values weighted by their ``rows``: the full batch's loss
    where every row weighs the same.

    Raises:
        InvalidInputError: a 0-dimensional output leaf that is not floating, or one without
            ``rows``.
    """
    flat = [pytree.tree_flatten(out) for out in per_microbatch]
    joined = []
    for position, leaves in enumerate(zip(*(leaves for leaves, _ in flat))):
        first = leaves[0]
        if isinstance(first, torch.Tensor):
            if first.dim() == 0:
                if rows is None or not first.is_floating_point():
                    raise InvalidInputError(
                        f"output leaf {position} is a 0-dimensional tensor; pipelined outputs "
                        "must have a batch dimension 0 or be a floating loss"
                    )
                total = float(sum(rows))
                joined.append(sum(x * (r / total) for x, r in zip(leaves, rows))
                              if len(leaves) > 1 else first)
                continue
            joined.append(torch.cat(leaves) if len(leaves) > 1 else first)
        else:
            joined.append(first)
    return pytree.tree_unflatten(joined, flat[0][1])


# ----------------------------------------------------------------------------------- helpers


def _boundary(graph: BlockGraph, first: int, end: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(reads, makes) of blocks ``first … end-1``, as :meth:`BlockGraph.extract` orders them."""
    return graph.boundary(first, end)


def _output_layout(graph: BlockGraph) -> OutputLayout:
    leaves, spec = graph.output_leaves()
    names = tuple(x.name if isinstance(x, fx.Node) else None for x in leaves)
    constants = tuple(None if isinstance(x, fx.Node) else x for x in leaves)
    return OutputLayout(spec, names, constants)


def _origins(graph: BlockGraph) -> dict[str, str]:
    """fx value → a short description of the operation that made it."""
    found = {}
    for node in graph.module.graph.nodes:
        if node.op == "placeholder":
            found[node.name] = f"input {node.target!r}"
        elif node.op == "call_method":
            found[node.name] = f"{node.args[0]}.{node.target}()" if node.args else str(node.target)
        elif node.op == "call_function":
            found[node.name] = f"{getattr(node.target, '__name__', node.target)}()"
        elif node.op in ("call_module", "get_attr"):
            found[node.name] = str(node.target)
    return found


def _article(noun: str) -> str:
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"
