"""The torch.export front end: a model that torch.fx cannot trace, captured from one call.

``torch.export.export(..., strict=False)`` runs the model's own Python once on fake tensors, so
decorated forwards, optional parameters left at their defaults, ``torch._assert``, control flow
on shapes and keyword inputs all work; Hugging Face transformers tests its models for exactly
this. The exported graph is then rewritten into a plain ``fx.GraphModule`` that the rest of
autosplit runs like a traced one:

- parameters and buffers become ``get_attr`` nodes on the model's own tensors (one next to
  each operation that reads them, so a tied weight is read where it is used, never sent);
- every node carries ``meta["autosplit_path"]``, the module it ran in (from the export's
  ``nn_module_stack``), which groups it into a block;
- dimension 0 of every input is dynamic (the batch), so one capture runs every micro-batch
  size; a size it needs (``x.size(0)``) is read from a tensor beside its use wherever one has
  it (:func:`_local_sizes`), and otherwise rebuilt on the far side of a cut;
- a device the export fixed is read from a tensor beside its use (:func:`device_of`), so a
  stage runs on whatever device holds it;
- a region of the model's code under a context (``with torch.autocast(...)``) is one of
  torch.export's higher-order operations, whose body module the graph holds under
  :data:`BODIES`; an autocast region's device type is read from its operands;
- ``meta["autosplit_kind"]`` says what each value is: ``"tensor"``, ``"size"`` (an integer
  computed from shapes) or ``"other"`` (a list, ``None`` …), which may not cross a cut.

The capture is of the mode the model is in (``model.training``): dropout and BatchNorm are
fixed to it, and :class:`~autosplit.graph.BlockGraph` records which.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from autosplit.capture.export_failures import (
    advice,
    check_batch_free,
    first_line,
    quiet_torch_logs,
)
from autosplit.capture.signature import InputSignature
from autosplit.errors import TraceError

__all__ = ["BODIES", "device_of", "device_type_of", "export_graph", "hf_defaults"]

BODIES = "_autosplit_bodies"
"""Where the captured graph module holds the bodies of torch.export's higher-order operations."""


_KEEP_META = ("nn_module_stack", "stack_trace", "autosplit_path", "autosplit_kind",
              "autosplit_scalar", "autosplit_bool")
_SIZE_OPS = {
    torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_stride.int, torch.ops.aten.sym_storage_offset.default,
}


def hf_defaults(model: nn.Module, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword inputs a Hugging Face style forward gets unless the call gives them:
    ``use_cache=False`` (a cache is inference state, not a training output)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in params and "use_cache" not in kwargs else {}


def export_graph(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any],
                 ) -> tuple[fx.GraphModule, InputSignature, pytree.TreeSpec]:
    """Capture ``model(*args, **kwargs)`` with torch.export: (graph module on the model's own
    parameters, the call's signature, the output's pytree structure).

    Raises:
        TraceError: torch.export cannot capture the model (the message names the construct).
    """
    defaults = hf_defaults(model, kwargs)
    call_kwargs = {**kwargs, **defaults}
    call_args = tuple(args)
    flat, spec = pytree.tree_flatten((call_args, call_kwargs))
    batch = next((int(x.shape[0]) for x in flat if isinstance(x, torch.Tensor) and x.dim()), 0)
    if batch == 1:  # a batch of 1 would be specialised: capture with 2 rows
        flat = [torch.cat([x, x]) if isinstance(x, torch.Tensor) and x.dim() else x for x in flat]
    flat = _distinct(flat)
    call_args, call_kwargs = pytree.tree_unflatten(flat, spec)
    dynamic = _dynamic_batch(model, call_args, call_kwargs)
    try:
        with quiet_torch_logs():  # a failed capture is reported once, here, in one line
            ep = torch.export.export(model, call_args, call_kwargs, dynamic_shapes=dynamic,
                                     strict=False)
    except Exception as exc:
        told = advice(model, exc, call_kwargs)
        if not told and kwargs:  # torch.fx takes a positional call only
            told = ("; called with positional inputs only (example_inputs returning a tuple), "
                    "torch.fx would try it, with --leaf-modules NAME for a submodule it cannot "
                    "trace")
        raise TraceError(f"torch.export cannot capture {type(model).__name__}: "
                         f"{first_line(exc)}{told}") from exc
    gm = _rebuild(model, ep)
    check_batch_free(model, gm, [x for x in flat if isinstance(x, torch.Tensor)],
                      2 if batch == 1 else batch)  # (the rows captured)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    signature = InputSignature.of(args, {**kwargs, **defaults}, names, defaults)
    return gm, signature, ep.call_spec.out_spec


def _distinct(flat: Sequence[Any]) -> list[Any]:
    """The call's leaves with every tensor its own object: one tensor given twice
    (``labels=input_ids``) would be captured as one input, and the graph would read either
    where the model reads the other."""
    seen: set[int] = set()
    out = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            x = x.clone() if id(x) in seen else x
            seen.add(id(x))
        out.append(x)
    return out


def _dynamic_batch(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """torch.export's ``dynamic_shapes``: dimension 0 of every tensor input is the batch."""
    def dims(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {0: torch.export.Dim.AUTO} if value.dim() else None
        if isinstance(value, (tuple, list)):
            return type(value)(dims(v) for v in value)
        if isinstance(value, dict):
            return {k: dims(v) for k, v in value.items()}
        return None

    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except TypeError as exc:
        raise TraceError(f"{type(model).__name__}.forward does not take the example inputs: "
                         f"{exc}") from exc
    return {name: dims(value) for name, value in bound.items()}


def _rebuild(model: nn.Module, ep: Any) -> fx.GraphModule:
    """The exported program as a GraphModule whose parameters are ``model``'s own."""
    from torch.export.graph_signature import InputKind, OutputKind

    sig = ep.graph_signature
    kinds = {s.arg.name: s for s in sig.input_specs}
    attrs: dict[str, Any] = {}
    lifted: dict[str, str] = {}  # placeholder → attribute target
    first_name = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    for name, spec in kinds.items():
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            tensor = model.get_parameter(spec.target) \
                if spec.kind == InputKind.PARAMETER else model.get_buffer(spec.target)
            target = first_name.get(id(tensor), spec.target)  # a tied weight by its first name
            lifted[name] = target
            attrs[target] = tensor
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            target = f"_autosplit_constants.{spec.target.replace('.', '_')}"
            lifted[name] = target
            attrs[target] = ep.constants[spec.target]
        elif spec.kind != InputKind.USER_INPUT:
            raise TraceError(f"torch.export gave {type(model).__name__} an input of kind "
                             f"{spec.kind.name}, which autosplit cannot run")
    bad = [s for s in sig.output_specs if s.kind != OutputKind.USER_OUTPUT]
    if bad:
        raise TraceError(f"{type(model).__name__} mutates {bad[0].target!r} in a way autosplit "
                         f"cannot split ({bad[0].kind.name})")

    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            if node.name in lifted:
                continue
            arg = kinds[node.name].arg
            if not hasattr(arg, "name") or type(arg).__name__ == "ConstantArgument":
                env[node] = arg.value  # a value fixed at capture (use_cache=False)
                continue
            new = graph.placeholder(node.name)
            new.meta.update(node.meta)
            new.meta["autosplit_path"] = ""
            env[node] = new
        elif node.op == "output":
            graph.output(fx.node.map_arg(node.args[0], lambda n: env[n]))
        elif node.op == "get_attr":  # a higher-order operation's body (an autocast region)
            target = f"{BODIES}.{node.target}"
            attrs[target] = _body(getattr(ep.graph_module, str(node.target)))
            new = graph.get_attr(target)
            new.meta.update(node.meta)
            new.meta["autosplit_path"] = _path_of(model, node)
            new.meta["autosplit_kind"] = "other"  # a module: never sent across a cut
            env[node] = new
        else:
            path = _path_of(model, node)
            stack = node.meta.get("nn_module_stack")
            args = fx.node.map_arg((node.args, node.kwargs),
                                   lambda n, p=path, k=stack: _value(graph, env, lifted, n, p, k))
            new = graph.create_node(node.op, node.target, args[0], args[1], node.name)
            new.meta.update(node.meta)
            new.meta["autosplit_path"] = path
            env[node] = new
            if node.target is torch.ops.higher_order.wrap_with_autocast:
                _autocast_device_type(graph, new)
    _local_sizes(graph)
    _devices_from_tensors(graph)
    for node in graph.nodes:
        node.meta["autosplit_kind"] = _kind(node)
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point():
            node.meta["autosplit_scalar"] = True
        if isinstance(value, torch.Tensor) and value.dtype == torch.bool:
            node.meta["autosplit_bool"] = True
        for key in [k for k in node.meta if k not in _KEEP_META]:
            del node.meta[key]
    graph.eliminate_dead_code(is_impure_node=lambda n: n.op != "get_attr"
                              and not _is_size_op(n)
                              and n.target not in (device_of, device_type_of))
    graph.lint()
    gm = fx.GraphModule(attrs, graph, type(model).__name__)
    return gm


def _body(module: fx.GraphModule) -> fx.GraphModule:
    """A higher-order operation's body, its fixed devices made those of its tensors (as
    :func:`_devices_from_tensors` does for the whole graph)."""
    _devices_from_tensors(module.graph)
    module.recompile()
    return module


def _value(graph: fx.Graph, env: dict[fx.Node, Any], lifted: Mapping[str, str],
           node: fx.Node, path: str, stack: Any) -> Any:
    """The new graph's value for ``node``: a weight is read by a ``get_attr`` of its own,
    in the module and the call (``stack``: ALBERT calls one layer many times) of its user."""
    if node.name not in lifted:
        return env[node]
    attr = graph.get_attr(lifted[node.name])
    attr.meta.update(node.meta)
    attr.meta["autosplit_path"] = path
    attr.meta["nn_module_stack"] = stack
    return attr


def _path_of(model: nn.Module, node: fx.Node) -> str:
    """The innermost module of ``model`` the node ran in ("" for the model itself)."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        if not path:
            continue
        try:
            model.get_submodule(path)
        except AttributeError:
            continue
        return str(path)
    return ""


def device_type_of(tensor: torch.Tensor) -> str:
    """The type of the device ``tensor`` is on ("cpu", "cuda"): an autocast region's."""
    return tensor.device.type


def _autocast_device_type(graph: fx.Graph, node: fx.Node) -> None:
    """An autocast region's device type read from its first tensor operand, as the model's
    ``torch.autocast(device_type=x.device.type)`` does, not the type fixed at capture."""
    source = next((a for a in node.args[5:] if isinstance(a, fx.Node)
                   and isinstance(a.meta.get("val"), torch.Tensor)), None)
    if source is None or not isinstance(node.args[0], str):
        return
    node.args = (_read_before(graph, node, device_type_of, source, "other"), *node.args[1:])


def _read_before(graph: fx.Graph, node: fx.Node, read: Any, source: fx.Node,
                 kind: str) -> fx.Node:
    """A new node ``read(source)`` just before ``node``, in its module and call, of kind
    ``kind`` (a device is a ``"size"``, computed again past a cut; a device type ``"other"``)."""
    with graph.inserting_before(node):
        new = graph.call_function(read, (source,))
    new.meta.update({"autosplit_path": node.meta.get("autosplit_path", ""),
                     "nn_module_stack": node.meta.get("nn_module_stack"),
                     "autosplit_kind": kind})
    return new


def device_of(tensor: torch.Tensor) -> torch.device:
    """The device ``tensor`` is on (a node of the graph: see :func:`_devices_from_tensors`)."""
    return tensor.device


def _devices_from_tensors(graph: fx.Graph) -> None:
    """Make every device the export fixed (``arange(…, device=cpu)``, ``x.to(cpu)``) the device
    of a tensor beside it: of the operation's own tensor argument, else of the model's first
    input. A stage then runs where its module is (a GPU, the meta device), not where the model
    was captured."""
    first = next((n for n in graph.nodes if n.op == "placeholder"), None)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is device_of:
            continue
        if not any(isinstance(a, torch.device) for a in (*node.args, *node.kwargs.values())):
            continue
        source = next((a for a in node.all_input_nodes
                       if isinstance(a.meta.get("val"), torch.Tensor)), first)
        if source is None:
            continue
        device = _read_before(graph, node, device_of, source, "size")
        node.args = tuple(device if isinstance(a, torch.device) else a for a in node.args)
        node.kwargs = {k: device if isinstance(v, torch.device) else v
                       for k, v in node.kwargs.items()}


def _is_size_op(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _SIZE_OPS


def _local_sizes(graph: fx.Graph) -> None:
    """Read each size where it is used: a use of ``sym_size(x, d)`` that has a tensor argument
    with the same size in some dimension reads it from that tensor instead."""
    for node in list(graph.nodes):
        if not (_is_size_op(node) and node.target is torch.ops.aten.sym_size.int):
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.SymInt):
            continue
        for user in list(node.users):
            local = _tensor_with_size(user, node, value)
            if local is None:
                continue
            with graph.inserting_before(user):
                size = graph.call_function(torch.ops.aten.sym_size.int, local)
            size.meta.update({"val": value, "autosplit_path": user.meta.get("autosplit_path", ""),
                              "nn_module_stack": user.meta.get("nn_module_stack", {})})
            user.replace_input_with(node, size)


def _tensor_with_size(user: fx.Node, size: fx.Node, value: torch.SymInt,
                      ) -> tuple[fx.Node, int] | None:
    expr = value.node.expr
    for arg in user.all_input_nodes:
        if arg is size:
            continue
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor):
            for dim, s in enumerate(val.shape):
                if isinstance(s, torch.SymInt) and s.node.expr == expr:
                    return arg, dim
    return None


_SIZE_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


def _kind(node: fx.Node) -> str:
    if "autosplit_kind" in node.meta:
        return str(node.meta["autosplit_kind"])
    if node.op in ("placeholder", "get_attr"):
        return "tensor"
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, _SIZE_TYPES) and (
            _is_size_op(node) or (node.op == "call_function"
                                  and getattr(node.target, "__module__", "") in
                                  ("_operator", "math", "torch", "torch.fx.experimental.sym_node"))):
        return "size"
    return "other"
