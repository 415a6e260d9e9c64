"""Where the planning commands get their numbers: a profile measured with a progress bar, an
analytic estimate or a ``--profile`` file, and the candidates' stages timed as they run."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console

from autosplit.cli.common import device_spec
from autosplit.errors import InvalidInputError
from autosplit.estimate.options import EstimateOptions
from autosplit.records import Plan, Profile
from autosplit.units import format_ms
from autosplit.verify.options import TimingOptions
from autosplit.workflow import PIPELINE_AGAIN, SEPARATED, Planned, Verifier

__all__ = ["estimate", "device_note", "measure", "profile_for", "report_verification",
           "verifier", "verifies", "with_schedule_costs"]


def estimate(args: argparse.Namespace, spec: Any, model: Any, inputs: Any, stages: int,
             console: Console) -> Profile:
    """An analytic profile of ``model`` on ``spec`` (FLOPs and bytes counted on meta)."""
    import time

    import torch

    from autosplit.estimate.analytic import analytic_profile

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    start = time.perf_counter()
    options = EstimateOptions(microbatch_sizes=getattr(args, "microbatch_sizes", None),
                              stages=stages, dtype=dtypes.get(getattr(args, "dtype", None) or ""))
    prof = analytic_profile(model, inputs, spec, options=options)
    console.print(
        f"estimated {prof.model} on {spec.label()} from its FLOPs and bytes (an estimate, not a "
        f"measurement) · micro-batch sizes {', '.join(map(str, prof.microbatch_sizes))} · "
        f"{time.perf_counter() - start:.1f} s"
    )
    return prof


def device_note(console: Console, gpus: int, device: str | None) -> None:
    """Say that CPU workers stand in for devices when there are too few CUDA devices."""
    import torch

    if (device is None or device.startswith("cpu")) and torch.cuda.device_count() < gpus:
        console.print(
            f"no CUDA device{'s' if gpus > 1 else ''} for {gpus} stages: profiling on CPU, one "
            f"worker per device; planning for {gpus} such devices"
        )


def _progress(what: str, console: Console, **options: Any) -> Any:
    """A progress bar ``<what> {description} ━━━ 40% 0:00:03``."""
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(TextColumn(f"{what} {{task.description}}"), BarColumn(),
                    TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(),
                    TextColumn("· about"), TimeRemainingColumn(), TextColumn("left"),
                    console=console, **options)


def _schedules(args: argparse.Namespace) -> tuple[str, ...] | None:
    """The schedules whose runtime cost per action the command measures with the profile:
    ``--schedule``'s; none yet for ``auto`` (:func:`with_schedule_costs` measures those that
    can win, once the candidates are known); ``None`` (every one) for a command without the
    option (``profile``: its file may be planned with any)."""
    schedule = getattr(args, "schedule", None)
    return None if schedule is None else () if schedule == "auto" else (schedule,)


def captured(args: argparse.Namespace, model: Any, example: Any) -> tuple[Any, Any]:
    """(the model's BlockGraph, its flat example inputs) from a model file's example inputs
    (a tensor, a tuple, a dict of keyword inputs, or both), captured as the command says:
    once per command (profiling and verifying share the capture)."""
    from autosplit.capture.signature import example_call
    from autosplit.capture.trace import trace
    from autosplit.measure.profiler import check_inputs

    done = getattr(args, "_captured", None)
    if done is not None and done[0] is model and done[1] is example:
        return done[2]
    call_args, call_kwargs = example_call(example)
    graph = trace(model, example_inputs=call_args, example_kwargs=call_kwargs,
                  **getattr(args, "capture_options", {}))
    result = graph, check_inputs(graph.signature.flatten(call_args, call_kwargs,
                                                         graph.model_name))
    args._captured = (model, example, result)
    return result


def measure(args: argparse.Namespace, model: Any, inputs: Any, stages: int, console: Console,
            include: int | None = None) -> Profile:
    """Profile ``model`` with a progress bar; ``include`` is a micro-batch size to measure
    too (when it fits the batch). The runtime's cost per action is measured for the schedules
    the command plans with (:func:`_schedules`)."""
    from autosplit.measure import steal_time
    from autosplit.measure.profiler import ProfileOptions, profile_graph

    graph, inputs = captured(args, model, inputs)
    with _progress("profiling", console, transient=False) as bar:
        task = bar.add_task(f"{graph.model_name} · {len(graph.blocks)} blocks", total=None)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total)

        options = ProfileOptions(
            microbatch_sizes=args.microbatch_sizes,
            include=(include,) if include and include <= int(inputs[0].shape[0]) else (),
            stages=stages,
            repeats=args.repeats,
            threads=args.threads,
            budget_s=profile_budget_s(args),
            loss=args.loss,
        )
        prof = profile_graph(graph, inputs, device=args.device, options=options,
                             progress=progress)
        bar.update(task, completed=1, total=1)
    aside = (f"; {prof.set_aside} timed round(s) set aside: the hypervisor took over "
             f"{steal_time.MAX_SHARE:.0%} of the CPUs during them" if prof.set_aside else "")
    console.print(
        f"measured micro-batch sizes {', '.join(map(str, prof.microbatch_sizes))} in "
        f"{prof.seconds:.1f} s{aside}"
    )
    stash: list[Any] = []
    args._machine_figures = stash
    return _with_allreduce(prof, stages, console, _schedules(args),
                           getattr(args, "remeasure", False), stash)


def _with_allreduce(prof: Profile, stages: int, console: Console,
                    schedules: Sequence[str] | None = None, remeasure: bool = False,
                    figures_out: list[Any] | None = None) -> Profile:
    """``prof`` with the machine's figures (:mod:`autosplit.measure.machine_cache`), from the cache
    or measured: the all-reduce and link bandwidths of 2 local ranks (gloo between CPU
    workers, NCCL between GPUs) and, between CPU workers, the pipeline runtime's cost per
    action of ``schedules`` (``None``: every schedule the planner searches;
    :mod:`autosplit.measure.runtime_cost`) and of one stage, when planning for more than one device.
    ``figures_out`` receives the figures (for :func:`with_schedule_costs`)."""
    import torch

    from autosplit.measure.machine import with_machine_figures
    from autosplit.measure.runtime_cost import MEASURED

    if stages < 2 or (prof.device.kind == "cuda" and torch.cuda.device_count() < 2):
        return prof
    wanted = tuple(schedules if schedules is not None else (name for name, _ in MEASURED))
    prof, figures, note = with_machine_figures(prof, wanted, remeasure=remeasure)
    console.print(note)
    backend = "gloo between 2 CPU workers" if prof.device.kind == "cpu" else "NCCL, 2 GPUs"
    console.print(f"({backend}) DDP's gradient all-reduce, 32 MiB: "
                  f"{figures.allreduce_bytes_per_s / 1e9:.2f} GB/s bus bandwidth after "
                  f"{format_ms(figures.allreduce_latency_ms)} whatever its size; a stage's send "
                  f"to the next, 16 MiB: {figures.link_bytes_per_s / 1e9:.2f} GB/s")
    if wanted:
        _print_actions(console, figures, wanted)
    if figures_out is not None:
        figures_out.append(figures)
    return prof


def _print_actions(console: Console, figures: Any, names: Sequence[str], note: str = "") -> None:
    """The runtime's cost per action of ``names`` and of one stage, in one line."""
    if not figures.action_ms and figures.one_stage_action_ms is None:
        return
    spreads = dict(figures.action_spread)
    console.print("torch's pipeline runtime per action (gloo, 2 CPU workers; ± half the "
                  "interquartile range over the rounds): "
                  + "".join(f"{name} {ms:.2f} ± {spreads[name]:.2f} ms, "
                            for name, ms in figures.action_ms if name in names)
                  + f"one stage per replica {figures.one_stage_action_ms:.2f} ± "
                    f"{figures.one_stage_action_spread:.2f} ms" + note)


def with_schedule_costs(args: argparse.Namespace, prof: Profile, request: Any,
                        console: Console) -> Profile:
    """``prof`` with the runtime's cost per action of the schedules that can win the plan of
    ``request`` (:func:`autosplit.workflow.schedules_worth_measuring`; ``--schedule auto`` on
    CPU workers, with a profile measured by this command): from the cache, else measured now,
    the most promising first, then those that can still win."""
    import dataclasses

    from autosplit.measure.machine_cache import figures_for
    from autosplit.measure.runtime_cost import MEASURED
    from autosplit.workflow import schedules_worth_measuring

    stash = getattr(args, "_machine_figures", None)
    if args.schedule != "auto" or not stash or prof.device.kind != "cpu":
        return prof
    figures = stash[-1]
    from autosplit.measure.machine import machine_measurers

    key, measurers = machine_measurers(prof.device.kind)
    names = list(dict.fromkeys(name for name, _ in MEASURED))
    known = [name for name, _ in figures.action_ms]
    measured_now: list[str] = []
    for first in (True, False):
        need = schedules_worth_measuring(prof, request, known)
        if not need:
            break
        # the most promising first, when measuring it may spare the others (each round
        # starts its own ranks: a few seconds)
        batch = list(need[:1] if first and len(need) > 2 else need)
        figures, _ = figures_for(key, [*known, *batch], measurers, have=figures)
        measured_now += batch
        known = [name for name, _ in figures.action_ms]
        prof = dataclasses.replace(prof, **figures.profile_fields())
    left = [name for name in names if name not in known]
    note = ""
    if measured_now:
        note += f"; measured now: {', '.join(measured_now)}"
    if left:
        note += (f"; not measured: {', '.join(left)} (not runnable here, or their best plan "
                 "cannot beat the best plan known even at no runtime cost)")
    _print_actions(console, figures, known, note)
    return prof


def profile_for(args: argparse.Namespace, source: Any, model: Any, inputs: Any,
                console: Console, must_measure: int | None = None) -> Profile:
    """The profile to plan from: ``--profile`` (checked against the model) or a measurement.

    ``must_measure`` is a micro-batch size the measurement has to include (a hand split's).
    """

    if args.profile:
        prof = Profile.load(args.profile)
        fingerprint = captured(args, model, inputs)[0].fingerprint  # as the command captures
        if prof.fingerprint != fingerprint:
            raise InvalidInputError(
                f"profile {args.profile!r} was made for another model ({prof.model}, fingerprint "
                f"{prof.fingerprint}); {args.model} has fingerprint {fingerprint}: profile it again"
            )
        return prof
    spec = device_spec(args)
    if spec is not None:
        return estimate(args, spec, model, inputs, args.gpus, console)
    device_note(console, args.gpus, args.device)
    return measure(args, model, inputs, args.gpus, console, must_measure)


def verifies(args: argparse.Namespace, prof: Profile) -> bool:
    """Verify stage times: on by default for a profile measured by this command."""
    return not args.no_verify and prof.source == "measured" and not args.profile


PROFILE_BUDGET_S = 40.0
"""How long profiling starts new default sizes without ``--budget`` (s)."""

VERIFY_BUDGET_S = 60.0
"""How long verification takes more rounds without ``--budget`` (s; at least 3 rounds)."""

PROFILE_SHARE = 0.4
"""The share of ``--budget`` profiling may take in a command that also plans."""


def elapsed_s(args: argparse.Namespace) -> float:
    """Seconds since the command started."""
    import time

    return time.perf_counter() - getattr(args, "started_at", time.perf_counter())


def profile_budget_s(args: argparse.Namespace) -> float:
    """How long profiling may start new default sizes (s): ``--budget``'s share (all of it
    for ``autosplit profile``), else :data:`PROFILE_BUDGET_S`."""
    if args.budget is None:
        return PROFILE_BUDGET_S
    share = 1.0 if getattr(args, "command", None) == "profile" else PROFILE_SHARE
    return max(args.budget * share - elapsed_s(args), 0.0)


def verifier(args: argparse.Namespace, model: Any, inputs: Any, prof: Profile,
             console: Console) -> Verifier | None:
    """How the command verifies candidates (:data:`autosplit.workflow.Verifier`): their
    stages and the other plans' timed as they run, with a progress bar; ``None`` when it does
    not verify (:func:`verifies`)."""
    if not verifies(args, prof):
        return None
    from autosplit.verify.choice import VerificationSkipped, verify_and_choose

    def verify(candidates: Sequence[Plan], others: Mapping[str, Plan]
               ) -> tuple[Plan, dict[str, Plan]]:
        graph, flat = captured(args, model, inputs)
        what = f"the {len(candidates)} best candidate{'s' if len(candidates) > 1 else ''}"
        listed = [name for name in others if not name.startswith(PIPELINE_AGAIN)]
        if listed:
            what += f" and {', '.join(listed)}"
        left = None if args.budget is None else args.budget - elapsed_s(args)
        skipped = None
        with _progress("verifying", console) as bar:
            task = bar.add_task(f"{what}, stage by stage", total=None)
            try:
                timing = TimingOptions(
                    device=args.device, threads=args.threads,
                    budget_s=VERIFY_BUDGET_S if left is None else max(left, 0.0))
                result = verify_and_choose(
                    graph, flat, prof, candidates, others, fit_budget=left is not None,
                    options=timing,
                    progress=lambda done, total, _: bar.update(task, completed=done,
                                                               total=total),
                )
                bar.update(task, completed=1, total=1)
            except VerificationSkipped as why:
                skipped = why
                bar.update(task, visible=False)
        if skipped is not None:
            console.print(f"not verified: {skipped} of --budget {args.budget:g} s; the "
                          "predictions are block sums (a larger --budget verifies)")
            return min(candidates, key=lambda c: c.predicted_step_ms), dict(others)
        return result

    return verify


def report_verification(console: Console, planned: Planned) -> None:
    """One line: how long verification took, what it changed, what it left out."""
    if not planned.verify_s or not planned.plan.verification:
        return
    from autosplit.verify.choice import describe_shape

    first = planned.block_sum_choice
    change = (f"it chose {describe_shape(planned.plan)} where block sums chose "
              f"{describe_shape(first)}" if planned.changed and first is not None
              else f"it kept block sums' choice, {describe_shape(planned.plan)}")
    aside = planned.set_aside
    left = (f"; {len(aside)} candidate{'s' if len(aside) > 1 else ''} not verified, "
            f"{SEPARATED:.0%} or more slower by block sums" if aside else "")
    console.print(f"verified in {planned.verify_s:.1f} s: {change}{left}")
