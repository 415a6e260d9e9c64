"""Helpers every command shares: the console, the checked outputs, the model file and its
arguments, the device spec to estimate for."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.console import Console

from autosplit.cli.outputs import Outputs, check_outputs

__all__ = ["make_console", "checked_outputs", "device_spec", "load_model", "model_args"]

_OUTPUTS = (("output", "-o"), ("emit", "--emit"), ("emit_torchtitan", "--emit-torchtitan"),
            ("plot", "--plot"))
"""(attribute, option) of every file a command writes."""
_INPUTS = (("model", "the model file"), ("profile", "--profile"), ("plan", "the plan file"),
           ("device_spec", "--device-spec"))
"""(attribute, what) of every file a command reads."""


def make_console() -> Console:
    """The console a command prints to (stdout)."""
    # a pipe or a file gets wide lines rather than a table wrapped at 80 columns
    return Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 140)


def checked_outputs(args: argparse.Namespace) -> Outputs:
    """The command's outputs, checked against its inputs and each other before any work."""
    outputs = {option: getattr(args, attr, None) for attr, option in _OUTPUTS}
    inputs = {what: getattr(args, attr, None) for attr, what in _INPUTS}
    entry = getattr(args, "entry", None)
    if entry and ":" in entry:
        inputs["the --entry file"] = entry.rpartition(":")[0]
    return check_outputs(outputs, inputs)


def device_spec(args: argparse.Namespace) -> Any:
    """The DeviceSpec to estimate for (``--device NAME`` or ``--device-spec``), or None."""
    from autosplit.specs import get_spec, load_spec

    if getattr(args, "device_spec", None):
        return load_spec(args.device_spec)
    device = getattr(args, "device", None)
    if device is None or device.split(":")[0] in ("cpu", "cuda"):
        return None
    return get_spec(device)


def model_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--model-arg KEY=VALUE`` options as keyword arguments."""
    from autosplit.modelfile import parse_model_args

    return parse_model_args(getattr(args, "model_arg", None) or [])


def load_model(args: argparse.Namespace, on_meta: bool = False) -> tuple[Any, Any, Any]:
    """(ModelFile, model, example inputs) from the model arguments; ``on_meta`` builds the
    model on the meta device (no memory is allocated for its weights)."""
    import torch

    from autosplit.modelfile import load_model_file

    source = load_model_file(args.model, args.entry)
    kwargs = model_args(args)
    if on_meta:
        from autosplit.estimate.analytic import build_on_meta

        model = build_on_meta(lambda: source.build(**kwargs))
    else:
        model = source.build(**kwargs)
    if getattr(args, "input_shape", None):
        batch = args.batch_size or source.default_batch_size or 32
        inputs: Any = (torch.randn(batch, *args.input_shape),)
    else:
        inputs = source.example_inputs(getattr(args, "batch_size", None), **kwargs)
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    args.capture_options = capture_options(args, source)
    return source, model, inputs


def capture_options(args: argparse.Namespace, source: Any) -> dict[str, Any]:
    """How to capture the model: ``--granularity`` and ``--leaf-modules``, else the model
    file's ``GRANULARITY`` and ``LEAF_MODULES``."""
    granularity = getattr(args, "granularity", None) or getattr(source, "granularity", None)
    leaves = getattr(args, "leaf_modules", None) or getattr(source, "leaf_modules", ())
    return {"granularity": granularity or "block", "leaf_modules": tuple(leaves)}
