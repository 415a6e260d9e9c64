"""``autosplit profile`` and ``autosplit plan``, and the hand-written split a plan is shown
beside."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from typing import Any

from rich.console import Console

from autosplit.cli.common import device_spec, load_model, make_console
from autosplit.cli.measuring import (
    PIPELINE_AGAIN,
    device_note,
    estimate,
    measure,
    profile_for,
    verifies,
    verify_plans,
)
from autosplit.cli.topology_args import resolve_device_count, topology_for
from autosplit.errors import AutosplitError, InfeasiblePlanError, InvalidInputError
from autosplit.records import Plan, Profile
from autosplit.topology import placements

__all__ = ["profile_command", "plan_command", "manual_reference"]


def profile_command(args: argparse.Namespace) -> int:
    """``autosplit profile``: measure (or estimate) every block; write the profile."""
    console = make_console()
    spec = device_spec(args)
    _, model, inputs = load_model(args, on_meta=spec is not None)
    if spec is not None:
        prof = estimate(args, spec, model, inputs, args.gpus, console)
    else:
        device_note(console, args.gpus, args.device)
        prof = measure(args, model, inputs, args.gpus, console)
    args.outputs.commit({"-o": prof.save})
    console.print(f"wrote {args.output}")
    return 0


def manual_reference(prof: Profile, source: Any, args: argparse.Namespace,
                     kwargs: dict[str, Any]) -> tuple[str, Plan] | None:
    """The hand-written split of ``--manual`` or the model file, scored; None if there is none."""
    from autosplit.comparison import manual_plan

    points = getattr(args, "manual", None) or source.manual_split
    explicit = getattr(args, "manual_split_size", None)
    if not points or len(points) + 1 != args.gpus:
        if getattr(args, "manual", None):
            raise InvalidInputError(
                f"--manual gives {len(points)} split point(s), i.e. {len(points) + 1} stages, "
                f"but --gpus is {args.gpus}"
            )
        if explicit is not None:
            found = (f"the model file's MANUAL_SPLIT has {len(points) + 1} stages, not "
                     f"--gpus {args.gpus}") if points else "the model file has no MANUAL_SPLIT"
            raise InvalidInputError(f"--manual-split-size {explicit} needs a hand split: {found}; "
                                    "give its first blocks with --manual BLOCK")
        return None  # no hand split, or the model file's is for another device count
    batch = kwargs["batch_size"]
    if explicit is not None and explicit > batch:
        raise InvalidInputError(f"--manual-split-size {explicit} is larger than the batch "
                                f"{batch}: give a smaller one or a larger --batch-size")
    if explicit is not None and explicit not in prof.microbatch_sizes:
        sizes = ",".join(map(str, sorted({*prof.microbatch_sizes, explicit})))
        raise InvalidInputError(
            f"--manual-split-size {explicit} was not profiled: the profile has micro-batch sizes "
            f"{', '.join(map(str, prof.microbatch_sizes))}; pick one of them or profile with "
            f"--microbatch-sizes {sizes}"
        )
    size, why = explicit or source.manual_split_size, ""
    if size is not None and size > batch:
        why = f"is larger than the batch {batch}"
    elif size is not None and size not in prof.microbatch_sizes:
        why = "was not profiled"
    plan = manual_plan(prof, points, None if why else size, **kwargs)
    label = f"hand split (cut at {', '.join(points)}, split {plan.split_size}"
    if why:  # the model file's size: the hand split gets its best measured one instead
        label += f"; its MANUAL_SPLIT_SIZE {size} {why}"
    return label + ")", plan


def _one_device_note(console: Console, prof: Profile, memory: float,
                     kwargs: dict[str, Any]) -> None:
    """Say whether one device of ``memory`` bytes could hold the model, and what it needs."""
    from autosplit.planner import plan as make_plan
    from autosplit.units import format_bytes

    try:
        make_plan(prof, 1, **{**kwargs, "memory_per_gpu": memory})
    except InfeasiblePlanError as exc:
        console.print(
            f" one device of {format_bytes(memory)} cannot hold it: it needs "
            f"{format_bytes(exc.min_capacity_bytes)} ({kwargs.get('optimizer', 'sgd')} state "
            "included)"
        )
    else:
        console.print(f" one device of {format_bytes(memory)} could hold it too")


def _chosen_plan(args: argparse.Namespace, source: Any, model: Any, inputs: Any,
                 prof: Profile, kwargs: dict[str, Any], layouts: Any,
                 console: Console) -> tuple[Plan, list[tuple[str, Plan]]]:
    """The plan of ``--gpus`` devices and the plans it is printed against.

    The candidates are the best pipelines of ``--gpus`` stages by block sums and, with
    ``layouts``, the best plan of every layout with replicas; all are timed stage by stage
    together (unless ``--no-verify``) and the fastest verified one is chosen (among those
    within noise or 3 % of it, the best by block sums:
    :func:`autosplit.verified_choice.steady_choice`). Beside it: the hand split, and the best
    pipeline when the choice has replicas.
    """
    from autosplit.planner import plan_candidates

    verify = verifies(args, prof)
    replicated = [] if layouts is None else [
        o.plan for o in layouts.options if o.plan is not None and o.replicas > 1]
    stages_max = min(len(prof.blocks), args.max_stages or args.gpus)
    pipelines: tuple[Plan, ...] = ()
    if args.gpus <= stages_max or not replicated:  # else no pipeline of --gpus stages
        try:
            pipelines = plan_candidates(
                prof, args.gpus, top_k=3 if verify else 1, split_size=args.split_size,
                solver=args.solver, **kwargs)
        except InfeasiblePlanError:
            if not replicated:
                raise
    candidates = [*pipelines, *replicated]
    others: dict[str, Plan] = {}
    reference = manual_reference(prof, source, args, kwargs)
    if reference is not None:
        others[reference[0]] = reference[1]
    # each pipeline candidate again, by name (its stage runs are timed once): the best
    # pipeline after verification is printed beside a choice with replicas
    piped = {f"{PIPELINE_AGAIN}{i}": c for i, c in enumerate(pipelines)} if replicated else {}
    if verify:
        plan, others = verify_plans(args, model, inputs, prof, candidates, {**others, **piped},
                                    console)
    else:
        plan = min(candidates, key=lambda c: c.predicted_step_ms)
        others = {**others, **piped}
    if piped and pipelines:
        best_piped = min((others.pop(name) for name in piped),
                         key=lambda c: c.predicted_step_ms)
        if plan.replicas > 1:
            others["the best pipeline"] = best_piped
    return plan, list(others.items())


def _fixed_layout_plan(args: argparse.Namespace, model: Any, inputs: Any, prof: Profile,
                       plan: Plan, console: Console) -> tuple[Plan, list[tuple[str, Plan]]]:
    """The best plan of the layout ``--replicas`` fixes, its stages verified unless
    ``--no-verify``."""
    if verifies(args, prof):
        plan, _ = verify_plans(args, model, inputs, prof, [plan], {}, console)
    return plan, []


def _print_layouts(console: Console, layouts: Any, plan: Plan) -> None:
    """The best plan of every stages × replicas layout, by block sums, the chosen one marked."""
    from autosplit.report import layout_table

    console.print()
    if layouts.note:
        console.print(f" {layouts.note}")
    console.print(layout_table(layouts, plan))


def _print_schedules(console: Console, prof: Profile, args: argparse.Namespace,
                     kwargs: dict[str, Any], plan: Plan) -> None:
    """Why this schedule: the best plan of every schedule searched, by block sums."""
    from autosplit.planner.schedules import plan_schedules, schedule_why
    from autosplit.planner.search import candidate_sizes, fixed_planner
    from autosplit.planner.settings import PlanSettings
    from autosplit.report import schedule_table

    settings = PlanSettings.check(prof, args.gpus, **kwargs)
    sizes = candidate_sizes(prof, args.split_size, settings.batch_size, "the batch")
    try:
        choice = plan_schedules(settings, prof, sizes, fixed=fixed_planner(settings, prof, sizes))
    except AutosplitError:  # devices of different kinds, nothing fits: no table
        return
    console.print()
    why = schedule_why(choice)
    if plan.replicas > 1 or len(plan.stages) != args.gpus:
        why = f"pipelines of {args.gpus} stages, by schedule — {why}"
    console.print(f" {why}")
    console.print(schedule_table(choice, plan))


def _check_layout_options(args: argparse.Namespace) -> None:
    """``--replicas`` and ``--pipeline-only`` against each other and ``--gpus``."""
    d = args.replicas
    if d is None:
        return
    if args.pipeline_only and d > 1:
        raise InvalidInputError(f"--pipeline-only with --replicas {d}: give one of them")
    if args.gpus % d:
        raise InvalidInputError(f"--replicas {d} does not divide --gpus {args.gpus}: the "
                                f"layout is --gpus / --replicas stages × --replicas replicas")
    if d > 1 and args.emit:
        raise InvalidInputError(f"--emit writes a one-process pipeline: it cannot run "
                                f"--replicas {d}; plan without --replicas to emit code")


def plan_command(args: argparse.Namespace) -> int:
    """``autosplit plan``: profile (or read, or estimate), plan, print; write the plan and,
    on request, the emitted code and the figure."""
    from autosplit.planner import plan_layouts
    from autosplit.report import print_plan

    counts = resolve_device_count(args)
    _check_layout_options(args)
    console = make_console()
    memory, bandwidth = args.memory, args.bandwidth  # bytes, bytes per second (or None)
    spec = None if args.profile else device_spec(args)
    if spec is not None:
        memory = memory or spec.memory_bytes
        bandwidth = bandwidth or spec.link_bandwidth_bytes_per_s
    source, model, inputs = load_model(args, on_meta=spec is not None)
    prof = profile_for(args, source, model, inputs, console, source.manual_split_size)
    kwargs: dict[str, Any] = dict(
        batch_size=args.batch_size or prof.batch_size,
        memory_per_gpu=memory,
        schedule=args.schedule,
        optimizer=args.optimizer,
        bandwidth_bytes_per_s=bandwidth,
    )
    searched: dict[str, Any] = dict(kwargs, split_size=args.split_size, solver=args.solver,
                                    allreduce_bandwidth_bytes_per_s=args.allreduce_bandwidth,
                                    max_stages=args.max_stages)
    topology = None
    if counts is not None:
        topology = topology_for(counts, spec, prof.device.kind, bandwidth,
                                args.inter_node_bandwidth)
        searched.update(topology=topology, bandwidth_bytes_per_s=None)
        kwargs["bandwidth_bytes_per_s"] = placements(topology, args.gpus, 1)[0].link_bytes_per_s
    layouts = None
    if (args.replicas or 1) > 1:
        fixed = plan_layouts(prof, args.gpus, replicas=args.replicas, **searched)
        plan, references = _fixed_layout_plan(args, model, inputs, prof, fixed.best, console)
    else:
        if not args.pipeline_only and not args.emit:
            try:
                layouts = plan_layouts(prof, args.gpus, **searched)
            except InfeasiblePlanError:  # nothing fits: the pipeline's planner says why
                layouts = None
        plan, references = _chosen_plan(args, source, model, inputs, prof, kwargs, layouts,
                                        console)
        if topology is not None and plan.replicas == 1:
            plan = dataclasses.replace(plan, placement="pp-inner",
                                       devices_per_node=topology.per_node)
    code = None
    if args.emit:
        from autosplit.codegen import emit

        code = emit(plan, source.ref, model=model, command=shlex.join(["autosplit", *args.argv]))
    console.print()
    print_plan(console, plan, references)
    if memory is not None and args.gpus > 1:
        _one_device_note(console, prof, memory, kwargs)
    if args.schedule == "auto" and args.gpus > 1 and not args.replicas:
        _print_schedules(console, prof, args, kwargs, plan)
    if layouts is not None:
        _print_layouts(console, layouts, plan)
    elif args.emit and not args.pipeline_only and args.gpus > 1:
        console.print(f"\n --emit writes a one-process pipeline: only pipelines of {args.gpus} "
                      "stages were considered (plan without --emit to weigh data parallelism)")
    writes: dict[str, Any] = {"-o": plan.save}
    if code is not None:
        writes["--emit"] = lambda path: path.write_text(code)
    if args.plot:
        from autosplit.figures import plan_figure

        writes["--plot"] = lambda path: plan_figure(plan, path)
    written = args.outputs.commit(writes)
    console.print()
    hints = []
    if not args.emit:
        hints.append("emit code with --emit pipelined_model.py")
    if not args.plot:
        hints.append("see it with --plot plan.png")
    console.print(f" wrote {', '.join(written)}" + "".join(f" · {h}" for h in hints))
    return 0
