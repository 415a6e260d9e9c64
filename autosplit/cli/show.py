"""``autosplit show``: print a saved plan (checked against a model file on request)."""

from __future__ import annotations

import argparse

from autosplit.cli.common import make_console
from autosplit.records import Plan

__all__ = ["show_command"]


def show_command(args: argparse.Namespace) -> int:
    """Print the plan's stage table; draw it with ``--plot``."""
    from autosplit.report import print_plan

    plan = Plan.load(args.plan)
    if args.model:
        from autosplit.capture.trace import trace
        from autosplit.modelfile import load_model_file

        graph = trace(load_model_file(args.model, args.entry).build())
        plan.check_model(graph.fingerprint, args.model)
        plan.check_blocks(graph.block_names, args.model)
    console = make_console()
    print_plan(console, plan)
    if args.plot:
        from autosplit.figures import plan_figure

        args.outputs.commit({"--plot": lambda path: plan_figure(plan, path)})
        console.print(f"\n wrote {args.plot}")
    return 0
