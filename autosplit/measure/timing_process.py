"""Time on a CPU where the ranks run: in a fresh Python process.

The training ranks (:func:`autosplit.launch.launch`, ``autosplit run``, torchrun) are
fresh processes, started with the allocator settings of :mod:`autosplit.measure.allocator`. The
process that plans is not, and on the 2-core development machines it ran the same work
measurably slower than a fresh process started from it: ResNet50's forward and backward
(b = 24, 3×64×64, one thread, a new model each time) took 814–968 ms (median 896) in the
process started from the shell against 790–931 ms (median 837) in a fresh child, slower in
20 of 21 interleaved pairs, and on an earlier day 1.22–1.87 s against 0.97–1.22 s in the
ranks. A prediction timed there is biased against the run it predicts, so CPU timings — the
profile (:func:`autosplit.measure.profiler.profile_graph`) and the stage runs that verify a plan
(:func:`autosplit.verify.plans.time_stages`) — are taken in a fresh process, like a rank's.

:func:`run_fresh` pickles the function and its arguments, starts a Python process with the
ranks' environment, relays ``progress(done, total, what)`` calls back through a pipe, and
returns the result or raises the child's :class:`~autosplit.errors.AutosplitError` again.
The model's modules travel pickled; modules loaded from a model file are imported again in
the child first. What cannot travel (a module whose class the child cannot import) is timed
in this process instead, with a :class:`RuntimeWarning` that says why.
``AUTOSPLIT_TIME_IN_PROCESS=1`` times in this process always (the test suite does, for
speed, except where it tests this module).

A command that times several times (``autosplit plan``: the profile, then the candidates'
stages) keeps one timing process for all of them (:func:`worker`): it starts on the first job
and takes the next ones in turn, so torch is imported there once, not once per job.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from autosplit.errors import AutosplitError
from autosplit.measure import allocator

__all__ = [
    "IN_PROCESS", "FreshProcessError", "Worker", "enabled", "import_model_files", "model_files",
    "run_fresh", "worker",
]

IN_PROCESS = "AUTOSPLIT_TIME_IN_PROCESS"
"""Set to 1 to time in the calling process (no fresh process)."""

_MODEL_FILES = "autosplit_model_"
"""Prefix of the modules :mod:`autosplit.modelfile` imports from model files."""

_CHILD = "import sys; from autosplit.measure.timing_process import _child; _child(*sys.argv[1:4])"
"""The fresh process's program (``python -c``: not ``-m``, which would run this module twice)."""

_WORKER = "import sys; from autosplit.measure.timing_process import _serve; _serve(*sys.argv[1:3])"
"""The program of a :class:`Worker`'s process: jobs in turn until its input closes."""

_DONE = "\x04done"
"""The line a :class:`Worker`'s process writes after each job's progress."""

T = TypeVar("T")
Progress = Callable[[int, int, str], None]


class FreshProcessError(AutosplitError):
    """The fresh timing process failed in an unexpected way (its traceback is the message)."""


def enabled() -> bool:
    """Whether CPU timings go to a fresh process (unless :data:`IN_PROCESS` is set)."""
    return os.environ.get(IN_PROCESS, "") in ("", "0")


def model_files() -> dict[str, str]:
    """Modules imported from model files, by name: a child process imports them first
    (:func:`import_model_files`)."""
    return {name: str(module.__file__) for name, module in list(sys.modules.items())
            if name.startswith(_MODEL_FILES) and getattr(module, "__file__", None)}


def run_fresh(fn: Callable[..., T], *args: Any, progress: Progress | None = None,
              **kwargs: Any) -> T:
    """``fn(*args, progress=…, **kwargs)`` in a fresh Python process; its result.

    ``fn`` must be a module-level function that takes a ``progress`` keyword argument;
    ``progress`` (here) receives every call the child makes to it, in order.

    Raises:
        AutosplitError: the child's, again (same class and message; a class that needs
            more than its message comes back as FreshProcessError naming it).
        FreshProcessError: the child failed otherwise (its traceback is the message).
    """
    try:
        payload = (pickle.dumps(model_files(), protocol=pickle.HIGHEST_PROTOCOL)
                   + pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as exc:  # noqa: BLE001 - a model that does not pickle is timed here
        return _here(fn, args, kwargs, progress, f"its arguments do not pickle ({exc})")
    with tempfile.TemporaryDirectory(prefix="autosplit-timing-") as tmp:
        job, result = Path(tmp, "job.pkl"), Path(tmp, "result.pkl")
        job.write_bytes(payload)
        del payload
        if _CURRENT:
            _CURRENT[-1].take(job, result, progress)
        else:
            _once(job, result, progress)
        if not result.exists():
            raise FreshProcessError("the timing process ended with no result")
        kind, value = pickle.loads(result.read_bytes())
    return _outcome(fn, args, kwargs, progress, kind, value)


def _once(job: Path, result: Path, progress: Progress | None) -> None:
    """Run ``job`` in a process of its own, relaying its progress; it writes ``result``."""
    read, write = os.pipe()
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(job), str(result), str(write)],
            env=allocator.environment(), pass_fds=(write,),
        )
    finally:
        os.close(write)
    try:
        with os.fdopen(read, encoding="utf-8") as lines:
            for line in lines:
                _relay(line, progress)
        code = child.wait()
    except BaseException:
        child.kill()
        child.wait()
        raise
    if not result.exists():
        raise FreshProcessError(f"the timing process ended with exit code {code} and no result")


def _relay(line: str, progress: Progress | None) -> None:
    done, total, what = line.rstrip("\n").split("\t", 2)
    if progress is not None:
        progress(int(done), int(total), what)


def _outcome(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any],
             progress: Progress | None, kind: str, value: Any) -> T:
    """The job's result, or its error raised again here."""
    if kind == "ok":
        return value  # type: ignore[no-any-return]
    if kind == "unpicklable":
        return _here(fn, args, kwargs, progress, f"the timing process cannot load the model "
                     f"({value})")
    if kind == "autosplit":
        cls, message = value
        try:
            error = cls(message)
        except Exception:  # noqa: BLE001 - a class that takes more than its message
            error = FreshProcessError(f"{cls.__name__}: {message}")
        raise error
    raise FreshProcessError(f"the timing process failed:\n{value}")


class Worker:
    """One fresh timing process for several jobs, started on the first (:func:`worker`)."""

    def __init__(self) -> None:
        self._child: subprocess.Popen[bytes] | None = None
        self._lines: Any = None

    def take(self, job: Path, result: Path, progress: Progress | None) -> None:
        """Run ``job`` there (starting the process if need be), relaying its progress until
        it is done; it writes ``result``."""
        if self._child is None or self._child.poll() is not None:
            self._start()
        assert self._child is not None and self._child.stdin is not None
        try:
            self._child.stdin.write(f"{job}\t{result}\n".encode())
            self._child.stdin.flush()
            for line in self._lines:
                if line.rstrip("\n") == _DONE:
                    return
                _relay(line, progress)
        except BaseException:
            self.close(kill=True)
            raise
        code = self._child.wait()
        self._child = None
        raise FreshProcessError(f"the timing process ended with exit code {code} during a job")

    def _start(self) -> None:
        if self._lines is not None:  # a process that died between jobs: its pipe too
            self._lines.close()
            self._lines = None
        read, write = os.pipe()
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-c", _WORKER, str(write)], stdin=subprocess.PIPE,
                env=allocator.environment(), pass_fds=(write,))
        finally:
            os.close(write)
        self._lines = os.fdopen(read, encoding="utf-8")

    def close(self, kill: bool = False) -> None:
        """End the process (its input closed: it ends after the job it is on, or at once)."""
        child, self._child = self._child, None
        if child is None:
            return
        if kill:
            child.kill()
        elif child.stdin is not None:
            with contextlib.suppress(OSError):
                child.stdin.close()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if self._lines is not None:
            self._lines.close()
            self._lines = None


_CURRENT: list[Worker] = []
"""The workers of the :func:`worker` blocks open now, innermost last."""


@contextlib.contextmanager
def worker() -> Iterator[Worker]:
    """Within the block, :func:`run_fresh` runs its jobs in one fresh process, started on the
    first job and ended with the block (a block inside another uses the outer one's)."""
    if _CURRENT:
        yield _CURRENT[-1]
        return
    kept = Worker()
    _CURRENT.append(kept)
    try:
        yield kept
    finally:
        _CURRENT.remove(kept)
        kept.close()


def _here(fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any],
          progress: Progress | None, why: str) -> T:
    warnings.warn(f"timing in this process, not in a fresh one like the ranks: {why}; "
                  "its times may differ from the ranks' (see autosplit.measure.timing_process)",
                  RuntimeWarning, stacklevel=3)
    return fn(*args, progress=progress, **kwargs)


def _child(job: str, result: str, fd: str) -> None:
    """The fresh process: load the job, run it, write ``(kind, value)`` to ``result``."""
    out = os.fdopen(int(fd), "w", encoding="utf-8", buffering=1)
    try:
        _job(job, result, out)
    finally:
        out.close()


def _serve(fd: str) -> None:
    """A :class:`Worker`'s process: each line of its input names a job and its result file;
    it runs them in turn, its progress and then :data:`_DONE` on ``fd``, until the input
    closes."""
    out = os.fdopen(int(fd), "w", encoding="utf-8", buffering=1)
    try:
        for line in sys.stdin:
            job, result = line.rstrip("\n").split("\t")
            _job(job, result, out)
            out.write(_DONE + "\n")
    finally:
        out.close()


def _job(job: str, result: str, out: Any) -> None:
    """Load the job, run it with its progress on ``out``, write ``(kind, value)`` to
    ``result``."""

    def relay(done: int, total: int, what: str) -> None:
        out.write(f"{done}\t{total}\t{str(what).replace(chr(10), ' ')}\n")

    def write(kind: str, value: Any) -> None:
        Path(result).write_bytes(pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL))

    try:
        with open(job, "rb") as f:
            import_model_files(pickle.load(f))  # before the job, whose classes they hold
            fn, args, kwargs = pickle.load(f)
    except Exception as exc:  # noqa: BLE001 - told back, and the caller times in its process
        write("unpicklable", f"{type(exc).__name__}: {exc}")
        return
    os.environ[IN_PROCESS] = "1"  # this is the fresh process: its timings stay in it
    try:
        value = fn(*args, progress=relay, **kwargs)
    except AutosplitError as exc:
        write("autosplit", (type(exc), str(exc)))
        return
    except Exception:  # noqa: BLE001 - told back with its traceback
        write("error", traceback.format_exc())
        return
    write("ok", value)


def import_model_files(files: dict[str, str]) -> None:
    """Import the model files of :func:`model_files` here (before unpickling what they hold);
    one that fails is left out (then what needs it does not load, and says so)."""
    from autosplit.modelfile import import_file

    for name, path in files.items():
        if name not in sys.modules:
            with contextlib.suppress(Exception):  # then the job may not load: said so
                import_file(Path(path), path)
