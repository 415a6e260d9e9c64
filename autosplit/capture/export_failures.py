"""Why torch.export cannot capture a model, or captured it in a way that would fail, said in
one line: the error's first line and the model's line it names (:func:`first_line`), what to do
about a branch on data (:func:`advice`), and a graph whose batch size the export fixed, found by
running it once on other rows (:func:`check_batch_free`). While exporting, torch's own logs are
held back (:func:`quiet_torch_logs`)."""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import re
import sys
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from autosplit.errors import TraceError

__all__ = ["advice", "check_batch_free", "first_line", "quiet_torch_logs"]


@contextlib.contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """While exporting, torch's log records up to WARNING are dropped and what it prints to
    stderr is held back, then let through only if the export succeeds: a failing export prints
    its partial graph, and autosplit reports the failure in one line instead."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    finally:
        logging.disable(previous)
    sys.stderr.write(held.getvalue())


def check_batch_free(model: nn.Module, gm: fx.GraphModule, inputs: Sequence[torch.Tensor],
                      batch: int) -> None:
    """Run the graph once on another number of rows: torch.export fixes the batch size where
    the model reads it as a Python number (``torch.arange(len(logits))`` in CLIP's loss), and
    such a graph would fail on the first micro-batch. The model's buffers and random numbers
    are left as they were.

    Raises:
        TraceError: the graph fails on another number of rows (the model's line is named).
    """
    rows = 2 if batch > 2 else 3
    resized = [(x[:rows] if rows <= batch else torch.cat([x, x[:rows - batch]]))
               if x.dim() and x.shape[0] == batch else x for x in inputs]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    runner = _NodeRunner(gm)
    try:
        with torch.no_grad(), torch.random.fork_rng(), quiet_torch_logs():
            runner.run(*resized)
    except Exception as exc:
        raise TraceError(
            f"the graph torch.export captured of {type(model).__name__} on {batch} rows fails "
            f"on {rows}{_model_line(runner.node)} ({first_line(exc)}): the model reads the "
            "batch size there as a fixed number (len(x), int(x.shape[0])), and every "
            "micro-batch would fail; compute that part outside the model (a loss over the whole "
            "batch: leave out the input that asks for it, such as return_loss or labels)"
        ) from exc
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


class _NodeRunner(fx.Interpreter):
    """Runs a graph node by node, keeping the node it is on (the one that failed)."""

    node: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.node = n
        return super().run_node(n)


def _model_line(node: fx.Node | None) -> str:
    """", at file:line `code`": the model's own line that made ``node``, where it says."""
    trace = (node.meta.get("stack_trace") or "") if node is not None else ""
    found = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s*(.+)', trace)
    if not found:
        return ""
    path, line, code = found[-1]
    return f", at {os.path.basename(path)}:{line} `{code.strip()}`"


def first_line(exc: BaseException) -> str:
    """The error's first line, and the line of the model's code it names, when it names one."""
    text = str(exc).strip()
    lines = text.splitlines()
    line = lines[0] if lines else ""
    shown = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    marker = "The following call raised this error:"
    if marker in lines:
        at = lines.index(marker)
        where = lines[at + 1].strip() if at + 1 < len(lines) else ""
        code = lines[at + 2].strip() if at + 2 < len(lines) else ""
        match = re.match(r'File "(.+)", line (\d+)', where)
        if match:
            shown += f", at {os.path.basename(match[1])}:{match[2]}" + (f" `{code}`" if code else "")
    frame = _caused_by(exc)
    if frame is not None:
        shown += f", at {os.path.basename(frame.filename)}:{frame.lineno} `{frame.line}`"
    return shown


def _caused_by(exc: BaseException) -> traceback.FrameSummary | None:
    """The frame of the model's code a data-dependent guard names ("Caused by: (file:line in
    function)"), found in the error's traceback (which has the source line)."""
    match = re.search(r"Caused by: .*?\((\S+):(\d+) in (\w+)\)", str(exc))
    if match is None:
        return None
    path, number = match[1], int(match[2])
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename.endswith(path) and frame.lineno == number and frame.line:
            return frame
    return None


def advice(model: nn.Module, exc: BaseException, kwargs: Mapping[str, Any]) -> str:
    """What to do about a branch on data (a data-dependent guard), when there is something:
    where the branch is in the model's own ``forward`` and the call gives ``labels``, it
    computes the loss, and the model can be planned on its logits instead."""
    frame = _caused_by(exc)
    if frame is None:
        return ""
    said = "; that line branches on values computed from the input data"
    forward = inspect.unwrap(type(model).forward)
    try:
        source, first = inspect.getsourcelines(forward)
        file = inspect.getsourcefile(forward)
    except (OSError, TypeError):
        return said
    inside = file is not None and os.path.samefile(file, frame.filename) \
        and first <= (frame.lineno or 0) < first + len(source)
    if inside and "labels" in kwargs:
        return (f"{said}, in the loss of {type(model).__name__}.forward: leave labels out of "
                "the example inputs, and the model is planned on its outputs with --loss mse")
    return said
