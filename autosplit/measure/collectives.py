"""The bandwidths of the real backend: the all-reduce, measured as the replicas' gradients use
it, and the point-to-point link between two stages, measured as the pipeline runtime sends.

Symbols: k ranks, n gradient bytes, t the time the gradient synchronisation adds to a backward
(s). A ring all-reduce sends and receives 2 (k − 1)/k · n bytes per rank (Patarasuk & Yuan
2009), so the figure returned is the "bus bandwidth"

    W = 2 (k − 1)/k · n / t   (bytes/s),

the W of :func:`autosplit.cost.replica_sync_ms`: planning with it predicts t again for n bytes.
``k`` worker processes are started on this machine (gloo on CPUs, one thread each, as the
runtime's CPU workers; NCCL on GPUs, one per rank). Each holds the same synthetic model of n
parameter bytes (a stack of 1024 × 1024 linear layers) wrapped in
``DistributedDataParallel``, as the runtime wraps a stage's replicas, and times its forward and
backward once under ``no_sync()`` and once synchronising, taking turns; t is the median
difference. So t is what DDP's synchronisation costs as it runs — its buckets, the copies into
and out of them, the all-reduce and whatever of it the backward does not hide — not a bare
all-reduce of one flat tensor: on 2 gloo CPU workers DDP's synchronisation of ResNet50's
25.6 M gradients took 164 ms where one all-reduce of as many bytes took 67 ms. The process
start-up (a few seconds: each rank imports torch) is not timed.

The synchronisation also costs a time that does not grow with n: DDP's hooks, the launch of
its bucket's all-reduce and the message's round trip. :func:`measure_allreduce` times it the
same way on a model of :data:`LATENCY_BYTES` gradient bytes (the latency α, ms) and takes the
bandwidth from what the n bytes add to it, so that α + 2 (k − 1)/k · n / W is the time measured
at n bytes again (:func:`autosplit.cost.replica_sync_ms`). On 2 gloo CPU workers α was
0.45–0.7 ms: next to a small model's millisecond steps, what the bandwidth alone leaves out (a
replicated 16 × 16 layer's one-stage step took 1.1 ms on the runtime, its compute 0.3 ms).

:func:`measure_collectives` takes the three figures the machine's cache keeps (the
synchronisation at n bytes, at :data:`LATENCY_BYTES`, and the link) on one start of the ranks.

The link (:func:`measure_link_bandwidth`) is timed as the pipeline runtime sends a stage's
output: a non-blocking send and receive of n bytes between 2 ranks, back and forth; its figure
is n over half a round trip (bytes/s, one direction), the bandwidth of
:func:`autosplit.cost.transfer_ms`. Between 2 gloo CPU workers on the development machines
(loopback TCP) it was 1.7–2.3 GB/s for 1–64 MiB, where 5 GB/s had been assumed.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from autosplit import checks
from autosplit.errors import InvalidInputError

__all__ = ["LATENCY_BYTES", "AllReduceCost", "Collectives", "bus_bandwidth", "collectives_of",
           "link_seconds", "measure_allreduce", "measure_allreduce_bandwidth",
           "measure_collectives", "measure_link_bandwidth", "sync_seconds"]

LATENCY_BYTES = 4096
"""Gradient bytes of the model the all-reduce's latency is timed on (one 1024 → 1 layer)."""


@dataclass(frozen=True, slots=True)
class AllReduceCost:
    """The measured cost of the replicas' gradient synchronisation: α + 2 (k − 1)/k · n / W.

    Attributes:
        bus_bytes_per_s: W, the bus bandwidth beyond the latency (bytes/s).
        latency_ms: α, what a synchronisation costs whatever its bytes (ms).
    """

    bus_bytes_per_s: float
    latency_ms: float


def bus_bandwidth(nbytes: float, ranks: int, seconds: float) -> float:
    """W = 2 (k − 1)/k · n / t (bytes/s) for an all-reduce of ``nbytes`` over ``ranks`` ranks
    that took ``seconds``."""
    return 2.0 * (ranks - 1) / ranks * nbytes / max(seconds, 1e-9)


def _join(rank: int, ranks: int, port: int, backend: str) -> Any:
    """Join the local process group as ``rank`` with one intra-op thread; this rank's device."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ranks)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    return device


def sync_seconds(rank: int, backend: str, device: Any, nbytes: int, repeats: int) -> float:
    """In a joined process group: the median time DDP's synchronisation of ``nbytes`` of
    gradients adds to a backward (s; see the module docstring)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    width = 1024  # layers of 4 MiB (fp32 weights), the last one cut to n bytes in all
    full, rest = divmod(max(nbytes // 4, width), width * width)
    layers = [nn.Linear(width, width, bias=False) for _ in range(full)]
    if rest // width:
        layers.append(nn.Linear(width, rest // width, bias=False))
    model = nn.Sequential(*layers).to(device)
    ddp = DistributedDataParallel(model, device_ids=[rank] if backend == "nccl" else None)
    x = torch.randn(8, width, device=device)

    def backward() -> float:
        dist.barrier()
        if backend == "nccl":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        ddp(x).sum().backward()  # noqa: F821 - a closure cell, deleted below on purpose
        if backend == "nccl":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    backward()  # warm-up: buckets, connections
    added = []
    for _ in range(repeats):
        with ddp.no_sync():
            alone = backward()
        added.append(backward() - alone)
    dist.barrier()  # no rank tears down while another still synchronises
    del ddp  # DDP's reducer before its process group: its threads end first
    return max(statistics.median(added), 1e-6)


def _rank(rank: int, ranks: int, port: int, backend: str, nbytes: int, repeats: int,
          results: Any) -> None:
    device = _join(rank, ranks, port, backend)
    try:
        seconds = sync_seconds(rank, backend, device, nbytes, repeats)
        if rank == 0:
            results.put(seconds)
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def measure_allreduce_bandwidth(ranks: int = 2, nbytes: int = 32 * 2**20, repeats: int = 7,
                                backend: str | None = None) -> float:
    """The measured bus bandwidth W of ``ranks`` local ranks synchronising ``nbytes`` bytes of
    gradients with DistributedDataParallel (bytes/s; see the module docstring), the median of
    ``repeats`` timings.

    ``backend`` defaults to NCCL when there is a GPU per rank, else gloo. The figure is kept
    for the process's lifetime: asking again with the same arguments measures nothing.

    Raises:
        ArgumentTypeError, InvalidInputError: a count that is not a positive integer, fewer
            than 2 ranks, an unknown backend.
    """
    ranks, backend = _group(ranks, backend)
    nbytes = checks.positive_int("nbytes", nbytes)
    repeats = checks.positive_int("repeats", repeats)
    key = (ranks, nbytes, repeats, backend)
    if key not in _MEASURED:
        _MEASURED[key] = bus_bandwidth(nbytes, ranks,
                                       float(_measure(_rank, ranks, nbytes, repeats, backend)))
    return _MEASURED[key]


_MEASURED: dict[tuple[int, int, int, str], float] = {}


def _group(ranks: int, backend: str | None) -> tuple[int, str]:
    """Checked ``ranks`` (2 or more) and ``backend`` (default: NCCL with a GPU per rank,
    else gloo)."""
    import torch

    ranks = checks.positive_int("ranks", ranks)
    if backend is None:
        backend = "nccl" if torch.cuda.device_count() >= ranks else "gloo"
    checks.one_of("backend", backend, ("gloo", "nccl"))
    if ranks < 2:
        raise InvalidInputError(f"ranks={ranks}: an all-reduce is measured among 2 ranks or "
                                "more")
    return ranks, backend


def _above_latency(nbytes: int) -> int:
    """``nbytes`` checked to exceed :data:`LATENCY_BYTES`, where the bandwidth is measured."""
    nbytes = checks.positive_int("nbytes", nbytes)
    if nbytes <= LATENCY_BYTES:
        raise InvalidInputError(f"nbytes={nbytes}: the bandwidth is measured above the "
                                f"latency's {LATENCY_BYTES} bytes")
    return nbytes


def _allreduce_cost(ranks: int, nbytes: int, seconds: float, latency_s: float
                    ) -> AllReduceCost:
    """α and W from the synchronisation of ``nbytes`` taking ``seconds`` and that of
    :data:`LATENCY_BYTES` taking ``latency_s`` (s)."""
    beyond = max(seconds - latency_s, seconds / 2)  # a noisy α: never more than half of it
    return AllReduceCost(bus_bandwidth(nbytes, ranks, beyond), latency_s * 1000.0)


def measure_allreduce(ranks: int = 2, nbytes: int = 32 * 2**20, repeats: int = 7,
                      backend: str | None = None) -> AllReduceCost:
    """The latency α and the bus bandwidth W of ``ranks`` local ranks synchronising gradients
    with DistributedDataParallel (see the module docstring): α timed on
    :data:`LATENCY_BYTES` gradient bytes (the median of ``3 · repeats`` timings: a small figure
    spreads more), W from what ``nbytes`` bytes add to it, so that α + 2 (k − 1)/k · n / W is
    the time measured at ``nbytes``. Kept for the process's lifetime, as
    :func:`measure_allreduce_bandwidth` (whose figure, α included, it reuses).

    Raises:
        As :func:`measure_allreduce_bandwidth`; ``nbytes`` must exceed :data:`LATENCY_BYTES`.
    """
    nbytes = _above_latency(nbytes)
    whole = measure_allreduce_bandwidth(ranks, nbytes, repeats, backend)
    small = measure_allreduce_bandwidth(ranks, LATENCY_BYTES, 3 * repeats, backend)
    seconds = bus_bandwidth(nbytes, ranks, 1.0) / whole  # the time measured at nbytes
    latency = bus_bandwidth(LATENCY_BYTES, ranks, 1.0) / small
    return _allreduce_cost(ranks, nbytes, seconds, latency)


@dataclass(frozen=True, slots=True)
class Collectives:
    """The figures of :func:`measure_collectives`.

    Attributes:
        allreduce: the replicas' gradient synchronisation, as :func:`measure_allreduce`.
        link_bytes_per_s: one stage's send to the next, as :func:`measure_link_bandwidth`
            (bytes/s, one direction).
    """

    allreduce: AllReduceCost
    link_bytes_per_s: float


def collectives_of(ranks: int, nbytes: int, seconds: float, latency_s: float,
                   link_bytes: int, link_s: float) -> Collectives:
    """The figures from the times measured (s): the synchronisation of ``nbytes`` took
    ``seconds``, that of :data:`LATENCY_BYTES` ``latency_s``, half a round trip of
    ``link_bytes`` ``link_s`` (the arithmetic of :func:`measure_allreduce` and
    :func:`measure_link_bandwidth`)."""
    return Collectives(_allreduce_cost(ranks, nbytes, seconds, latency_s),
                       link_bytes / max(link_s, 1e-9))


def measure_collectives(ranks: int = 2, nbytes: int = 32 * 2**20,
                        link_bytes: int = 16 * 2**20, repeats: int = 7,
                        backend: str | None = None) -> Collectives:
    """:func:`measure_allreduce` and :func:`measure_link_bandwidth` (between ranks 0 and 1) at
    once, on one set of ``ranks`` fresh processes: what the machine's figures need, for one
    process start instead of three. Each figure is kept for the process's lifetime, as the
    functions it stands for keep theirs, and taken from there when they measured it already.

    Raises:
        As :func:`measure_allreduce` and :func:`measure_link_bandwidth`.
    """
    ranks, backend = _group(ranks, backend)
    nbytes = _above_latency(nbytes)
    link_bytes = checks.positive_int("link_bytes", link_bytes)
    repeats = checks.positive_int("repeats", repeats)
    keys = ((ranks, nbytes, repeats, backend), (ranks, LATENCY_BYTES, 3 * repeats, backend),
            (0, link_bytes, repeats, backend))
    if any(key not in _MEASURED for key in keys):
        whole, small, link = _measure(_all_rank, ranks, (nbytes, LATENCY_BYTES, link_bytes),
                                      repeats, backend)
        for key, seconds in zip(keys, (whole, small)):
            _MEASURED.setdefault(key, bus_bandwidth(key[1], ranks, float(seconds)))
        _MEASURED.setdefault(keys[2], link_bytes / float(link))
    return Collectives(measure_allreduce(ranks, nbytes, repeats, backend),
                       measure_link_bandwidth(link_bytes, repeats, backend))


def link_seconds(rank: int, backend: str, device: Any, nbytes: int, repeats: int) -> float:
    """In a joined process group: ``nbytes`` sent from rank 0 to rank 1 and back, ``repeats``
    times after a warm-up; the median of half a round trip (s). Ranks beyond 1 only keep
    step."""
    import torch
    import torch.distributed as dist

    out = torch.ones(max(nbytes // 4, 1), device=device)
    into = torch.empty_like(out)
    other = 1 - rank

    def hop(send: bool) -> None:
        op = dist.isend(out, other) if send else dist.irecv(into, other)
        op.wait()

    halves = []
    for i in range(repeats + 1):  # the first: connections and buffers, not timed
        dist.barrier()
        if rank > 1:
            continue
        if backend == "nccl":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        hop(rank == 0)
        hop(rank == 1)
        if backend == "nccl":
            torch.cuda.synchronize(device)
        if i:
            halves.append((time.perf_counter() - t0) / 2)
    dist.barrier()
    return max(statistics.median(halves), 1e-9) if halves else 0.0


def _link_rank(rank: int, ranks: int, port: int, backend: str, nbytes: int, repeats: int,
               results: Any) -> None:
    """:func:`link_seconds` on a process group of its own; rank 0 puts it (s)."""
    device = _join(rank, ranks, port, backend)
    try:
        seconds = link_seconds(rank, backend, device, nbytes, repeats)
        if rank == 0:
            results.put(seconds)
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def _all_rank(rank: int, ranks: int, port: int, backend: str,
              sizes: tuple[int, int, int], repeats: int, results: Any) -> None:
    """The synchronisation at ``sizes[0]`` and at ``sizes[1]`` bytes (the latter 3 ·
    ``repeats`` times) and the link at ``sizes[2]`` bytes, on one process group: rank 0 puts
    the three times (s)."""
    device = _join(rank, ranks, port, backend)
    try:
        whole = sync_seconds(rank, backend, device, sizes[0], repeats)
        small = sync_seconds(rank, backend, device, sizes[1], 3 * repeats)
        link = link_seconds(rank, backend, device, sizes[2], repeats)
        if rank == 0:
            results.put((whole, small, link))
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def measure_link_bandwidth(nbytes: int = 16 * 2**20, repeats: int = 7,
                           backend: str | None = None) -> float:
    """The measured bandwidth of one stage's send to the next between 2 local ranks (bytes/s,
    one direction; see the module docstring): ``nbytes`` over the median of ``repeats``
    half round trips.

    ``backend`` defaults to NCCL when there are 2 GPUs, else gloo. Kept for the process's
    lifetime, as :func:`measure_allreduce_bandwidth`.

    Raises:
        ArgumentTypeError, InvalidInputError: a count that is not a positive integer, an
            unknown backend.
    """
    import torch

    nbytes = checks.positive_int("nbytes", nbytes)
    repeats = checks.positive_int("repeats", repeats)
    if backend is None:
        backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    checks.one_of("backend", backend, ("gloo", "nccl"))
    key = (0, nbytes, repeats, backend)  # 0 ranks: the link's key, not an all-reduce's
    if key not in _MEASURED:
        _MEASURED[key] = nbytes / float(_measure(_link_rank, 2, nbytes, repeats, backend))
    return _MEASURED[key]


def _measure(rank_fn: Any, ranks: int, nbytes: Any, repeats: int, backend: str) -> Any:
    """Run ``rank_fn`` on ``ranks`` fresh local processes of one intra-op thread; what rank 0
    puts (s, or a tuple of them)."""
    import torch.multiprocessing as mp

    from autosplit.launch import free_port

    results = mp.get_context("spawn").SimpleQueue()
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the ranks' intra-op threads, as the CPU workers'
    try:
        mp.start_processes(rank_fn, args=(ranks, free_port(), backend, nbytes, repeats, results),
                           nprocs=ranks, join=True, start_method="spawn")
    except mp.ProcessExitedException:
        # A rank killed by a signal after rank 0 put its figure: torch's DDP and gloo threads
        # now and then abort at teardown ("terminate called without an active exception",
        # SIGABRT) once the timing is done; the figure stands. Before it: a real failure.
        if results.empty():
            raise
    finally:
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env
    return results.get()
