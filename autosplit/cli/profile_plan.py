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
    device_note,
    estimate,
    measure,
    profile_for,
    report_verification,
    verifier,
    with_schedule_costs,
)
from autosplit.cli.topology_args import resolve_device_count, topology_for
from autosplit.errors import AutosplitError, InfeasiblePlanError, InvalidInputError
from autosplit.planner import PlanOptions
from autosplit.records import Plan, Profile
from autosplit.topology import placements
from autosplit.workflow import PlanRequest, choose_plan

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
                     options: PlanOptions) -> tuple[str, Plan] | None:
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
    batch = options.batch_size or prof.batch_size
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
    plan = manual_plan(prof, points, None if why else size, options)
    label = f"hand split (cut at {', '.join(points)}, split {plan.split_size}"
    if why:  # the model file's size: the hand split gets its best measured one instead
        label += f"; its MANUAL_SPLIT_SIZE {size} {why}"
    return label + ")", plan


def _one_device_note(console: Console, prof: Profile, memory: float,
                     options: PlanOptions) -> None:
    """Say whether one device of ``memory`` bytes could hold the model, and what it needs."""
    from autosplit.planner import plan as make_plan
    from autosplit.units import format_bytes

    try:
        make_plan(prof, 1, dataclasses.replace(options, memory_per_gpu=memory))
    except InfeasiblePlanError as exc:
        console.print(
            f" one device of {format_bytes(memory)} cannot hold it: it needs "
            f"{format_bytes(exc.min_capacity_bytes)} ({options.optimizer} state "
            "included)"
        )
    else:
        console.print(f" one device of {format_bytes(memory)} could hold it too")


def _print_layouts(console: Console, layouts: Any, plan: Plan) -> None:
    """The best plan of every stages × replicas layout, by block sums, the chosen one marked."""
    from autosplit.report import layout_table

    console.print()
    if layouts.note:
        console.print(f" {layouts.note}")
    console.print(layout_table(layouts, plan))


def _print_schedules(console: Console, prof: Profile, args: argparse.Namespace,
                     options: PlanOptions, plan: Plan) -> None:
    """Why this schedule: the best plan of every schedule searched, by block sums."""
    from autosplit.planner.schedules import plan_schedules, schedule_why
    from autosplit.planner.search import candidate_sizes, fixed_planner
    from autosplit.planner.settings import PlanSettings
    from autosplit.report import schedule_table

    settings = PlanSettings.check(prof, args.gpus, options)
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
    measured = dict(prof.action_ms)
    unmeasured = [] if not measured and prof.one_stage_action_ms is None else [
        o.schedule for o in choice.options if o.schedule not in measured]
    console.print(schedule_table(choice, plan, unmeasured))


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
    options = PlanOptions(
        batch_size=args.batch_size, memory_per_gpu=memory, schedule=args.schedule,
        optimizer=args.optimizer, bandwidth_bytes_per_s=bandwidth, split_size=args.split_size,
        solver=args.solver, allreduce_bandwidth_bytes_per_s=args.allreduce_bandwidth,
        replica_mode=args.replica_mode)
    topology = None
    if counts is not None:
        topology = topology_for(counts, spec, prof.device.kind, bandwidth,
                                args.inter_node_bandwidth)
        options = dataclasses.replace(
            options, bandwidth_bytes_per_s=placements(topology, args.gpus, 1)[0].link_bytes_per_s)
    request = PlanRequest(
        args.gpus, options, max_stages=args.max_stages, topology=topology,
        replicas=args.replicas,
        pipeline_only=args.pipeline_only or bool(args.emit))  # --emit: one process, a pipeline
    prof = with_schedule_costs(args, prof, request, console)
    scored = dataclasses.replace(request.planning(prof), split_size=None, solver="dp")
    reference = None if (args.replicas or 1) > 1 else manual_reference(prof, source, args,
                                                                       scored)
    planned = choose_plan(prof, request, verifier(args, model, inputs, prof, console),
                          dict([reference]) if reference else None)
    report_verification(console, planned)
    plan, references, layouts = planned.plan, list(planned.references), planned.layouts
    if topology is not None and plan.replicas == 1:
        plan = dataclasses.replace(plan, placement="pp-inner",
                                   devices_per_node=topology.per_node)
    code = None
    if args.emit:
        from autosplit.codegen import emit

        code = emit(plan, source.ref, model=model, command=shlex.join(["autosplit", *args.argv]))
    titan = None
    if args.emit_torchtitan:
        from autosplit.export import torchtitan_config

        titan = torchtitan_config(plan, model,
                                  source=shlex.join(["autosplit", *args.argv]))
    console.print()
    print_plan(console, plan, references)
    if memory is not None and args.gpus > 1:
        _one_device_note(console, prof, memory, scored)
    if args.schedule == "auto" and args.gpus > 1 and not args.replicas:
        _print_schedules(console, prof, args, scored, plan)
    if layouts is not None:
        _print_layouts(console, layouts, plan)
    elif args.emit and not args.pipeline_only and args.gpus > 1:
        console.print(f"\n --emit writes a one-process pipeline: only pipelines of {args.gpus} "
                      "stages were considered (plan without --emit to weigh data parallelism)")
    writes: dict[str, Any] = {"-o": plan.save}
    if code is not None:
        writes["--emit"] = lambda path: path.write_text(code)
    if titan is not None:
        writes["--emit-torchtitan"] = lambda path: path.write_text(titan)
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
