"""Run a pipeline stage under activation checkpointing (``Stage.checkpoint``): mechanism only.

A checkpointed stage keeps only what it receives for backward; its backward first runs its
forward again to rebuild what it needs (``torch.utils.checkpoint``, non-reentrant, with the
RNG state preserved, so dropout draws the same masks again). Outputs and gradients are those
of the stage run plainly.

One thing the recomputation would change: buffers that the forward updates. A BatchNorm in
training mode updates its running statistics on every forward, so the recomputed forward
would apply the momentum a second time (and count ``num_batches_tracked`` twice). The stage's
buffers are therefore saved before the recomputation and put back after it, so that they
update once per micro-batch, as in one process. (Its output does not depend on this: in
training mode BatchNorm normalises with the micro-batch's own statistics.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["buffers_kept", "checkpointed"]


class buffers_kept(contextlib.AbstractContextManager[None]):
    """Put ``module``'s buffers back as they were on entering, whatever ran inside.

    Re-entrant: ``torch.utils.checkpoint`` makes one recompute context per forward and enters
    it at every recomputation, and a zero-bubble schedule's backward recomputes twice (once
    for the input gradients, once for the weight gradients).
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> None:
        self.saved = [(buffer, buffer.detach().clone()) for buffer in self.module.buffers()]

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for buffer, value in self.saved:
                buffer.copy_(value)
        self.saved = []


def checkpointed(body: Callable[..., Any], module: nn.Module) -> Callable[..., Any]:
    """``body`` (the stage ``module`` or a functional call of it) run under activation
    checkpointing, its buffers updated by the first forward only."""

    def contexts() -> tuple[contextlib.AbstractContextManager[None],
                            contextlib.AbstractContextManager[None]]:
        return contextlib.nullcontext(), buffers_kept(module)

    def run(*args: Any) -> Any:
        return checkpoint(body, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=contexts)

    return run
