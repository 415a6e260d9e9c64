"""``autosplit run``: train a plan with one process per stage on torch.distributed.pipelining
(× its replicas, DDP or FSDP2 on a 2-D DeviceMesh), started here or, under torchrun, as one of its
ranks."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import TYPE_CHECKING, Any

from autosplit.cli.common import make_console, model_args
from autosplit.errors import InvalidInputError
from autosplit.records import Plan
from autosplit.units import format_ms

if TYPE_CHECKING:
    from autosplit.distributed.job import RunResult

__all__ = ["run_command"]


def _check_batch(args: argparse.Namespace, plan: Plan) -> None:
    """The run's batch must be the plan's d replicas × m equal micro-batches of b rows."""
    b, m, d = plan.split_size, plan.microbatches, plan.replicas
    rows = d * m * b
    each = f"{d} replicas × " if d > 1 else ""
    if args.batch_size is not None and args.batch_size != rows:
        raise InvalidInputError(
            f"--batch-size {args.batch_size}: the plan runs {each}{m} micro-batches of {b} = "
            f"{rows} rows; give that batch size or make a plan for yours"
        )
    if plan.batch_size != rows:
        share = plan.batch_size // d
        whose = "each replica's share" if d > 1 else "its batch"
        raise InvalidInputError(
            f"the plan splits {whose} of {share} into {m} micro-batches of {b} (the last "
            f"smaller); "
            f"torch.distributed.pipelining needs equal micro-batches: make a plan with a "
            f"--split-size that divides {share}"
        )
    if not args.timeout > 0:
        raise InvalidInputError(f"--timeout must be positive, got {args.timeout}")


def _ranks(args: argparse.Namespace, plan: Plan) -> int:
    """Ranks to start here: ``--nproc`` or p / v per replica (v = ``Plan.stages_per_rank``),
    checked against the plan and its schedule (k · d ranks, k pipeline ranks dividing p)."""
    from autosplit.distributed.stage_module import check_schedule

    p, d = len(plan.stages), plan.replicas
    default = p // plan.stages_per_rank * d
    nproc = args.nproc or default
    if nproc % d:
        raise InvalidInputError(
            f"--nproc {nproc}: a plan of {p} stages × {d} replicas runs on a multiple of {d} "
            f"ranks (default {default}, {plan.stages_per_rank} stage(s) per rank and replica)")
    try:
        check_schedule(plan, nproc // d, replicas=d)
    except InvalidInputError as exc:
        raise InvalidInputError(f"--nproc {nproc}: {exc}") from None
    return nproc


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or all(
        k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_command(args: argparse.Namespace) -> int:
    """Run ``--steps`` training steps of the plan; print each step's time and loss."""
    import torch

    from autosplit.distributed import (
        RankFailedError,
        RankSettings,
        RunSpec,
        graph_for_plan,
        launch,
        run_rank,
        train_model_file,
    )
    from autosplit.sharding import mode_label

    plan = Plan.load(args.plan)
    p, b, m, d = len(plan.stages), plan.split_size, plan.microbatches, plan.replicas
    _check_batch(args, plan)
    spec = RunSpec(args.model, args.entry, plan, args.steps,
                   tuple(args.input_shape) if args.input_shape else None, args.lr,
                   model_args=tuple(model_args(args).items()),
                   granularity=args.granularity,
                   leaf_modules=tuple(args.leaf_modules) if args.leaf_modules else None)
    console = make_console()
    stages = " | ".join(s.blocks[0] if len(s.blocks) == 1 else f"{s.blocks[0]} … {s.blocks[-1]}"
                        for s in plan.stages)
    layout = (f"{p} stage{'s' if p != 1 else ''} × {d} replicas ({mode_label(plan.replica_mode)})"
              if d > 1 else f"{p} stages")
    batch = f"{d} replicas × {m} × {b}" if d > 1 else f"{m} × {b}"
    header = (f"{plan.model} · {layout} ({stages}) · batch {d * m * b} = {batch} · "
              f"schedule {plan.schedule}")
    torchrun = _under_torchrun()
    result: Any
    if torchrun:  # one rank of a torchrun job: rank 0 prints
        world = int(os.environ.get("WORLD_SIZE", "1"))
        backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        from autosplit.launch import rendezvous_words

        print(f"{rendezvous_words()} · {backend} · waiting for the other ranks (up to "
              f"--timeout {args.timeout:g} s)", file=sys.stderr, flush=True)
        result = run_rank(train_model_file, (spec,), backend, args.timeout,
                          args.threads if backend == "gloo" else None)
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
        where = f"{world} ranks (torchrun)"
    else:
        from autosplit.distributed.job import capture_of, model_and_batch, plan_rows
        from autosplit.errors import ModelFileError, TraceError
        from autosplit.modelfile import load_model_file

        # the model and the plan are checked here, so that mistakes end before any process starts
        try:
            model, (call_args, call_kwargs) = model_and_batch(spec, plan_rows(plan))
        except ModelFileError:  # no inputs: still say first if the plan is of another model
            with contextlib.suppress(TraceError):  # (where the model traces without them)
                graph_for_plan(load_model_file(spec.model, spec.entry).build(
                    **dict(spec.model_args)), plan, **capture_of(spec))
            raise
        graph_for_plan(model, plan, example_inputs=call_args, example_kwargs=call_kwargs,
                       **capture_of(spec))
        nproc = _ranks(args, plan)
        backend = args.backend or ("nccl" if torch.cuda.device_count() >= nproc else "gloo")
        threads = args.threads if backend == "gloo" else None
        console.print(header)
        console.print(f"starting {nproc} rank{'s' if nproc != 1 else ''} on 127.0.0.1 · {backend}"
                      + (f" · {threads} thread{'s' if threads != 1 else ''} each"
                         if threads else ""))
        cores = _cores()
        if threads and nproc * threads > cores:
            console.print(f"note: {nproc} ranks × {threads} thread{'s' if threads != 1 else ''}"
                          f" on {cores} core{'s' if cores != 1 else ''}: the ranks take turns on "
                          "the cores, and the plan gives each worker a core of its own, so the "
                          "steps will be slower than predicted")
        try:
            results = launch(train_model_file, nproc, spec, backend=backend,
                             timeout_s=args.timeout, ranks=RankSettings(threads=threads))
        except RankFailedError as exc:
            print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
            return 1
        result = results[0]
        where = f"{nproc} rank{'s' if nproc != 1 else ''}"
    if torchrun:
        console.print(header)
    for i, (seconds, loss) in enumerate(zip(result.step_s, result.losses), start=1):
        note = "  (first step: warm-up)" if i == 1 and len(result.step_s) > 1 else ""
        console.print(f"step {i}  {format_ms(seconds * 1000):>9}  loss {loss:.6g}{note}")
    console.print(_against_plan(result, plan, where))
    return 0


def _cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _against_plan(result: RunResult, plan: Plan, where: str) -> str:
    """The median step with the range of the steps it is taken from, against the plan's
    prediction with its spread, and the difference in percent."""
    steady = result.step_s[1:] or result.step_s
    median = result.steady_step_s * 1000
    span = (f" ({format_ms(min(steady) * 1000)}–{format_ms(max(steady) * 1000)}, "
            f"{len(steady)} step{'s' if len(steady) != 1 else ''}"
            f"{' after the first' if len(result.step_s) > 1 else ''})")
    spread = f" ± {plan.step_spread:.0%}" if plan.step_spread else ""
    line = (f"median step {format_ms(median)}{span} on {where} ({result.device}) · the plan "
            f"predicted {format_ms(plan.predicted_step_ms)}{spread}")
    if plan.predicted_step_ms > 0:
        line += f" · measured {(median - plan.predicted_step_ms) / plan.predicted_step_ms:+.0%}"
    return line
