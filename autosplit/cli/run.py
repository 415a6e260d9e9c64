"""``autosplit run``: train a plan with one process per stage on torch.distributed.pipelining,
started here or, under torchrun, as one of its ranks."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from autosplit.cli.common import make_console, model_args
from autosplit.errors import InvalidInputError
from autosplit.records import Plan
from autosplit.runnable import require_pipeline_only

__all__ = ["run_command"]


def _check_batch(args: argparse.Namespace, plan: Plan) -> None:
    """The run's batch must be the plan's m equal micro-batches of b rows."""
    b, m = plan.split_size, plan.microbatches
    if args.batch_size is not None and args.batch_size != m * b:
        raise InvalidInputError(
            f"--batch-size {args.batch_size}: the plan runs {m} micro-batches of {b} = {m * b} "
            "rows; give that batch size or make a plan for yours"
        )
    if plan.batch_size != m * b:
        raise InvalidInputError(
            f"the plan splits its batch of {plan.batch_size} into {m} micro-batches of {b} (the "
            f"last smaller); torch.distributed.pipelining needs equal micro-batches: make a plan "
            f"with a --split-size that divides {plan.batch_size}"
        )
    if not args.timeout > 0:
        raise InvalidInputError(f"--timeout must be positive, got {args.timeout}")


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or all(
        k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_command(args: argparse.Namespace) -> int:
    """Run ``--steps`` training steps of the plan; print each step's time and loss."""
    import torch

    from autosplit.distributed import (
        RankFailedError,
        RunSpec,
        graph_for_plan,
        launch,
        run_rank,
        stage_indices,
        train_model_file,
    )

    plan = Plan.load(args.plan)
    require_pipeline_only(plan, "autosplit run")
    p, b, m = len(plan.stages), plan.split_size, plan.microbatches
    _check_batch(args, plan)
    spec = RunSpec(args.model, args.entry, plan, args.steps,
                   tuple(args.input_shape) if args.input_shape else None, args.lr,
                   model_args=tuple(model_args(args).items()))
    console = make_console()
    stages = " | ".join(s.blocks[0] if len(s.blocks) == 1 else f"{s.blocks[0]} … {s.blocks[-1]}"
                        for s in plan.stages)
    header = (f"{plan.model} · {p} stages ({stages}) · batch {m * b} = {m} × {b} · "
              f"schedule {plan.schedule}")
    torchrun = _under_torchrun()
    result: Any
    if torchrun:  # one rank of a torchrun job: rank 0 prints
        world = int(os.environ.get("WORLD_SIZE", "1"))
        backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        result = run_rank(train_model_file, (spec,), backend, args.timeout,
                          args.threads if backend == "gloo" else None)
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
        where = f"{world} ranks (torchrun)"
    else:
        from autosplit.modelfile import load_model_file

        # the model and the plan are checked here, so that mistakes end before any process starts
        graph_for_plan(load_model_file(args.model, args.entry).build(**model_args(args)), plan)
        nproc = args.nproc or p
        stage_indices(p, 0, nproc)
        backend = args.backend or ("nccl" if torch.cuda.device_count() >= nproc else "gloo")
        threads = args.threads if backend == "gloo" else None
        console.print(header)
        console.print(f"starting {nproc} rank{'s' if nproc != 1 else ''} on 127.0.0.1 · {backend}"
                      + (f" · {threads} thread{'s' if threads != 1 else ''} each"
                         if threads else ""))
        try:
            results = launch(train_model_file, nproc, spec, backend=backend,
                             timeout_s=args.timeout, threads=threads)
        except RankFailedError as exc:
            print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
            return 1
        result = results[0]
        where = f"{nproc} rank{'s' if nproc != 1 else ''}"
    if torchrun:
        console.print(header)
    for i, (seconds, loss) in enumerate(zip(result.step_s, result.losses), start=1):
        note = "  (first step: warm-up)" if i == 1 and len(result.step_s) > 1 else ""
        console.print(f"step {i}  {seconds:7.2f} s  loss {loss:.6g}{note}")
    predicted = plan.predicted_step_ms
    console.print(f"median step {result.steady_step_s:.2f} s on {where} ({result.device}) · "
                  f"the plan predicted {predicted / 1000:.2f} s")
    return 0
