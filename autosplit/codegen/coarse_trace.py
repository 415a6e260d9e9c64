"""The model traced a second time by torch.fx, with every block's module as a leaf.

A stage is then one line per block plus the small root-level operations between blocks
(``torch.flatten``, ``+``). Every node of that coarse graph is matched back to its block
through the module stack torch.fx records on the fine graph, so the stage boundaries are
exactly the plan's. Children of a plain ``nn.Sequential`` that all run in order on one stage
are folded into the container (``model.layer1``); a container split between stages is not:
each stage holds only the children it runs (``model.layer3[0]``).
"""

from __future__ import annotations

import itertools

from torch import fx, nn

from autosplit.errors import CodegenError
from autosplit.graph import BlockGraph

__all__ = ["INPUTS", "coarse_trace", "fold_sequentials", "is_chain", "values_of"]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
INPUTS = -1  # stage index of the model's inputs


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


def values_of(
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
