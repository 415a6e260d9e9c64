"""The command line shared by the benchmarks that profile, plan and then measure on 2 CPU
workers (``accuracy.py``, ``layouts.py``, ``schedules.py``): which models, how many rounds,
the profile's and the verification's budgets, ``--smoke`` (toy models in seconds, never
written to benchmarks/results) and ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common import RESULTS, command_line, write_results
from harness import add_load_arguments

from autosplit.verify.options import TimingOptions


def benchmark_parser(doc: str | None, names: Sequence[str],
                     default: Sequence[str] | None = None, verify: bool = True,
                     profile_budget: float = 40.0) -> argparse.ArgumentParser:
    """A parser with the shared options; ``names`` are the models ``--models`` may name,
    ``default`` those it runs without ``--models`` (``None``: all of them); ``verify=False``:
    no ``--verify-budget`` (a script that verifies nothing); ``profile_budget``: the default
    of ``--profile-budget`` (s; autosplit's 40)."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    chosen = list(names if default is None else default)
    which = (f"default all: {' '.join(names)}" if chosen == list(names) else
             f"of {' '.join(names)}; default {' '.join(chosen)}")
    parser.add_argument("--models", nargs="+", choices=names, default=chosen,
                        metavar="MODEL", help=f"the models to run ({which})")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per plan (default 5)")
    parser.add_argument("--profile-budget", type=float, default=profile_budget,
                        help=f"each profile's budget (s; default {profile_budget:g})")
    if verify:
        parser.add_argument("--verify-budget", type=float, default=60.0,
                            help="each verification's budget (s; autosplit's default 60)")
    parser.add_argument("--timeout", type=float, default=900.0, help="process-group timeout (s)")
    add_load_arguments(parser)
    parser.add_argument("--smoke", action="store_true", help="toy models in seconds (tests)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the results (default benchmarks/results; with --smoke "
                             "a temporary folder)")
    return parser


def chosen_cases(parser: argparse.ArgumentParser, args: argparse.Namespace,
                 argv: Sequence[str] | None, script: str, default_cases: Callable[[], list[Any]],
                 smoke_cases: Callable[[], list[Any]]) -> list[Any]:
    """The cases to run; sets ``args.sizes``, ``args.out`` and ``args.command`` (and, with
    ``--smoke``, one round, no retakes, lead-in steps or settling rounds, 5 s budgets and
    sizes 2 and 4)."""
    if args.rounds < 1:
        parser.error("--rounds must be positive")
    args.sizes = None
    if args.smoke:
        cases = smoke_cases()
        args.rounds, args.retries, args.lead_in = 1, 0, 0.0
        args.settle_rounds, args.more_rounds = 0, 0
        args.profile_budget, args.verify_budget, args.sizes = 5.0, 5.0, [2, 4]
    else:
        cases = [c for c in default_cases() if c.name in args.models]
    stem = Path(script).stem
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix=f"{stem}-smoke-")) if args.smoke else RESULTS
    elif args.smoke and args.out.resolve() == RESULTS.resolve():
        parser.error("--smoke never writes to benchmarks/results: give another --out")
    args.command = command_line(script, sys.argv[1:] if argv is None else argv)
    return cases


def verify_options(args: argparse.Namespace, **fields: Any) -> TimingOptions:
    """The verification's timing options: ``--verify-budget``, and with ``--smoke`` two timed
    rounds after one warm-up (a smoke run checks that the benchmark runs, not its figures);
    ``fields`` set the others."""
    if args.smoke:
        fields = {"warmup": 1, "rounds": 2, "max_rounds": 2, **fields}
    return TimingOptions(budget_s=args.verify_budget, **fields)


def write_and_show(args: argparse.Namespace, script: str, data: dict[str, Any],
                   text: str) -> None:
    """Write ``<stem>[_smoke].json`` and ``.md`` under ``args.out`` and print the text."""
    stem = Path(script).stem + ("_smoke" if args.smoke else "")
    write_results(args.out, stem, data, text)
    print(text)
    print(f"wrote {args.out / stem}.json and .md")
