"""``autosplit compare``: autosplit's plan beside a hand-written split and the baselines,
predicted by one simulator and, with ``--measure``, trained side by side."""

from __future__ import annotations

import argparse
import statistics

from rich.console import Console

from autosplit.cli.common import device_spec, load_model, make_console, model_args
from autosplit.cli.measuring import profile_for, report_verification, verifier
from autosplit.cli.profile_plan import manual_reference
from autosplit.planner import PlanOptions
from autosplit.records import Plan
from autosplit.workflow import PlanRequest, choose_plan

__all__ = ["compare_command"]


def _measure_plans(args: argparse.Namespace, plans: dict[str, Plan],
                   console: Console) -> dict[str, list[float]]:
    """Train every plan side by side on the multi-process runtime: each plan's timed step
    times (ms), ``--rounds`` of them, taken in turn."""
    import torch

    from autosplit.distributed import RankSettings, RunSpec, launch, measure_plans

    runnable = {k: p for k, p in plans.items() if p.batch_size == p.microbatches * p.split_size}
    for name in plans.keys() - runnable.keys():
        console.print(f" {name}: not measured (its micro-batches are not all of one size)")
    if not runnable:
        return {}
    first = next(iter(runnable.values()))
    backend = "nccl" if torch.cuda.device_count() >= args.gpus else "gloo"
    shape = tuple(args.input_shape) if args.input_shape else None
    spec = RunSpec(args.model, args.entry, first, input_shape=shape,
                   model_args=tuple(model_args(args).items()))
    console.print(f"measuring {len(runnable)} plans on {args.gpus} ranks ({backend}), "
                  f"{args.rounds} timed step(s) each, taken in turn …")
    results = launch(measure_plans, args.gpus, spec, list(runnable.values()), args.rounds,
                     backend=backend, timeout_s=args.timeout,
                     ranks=RankSettings(threads=1 if backend == "gloo" else None))
    times = results[0]
    return {name: [1000.0 * x for x in t] for name, t in zip(runnable, times)}


def compare_command(args: argparse.Namespace) -> int:
    """``autosplit compare``: print the comparison table; draw it with ``--plot``."""
    from autosplit.comparison import baseline_plans, compare
    from autosplit.report import comparison_table

    console = make_console()
    memory = args.memory
    spec = None if args.profile else device_spec(args)
    if spec is not None:
        memory = memory or spec.memory_bytes
    source, model, inputs = load_model(args, on_meta=spec is not None)
    size = args.manual_split_size or source.manual_split_size
    prof = profile_for(args, source, model, inputs, console, size)
    options = PlanOptions(batch_size=args.batch_size or prof.batch_size, memory_per_gpu=memory,
                          schedule=args.schedule, optimizer=args.optimizer)
    others: dict[str, Plan] = {}
    reference = manual_reference(prof, source, args, options)
    if reference is not None:
        others["hand split"] = reference[1]
    others.update(baseline_plans(prof, args.gpus, options))
    request = PlanRequest(args.gpus, options,
                          pipeline_only=True)  # pipelines of N stages, beside the others
    verify = verifier(args, model, inputs, prof, console)
    planned = choose_plan(prof, request, verify, others)
    report_verification(console, planned)
    plans = {"autosplit": planned.plan, **dict(planned.references)}
    measured = _measure_plans(args, plans, console) if args.measure else {}
    rows = compare(prof, plans, {n: statistics.median(t) for n, t in measured.items()}
                   if args.measure else None)
    console.print()
    console.print(comparison_table([(r.name, r.plan, measured.get(r.name)) for r in rows]))
    if measured:
        console.print(f" measured: the median of {args.rounds} timed step(s) per plan, the plans "
                      "taking turns after a warm-up step each (range in brackets)")
    console.print()
    how = ("stage times verified: each plan's stages timed as they run, taking turns"
           if verify is not None else "from block sums")
    console.print(f" all predicted by one simulator, {how} (profile {prof.describe()})")
    if args.plot:
        from autosplit.figures import comparison_figure

        title = (f"{prof.model} on {args.gpus} devices, batch {options.batch_size}: "
                 "predicted step time")
        args.outputs.commit({"--plot": lambda path: comparison_figure(rows, path, title)})
        console.print(f" wrote {args.plot}")
    return 0
