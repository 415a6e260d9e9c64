"""What one block holds while it runs a micro-batch (bytes), measured untimed for the profile.

* :func:`working_bytes`: the highest rise of allocated memory during a forward and backward with
  the block's gradients already held, as in every micro-batch of a step but the first —
  ``BlockProfile.peak_bytes``;
* :func:`split_held_bytes`: what a micro-batch holds between the two passes of a split backward
  (torch's zero-bubble stages) — ``BlockProfile.split_held_bytes``.

Both run under :mod:`autosplit.measure.peak_memory` (torch's profiler on a CPU, the caching allocator's
statistics on a GPU), which slows them down: nothing here is timed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from autosplit.graph import Segment
from autosplit.measure.peak_memory import change_during, rise_during
from autosplit.measure.tensor_trees import backward_from, nbytes, tensor_leaves

__all__ = ["split_held_bytes", "working_bytes"]


def working_bytes(seg: Segment, args: Sequence[Any], dev: torch.device,
                  loss: Callable[[Any], torch.Tensor] | None) -> int:
    """The highest rise of allocated memory during one forward and backward of ``seg`` on
    ``args`` (from ``loss`` after it, for the last block), in bytes: the activations it saves,
    its outputs and their gradient, the gradient of its inputs, and the temporaries of both
    passes (a new weight gradient before it is added to the held one, weights reordered for
    the kernels, workspaces). Run it after the block's gradients exist."""
    _, rise = rise_during(lambda: backward_from(seg.module(*args), loss), dev)
    return rise


def split_held_bytes(seg: Segment, args: Sequence[Any], dev: torch.device) -> int | None:
    """Bytes one micro-batch of ``seg`` holds between the two passes of a split backward: what
    its forward and input pass (torch's ``stage_backward_input``) leave allocated for the
    weight pass — the activations the weight gradients read and the intermediate gradients
    torch keeps for them — less the gradient of its inputs (sent upstream). Inputs it keeps
    were allocated before and are not counted here. ``None`` when the block has no input pass
    (none of its inputs needs a gradient, or torch cannot split its backward): it then holds
    what it saves until its one backward pass."""
    from torch.distributed.pipelining._backward import stage_backward_input

    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return None

    def forward_and_input_pass() -> tuple[Any, int] | None:
        outputs = [t.clone() if t._is_view() else t  # torch detaches outputs in place
                   for t in tensor_leaves(seg.module(*args)) if t.requires_grad]
        if not outputs:
            return None
        grads = [torch.ones_like(t) for t in outputs]
        input_grads, groups = stage_backward_input(outputs, grads, list(args),
                                                   seg.module.parameters())
        return groups, nbytes([g for g in input_grads if g is not None])

    try:
        kept, (_, net) = change_during(forward_and_input_pass, dev)
    except Exception:  # noqa: BLE001  torch cannot split it: one piece
        return None
    if kept is None:
        return None
    return max(0, net - kept[1])
