"""Does DistributedDataParallel's gradient all-reduce overlap the backward on CPU workers?

Two gloo ranks on this machine, one intra-op thread each (the runtime's CPU workers), train a
stack of ``--layers`` Linear(``--width``, ``--width``) layers (fp32 gradients of 4·width² bytes
each) on ``--batch`` samples per rank. Each round, taken in turn A B C:

* A, compute: forward + backward of the plain model (no communication): t_c;
* B, all-reduce: the same gradients all-reduced one tensor after the other: t_a;
* C, DDP: forward + backward of the model under DistributedDataParallel (its buckets start
  all-reducing during the backward; ``backward()`` returns once all are done): t_ddp.

The overlapped share is o = (t_c + t_a − t_ddp) / t_a (1: hidden entirely, 0: none of it), from
the medians over ``--rounds`` rounds of rank 0's times; the planner's
:func:`autosplit.cost.replica_sync_ms` takes o as ``allreduce_overlap``.

    python benchmarks/allreduce_overlap.py     # writes benchmarks/results/allreduce_overlap.*
    python benchmarks/allreduce_overlap.py --smoke --out /tmp/x   # tiny, seconds
"""

from __future__ import annotations

if __name__ == "__main__":  # started again first, before the imports below pay twice: the C
    # allocator keeping freed memory, as the ranks run (see autosplit/measure/allocator.py)
    from autosplit.measure.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, command_line, describe, machine, timed_in_turn, write_results


def _rank(rank: int, port: int, layers: int, width: int, batch: int, rounds: int,
          results: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU())
                            for _ in range(layers)])
    wrapped = DistributedDataParallel(nn.Sequential(*[nn.Sequential(nn.Linear(width, width),
                                                                    nn.ReLU())
                                                      for _ in range(layers)]))
    x = torch.randn(batch, width)

    def compute() -> None:
        plain.zero_grad()
        plain(x).sum().backward()

    def allreduce() -> None:
        for p in plain.parameters():
            dist.all_reduce(p.grad)  # type: ignore[arg-type]

    def ddp() -> None:
        wrapped.zero_grad()
        wrapped(x).sum().backward()

    steps = {"compute": compute, "allreduce": allreduce, "ddp": ddp}
    times = timed_in_turn(steps, rounds)
    if rank == 0:
        results.put(times)
    dist.destroy_process_group()


def measure(layers: int, width: int, batch: int, rounds: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from autosplit.launch import free_port

    results = mp.get_context("spawn").SimpleQueue()
    os.environ["OMP_NUM_THREADS"] = "1"
    mp.start_processes(_rank, args=(free_port(), layers, width, batch, rounds, results),
                       nprocs=2, join=True, start_method="spawn")
    times = results.get()
    med = {name: statistics.median(v) * 1000 for name, v in times.items()}
    overlap = (med["compute"] + med["allreduce"] - med["ddp"]) / med["allreduce"]
    return {"layers": layers, "width": width, "batch_per_rank": batch, "rounds": rounds,
            "grad_bytes": layers * (width * width + width) * 4,
            "times_ms": {k: [t * 1000 for t in v] for k, v in times.items()},
            "median_ms": med, "overlap": overlap}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    cases = [(2, 64, 4, 2)] if args.smoke else [
        (8, 1024, 32, args.rounds), (8, 1024, 128, args.rounds), (4, 2048, 64, args.rounds)]
    start = time.perf_counter()
    rows = [measure(*case) for case in cases]
    seconds = time.perf_counter() - start
    info = machine()
    lines = [
        ("# Does DDP's all-reduce overlap the backward on CPU workers? (2 gloo ranks, 1 "
         "thread each)"), "",
        (f"Machine: {describe(info)}. Run time {seconds:.0f} s. Command: "
         f"`{command_line('allreduce_overlap.py', sys.argv[1:] if argv is None else argv)}`"),
        "", "Medians over the rounds (rank 0), the three steps taken in turn each round.", "",
        ("| layers × width | batch/rank | gradients | compute t_c | all-reduce t_a | DDP t_ddp "
         "| overlap o = (t_c + t_a − t_ddp) / t_a |"),
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["median_ms"]
        lines.append(f"| {r['layers']} × {r['width']} | {r['batch_per_rank']} | "
                     f"{r['grad_bytes'] / 2**20:.0f} MiB | {m['compute']:.1f} ms | "
                     f"{m['allreduce']:.1f} ms | {m['ddp']:.1f} ms | {r['overlap']:.2f} |")
    write_results(args.out, "allreduce_overlap_smoke" if args.smoke else "allreduce_overlap",
                  {"machine": info, "seconds": seconds, "rows": rows}, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
