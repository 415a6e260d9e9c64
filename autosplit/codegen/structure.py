"""The model's own code as stages: a coarse trace with every block module as a leaf.

The model is traced a second time with torch.fx, treating every block's module (``layer3.0``,
``fc`` …) as a leaf, so a stage is one line per block plus the small root-level operations
between blocks (``torch.flatten``, ``+``). Every node of that coarse graph is matched back to
its block through the module stack torch.fx records on the fine graph, so the stage boundaries
are exactly the plan's. Children of a plain ``nn.Sequential`` that all run in order on one
stage are folded into the container (``model.layer1``); a container split between stages is
not: each stage holds only the children it runs (``model.layer3[0]``).
"""

from __future__ import annotations

import builtins
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from autosplit.codegen.names import GLOBALS, fresh_name, resolve_path, short_names
from autosplit.codegen.value_kinds import stand_in
from autosplit.errors import CodegenError
from autosplit.graph import BlockGraph, Granularity
from autosplit.records import Plan
from autosplit.stages import StageLayout, stage_layout

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
INPUTS = -1  # stage index of the model's inputs

# Locals of the pipelined forward: the model's input names must not shadow them either.
_FORWARD_LOCALS = {"micro", "mb", "b", "m", "p", "s", "tick", "v", "last", "dev", "outputs"}


@dataclass(slots=True)
class StageSplit:
    """The coarse graph of the model, each node assigned to its stage.

    Attributes:
        model: the model (the generated code refers to its submodules by path).
        graph: the coarse fx graph: one node per block module call or root-level operation.
        stage: stage of every node; the model's inputs have stage -1.
        names: the variable name of every value in the generated code.
        blocks: the plan's block names per stage.
        short: a short name for every module and weight the code uses, by path.
        layout: the stage boundary (:mod:`autosplit.stages`) on the model's block graph: what
            each stage reads, makes and sends; the code's values are matched to its values.
        values: for each node whose value leaves its unit, that value's name in ``layout``.
    """

    model: nn.Module
    graph: fx.Graph
    stage: dict[fx.Node, int]
    names: dict[fx.Node, str]
    blocks: list[tuple[str, ...]]
    short: dict[str, str]
    layout: StageLayout
    values: dict[fx.Node, str]

    @classmethod
    def build(
        cls,
        model: nn.Module,
        graph: BlockGraph,
        plan: Plan,
        granularity: Granularity,
        leaf_modules: tuple[type[nn.Module] | str, ...],
    ) -> StageSplit:
        """The stage split of ``model`` for ``plan``.

        Raises:
            CutValueError: a value that is surely not a tensor crosses a cut (the stage
                boundary's rule, as in every runtime).
            CodegenError: the coarse graph cannot be matched to the plan's blocks.
        """
        layout = stage_layout(graph, plan)
        _check_crossings(graph, layout)
        if graph.traced and granularity == "block":
            coarse, block_of, fine_of = coarse_trace(model, graph, leaf_modules)
        else:  # one node per block already (fallback), or leaf-level blocks
            coarse = graph.module.graph
            block_of = {
                n: graph.node_block.get(n.name, INPUTS) for n in coarse.nodes if n.op != "output"
            }
            fine_of = {n: [n] for n in block_of if n.op != "placeholder"}
        stage = {
            n: (INPUTS if b == INPUTS else layout.stage_of_block(b)) for n, b in block_of.items()
        }
        blocks = [st.blocks for st in plan.stages]
        for s, names in enumerate(blocks):
            covered = {
                graph.block_names[b] for n, b in block_of.items() if b >= 0 and stage[n] == s
            }
            if covered != set(names):
                raise CodegenError(
                    f"stage {s}'s code covers blocks {sorted(covered)}, but the plan gives it "
                    f"{list(names)}: the coarse trace of {graph.model_name} cannot be matched "
                    "to its blocks; run the plan with autosplit.partition(model, plan=plan) instead"
                )
        for node, s in stage.items():
            for arg in node.all_input_nodes:
                if stage[arg] > s:
                    raise CodegenError(
                        f"{node.name} (stage {s}) reads {arg.name} from the later stage "
                        f"{stage[arg]}: the coarse graph cannot be matched to the plan's blocks"
                    )
        values = _values_of(graph, coarse, fine_of)
        fold_sequentials(model, coarse, stage, values)
        targets = [str(n.target) for n in coarse.nodes if n.op in ("call_module", "get_attr")]
        split = cls(model, coarse, stage, {}, blocks, short_names(model, targets), layout, values)
        split._check_boundary()
        split.names = split._choose_names()
        return split

    def _choose_names(self) -> dict[fx.Node, str]:
        """Value names: a module call is named by its module (``layer3_1``, ``denselayer5``)."""
        taken = set(GLOBALS) | {f"Stage{s}" for s in range(len(self.blocks))}
        taken |= set(dir(builtins)) - {"input", "filter", "format", "type", "id", "hash"}
        names: dict[fx.Node, str] = {}
        for node in self.graph.nodes:
            if node.op == "output":
                continue
            avoid = taken | _FORWARD_LOCALS if node.op == "placeholder" else taken
            name = self.short[str(node.target)] if node.op == "call_module" else node.name
            names[node] = fresh_name(name, avoid)
            taken.add(names[node])
        return names

    def nodes_of(self, s: int) -> list[fx.Node]:
        """The nodes stage s runs, in order."""
        return [n for n in self.graph.nodes if n.op != "output" and self.stage[n] == s]

    def inputs_of(self, s: int) -> list[fx.Node]:
        """Values stage s reads from the model's inputs or earlier stages (the layout's
        ``reads``, in its order)."""
        return self._nodes_named(s, self.layout.stages[s].reads)

    def outputs_of(self, s: int) -> list[fx.Node]:
        """Values of stage s that a later stage or the model's output reads (``makes``)."""
        return self._nodes_named(s, self.layout.stages[s].makes)

    def passes_on(self, node: fx.Node, s: int) -> bool:
        """Whether stage s sends ``node`` on (a later stage or the output reads it too)."""
        return self.values.get(node) in self.layout.stages[s].sends

    def _nodes_named(self, s: int, names: Sequence[str]) -> list[fx.Node]:
        by_value = {value: node for node, value in self.values.items()}
        missing = [name for name in names if name not in by_value]
        if missing:
            raise CodegenError(
                f"stage {s} exchanges {missing}, which the coarse graph has no value for (a "
                "block module returning several values?); run the plan with "
                "autosplit.partition(model, plan=plan) instead"
            )
        return [by_value[name] for name in names]

    def _check_boundary(self) -> None:
        """The code of each stage reads and makes exactly what the stage boundary says."""
        for s in range(len(self.blocks)):
            nodes = self.nodes_of(s)
            read = {a for n in nodes for a in n.all_input_nodes if self.stage[a] != s}
            made = {
                n for n in nodes if any(u.op == "output" or self.stage[u] > s for u in n.users)
            }
            if read != set(self.inputs_of(s)) or made != set(self.outputs_of(s)):
                raise CodegenError(
                    f"stage {s}'s code reads or makes other values than the stage boundary "
                    "says: the coarse graph cannot be matched to the plan's blocks; run the "
                    "plan with autosplit.partition(model, plan=plan) instead"
                )

    def output(self) -> Any:
        """The model's output structure: nodes inside tuples, lists and dicts."""
        return next(n for n in self.graph.nodes if n.op == "output").args[0]

    def weights(self) -> dict[int, tuple[torch.Tensor, str, set[int]]]:
        """Every parameter and buffer the stages hold: id → (tensor, a holder, stages)."""
        found: dict[int, tuple[torch.Tensor, str, set[int]]] = {}
        for node in self.graph.nodes:
            if node.op in ("call_module", "get_attr") and self.stage[node] >= 0:
                obj = resolve_path(self.model, str(node.target))
                if isinstance(obj, nn.Module):
                    tensors = [*obj.parameters(), *obj.buffers()]
                else:
                    tensors = [obj] if isinstance(obj, torch.Tensor) else []
                for t in tensors:
                    entry = found.setdefault(id(t), (t, str(node.target), set()))
                    entry[2].add(self.stage[node])
        return found

    def tied_stages(self) -> set[int]:
        """Stages that use a parameter an earlier stage uses too (tied weights)."""
        return {
            s for t, _, stages in self.weights().values() if isinstance(t, nn.Parameter)
            for s in sorted(stages)[1:]
        }

    def check_devices(self, devices: Sequence[str]) -> None:
        """Refuse buffers shared by stages on different devices (a parameter shared so is
        read through ``.to()``; a buffer updated in place cannot be)."""
        for t, holder, stages in self.weights().values():
            places = {devices[s] for s in stages}
            if len(places) > 1 and not isinstance(t, nn.Parameter):
                raise CodegenError(
                    f"{holder} holds buffers that stages {sorted(stages)} share on different "
                    f"devices ({', '.join(sorted(places))}); shared buffers must stay on one "
                    "device: give those stages the same device, or plan them onto one stage"
                )

    def parameter_count(self) -> int:
        """Number of parameter elements the stages hold (each shared parameter once)."""
        return sum(
            t.numel() for t, _, _ in self.weights().values() if isinstance(t, nn.Parameter)
        )


def coarse_trace(
    model: nn.Module, graph: BlockGraph, leaf_modules: tuple[type[nn.Module] | str, ...]
) -> tuple[fx.Graph, dict[fx.Node, int], dict[fx.Node, list[fx.Node]]]:
    """Trace ``model`` with every block module as a leaf.

    Returns:
        The coarse graph, the block of each node, and the nodes of the model's block graph
        each node stands for (none for a module whose forward makes no operation).
    """
    leaf_types = tuple(x for x in leaf_modules if isinstance(x, type))
    leaf_names = {x for x in leaf_modules if isinstance(x, str)}
    leaves: set[str] = set()

    class _BlockTracer(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            leaf = (
                qualname in leaf_names
                or bool(leaf_types and isinstance(m, leaf_types))
                or _is_block_module(model, m, qualname)
                or super().is_leaf_module(m, qualname)
            )
            if leaf:
                leaves.add(qualname)
            return leaf

    try:
        coarse = _BlockTracer().trace(model)
    except Exception as exc:  # fx raises many kinds of errors from user code
        raise CodegenError(
            f"tracing {graph.model_name} with its blocks as leaves failed "
            f"({type(exc).__name__}: {exc}); run the plan with autosplit.partition(model, "
            "plan=plan) instead"
        ) from exc

    # The fine graph as units: consecutive nodes inside one call of a block module, or one
    # root-level operation. The coarse graph has one node per unit, in the same order.
    units: list[tuple[str | None, list[fx.Node]]] = []
    for node in graph.module.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        stack = node.meta.get("nn_module_stack") or {}
        key = next((k for k, (path, _) in stack.items() if path in leaves), None)
        if key is not None and units and units[-1][0] == key:
            units[-1][1].append(node)
        else:
            units.append((key, [node]))
    remaining = {key for key, _ in units if key is not None}

    block_of: dict[fx.Node, int] = {}
    fine_of: dict[fx.Node, list[fx.Node]] = {}
    calls: dict[str, int] = {}
    j, previous = 0, 0
    for node in coarse.nodes:
        if node.op == "placeholder":
            block_of[node] = INPUTS
            continue
        if node.op == "output":
            continue
        if node.op == "call_module":
            target = str(node.target)
            n = calls.get(target, 0)
            calls[target] = n + 1
            key = target if n == 0 else f"{target}@{n}"
            if j < len(units) and units[j][0] == key:
                fine = units[j][1]
            elif key not in remaining:  # a module whose forward makes no operation
                block_of[node] = previous
                continue
            else:
                raise _unmatched(node, units[j][1] if j < len(units) else None)
        else:
            fine = units[j][1] if j < len(units) else []
            if not (
                fine
                and units[j][0] is None
                and len(fine) == 1
                and (fine[0].op, fine[0].target) == (node.op, node.target)
            ):
                raise _unmatched(node, fine or None)
        j += 1
        found = {graph.node_block[f.name] for f in fine}
        if len(found) != 1:
            names = sorted(graph.block_names[b] for b in found)
            raise CodegenError(
                f"{node.name} spans the blocks {names}; run the plan with "
                "autosplit.partition(model, plan=plan) instead"
            )
        block_of[node] = previous = found.pop()
        fine_of[node] = fine
    if j != len(units):
        raise _unmatched(None, units[j][1])
    return coarse, block_of, fine_of


def _values_of(
    graph: BlockGraph, coarse: fx.Graph, fine_of: dict[fx.Node, list[fx.Node]]
) -> dict[fx.Node, str]:
    """Each coarse node's value by its name in the block graph: the model's inputs in order,
    and the one value that leaves the node's unit of fine nodes (none when several do)."""
    fine_inputs = [n.name for n in graph.module.graph.nodes if n.op == "placeholder"]
    coarse_inputs = [n for n in coarse.nodes if n.op == "placeholder"]
    values = dict(zip(coarse_inputs, fine_inputs))
    for node, fine in fine_of.items():
        unit = set(fine)
        leaving = [f.name for f in fine if any(u not in unit for u in f.users)]
        if len(leaving) == 1:
            values[node] = leaving[0]
    return values


def _check_crossings(graph: BlockGraph, layout: StageLayout) -> None:
    """Refuse, as every runtime does, a value that is surely not a tensor crossing a cut.

    Raises:
        CutValueError: from :meth:`StageLayout.check_sent`, naming the value, the block that
            made it and the cut.
    """
    nodes = {n.name: n for n in graph.module.graph.nodes}
    for spec in layout.stages:
        layout.check_sent(spec.index, [stand_in(nodes[name]) for name in spec.sends])


def _unmatched(node: fx.Node | None, fine: list[fx.Node] | None) -> CodegenError:
    here = f"{node.op} {node.target}" if node is not None else "the end of the coarse graph"
    there = f"{fine[0].op} {fine[0].target}" if fine else "the end of the model's graph"
    return CodegenError(
        f"the coarse trace does not follow the model's graph ({here} where the blocks have "
        f"{there}); run the plan with autosplit.partition(model, plan=plan) instead"
    )


def _is_block_module(model: nn.Module, m: nn.Module, qualname: str) -> bool:
    """A block module: not a container itself, and only containers above it."""
    if not qualname or isinstance(m, _CONTAINERS):
        return False
    parts = qualname.split(".")
    return all(
        isinstance(model.get_submodule(".".join(parts[:i])), _CONTAINERS)
        for i in range(1, len(parts))
    )


def fold_sequentials(
    model: nn.Module, graph: fx.Graph, stage: dict[fx.Node, int], values: dict[fx.Node, str]
) -> None:
    """Replace the calls of all of a plain nn.Sequential's children, in order, by one call.

    Only when every child is called once, one after the other on the previous child's output
    alone, on one stage, and the intermediate values are used by nothing else. Inner
    containers fold first, so ``features.0.0 … features.3.1`` can become ``features``.
    """
    while True:
        calls: dict[str, list[fx.Node]] = {}
        for node in graph.nodes:
            if node.op == "call_module":
                calls.setdefault(str(node.target), []).append(node)
        parents = {t.rpartition(".")[0] for t in calls if "." in t}
        for parent in sorted(parents, key=lambda t: (-t.count("."), t)):
            seq = model.get_submodule(parent)
            if type(seq).forward is not nn.Sequential.forward or not isinstance(seq, nn.Sequential):
                continue
            runs = [calls.get(f"{parent}.{k}", []) for k in seq._modules]
            if not runs or any(len(r) != 1 for r in runs):
                continue
            chain = [r[0] for r in runs]
            if not is_chain(chain, stage):
                continue
            with graph.inserting_before(chain[0]):
                folded = graph.call_module(parent, chain[0].args)
            stage[folded] = stage[chain[0]]
            if chain[-1] in values:
                values[folded] = values[chain[-1]]
            chain[-1].replace_all_uses_with(folded)
            for node in reversed(chain):
                graph.erase_node(node)
                del stage[node]
                values.pop(node, None)
            break
        else:
            return


def is_chain(nodes: list[fx.Node], stage: dict[fx.Node, int]) -> bool:
    """Each node calls a module on the previous node's output alone, nothing in between."""
    first = nodes[0]
    if len(first.args) != 1 or first.kwargs:
        return False
    for prev, node in itertools.pairwise(nodes):
        if prev.next is not node or node.args != (prev,) or node.kwargs:
            return False
        if set(prev.users) != {node} or stage[prev] != stage[node]:
            return False
    return True
