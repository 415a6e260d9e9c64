"""Build a model on the meta device, or move one there: shapes and dtypes, no storage.

:mod:`autosplit.estimate.analytic` counts work on such models; a model of billions of parameters costs
no memory there.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from autosplit import checks
from autosplit.errors import ArgumentTypeError, InvalidInputError

__all__ = [
    "META",
    "build_on_meta",
    "model_dtype",
    "to_meta",
]

META = torch.device("meta")


def build_on_meta(factory: Callable[..., Any], *args: Any, **kwargs: Any) -> nn.Module:
    """Build a model with every parameter and buffer on the meta device, allocating nothing.

    ``factory(*args, **kwargs)`` runs under ``with torch.device("meta"):``, so tensors it
    creates without an explicit device land on meta. Parameters or buffers that the factory
    puts on a device explicitly are replaced by meta tensors of the same shape and dtype
    (their memory was allocated by the factory itself; nothing more is).

    Raises:
        ArgumentTypeError: ``factory`` is not callable.
        InvalidInputError: the factory does not return an ``nn.Module`` or fails.
    """
    if not callable(factory):
        raise ArgumentTypeError(
            f"factory must be a function or class that builds the model, got "
            f"{checks.show(factory)}"
        )
    try:
        with torch.device("meta"):
            model = factory(*args, **kwargs)
    except Exception as exc:  # the user's factory
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise InvalidInputError(
            f"building the model on the meta device failed: {type(exc).__name__}: {first}. A "
            "factory that reads weights or data cannot run on meta; build the bare architecture "
            "instead"
        ) from exc
    if not isinstance(model, nn.Module):
        raise InvalidInputError(
            f"the factory returned a {type(model).__name__}, not a torch.nn.Module"
        )
    if any(t.device.type != "meta" for t in itertools.chain(model.parameters(), model.buffers())):
        model = to_meta(model)
    return model


def to_meta(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors (``model`` is untouched).

    Parameter and buffer data are never copied: the deep copy is given meta stand-ins for them
    up front. With ``dtype``, floating-point parameters and buffers take that dtype.
    """
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        if id(t) in memo:
            continue
        dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
        stand_in: torch.Tensor = torch.empty(tuple(t.shape), dtype=dt, device=META)
        if isinstance(t, nn.Parameter):
            stand_in = nn.Parameter(stand_in, requires_grad=t.requires_grad)
        memo[id(t)] = stand_in
    return copy.deepcopy(model, memo)


def model_dtype(module: nn.Module) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for p in module.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=lambda d: counts[d]) if counts else torch.float32
