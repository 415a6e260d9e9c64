"""The peak of tensor memory while a function runs, on a CPU as on a GPU (bytes).

A GPU's caching allocator keeps a high-water mark (``torch.cuda.max_memory_allocated``); a CPU
keeps none. On a CPU, :func:`rise_during` runs the function under ``torch.profiler`` with
``profile_memory=True``: every allocation and free of a tensor's memory by torch's CPU allocator
is an event with its size (frees negative), and the running sum of those events, in time order,
peaks at the highest rise above what was allocated when the function started. That is tensor
memory as the memory model counts it (parameters, gradients, optimizer state, activations in
flight, received values), not the process's resident set: the C library's heap, the
interpreter and torch's own code are left out, as they are from every prediction.

The profiler records the allocations of the threads it follows (the calling thread, and the
autograd engine's work for CPU tensors, which runs on it); it slows the function down, so time
nothing under it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

from autosplit.errors import InvalidInputError

T = TypeVar("T")

__all__ = ["change_during", "rise_during", "tensor_bytes"]


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``None`` skipped; a storage two
    tensors share counted once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def rise_during(fn: Callable[[], T], device: torch.device | str = "cpu") -> tuple[T, int]:
    """Run ``fn`` and return (its result, the highest rise in ``device``'s allocated tensor
    memory above its level when ``fn`` started, in bytes): :func:`change_during`'s peak."""
    result, (peak, _) = change_during(fn, device)
    return result, peak


def change_during(fn: Callable[[], T], device: torch.device | str = "cpu"
                  ) -> tuple[T, tuple[int, int]]:
    """Run ``fn`` and return (its result, (peak, net)): the highest rise of ``device``'s
    allocated tensor memory above its level when ``fn`` started, and the level when it
    returned less the level when it started (what ``fn`` left allocated: its result, and
    what the result keeps alive), in bytes.

    On a GPU, from the caching allocator's statistics (its peak is reset); on a CPU, from the
    profiler's memory events (see the module's docstring), which know nothing of memory
    allocated before ``fn`` started: freeing it goes unseen. Free what ``fn`` will reallocate
    (gradients: ``zero_grad(set_to_none=True)``) before calling it.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        return result, (max(0, peak), torch.cuda.memory_allocated(device) - before)
    if device.type != "cpu":
        raise InvalidInputError(f"device: peak memory is measured on cpu and cuda devices, "
                                f"not {device}")
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # the profiler's library logs every start and stop there
        prof.start()
    try:
        result = fn()
    finally:
        with _quiet_stderr():
            prof.stop()
    return result, _levels(prof.profiler.kineto_results.events())


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Send what native code writes to file descriptor 2 to /dev/null meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _levels(events: Iterable[Any]) -> tuple[int, int]:
    """The highest running sum of the CPU memory events' sizes, in time order, and the last
    (bytes; the highest ≥ 0)."""
    changes = sorted(  # stable: events of one instant keep the order they were recorded in
        ((e.start_ns(), e.nbytes()) for e in events
         if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
        key=lambda change: change[0],
    )
    level = highest = 0
    for _, nbytes in changes:
        level += nbytes
        highest = max(highest, level)
    return highest, level
