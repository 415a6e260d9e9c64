"""Which values of a captured graph may cross a cut between stages.

Only tensors travel between stages. A value of another kind is one of:

- ``"size"``: an integer (or float, bool) computed from shapes — ``x.size(0)``,
  ``x.shape[-2:]``, ``sym_size(x, 0) * 16``. It never crosses a cut: the stage that needs it
  computes it again from the tensors it was computed from, which cross instead
  (:func:`size_chain`).
- ``"other"``: anything else (a list from ``split``, ``None``, a Python object). No cut may
  lie where one is live: :func:`autosplit.capture.trace.trace` keeps the blocks around it together.

Graphs from torch.export say what each value is (``meta["autosplit_kind"]``, from the fake
values of the export). Graphs from torch.fx are read by what made each value: a shape, a
``size()`` or ``dim()`` call, and arithmetic or indexing on those, are sizes; everything else
is taken to be a tensor (a traced graph that moves another value across a cut is refused when
it runs, with :class:`~autosplit.errors.CutValueError`).
"""

from __future__ import annotations

import builtins
import operator
from typing import Literal

from torch import fx

__all__ = ["Kind", "value_kinds", "size_chain"]

Kind = Literal["tensor", "size", "other"]

_SIZE_METHODS = {"size", "dim", "numel", "__len__", "nelement", "ndimension"}
_SIZE_ATTRIBUTES = {"shape", "ndim", "dtype", "device", "is_cuda"}
_ARITHMETIC = {
    operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv,
    operator.truediv, operator.mod, operator.neg, operator.pow, operator.eq, operator.ne,
    operator.lt, operator.le, operator.gt, operator.ge, builtins.len, builtins.int,
    builtins.min, builtins.max,
}


def value_kinds(graph: fx.Graph) -> dict[str, Kind]:
    """What each node's value is, by node name (see the module docstring)."""
    kinds: dict[str, Kind] = {}
    for node in graph.nodes:
        given = node.meta.get("autosplit_kind")
        kinds[node.name] = given if given is not None else _fx_kind(node, kinds)
    return kinds


def _fx_kind(node: fx.Node, kinds: dict[str, Kind]) -> Kind:
    if node.op == "call_method" and node.target in _SIZE_METHODS:
        return "size"
    if node.op == "call_function" and node.target is builtins.getattr \
            and len(node.args) > 1 and node.args[1] in _SIZE_ATTRIBUTES:
        return "size"
    if node.op == "call_function" and node.target in _ARITHMETIC:
        inputs = node.all_input_nodes
        if inputs and all(kinds.get(n.name) == "size" for n in inputs):
            return "size"
    return "tensor"


def size_chain(node: fx.Node, kinds: dict[str, Kind]) -> tuple[list[fx.Node], list[fx.Node]]:
    """How to compute the size ``node`` again: (the size nodes to copy, in graph order; the
    tensors they read)."""
    chain: dict[fx.Node, None] = {}
    roots: dict[fx.Node, None] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if n in chain:
            continue
        chain[n] = None
        for arg in n.all_input_nodes:
            if kinds[arg.name] == "size":
                stack.append(arg)
            else:
                roots.setdefault(arg, None)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(chain, key=order.__getitem__), sorted(roots, key=order.__getitem__)

