"""The ``autosplit`` command line: ``main(argv) -> int``.

Exit codes: 0 success; 2 bad input (an :class:`AutosplitError`, a file that cannot be read or
written, a bad option), one line ``error: …`` on stderr; 1 an internal error (a bug), one line
``internal error: …``, or a rank of ``autosplit run`` failed; 130 interrupted. ``--debug`` shows
the traceback instead. No traceback otherwise.

Inputs are never overwritten, and a command writes its outputs only once it has succeeded, all
or none (see :mod:`autosplit.cli.outputs`): they are checked before any work.

The parser is :mod:`autosplit.cli.parser`; each command lives in its own module
(:mod:`~autosplit.cli.profile_plan`, :mod:`~autosplit.cli.compare`, :mod:`~autosplit.cli.show`,
:mod:`~autosplit.cli.devices`, :mod:`~autosplit.cli.run`) as ``<name>_command(args) -> int``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from collections.abc import Sequence

from autosplit.cli.common import checked_outputs
from autosplit.cli.parser import EXIT_USAGE, build_parser
from autosplit.errors import AutosplitError, InfeasiblePlanError
from autosplit.measure.timing_process import worker as timing_worker
from autosplit.units import size_at_least

__all__ = ["main", "entry", "build_parser"]

EXIT_INTERNAL = 1
EXIT_INTERRUPTED = 130


def entry() -> None:
    """The ``autosplit`` program: restarted once with the C allocator keeping freed memory
    (:mod:`autosplit.measure.allocator`: profiles and steps then take what they will take in the ranks
    autosplit starts), then :func:`main` on ``sys.argv``."""
    from autosplit.measure.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()
    sys.exit(main())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 success, 1 internal error or a failed
    rank, 2 bad input, 130 interrupted)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.started_at = time.perf_counter()  # --budget counts from here
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            args.outputs = checked_outputs(args)
            with timing_worker():  # one timing process for the whole command
                code = int(args.run(args))
        for w in caught:
            if issubclass(w.category, UserWarning) and "CPU stand-ins" not in str(w.message):
                print(f"note: {_one_line(w.message)}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (AutosplitError, OSError) as exc:  # the user's input, or a file they named
        if args.debug:
            raise
        print(f"error: {_one_line(_in_cli_words(exc, args))}", file=sys.stderr)
        rank_failed = getattr(sys.modules.get("autosplit.distributed"), "RankFailedError", ())
        return EXIT_INTERNAL if isinstance(exc, rank_failed) else EXIT_USAGE
    except Exception as exc:  # a bug of autosplit's
        if args.debug:
            raise
        print(f"internal error: {type(exc).__name__}: {_one_line(exc)} (run with --debug for "
              "the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


def _in_cli_words(exc: Exception, args: argparse.Namespace) -> object:
    """The error as the command line words it: a plan that does not fit says what does not
    fit (:attr:`InfeasiblePlanError.finding`), then what to try with this command's own
    options (the library's message names its keyword arguments instead)."""
    if not isinstance(exc, InfeasiblePlanError) or not exc.finding:
        return exc
    tries = []
    if isinstance(getattr(args, "gpus", None), int):
        tries.append(f"more devices than --gpus {args.gpus}")
    if getattr(args, "schedule", "auto") not in ("auto", "1f1b"):
        tries.append("--schedule 1f1b")
    if getattr(args, "split_size", None):
        tries.append("a smaller --split-size")
    need = exc.min_capacity_bytes
    if hasattr(args, "memory") and need is not None and math.isfinite(need):
        tries.append(f"--memory {size_at_least(need)}")
    if not tries:
        return exc
    return f"{exc.finding}. Try {', '.join(tries[:-1])}{' or ' if len(tries) > 1 else ''}" \
           f"{tries[-1]}"


def _one_line(exc: object) -> str:
    """An error message on one line (whitespace, newlines included, collapsed)."""
    text = " ".join(str(exc).split())
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        text = f"{exc.strerror}: {str(exc.filename)!r}"  # no "[Errno 13]"
    return text or type(exc).__name__

