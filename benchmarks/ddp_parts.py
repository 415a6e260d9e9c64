"""Data parallelism's step on 2 CPU workers, taken apart, against autosplit's prediction of it.

For each model (``hf_models.py``: tiny Llama and GPT-2, B = 32 × 32 tokens, their own loss):
one profile at b = 16 (``autosplit.profile``), the machine's figures as ``autosplit plan`` takes
them (``autosplit.measure.machine.with_machine_figures``), and autosplit's plan of 1 stage × 2
replicas under DDP (``plan_replicated``) with its predicted step and the parts it adds up: the stage's
compute, DDP's gradient synchronisation, the optimizer's update and the one-stage runtime's
cost per action. Then, on 2 gloo ranks of one thread each, in one launch, interleaved round by
round (A B … then … B A), each timing ``--steps`` steps after a barrier (the slower rank's):

* **trainer**: autosplit's ``Trainer`` of that plan (what ``autosplit run`` trains);
* **DDP**: the HF model under ``DistributedDataParallel``, forward, backward, SGD step;
* **DDP no_sync**: the same without the all-reduce (``no_sync()``);
* **both ranks**: the HF model without DDP on both ranks at once, with the SGD step;
* **rank 0 alone**: the same on rank 0 while rank 1 waits;
* **forward + backward**: both ranks at once, no optimizer;
* **one all-reduce**: of a flat tensor of the model's gradient elements.

DDP − no_sync is what synchronisation costs as it runs, set against the predicted one; trainer −
DDP what the runtime adds. ``--rounds`` timed rounds after 2 untimed ones; median and min–max.

    python benchmarks/ddp_parts.py     # ~4 min on 2 quiet cores; writes benchmarks/results/ddp_parts.*
    python benchmarks/ddp_parts.py --smoke   # the tiny models in about a minute
"""

from __future__ import annotations

if __name__ == "__main__":  # started again first, before the imports below pay twice: the C
    # allocator keeping freed memory, as the ranks run (see autosplit/measure/allocator.py)
    from autosplit.measure.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from common import RESULTS, command_line, describe, machine, write_results
from hf_models import HFSpec

import autosplit
from autosplit import PlanOptions, ProfileOptions
from autosplit.measure.machine import with_machine_figures
from autosplit.planner.layouts import plan_replicated
from autosplit.records import Plan

BATCH, SIZE = 32, 16
PARTS = ("trainer", "DDP", "DDP no_sync", "both ranks", "rank 0 alone", "forward + backward",
         "one all-reduce")


def _rank(plan_path: str, key: str, rounds: int, steps: int) -> dict[str, list[float]] | None:
    """Every part of :data:`PARTS` timed ``rounds`` times on this rank (ms per step, the slower
    rank's); rank 0 returns them."""
    import torch.distributed as dist
    from harness import _trainer
    from torch.nn.parallel import DistributedDataParallel

    from autosplit.measure.losses import model_loss

    torch.set_num_threads(1)
    rank = dist.get_rank()
    spec = HFSpec(key, BATCH)
    kwargs = spec.make_kwargs()
    half = {k: v[rank * SIZE:(rank + 1) * SIZE] for k, v in kwargs.items()}
    trainer = _trainer(Plan.load(plan_path), spec.build(), torch.device("cpu"), (), kwargs, True)
    replicated = spec.build()
    ddp = DistributedDataParallel(replicated)
    ddp_sgd = torch.optim.SGD(replicated.parameters(), lr=1e-3)
    plain = spec.build()
    sgd = torch.optim.SGD(plain.parameters(), lr=1e-3)
    flat = torch.zeros(sum(p.numel() for p in plain.parameters()))

    def with_ddp(sync: bool) -> None:
        ddp_sgd.zero_grad(set_to_none=True)
        if sync:
            model_loss(ddp(**half)).backward()
        else:
            with ddp.no_sync():
                model_loss(ddp(**half)).backward()
        ddp_sgd.step()

    def alone(update: bool = True) -> None:
        sgd.zero_grad(set_to_none=True)
        model_loss(plain(**half)).backward()
        if update:
            sgd.step()

    parts = dict(zip(PARTS, (
        lambda: trainer.step((), None, kwargs=kwargs),
        lambda: with_ddp(True),
        lambda: with_ddp(False),
        alone,
        lambda: alone() if rank == 0 else None,
        lambda: alone(update=False),
        lambda: dist.all_reduce(flat),
    )))
    times: dict[str, list[float]] = {name: [] for name in PARTS}
    for r in range(rounds + 2):
        for name in (PARTS if r % 2 == 0 else PARTS[::-1]):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                parts[name]()
            took = torch.tensor([(time.perf_counter() - start) * 1000.0 / steps])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if r >= 2:
                times[name].append(float(took))
    return times if rank == 0 else None


def run_model(key: str, args: argparse.Namespace) -> dict[str, Any]:
    from autosplit.launch import launch

    spec = HFSpec(key, BATCH)
    profile = autosplit.profile(spec.build(), (), spec.make_kwargs(),
                                options=ProfileOptions(microbatch_sizes=[SIZE]))
    profile, _, note = with_machine_figures(profile, ["gpipe"])
    print(f"{key}: {note}", flush=True)
    plan = plan_replicated(profile, 1, 2, PlanOptions(replica_mode="ddp"))
    predicted = {"step": plan.predicted_step_ms, "compute": plan.stages[0].compute_ms,
                 "synchronisation": plan.sync_after_ms, "update": plan.update_ms,
                 "runtime per action": plan.action_ms}
    print(f"{key}: predicted {plan.predicted_step_ms:.1f} ms; measuring …", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "plan.json")
        plan.save(path)
        times = launch(_rank, 2, path, key, args.rounds, args.steps, timeout_s=900)[0]
    measured = {name: {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t),
                       "ms": t} for name, t in times.items()}
    trainer = measured["trainer"]["median_ms"]
    return {"key": key, "describe": spec.describe, "replica_mode": plan.replica_mode,
            "predicted_ms": predicted,
            "measured": measured, "error": (plan.predicted_step_ms - trainer) / trainer,
            "sync_measured_ms": measured["DDP"]["median_ms"] - measured["DDP no_sync"]["median_ms"],
            "runtime_measured_ms": trainer - measured["DDP"]["median_ms"]}


def markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    lines = ["# Data parallelism's step on 2 CPU workers, taken apart", "",
             f"Machine: {describe(s['machine'])}.  ", f"Command: `{s['command']}`.  ",
             (f"2 gloo ranks of 1 thread each, one launch; {s['rounds']} interleaved rounds after "
              f"2 untimed ones, each timing {s['steps']} steps after a barrier (the slower "
              "rank's); median and min–max. Total "
              f"{data['seconds']:.0f} s."), ""]
    for m in data["models"]:
        p = m["predicted_ms"]
        lines += [f"## {m['key']} ({m['describe']}), 1 stage × 2 replicas, b = {SIZE}", "",
                  (f"Predicted step {p['step']:.1f} ms: compute {p['compute']:.1f}, DDP's "
                   f"synchronisation {p['synchronisation']:.1f}, update {p['update']:.1f}, "
                   f"runtime {p['runtime per action']:.2f} per action. Measured (trainer) "
                   f"{m['measured']['trainer']['median_ms']:.1f} ms: the prediction is "
                   f"{m['error']:+.1%} off. Synchronisation as it runs (DDP − no_sync): "
                   f"{m['sync_measured_ms']:.1f} ms; the runtime beyond DDP (trainer − DDP): "
                   f"{m['runtime_measured_ms']:.1f} ms."), "",
                  "| part | median ms | min–max ms |", "|---|---|---|"]
        lines += [f"| {name} | {x['median_ms']:.1f} | {x['min_ms']:.1f}–{x['max_ms']:.1f} |"
                  for name, x in m["measured"].items()]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["hf-gpt2-small", "hf-llama-small"],
                        choices=["hf-gpt2-small", "hf-llama-small", "hf-gpt2-tiny",
                                 "hf-llama-tiny"])
    parser.add_argument("--rounds", type=int, default=12, help="timed rounds (default 12)")
    parser.add_argument("--steps", type=int, default=3, help="steps per timing (default 3)")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny models, 2 rounds of 1 step, to a temporary folder")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the results (default benchmarks/results)")
    args = parser.parse_args(argv)
    if args.smoke:
        if args.out is not None and args.out.resolve() == RESULTS.resolve():
            parser.error("--smoke never writes to benchmarks/results: give another --out")
        args.models, args.rounds, args.steps = ["hf-gpt2-tiny", "hf-llama-tiny"], 2, 1
        args.out = args.out or Path(tempfile.mkdtemp(prefix="ddp-parts-smoke-"))
    args.out = args.out or RESULTS
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be positive")
    start = time.perf_counter()
    models = [run_model(key, args) for key in args.models]
    data = {"settings": {"machine": machine(), "rounds": args.rounds, "steps": args.steps,
                         "command": command_line("ddp_parts.py", sys.argv[1:] if argv is None
                                                 else argv)},
            "seconds": time.perf_counter() - start, "models": models}
    text = markdown(data)
    write_results(args.out, "ddp_parts_smoke" if args.smoke else "ddp_parts", data, text)
    print(text)


if __name__ == "__main__":
    main()
