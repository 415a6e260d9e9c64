"""How a split zoo model is checked against the unsplit one: the same micro-batches, outputs
of the same type and values, and every parameter gradient."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autosplit.capture.exported import hf_defaults
from autosplit.stages import concat, split


def objective(output: Any) -> torch.Tensor:
    """The model's own loss where it returns one, else a weighted sum of its floating outputs
    (so that every output element gets its own gradient)."""
    leaves = [x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor)
              and x.is_floating_point()]
    losses = [x for x in leaves if x.dim() == 0]
    if losses:
        return losses[0]
    total = torch.zeros(())
    for x in leaves:
        total = total + (torch.linspace(0.5, 1.5, x.numel()).reshape(x.shape) * x).sum()
    return total


def reference(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              size: int) -> Any:
    """The unsplit model on the same micro-batches, its outputs joined as the pipeline joins
    them (a Hugging Face model called without its inference cache, as autosplit calls it)."""
    kwargs = {**hf_defaults(model, kwargs), **kwargs}
    outs = [model(*a, **k) for a, k in split((args, kwargs), size)]
    return concat(outs, [size] * len(outs))


def assert_same_output(got: Any, want: Any) -> None:
    """The same output type, pytree structure and values."""
    assert type(got) is type(want)
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec
    for a, b in zip(got_leaves, want_leaves):
        torch.testing.assert_close(a, b)


def assert_same_gradients(model: nn.Module, ref_model: nn.Module) -> None:
    """Every parameter of ``model`` has the gradient of its namesake in ``ref_model``."""
    params = dict(ref_model.named_parameters())
    for pname, p in model.named_parameters():
        q = params[pname]
        assert (p.grad is None) == (q.grad is None), pname
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, msg=pname)


def assert_trains_like(pm: Any, model: nn.Module, ref_model: nn.Module, args: tuple[Any, ...],
                       kwargs: dict[str, Any], size: int) -> None:
    """``pm`` (the split ``model``) called on ``args`` and ``kwargs`` gives the output of the
    unsplit ``ref_model`` on micro-batches of ``size`` rows, and every parameter its gradient."""
    got = pm(*args, **kwargs)
    want = reference(ref_model, args, kwargs, size)
    assert_same_output(got, want)
    objective(got).backward()
    objective(want).backward()
    assert_same_gradients(model, ref_model)
