"""The neighbouring worker's load while a stage is timed on a CPU.

On a CPU, a plan's workers are processes on the cores of one machine, and they slow each other
down: they share the memory bus and the last-level cache. On the 2-core development machines a
forward and backward of GPT small or ResNet50 (b = 16, one thread) took 5–7 % longer (median of
15 interleaved pairs) while the same work ran on the other core than with that core idle; plans
of two workers (pipelines, and data parallelism) were predicted 5–14 % below their measured
step from stages timed with the other core idle, while one device, which runs alone, was within
a few percent.

So :func:`autosplit.verify.stage_timing.time_stages` can time a stage run *beside* another one: a
:class:`Neighbour` process runs the other run (forward and backward of one micro-batch, again
and again) on the other core while the stage is timed, and goes idle for a run timed alone (one
device). It is started with the ranks' environment (:mod:`autosplit.measure.allocator`) and its own
copy of the model.

Protocol (text lines over two pipes): the parent sends ``run <i>``, ``idle`` or ``stop``; the
neighbour answers ``ready`` once it has built its model and ``idle`` once it has stopped
working. A ``run`` is taken up when the current micro-batch ends, without an answer: the core
stays busy across the switch.
"""

from __future__ import annotations

import os
import pickle
import select
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import torch

from autosplit.graph import BlockGraph
from autosplit.measure import allocator, block_timing, timing_process
from autosplit.measure.losses import timing_loss

__all__ = ["ALONE", "Neighbour", "enabled"]

ALONE = "AUTOSPLIT_TIME_ALONE"
"""Set to 1 to time every stage with the other cores idle (no :class:`Neighbour`)."""

_CHILD = "import sys; from autosplit.measure.contention import _main; _main(*sys.argv[1:4])"

_READY_TIMEOUT_S = 300.0
"""How long the neighbour may take to load the model (s)."""


def enabled() -> bool:
    """Whether stages of several CPU workers are timed beside a neighbour (unless :data:`ALONE`
    is set)."""
    return os.environ.get(ALONE, "") in ("", "0")


class Neighbour:
    """A process that runs stage runs ``(first, end, b)`` on another core, on request.

    Use as a context manager; :meth:`beside` chooses what it runs (the first call waits until
    the process has loaded the model: it loads while the caller prepares its own). If it cannot
    start (a model that does not pickle, a child that fails), :attr:`running` becomes False,
    :meth:`beside` does nothing and a :class:`RuntimeWarning` says why: the stages are then
    timed alone.
    """

    def __init__(self, graph: BlockGraph, inputs: Sequence[torch.Tensor],
                 runs: Sequence[tuple[int, int, int]], loss: str = "none",
                 threads: int = 1) -> None:
        self.runs = list(dict.fromkeys(runs))
        self.running = False
        self._starting = False
        self._current: int | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="autosplit-neighbour-")
        job = Path(self._tmp.name, "job.pkl")
        try:
            job.write_bytes(pickle.dumps(timing_process.model_files(),
                                         protocol=pickle.HIGHEST_PROTOCOL)
                            + pickle.dumps((graph, tuple(inputs), self.runs, loss, threads),
                                           protocol=pickle.HIGHEST_PROTOCOL))
        except Exception as exc:  # noqa: BLE001 - timed alone, said so
            self._give_up(f"its arguments do not pickle ({exc})")
            return
        down_read, self._down = os.pipe()
        self._up, up_write = os.pipe()
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(job), str(down_read), str(up_write)],
                env=allocator.environment(), pass_fds=(down_read, up_write),
            )
        finally:
            os.close(down_read)
            os.close(up_write)
        self._buffer = b""
        self.running = True  # (ready once it answers: the first beside() waits for that)
        self._starting = True

    def _wait_ready(self) -> None:
        self._starting = False
        answer = self._answer(_READY_TIMEOUT_S)
        if answer != "ready":
            self.close()
            self._give_up(answer or "it did not start")

    def _give_up(self, why: str) -> None:
        warnings.warn(f"timing the stages with the other cores idle: the neighbouring "
                      f"worker's load cannot run: {why}", RuntimeWarning, stacklevel=3)
        self._tmp.cleanup()

    def _send(self, line: str) -> None:
        os.write(self._down, (line + "\n").encode())

    def _answer(self, timeout_s: float) -> str:
        """The child's next line ("" if it ended or said nothing within ``timeout_s``)."""
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self._up], [], [], timeout_s)
            chunk = os.read(self._up, 4096) if ready else b""
            if not chunk:
                return ""
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode(errors="replace")

    def beside(self, run: tuple[int, int, int] | None) -> None:
        """Run ``run`` again and again from the end of the current micro-batch on (no wait), or
        with ``None`` stop and return once idle."""
        if self.running and self._starting:
            self._wait_ready()
        if not self.running:
            return
        index = None if run is None else self.runs.index(run)
        if index == self._current:
            return
        self._current = index
        try:
            if self._child.poll() is not None:  # it ended: told below
                raise OSError("ended")
            self._send("idle" if index is None else f"run {index}")
            if index is not None or self._answer(_READY_TIMEOUT_S) == "idle":
                return
        except OSError:
            pass
        self.close()
        warnings.warn("the neighbouring worker stopped; the remaining stages are timed with "
                      "the other cores idle", RuntimeWarning, stacklevel=2)

    def close(self) -> None:
        """Stop the child and wait for it (idempotent)."""
        child = getattr(self, "_child", None)
        if child is None:
            return
        self.running = False
        try:
            self._send("stop")
        except OSError:
            pass
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        for fd in (self._down, self._up):
            try:
                os.close(fd)
            except OSError:
                pass
        self._child = None
        self._tmp.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _main(job: str, down: str, up: str) -> None:
    """The neighbour's process: :func:`_child`, then exit at once (``os._exit``): it holds no
    file to flush, and tearing the interpreter down (torch and a model: about half a second)
    would keep the parent waiting in :meth:`Neighbour.close`."""
    code = 0
    try:
        _child(job, down, up)
    except BaseException:  # noqa: BLE001 - printed, then exit 1 as Python would
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _child(job: str, down: str, up: str) -> None:
    """The neighbour: load the job, answer ``ready``, then run what it is told."""
    out = int(up)
    commands = int(down)
    try:
        with open(job, "rb") as f:
            timing_process.import_model_files(pickle.load(f))
            graph, inputs, runs, loss, threads = pickle.load(f)
        torch.set_num_threads(threads)
        dev = torch.device("cpu")
        work = block_timing.private_copy(graph, dev)
        envs = {b: block_timing.stage_inputs(work, inputs, b, runs, dev) for b in {r[2] for r in runs}}
        segments = {r: work.extract(r[0], r[1]) for r in runs}
        last = timing_loss(loss)
    except Exception as exc:  # noqa: BLE001 - told back in one line; the parent times alone
        why = f"it cannot load the model ({type(exc).__name__}: {exc})"
        os.write(out, why.replace("\n", " ").encode() + b"\n")
        return
    os.write(out, b"ready\n")
    buffer, current = b"", None
    while True:
        if current is None or select.select([commands], [], [], 0)[0]:
            chunk = os.read(commands, 4096)
            if not chunk:
                return  # the parent is gone
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                word, *arg = line.decode().split()
                if word == "stop":
                    return
                current = runs[int(arg[0])] if word == "run" else None
                if word == "idle":
                    os.write(out, b"idle\n")
            continue
        seg = segments[current]
        for param in seg.module.parameters():
            param.grad = None
        args = block_timing.segment_args(work, envs[current[2]], seg)
        block_timing.timed_run(seg, args, dev,
                              loss=last if current[1] == len(work.blocks) else None)
