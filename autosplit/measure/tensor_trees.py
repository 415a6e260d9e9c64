"""Small helpers on (nested structures of) tensors, shared by the profilers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["backward_from", "fresh_leaves", "nbytes", "tensor_leaves"]


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested structure of tuples, lists and dicts."""
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


def nbytes(value: Any) -> int:
    """Total bytes of every tensor in ``value``."""
    return sum(x.numel() * x.element_size() for x in tensor_leaves(value))


def fresh_leaves(values: Sequence[Any], needs_grad: Sequence[bool] | None = None) -> list[Any]:
    """Detached copies (sharing storage) of a block's inputs, floating ones requiring grad,
    so that the block's forward and backward can be run and measured on their own.

    ``needs_grad[i] = False`` leaves input i without grad: the model's own inputs, whose
    gradient training never computes (the first block's input-gradient pass would otherwise be
    counted, a large one for a high-resolution first convolution)."""
    out = []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            v = v.detach()
            wanted = needs_grad is None or needs_grad[i]
            if wanted and (v.is_floating_point() or v.is_complex()):
                v.requires_grad_(True)
        out.append(v)
    return out


def backward_from(outputs: Any, loss: Callable[[Any], torch.Tensor] | None) -> bool:
    """Backward from ``loss(outputs)``, or from a gradient of ones on every output that needs
    one; False when nothing needs a gradient."""
    grads_for = [t for t in tensor_leaves(outputs) if t.requires_grad]
    if not grads_for:
        return False
    if loss is not None:
        loss(outputs).backward()
    else:
        torch.autograd.backward(grads_for, [torch.ones_like(t) for t in grads_for])
    return True
