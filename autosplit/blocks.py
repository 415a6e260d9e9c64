"""Group a model's fx nodes into blocks, or fall back to its top-level children.

:func:`autosplit.capture.trace.trace` uses these: :func:`symbolic_trace` runs torch.fx with the user's
leaf modules, :func:`group_blocks` groups the nodes into :class:`Block` objects (one "leaf-ish"
submodule with the parameter-free operations after it, or one leaf module per block with
``granularity="layer"``), and :func:`sequential_fallback` splits an untraceable model at its
top-level children when that is provably the same computation.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from autosplit import checks
from autosplit.capture.layers import Granularity, block_key, entered_paths
from autosplit.errors import ArgumentTypeError, TraceError

__all__ = [
    "Block",
    "Granularity",
    "group_blocks",
    "leaf_module_list",
    "module_path",
    "owned_params",
    "sequential_fallback",
    "symbolic_trace",
]



@dataclass(frozen=True, slots=True)
class Block:
    """A group of consecutive fx nodes that always stay on one stage.

    Attributes:
        index: position in the block order.
        name: unique display name, the module path of its first node (``"layer3.0"``).
        nodes: names of its fx nodes, in graph order.
        params: ``(qualified name, shape)`` of every parameter it owns (first use owns).
    """

    index: int
    name: str
    nodes: tuple[str, ...]
    params: tuple[tuple[str, tuple[int, ...]], ...]


def leaf_module_list(leaf_modules: Iterable[type[nn.Module] | str]) -> tuple[Any, ...]:
    """``leaf_modules`` as a tuple of ``nn.Module`` subclasses and qualified names.

    Raises:
        ArgumentTypeError: a bare string (wrap it in a list) or an entry of another type.
    """

    def entry(label: str, value: Any) -> Any:
        if isinstance(value, type) and issubclass(value, nn.Module):
            return value
        if isinstance(value, str) and value:
            return value
        raise ArgumentTypeError(
            f"{label} must be an nn.Module subclass or a qualified module name, got "
            f"{checks.show(value)}"
        )

    return checks.sequence_of("leaf_modules", leaf_modules, entry, allow_empty=True)


def symbolic_trace(model: nn.Module, leaves: tuple[type[nn.Module] | str, ...],
                   defaults: dict[str, Any] | None = None) -> fx.GraphModule:
    """``model`` traced by torch.fx, without entering ``leaves``; the forward's parameters in
    ``defaults`` are traced at those values (constants, not inputs of the graph)."""
    leaf_types = tuple(x for x in leaves if isinstance(x, type))
    leaf_names = {x for x in leaves if isinstance(x, str)}

    class _Tracer(fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            if qualname in leaf_names or (leaf_types and isinstance(m, leaf_types)):
                return True
            return super().is_leaf_module(m, qualname)

    tracer = _Tracer()
    graph = tracer.trace(model, concrete_args=defaults or None)
    constants = defaults or {}
    for node in [n for n in graph.nodes if n.op == "placeholder"]:
        name = str(node.target).rsplit("_", 1)[0]  # fx names a constant's placeholder "x_1"
        if name not in constants or node.target in constants:
            continue
        for user in list(node.users):  # fx checks that a call passes the constant again
            if getattr(user.target, "__name__", "") == "_assert_is_none":
                graph.erase_node(user)
            else:
                user.args, user.kwargs = fx.node.map_arg(
                    (user.args, user.kwargs), lambda n, p=node, v=constants[name]: v if n is p else n)
        graph.erase_node(node)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def module_path(gm: fx.GraphModule, node: fx.Node) -> str:
    """The module ``node`` ran in: its ``meta["autosplit_path"]`` when the capture set one
    (torch.export), else the called module, the owner of the attribute, or the innermost
    module of its ``nn_module_stack``."""
    if "autosplit_path" in node.meta:
        return str(node.meta["autosplit_path"])
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    stack = node.meta.get("nn_module_stack")
    if stack:
        return str(list(stack.values())[-1][0])
    return ""


def owned_params(
    model: nn.Module, nodes: Iterable[fx.Node], seen: set[str]
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    owned = []
    for node in nodes:
        if node.op == "call_module":
            sub = model.get_submodule(str(node.target))
            items = [(f"{node.target}.{k}", p) for k, p in sub.named_parameters()]
        elif node.op == "get_attr":
            try:
                attr = model.get_parameter(str(node.target))
            except AttributeError:
                continue
            items = [(str(node.target), attr)]
        else:
            continue
        for qualname, param in items:
            if qualname not in seen:
                seen.add(qualname)
                owned.append((qualname, tuple(param.shape)))
    return tuple(owned)


def group_blocks(model: nn.Module, gm: fx.GraphModule, granularity: Granularity) -> list[Block]:
    """Group graph nodes into blocks (see the module docstring)."""
    runs: list[tuple[str, list[fx.Node]]] = []
    pending: list[fx.Node] = []  # root-level ops before any keyed node
    entered = entered_paths(model, called_again(gm))
    last_call: Any = None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        key = block_key(entered, module_path(gm, node), granularity)
        call = _call_of(node, key)
        if not key:
            (runs[-1][1] if runs else pending).append(node)
        elif runs and runs[-1][0] == key and (None in (call, last_call) or call == last_call):
            runs[-1][1].append(node)
            last_call = last_call if call is None else call
        else:
            runs.append((key, pending + [node]))
            pending = []
            last_call = call
    if pending:
        runs.append(("ops", pending))

    seen: set[str] = set()
    grouped: list[tuple[str, list[fx.Node], tuple[tuple[str, tuple[int, ...]], ...]]] = []
    carry: list[fx.Node] = []  # stateless runs before the first block with state
    for key, nodes in runs:
        params = owned_params(model, nodes, seen)
        stateless = not any(_has_state(model, n) for n in nodes)
        if granularity == "block" and stateless:
            if grouped:
                name, prev, prev_params = grouped[-1]
                grouped[-1] = (name, prev + nodes, prev_params)
            else:
                carry += nodes
            continue
        grouped.append((key, carry + nodes, params))
        carry = []
    if carry:
        grouped.append(("ops", carry, ()))

    blocks: list[Block] = []
    used: dict[str, int] = {}
    for i, (key, nodes, params) in enumerate(grouped):
        used[key] = used.get(key, 0) + 1
        name = key if used[key] == 1 else f"{key}#{used[key]}"
        blocks.append(Block(i, name, tuple(n.name for n in nodes), params))
    return blocks


def _call_of(node: fx.Node, key: str) -> Any:
    """Which call of module ``key`` the node belongs to: its own node for a module called
    whole (torch.fx), else the export's ``nn_module_stack`` entry for that module (``layer@2``
    is its third call); ``None`` where the node does not say (a weight read, a device)."""
    if node.op == "call_module" and str(node.target) == key:
        return node
    for stack_key, value in (node.meta.get("nn_module_stack") or {}).items():
        if value and value[0] == key:
            return stack_key
    return None


def called_again(gm: fx.GraphModule) -> set[str]:
    """The modules the graph calls more than once: a ``call_module`` target met twice
    (torch.fx), or a module the export's ``nn_module_stack`` names with a call index
    (``layer@1``)."""
    calls: dict[str, int] = {}
    again: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
        for key, value in (node.meta.get("nn_module_stack") or {}).items():
            if "@" in str(key) and value and value[0]:
                again.add(str(value[0]))
    return again | {path for path, count in calls.items() if count > 1}


def _has_state(model: nn.Module, node: fx.Node) -> bool:
    if node.op == "call_module":
        sub = model.get_submodule(str(node.target))
        return any(True for _ in sub.parameters()) or any(True for _ in sub.buffers())
    return node.op == "get_attr"


# ---------------------------------------------------------------------------------- fallback


def sequential_fallback(
    model: nn.Module, example_inputs: Sequence[Any] | None, cause: Exception
) -> fx.GraphModule:
    children = list(model.named_children())
    reason = f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"
    fix = (
        "mark the submodule with data-dependent control flow as a leaf "
        "(leaf_modules=[ThatModule]) or make the model an nn.Sequential of traceable parts"
    )
    if not children:
        raise TraceError(f"torch.fx cannot trace {type(model).__name__} ({reason}); {fix}") from cause
    if not isinstance(model, nn.Sequential) and (
            example_inputs is None or not _calls_children_in_order(model, example_inputs)):
        raise TraceError(
            f"torch.fx cannot trace {type(model).__name__} ({reason}), and its children are "
            f"not called one after the other; {fix}"
        ) from cause
    warnings.warn(
        f"torch.fx cannot trace {type(model).__name__} ({reason}); splitting it at its "
        f"{len(children)} top-level children instead, in order",
        stacklevel=3,
    )
    graph = fx.Graph()
    value: fx.Node = graph.placeholder("input")
    for child_name, _ in children:
        value = graph.call_module(child_name, (value,))
    graph.output(value)
    return fx.GraphModule(model, graph, type(model).__name__)


def _calls_children_in_order(model: nn.Module, example_inputs: Sequence[Any]) -> bool:
    """True when a forward pass (on a copy) is exactly ``children[-1](…children[0](x))``."""
    if len(example_inputs) != 1 or not isinstance(example_inputs[0], torch.Tensor):
        return False
    probe = copy.deepcopy(model)
    calls: list[tuple[str, Any, Any]] = []
    handles = [
        child.register_forward_hook(lambda m, args, out, n=n: calls.append((n, args, out)))
        for n, child in probe.named_children()
    ]
    try:
        with torch.no_grad(), torch.random.fork_rng():
            out = probe(*example_inputs)
    except Exception:  # noqa: BLE001 - the user's model failed: then its children are not known
        return False
    finally:
        for h in handles:
            h.remove()
    names = [n for n, _ in probe.named_children()]
    if [c[0] for c in calls] != names:
        return False
    value: Any = example_inputs[0]
    for _, args, result in calls:
        if len(args) != 1 or args[0] is not value:
            return False
        value = result
    return out is value
