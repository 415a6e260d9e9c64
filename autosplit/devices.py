"""Which devices a plan runs on, and how they are described.

On a machine with CUDA, device s of a p-stage plan is ``cuda:s``. Without enough GPUs every
stage is a CPU worker: in one process all stages share the CPU (``"cpu"``), and the
distributed runtime gives each stage its own process with one intra-op thread.
"""

from __future__ import annotations

import torch

from autosplit import checks
from autosplit.cost import DEFAULT_LINK_BYTES_PER_S  # re-exported
from autosplit.errors import InvalidInputError
from autosplit.records import DeviceInfo

__all__ = [
    "resolve_device",
    "describe_device",
    "default_devices",
    "DEFAULT_LINK_BYTES_PER_S",
    "measure_link_bandwidth",
]

def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` → ``cuda:0`` when CUDA is available, else ``cpu``; strings are checked.

    Raises:
        ArgumentTypeError: ``device`` is neither a string nor a ``torch.device``.
        InvalidInputError: the string is not a device, or names a GPU that is not there.
    """
    if device is None:
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if not isinstance(device, torch.device):
        checks.text("device", device)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidInputError(f"{device!r} is not a device: use e.g. 'cpu' or 'cuda:0'") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count()
        index = dev.index if dev.index is not None else 0
        if index >= count:
            raise InvalidInputError(
                f"device {device!r} does not exist: this machine has {count} CUDA device(s)"
            )
        dev = torch.device("cuda", index)
    elif dev.type != "cpu":
        raise InvalidInputError(f"device type {dev.type!r} is not supported: use 'cpu' or 'cuda:N'")
    return dev


def describe_device(dev: torch.device, threads: int = 1) -> DeviceInfo:
    """A :class:`DeviceInfo` for ``dev`` (CPU workers record their thread count)."""
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return DeviceInfo("cuda", props.name, None, int(props.total_memory))
    plural = "" if threads == 1 else "s"
    return DeviceInfo("cpu", f"cpu worker ({threads} thread{plural})", threads, None)


def default_devices(gpus: int) -> tuple[list[torch.device], bool]:
    """``gpus`` devices: ``cuda:0 … cuda:gpus-1`` when present, else CPU workers.

    Returns:
        The devices and whether they are CPU stand-ins for missing GPUs.
    """
    gpus = checks.positive_int("gpus", gpus)
    if torch.cuda.device_count() >= gpus:
        return [torch.device("cuda", i) for i in range(gpus)], False
    return [torch.device("cpu") for _ in range(gpus)], True


def measure_link_bandwidth(
    src: str | torch.device, dst: str | torch.device, nbytes: int = 64 * 2**20, repeats: int = 5
) -> float:
    """Measured copy bandwidth from ``src`` to ``dst`` in bytes/s (median of ``repeats``).

    Between two GPUs this is a peer-to-peer (or staged) device copy timed with CUDA events;
    between CPU workers in one process it is a memory copy, the cost of handing a tensor from
    one worker to the other.
    """
    import statistics
    import time

    a, b = resolve_device(src), resolve_device(dst)
    nbytes = checks.positive_int("nbytes", nbytes)
    repeats = checks.positive_int("repeats", repeats)
    source = torch.empty(nbytes, dtype=torch.uint8, device=a)
    target = torch.empty(nbytes, dtype=torch.uint8, device=b)
    target.copy_(source)  # warm-up (and P2P enablement)
    seconds = []
    for _ in range(repeats):
        if a.type == "cuda" or b.type == "cuda":
            start_evt = torch.cuda.Event(enable_timing=True)
            end_evt = torch.cuda.Event(enable_timing=True)
            start_evt.record()
            target.copy_(source, non_blocking=True)
            end_evt.record()
            end_evt.synchronize()
            seconds.append(start_evt.elapsed_time(end_evt) / 1000.0)
        else:
            t0 = time.perf_counter()
            target.copy_(source)
            seconds.append(time.perf_counter() - t0)
    return nbytes / max(statistics.median(seconds), 1e-9)
