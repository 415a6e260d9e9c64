"""What a node of the model's graph holds, known without running it: a tensor or not.

The emitted code moves a value that is surely one tensor with ``.to(device)`` and anything
else (a module's tuple of tensors) with ``move()``. A value that is surely not a tensor (an
``int`` from ``x.size(0)``, a shape) and crosses a cut is refused by
:meth:`autosplit.stages.StageLayout.check_sent`, as in every runtime: :func:`stand_in` gives
it an object of the type it will have, so that the refusal names that type.
"""

from __future__ import annotations

import builtins
import operator
from typing import Any

import torch
from torch import fx

# Values that are not tensors (shapes, sizes, tuples): moved between devices with move().
_NON_TENSOR_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad"}
_NON_TENSOR_METHODS = {
    "size", "dim", "numel", "nelement", "item", "tolist", "split", "chunk", "unbind",
    "tensor_split", "stride", "element_size", "get_device", "is_contiguous", "__len__",
}
_NON_TENSOR_FUNCTIONS = {
    torch.split, torch.chunk, torch.unbind, torch.tensor_split, builtins.len, builtins.int,
    builtins.float, builtins.tuple, builtins.list,
}


def is_tensor(node: fx.Node) -> bool:
    """Whether ``node`` surely holds one tensor (else it is moved with move())."""
    if node.op in ("placeholder", "get_attr"):
        return True
    if node.op == "call_module":
        return not any(u.target is operator.getitem for u in node.users)
    if node.op == "call_method":
        return node.target not in _NON_TENSOR_METHODS
    fn = node.target
    if fn is builtins.getattr:
        return node.args[1] not in _NON_TENSOR_ATTRS and isinstance(node.args[0], fx.Node)
    if fn is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and is_tensor(src)
    if fn in _NON_TENSOR_FUNCTIONS:
        return False
    if getattr(fn, "__module__", None) in ("torch", "torch.functional", "torch.nn.functional"):
        return True
    return any(is_tensor(a) for a in node.all_input_nodes)


_ATTR_TYPES: dict[str, type] = {
    "shape": torch.Size, "dtype": torch.dtype, "device": torch.device, "ndim": int,
    "is_cuda": bool, "layout": torch.layout, "requires_grad": bool,
}
_METHOD_TYPES: dict[str, type] = {
    "dim": int, "numel": int, "nelement": int, "item": float, "tolist": list, "split": tuple,
    "chunk": tuple, "unbind": tuple, "tensor_split": tuple, "stride": tuple,
    "element_size": int, "get_device": int, "is_contiguous": bool, "__len__": int,
}
_FUNCTION_TYPES: dict[Any, type] = {
    torch.split: tuple, torch.chunk: tuple, torch.unbind: tuple, torch.tensor_split: tuple,
    builtins.len: int, builtins.int: int, builtins.float: float, builtins.tuple: tuple,
    builtins.list: list,
}
_STAND_INS: dict[type, Any] = {
    torch.Size: torch.Size(), torch.dtype: torch.float32, torch.device: torch.device("cpu"),
    torch.layout: torch.strided, int: 0, float: 0.0, bool: False, tuple: (), list: [],
}


def non_tensor_type(node: fx.Node) -> type | None:
    """The type of ``node``'s value when it is surely not a tensor (``int`` for
    ``x.shape[0]``, ``torch.Size`` for ``x.shape``), else ``None`` (a tensor, or unknown)."""
    if node.op == "call_method":
        if node.target == "size":
            return int if len(node.args) > 1 or node.kwargs else torch.Size
        return _METHOD_TYPES.get(str(node.target))
    if node.op != "call_function":
        return None
    fn = node.target
    if fn is builtins.getattr and isinstance(node.args[0], fx.Node):
        return _ATTR_TYPES.get(node.args[1]) if isinstance(node.args[1], str) else None
    if fn is operator.getitem and isinstance(node.args[0], fx.Node):
        if non_tensor_type(node.args[0]) is torch.Size:
            return torch.Size if isinstance(node.args[1], slice) else int
        return None  # an item of a tensor or of a tuple of tensors
    return _FUNCTION_TYPES.get(fn)


def stand_in(node: fx.Node) -> Any:
    """An object of the type ``node``'s value will have: an empty tensor unless it is surely
    something else (then a value of that type)."""
    kind = non_tensor_type(node)
    return torch.empty(0) if kind is None else _STAND_INS[kind]
