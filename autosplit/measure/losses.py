"""The training loss: the one ``autosplit run`` trains with, and the one the profiler times.

The loss is part of the last stage's work (its forward, and the start of its backward), so a
profile that leaves it out predicts the last stage — and every step — too short by the loss's
cost, which is large where the output is large (a language model's logits over its vocabulary:
on a 32,000-token head the tutorial's MSE costs about as much as the model's own forward and
backward). A measured profile therefore times the last block *with* the loss
(:attr:`autosplit.records.Profile.loss` names it), and stage verification does the same.

Losses by name (:data:`LOSSES`):

* ``"mse"`` — :func:`tutorial_loss`: the PyTorch model-parallel tutorial's MSE of every
  floating output against a target of the same shape (one-hot labels in ``autosplit run``;
  the profiler uses zeros, which cost the same);
* ``"model"`` — the model's own loss (:func:`model_loss`): the 0-dimensional floating
  tensor the model returns (a Hugging Face model called with ``labels=``); its cost is in the
  last block already, and the backward starts from it. The default for a model that
  returns one (:func:`default_loss`);
* ``"none"`` — no loss: the last block's backward starts from a gradient of ones (older
  profiles, and the analytic estimates, are of this kind).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autosplit.errors import InvalidInputError

__all__ = ["LOSSES", "check_loss", "default_loss", "model_loss", "timing_loss",
           "tutorial_loss"]

LOSSES = ("mse", "none", "model")
"""The losses a profile can include in its last block's times."""


def check_loss(name: Any, argument: str = "loss") -> str:
    """``name`` if it is one of :data:`LOSSES`, else :class:`InvalidInputError` naming it."""
    if name not in LOSSES:
        raise InvalidInputError(
            f"{argument} must be one of {', '.join(map(repr, LOSSES))}, got {name!r}"
        )
    return str(name)


def _floating_leaves(output: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(output)
            if isinstance(x, torch.Tensor) and x.is_floating_point()]


def tutorial_loss(output: Any, target: Any) -> torch.Tensor:
    """The tutorial's loss: MSE of every floating output tensor against its target.

    ``target`` holds one tensor per floating output leaf, in order (see
    :func:`autosplit.distributed.tutorial_targets`); integer outputs are ignored.
    """
    leaves = _floating_leaves(output)
    targets = pytree.tree_leaves(target)
    if len(leaves) != len(targets):
        raise InvalidInputError(
            f"the model returns {len(leaves)} floating tensors but {len(targets)} targets "
            "were given"
        )
    losses = [nn.functional.mse_loss(x, t.to(x.dtype)) for x, t in zip(leaves, targets)]
    return torch.stack(losses).sum()


def model_loss(output: Any, target: Any = None) -> torch.Tensor:
    """The model's own loss in its output: the first 0-dimensional floating tensor leaf
    (``target`` is not used: the model computed the loss from its own inputs).

    Raises:
        InvalidInputError: the output holds no such tensor.
    """
    for x in pytree.tree_leaves(output):
        if isinstance(x, torch.Tensor) and x.dim() == 0 and x.is_floating_point():
            return x
    raise InvalidInputError(
        "the model returns no loss (a 0-dimensional floating tensor): pass its labels (a "
        "Hugging Face model computes its loss when called with labels=), or train with "
        "another loss"
    )


def default_loss(returns_loss: bool) -> str:
    """``"model"`` for a model that returns its own loss, else the tutorial's ``"mse"``."""
    return "model" if returns_loss else "mse"


def timing_loss(name: str) -> Callable[[Any], torch.Tensor] | None:
    """``loss(outputs) -> scalar`` that costs what the named loss costs in training, for
    timing the last block with it; ``None`` for ``"none"``.

    Targets are zeros of each output's shape, made once per shape (outside the timed region
    after the first call), as a run's targets exist before its step.
    """
    if check_loss(name) == "none":
        return None
    if name == "model":
        return model_loss
    targets: dict[tuple[Any, ...], torch.Tensor] = {}

    def loss(output: Any) -> torch.Tensor:
        leaves = _floating_leaves(output)
        wanted = []
        for x in leaves:
            key = (tuple(x.shape), x.dtype, x.device)
            if key not in targets:
                targets[key] = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
            wanted.append(targets[key])
        return tutorial_loss(leaves, wanted)

    return loss
