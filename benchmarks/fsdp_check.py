"""FSDP2 replicas on CPU workers: predicted memory per device beside one step's, and whether
FSDP2's collectives overlap compute.

Two gloo ranks on this machine, one intra-op thread each (the runtime's CPU workers).

**Memory.** A stack of ``--layers`` Linear(``--width``, ``--width``) blocks is profiled by
autosplit (one process), planned as data parallel ×2 with each replica mode (DDP, FSDP2,
FSDP2 without resharding) and Adam (two moments per parameter), GPipe, b samples a
micro-batch and m micro-batches per replica; and as 2 stages × 2 replicas on 4 ranks. Each plan is then trained by ``autosplit``'s
``Trainer`` on 2 ranks: one step (Adam's state then exists), the gradients dropped, and the
second step measured under torch's profiler (:func:`autosplit.measure.peak_memory.rise_during`):
measured = the rank's parameters (its shards) + Adam's state + the step's highest rise. The
prediction is the plan's ``Stage.memory_bytes`` (:mod:`autosplit.sharding`). The profiles
are saved beside the results (``fsdp_check_profile_*.json``): ``tests/test_sharding.py``
plans them again and holds the prediction to the measured bytes.

**Overlap.** Per round, taken in turn: A, compute: forward + backward of the plain stack
(t_c); B, collectives: what FSDP2 without resharding exchanges for it, each block's flat
parameters all-gathered and its flat gradients reduce-scattered (``all_gather_single``,
``reduce_scatter_single``, the primitives FSDP2 calls; t_x); C, FSDP2: forward + backward of
the stack under ``fully_shard`` per block, ``reshard_after_forward=False`` (t_f). The
overlapped share o = (t_c + t_x − t_f) / t_x (1: hidden, 0: none), from the medians of rank
0's times over ``--rounds`` rounds. Times are reported, never asserted.

    python benchmarks/fsdp_check.py               # writes benchmarks/results/fsdp_check.*
    python benchmarks/fsdp_check.py --smoke --out /tmp/x   # tiny, seconds
"""

from __future__ import annotations

if __name__ == "__main__":  # started again first, before the imports below pay twice: the C
    # allocator keeping freed memory, as the ranks run (see autosplit/measure/allocator.py)
    from autosplit.measure.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, command_line, describe, machine, timed_in_turn, write_results

from autosplit import PlanOptions, ProfileOptions

MODES = ("ddp", "fsdp2", "fsdp2-no-reshard")


def _stack(layers: int, width: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _local_bytes(tensors: Any) -> int:
    """Bytes of this rank's part of ``tensors`` (a DTensor's local shard)."""
    import torch

    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.untyped_storage().nbytes()
    return total


def _memory_rank(plan: Any, layers: int, width: int) -> Any:
    """One rank's measured peak (bytes) of the plan's second step, and its parts."""
    import torch
    import torch.distributed as dist

    from autosplit import distributed
    from autosplit.measure.peak_memory import rise_during

    x = torch.randn(plan.batch_size, width, generator=torch.Generator().manual_seed(1))
    y = torch.randn(plan.batch_size, width, generator=torch.Generator().manual_seed(2))
    trainer = distributed.Trainer(_stack(layers, width), plan,
                                  lambda out, target: ((out - target) ** 2).mean(),
                                  lambda ps: torch.optim.Adam(ps, lr=1e-3))
    trainer.step(x, y)
    for p in trainer.parameters():
        p.grad = None  # the step drops them first: freed here, seen by the profiler
    held = _local_bytes(trainer.parameters())
    state = _local_bytes(v for s in trainer.optimizer.state.values() for v in s.values())
    _, rise = rise_during(lambda: trainer.step(x, y))
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, {"params": held, "state": state, "rise": rise,
                                 "peak": held + state + rise})
    return out if dist.get_rank() == 0 else None


def memory(layers: int, width: int, split: int, microbatches: int, stages: int,
           out: Path) -> list[dict[str, Any]]:
    """Each mode's predicted and measured memory per device (bytes), for ``stages`` × 2
    replicas; the profile is saved in ``out`` (``tests/test_sharding.py`` plans it again)."""
    import torch

    from autosplit import distributed, profile
    from autosplit.planner import plan_replicated

    model = _stack(layers, width)
    batch = 2 * split * microbatches
    prof = profile(model, torch.randn(batch, width),
                   options=ProfileOptions(microbatch_sizes=[split], repeats=1, budget_s=None))
    name = f"fsdp_check_profile_{layers}x{width}.json"
    out.mkdir(parents=True, exist_ok=True)
    prof.save(out / name)
    rows = []
    for mode in MODES:
        plan = plan_replicated(prof, stages, 2,
                               options=PlanOptions(optimizer="adam", split_size=split,
                                                   replica_mode=mode, schedule="gpipe"))
        ranks = distributed.launch(_memory_rank, 2 * stages, plan, layers, width,
                                   timeout_s=120.0)[0]
        predicted = [s.memory_bytes for s in plan.stages]
        measured = [r["peak"] for r in ranks]  # rank r · p + j: stage j of replica r
        rows.append({"mode": mode, "layers": layers, "width": width, "split": split,
                     "microbatches": microbatches, "stages": stages, "replicas": 2,
                     "balance": list(plan.balance), "profile": name,
                     "param_bytes": sum(b.param_bytes for b in prof.blocks),
                     "predicted_bytes": predicted, "measured_bytes": measured,
                     "ranks": ranks, "error": max(predicted) / max(measured) - 1})
    return rows


def _overlap_rank(layers: int, width: int, batch: int, rounds: int) -> Any:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    plain = _stack(layers, width)
    sharded = _stack(layers, width)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    for layer in sharded:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(sharded, mesh=mesh, reshard_after_forward=False)
    x = torch.randn(batch, width)
    flats = [torch.cat([p.detach().reshape(-1) for p in layer.parameters()]) for layer in plain]
    shards = [f[: f.numel() // 2].clone() for f in flats]

    def compute() -> None:
        plain.zero_grad(set_to_none=True)
        plain(x).sum().backward()

    def collectives() -> None:
        for flat, shard in zip(flats, shards):
            dist.all_gather_single(torch.empty_like(flat), shard)
        for flat, shard in zip(reversed(flats), reversed(shards)):
            dist.reduce_scatter_single(output=torch.empty_like(shard), input=flat)

    def fsdp() -> None:
        sharded.zero_grad(set_to_none=True)
        sharded(x).sum().backward()

    steps = {"compute": compute, "collectives": collectives, "fsdp2": fsdp}
    times = timed_in_turn(steps, rounds)
    return times if dist.get_rank() == 0 else None


def overlap(layers: int, width: int, batch: int, rounds: int) -> dict[str, Any]:
    from autosplit import distributed

    times = distributed.launch(_overlap_rank, 2, layers, width, batch, rounds,
                               timeout_s=300.0)[0]
    med = {name: statistics.median(v) * 1000 for name, v in times.items()}
    share = (med["compute"] + med["collectives"] - med["fsdp2"]) / med["collectives"]
    return {"layers": layers, "width": width, "batch_per_rank": batch, "rounds": rounds,
            "param_bytes": layers * (width * width + width) * 4,
            "times_ms": {k: [t * 1000 for t in v] for k, v in times.items()},
            "median_ms": med, "overlap": share}


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args(argv)
    memory_cases = [(4, 64, 2, 2, 1)] if args.smoke else [
        (8, 512, 4, 2, 1), (4, 1024, 8, 4, 1), (8, 512, 4, 2, 2)]
    overlap_cases = [(2, 64, 4, 2)] if args.smoke else [
        (8, 1024, 32, args.rounds), (4, 2048, 64, args.rounds)]
    start = time.perf_counter()
    memory_rows = [row for case in memory_cases for row in memory(*case, args.out)]
    overlap_rows = [overlap(*case) for case in overlap_cases]
    seconds = time.perf_counter() - start
    info = machine()
    lines = [
        "# FSDP2 replicas on CPU workers (2 gloo ranks, 1 thread each)", "",
        (f"Machine: {describe(info)}. Run time {seconds:.0f} s. Command: "
         f"`{command_line('fsdp_check.py', sys.argv[1:] if argv is None else argv)}`"), "",
        "## Memory per device: predicted (the plan) beside one step measured (torch's profiler)",
        "",
        "p stages × 2 replicas, Adam, GPipe; measured: the rank's parameters + Adam's state + "
        "the second step's highest rise, the largest over the ranks; predicted: the largest "
        "stage's ``memory_bytes``.", "",
        "| layers × width | p × d | b × m | parameters | mode | predicted | measured | "
        "predicted / measured − 1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in memory_rows:
        lines.append(f"| {r['layers']} × {r['width']} | {r['stages']} × {r['replicas']} | "
                     f"{r['split']} × {r['microbatches']} | {_mib(r['param_bytes'])} | "
                     f"{r['mode']} | {_mib(max(r['predicted_bytes']))} | "
                     f"{_mib(max(r['measured_bytes']))} | {r['error']:+.1%} |")
    lines += [
        "", "## Do FSDP2's collectives overlap compute?", "",
        "Medians over the rounds (rank 0), the three steps taken in turn each round.", "",
        ("| layers × width | batch/rank | parameters | compute t_c | collectives t_x | "
         "FSDP2 t_f | overlap o = (t_c + t_x − t_f) / t_x |"),
        "|---|---|---|---|---|---|---|",
    ]
    for r in overlap_rows:
        m = r["median_ms"]
        lines.append(f"| {r['layers']} × {r['width']} | {r['batch_per_rank']} | "
                     f"{r['param_bytes'] / 2**20:.0f} MiB | {m['compute']:.1f} ms | "
                     f"{m['collectives']:.1f} ms | {m['fsdp2']:.1f} ms | {r['overlap']:.2f} |")
    write_results(args.out, "fsdp_check_smoke" if args.smoke else "fsdp_check",
                  {"machine": info, "seconds": seconds, "memory": memory_rows,
                   "overlap": overlap_rows}, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
