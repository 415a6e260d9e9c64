"""The ``autosplit`` command line: ``main(argv) -> int``.

Exit codes: 0 success; 2 bad input (an :class:`AutosplitError`, a file that cannot be read or
written, a bad option), one line ``error: …`` on stderr; 1 an internal error (a bug), one line
``internal error: …``, or a rank of ``autosplit run`` failed; 130 interrupted. ``--debug`` shows
the traceback instead. No traceback otherwise.

Inputs are never overwritten, and a command writes its outputs only once it has succeeded, all
or none (see :mod:`autosplit.outputs`): they are checked before any work.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from rich.console import Console

from autosplit.errors import AutosplitError, InvalidInputError
from autosplit.outputs import Outputs, check_outputs
from autosplit.records import Plan, Profile

__all__ = ["main", "build_parser"]

EXIT_USAGE = 2
EXIT_INTERNAL = 1
EXIT_INTERRUPTED = 130

_OUTPUTS = (("output", "-o"), ("emit", "--emit"), ("plot", "--plot"))
"""(attribute, option) of every file a command writes."""
_INPUTS = (("model", "the model file"), ("profile", "--profile"), ("plan", "the plan file"),
           ("device_spec", "--device-spec"))
"""(attribute, what) of every file a command reads."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _number(text: str, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        sign = "non-negative" if allow_zero else "positive"
        raise argparse.ArgumentTypeError(f"must be a finite {sign} number, got {text}")
    return value


def _positive_float(text: str) -> float:
    return _number(text, allow_zero=False)


def _budget_seconds(text: str) -> float:
    return _number(text, allow_zero=True)


def _byte_size(what: str) -> Any:
    """An argparse type reading sizes such as ``16GiB`` (bytes, int)."""
    from autosplit.units import parse_bytes

    def parse(text: str) -> int:
        try:
            return parse_bytes(text, what)
        except InvalidInputError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must list positive integers, e.g. 4,8,20")
    return values


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL.py", help="model file defining build_model() (or model) and example_inputs(batch_size)")
    p.add_argument("--entry", metavar="FILE_OR_MODULE:CALLABLE", help="another model factory than build_model/model")
    p.add_argument("--batch-size", type=_positive_int, metavar="B", help="batch size B (default: the model file's)")
    p.add_argument("--input-shape", type=_int_list, metavar="C,H,W", help="one float input of this shape per sample, instead of example_inputs()")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE", help="keyword argument for the model file's factory and example_inputs, e.g. size=7b (repeatable)")


def _add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="cpu or cuda:N: measure there (default: cuda:0 if present, else cpu); a device name such as h100-80gb (see `autosplit devices`): estimate from FLOPs and bytes on the meta device, for hardware you do not have")
    p.add_argument("--device-spec", metavar="SPEC.json", help="estimate for the device described in this file (see `autosplit calibrate`)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="with an estimated device: count the model in this precision (default: as built)")
    p.add_argument("--microbatch-sizes", type=_int_list, metavar="B1,B2,…", help="micro-batch sizes to measure (default: chosen from the batch)")
    p.add_argument("--threads", type=_positive_int, default=1, help="threads of a CPU worker while profiling (default 1)")
    p.add_argument("--repeats", type=_positive_int, default=3,
                   help="timed runs per block and size, at least; more (up to 3×) while their "
                        "spread is above 5%%; the median is kept (default 3)")
    p.add_argument("--budget", type=_budget_seconds, default=40.0, metavar="SECONDS",
                   help="stop starting new default sizes after this long (default 40)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command."""
    from autosplit import __version__

    parser = _Parser(
        prog="autosplit",
        description="Split a PyTorch model across several devices: profile it, plan the cut "
        "points and micro-batch size, emit the pipelined code.",
        epilog="Example: autosplit plan examples/resnet50.py --gpus 2",
    )
    parser.add_argument("--version", action="version", version=f"autosplit {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error instead of one line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("profile", help="measure every block of a model; write profile.json",
                       description="Measure forward/backward time, memory and crossing bytes of every block.")
    _add_model_arguments(p)
    _add_profile_arguments(p)
    p.add_argument("--gpus", type=_positive_int, default=2, help="stages planned for (chooses default sizes; default 2)")
    p.add_argument("-o", "--output", default="profile.json", help="where to write the profile (default profile.json)")
    p.set_defaults(run=_cmd_profile)

    p = sub.add_parser("plan", help="choose cut points and micro-batch size; print and save the plan",
                       description="Profile the model (or read --profile), plan it for N devices, print the stage table and write plan.json.")
    _add_model_arguments(p)
    _add_profile_arguments(p)
    p.add_argument("--gpus", type=_positive_int, required=True, metavar="N", help="number of devices (pipeline stages)")
    p.add_argument("--profile", metavar="profile.json", help="plan from this profile instead of measuring")
    p.add_argument("--memory", type=_byte_size("memory size"), metavar="SIZE",
                   help="memory per device, e.g. 16GiB")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe", help="pipeline schedule (default gpipe)")
    p.add_argument("--optimizer", default="sgd", help="optimizer assumed by the memory model: sgd, sgd-momentum, adam … (default sgd)")
    p.add_argument("--split-size", type=_positive_int, metavar="K", help="fix the micro-batch size instead of choosing it")
    p.add_argument("--solver", choices=("dp", "milp"), default="dp", help="exact dynamic program (default) or the PuLP MILP (same optimum, slower)")
    p.add_argument("--bandwidth", type=_byte_size("bandwidth"), metavar="BYTES_PER_S",
                   help="link bandwidth between stages, e.g. 16GB (per second); default "
                   "measured-free figures: see autosplit.devices")
    p.add_argument("-o", "--output", default="plan.json", help="where to write the plan (default plan.json)")
    p.add_argument("--emit", metavar="FILE.py", help="also write the pipelined model as readable Python")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the schedule timeline, time per stage and memory per device")
    p.add_argument("--no-verify", action="store_true", help="skip timing the best candidates' stages as they run (predictions then come from block sums)")
    p.set_defaults(run=_cmd_plan)

    p = sub.add_parser("compare", help="autosplit's plan beside a hand-written split and the peers' heuristics",
                       description="Predicted step time and memory of autosplit's plan, a hand-written split (default: the model file's MANUAL_SPLIT, e.g. the tutorial's for examples/resnet50.py) and the baselines (uniform, by parameters, torchgpipe-style), all scored by the same cost model.")
    _add_model_arguments(p)
    _add_profile_arguments(p)
    p.add_argument("--gpus", type=_positive_int, required=True, metavar="N", help="number of devices (pipeline stages)")
    p.add_argument("--profile", metavar="profile.json", help="use this profile instead of measuring")
    p.add_argument("--manual", action="append", metavar="BLOCK", help="first block (or module, e.g. layer3) of each stage after the first; repeat for more stages")
    p.add_argument("--manual-split-size", type=_positive_int, metavar="K", help="micro-batch size of the hand-written split")
    p.add_argument("--memory", type=_byte_size("memory size"), metavar="SIZE",
                   help="memory per device, e.g. 16GiB")
    p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe", help="pipeline schedule (default gpipe)")
    p.add_argument("--optimizer", default="sgd", help="optimizer assumed by the memory model (default sgd)")
    p.add_argument("--plot", metavar="FILE.png", help="draw the plans' predicted (and measured) step times side by side")
    p.add_argument("--measure", action="store_true", help="also train each plan, one process per stage (gloo on CPUs, NCCL on GPUs), side by side, and show the measured step time")
    p.add_argument("--rounds", type=_positive_int, default=2, help="with --measure: timed steps per plan, taken in turn A B A B (default 2)")
    p.add_argument("--timeout", type=_positive_float, default=300.0, metavar="SECONDS",
                   help="with --measure: how long a rank waits for a peer (default 300)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip timing every plan's stages as they run (predictions then come "
                        "from block sums)")
    p.set_defaults(run=_cmd_compare)

    p = sub.add_parser("show", help="print a saved plan", description="Print the stage table of a plan file.")
    p.add_argument("plan", metavar="plan.json")
    p.add_argument("--model", metavar="MODEL.py", help="check that the plan was made for this model file")
    p.add_argument("--entry", metavar="FILE_OR_MODULE:CALLABLE", help="another model factory than build_model/model")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the plan")
    p.set_defaults(run=_cmd_show)

    p = sub.add_parser("calibrate", help="fit a device spec's efficiency to a measured profile",
                       description="Count the model's FLOPs and bytes at the measured profile's batch and sizes, fit the spec's compute and bandwidth efficiency so that its estimated block times match the measured ones, and write the calibrated spec (use it with --device-spec).")
    _add_model_arguments(p)
    p.add_argument("--profile", required=True, metavar="profile.json", help="a measured profile of this model (autosplit profile …)")
    p.add_argument("--device", required=True, metavar="NAME", help="the spec to start from (see `autosplit devices`), e.g. cpu-core")
    p.add_argument("--device-spec", metavar="SPEC.json", help="start from this spec file instead of a named one")
    p.add_argument("--split-size", type=_positive_int, metavar="K", help="fit only at this micro-batch size (the one you will plan with)")
    p.add_argument("-o", "--output", default="device.json", help="where to write the calibrated spec (default device.json)")
    p.set_defaults(run=_cmd_calibrate)

    p = sub.add_parser("devices", help="list the named devices analytic plans can target",
                       description="The device specs autosplit knows (published figures, with their sources).")
    p.set_defaults(run=_cmd_devices)

    p = sub.add_parser("run", help="train a plan with one process per stage (torch.distributed.pipelining)",
                       description="Start one process per stage on this machine (gloo on CPUs, NCCL on GPUs), run N training steps on the model file's example inputs and print the step times. Under torchrun it runs as one of the ranks (several machines: see the README).")
    p.add_argument("model", metavar="MODEL.py", help="model file defining build_model() (or model) and example_inputs(batch_size)")
    p.add_argument("--entry", metavar="FILE_OR_MODULE:CALLABLE", help="another model factory than build_model/model")
    p.add_argument("--plan", required=True, metavar="plan.json", help="the plan to run (autosplit plan … -o plan.json)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE", help="keyword argument for the model file's factory and example_inputs (repeatable)")
    p.add_argument("--steps", type=_positive_int, default=3, help="training steps to run (default 3)")
    p.add_argument("--backend", choices=("gloo", "nccl"), help="gloo (CPUs) or nccl (one GPU per rank); default nccl when there is a GPU per rank, else gloo")
    p.add_argument("--batch-size", type=_positive_int, metavar="B", help="batch size; must be the plan's micro-batches × split size (the default)")
    p.add_argument("--input-shape", type=_int_list, metavar="C,H,W", help="one float input of this shape per sample, instead of example_inputs()")
    p.add_argument("--nproc", type=_positive_int, metavar="N", help="processes on this machine (default one per stage; a divisor of the stage count interleaves stages)")
    p.add_argument("--threads", type=_positive_int, default=1, help="intra-op threads per rank on CPUs (default 1)")
    p.add_argument("--timeout", type=_positive_float, default=120.0, metavar="SECONDS",
                   help="how long a rank waits for a peer before the run fails (default 120)")
    p.add_argument("--lr", type=_positive_float, default=0.001,
                   help="SGD learning rate (default 0.001, the tutorial's)")
    p.set_defaults(run=_cmd_run)
    for command in sub.choices.values():  # --debug after the command name too
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show the traceback of an error instead of one line")
    return parser


# ------------------------------------------------------------------------------------ helpers


def _console() -> Console:
    # a pipe or a file gets wide lines rather than a table wrapped at 80 columns
    return Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 140)


def _err_console() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _check_outputs(args: argparse.Namespace) -> Outputs:
    """The command's outputs, checked against its inputs and each other before any work."""
    outputs = {option: getattr(args, attr, None) for attr, option in _OUTPUTS}
    inputs = {what: getattr(args, attr, None) for attr, what in _INPUTS}
    entry = getattr(args, "entry", None)
    if entry and ":" in entry:
        inputs["the --entry file"] = entry.rpartition(":")[0]
    return check_outputs(outputs, inputs)


def _spec(args: argparse.Namespace) -> Any:
    """The DeviceSpec to estimate for (``--device NAME`` or ``--device-spec``), or None."""
    from autosplit.specs import get_spec, load_spec

    if getattr(args, "device_spec", None):
        return load_spec(args.device_spec)
    device = getattr(args, "device", None)
    if device is None or device.split(":")[0] in ("cpu", "cuda"):
        return None
    return get_spec(device)


def _load(args: argparse.Namespace, on_meta: bool = False) -> tuple[Any, Any, Any]:
    """(ModelFile, model, example inputs) from the model arguments; ``on_meta`` builds the
    model on the meta device (no memory is allocated for its weights)."""
    import torch

    from autosplit.modelfile import load_model_file

    source = load_model_file(args.model, args.entry)
    kwargs = _model_args(args)
    if on_meta:
        from autosplit.analytic import build_on_meta

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
    return source, model, inputs


def _estimate(args: argparse.Namespace, spec: Any, model: Any, inputs: Any, stages: int,
              console: Console) -> Profile:
    """An analytic profile of ``model`` on ``spec`` (FLOPs and bytes counted on meta)."""
    import time

    import torch

    from autosplit.analytic import analytic_profile

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    start = time.perf_counter()
    prof = analytic_profile(
        model, inputs, spec, microbatch_sizes=getattr(args, "microbatch_sizes", None),
        stages=stages, dtype=dtypes.get(getattr(args, "dtype", None) or ""),
    )
    console.print(
        f"estimated {prof.model} on {spec.label()} from its FLOPs and bytes (an estimate, not a "
        f"measurement) · micro-batch sizes {', '.join(map(str, prof.microbatch_sizes))} · "
        f"{time.perf_counter() - start:.1f} s"
    )
    return prof


def _device_note(console: Console, gpus: int, device: str | None) -> None:
    import torch

    if (device is None or device.startswith("cpu")) and torch.cuda.device_count() < gpus:
        console.print(
            f"no CUDA device{'s' if gpus > 1 else ''} for {gpus} stages: profiling on CPU, one "
            f"worker per device; planning for {gpus} such devices"
        )


def _measure(args: argparse.Namespace, model: Any, inputs: Any, stages: int, console: Console,
             include: int | None = None) -> Profile:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from autosplit.graph import trace
    from autosplit.profiler import check_inputs, profile_graph

    inputs = check_inputs(inputs)
    graph = trace(model, example_inputs=inputs)
    with Progress(
        TextColumn("profiling {task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task(f"{graph.model_name} · {len(graph.blocks)} blocks", total=None)

        def progress(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total)

        prof = profile_graph(
            graph,
            inputs,
            device=args.device,
            microbatch_sizes=args.microbatch_sizes,
            include=[include] if include and include <= int(inputs[0].shape[0]) else [],
            stages=stages,
            repeats=args.repeats,
            threads=args.threads,
            budget_s=args.budget,
            progress=progress,
        )
        bar.update(task, completed=1, total=1)
    console.print(
        f"measured micro-batch sizes {', '.join(map(str, prof.microbatch_sizes))} in {prof.seconds:.1f} s"
    )
    return prof


# ----------------------------------------------------------------------------------- commands


def _cmd_profile(args: argparse.Namespace) -> int:
    console = _console()
    spec = _spec(args)
    _, model, inputs = _load(args, on_meta=spec is not None)
    if spec is not None:
        prof = _estimate(args, spec, model, inputs, args.gpus, console)
    else:
        _device_note(console, args.gpus, args.device)
        prof = _measure(args, model, inputs, args.gpus, console)
    args.outputs.commit({"-o": prof.save})
    console.print(f"wrote {args.output}")
    return 0


def _profile_for(args: argparse.Namespace, source: Any, model: Any, inputs: Any, console: Console,
                 must_measure: int | None = None) -> Profile:
    """The profile to plan from: ``--profile`` (checked against the model) or a measurement.

    ``must_measure`` is a micro-batch size the measurement has to include (a hand split's).
    """
    from autosplit.graph import trace

    if args.profile:
        prof = Profile.load(args.profile)
        fingerprint = trace(model).fingerprint
        if prof.fingerprint != fingerprint:
            raise InvalidInputError(
                f"profile {args.profile!r} was made for another model ({prof.model}, fingerprint "
                f"{prof.fingerprint}); {args.model} has fingerprint {fingerprint}: profile it again"
            )
        return prof
    spec = _spec(args)
    if spec is not None:
        return _estimate(args, spec, model, inputs, args.gpus, console)
    _device_note(console, args.gpus, args.device)
    return _measure(args, model, inputs, args.gpus, console, must_measure)


def _manual_reference(prof: Profile, source: Any, args: argparse.Namespace,
                      kwargs: dict[str, Any]) -> tuple[str, Plan] | None:
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
    batch = kwargs["batch_size"]
    if explicit is not None and explicit > batch:
        raise InvalidInputError(f"--manual-split-size {explicit} is larger than the batch {batch}: "
                                "give a smaller one or a larger --batch-size")
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
    plan = manual_plan(prof, points, None if why else size, **kwargs)
    label = f"hand split (cut at {', '.join(points)}, split {plan.split_size}"
    if why:  # the model file's size: the hand split gets its best measured one instead
        label += f"; its MANUAL_SPLIT_SIZE {size} {why}"
    return label + ")", plan


def _verifies(args: argparse.Namespace, prof: Profile) -> bool:
    """Verify stage times: on by default for a profile measured by this command."""
    return not args.no_verify and prof.source == "measured" and not args.profile


def _verify(args: argparse.Namespace, model: Any, inputs: Any, prof: Profile,
            candidates: Sequence[Plan], others: dict[str, Plan],
            console: Console) -> tuple[Plan, dict[str, Plan]]:
    """Time the candidates' and the other plans' stages as they run; the best by that."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from autosplit.graph import trace
    from autosplit.profiler import check_inputs
    from autosplit.verify import verify_and_choose

    inputs = check_inputs(inputs)
    what = f"the {len(candidates)} best candidate{'s' if len(candidates) > 1 else ''}"
    if others:
        what += f" and {', '.join(others)}"
    with Progress(TextColumn("verifying {task.description}"), BarColumn(),
                  TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(),
                  console=console) as bar:
        task = bar.add_task(f"{what}, stage by stage", total=None)
        result = verify_and_choose(
            trace(model, example_inputs=inputs), inputs, prof, candidates, others,
            device=args.device, threads=args.threads, budget_s=args.budget,
            progress=lambda done, total, _: bar.update(task, completed=done, total=total),
        )
        bar.update(task, completed=1, total=1)
    return result


def _cmd_plan(args: argparse.Namespace) -> int:
    from autosplit.planner import plan_candidates
    from autosplit.report import print_plan

    console = _console()
    memory, bandwidth = args.memory, args.bandwidth  # bytes, bytes per second (or None)
    spec = None if args.profile else _spec(args)
    if spec is not None:
        memory = memory or spec.memory_bytes
        bandwidth = bandwidth or spec.link_bandwidth_bytes_per_s
    source, model, inputs = _load(args, on_meta=spec is not None)
    prof = _profile_for(args, source, model, inputs, console, source.manual_split_size)
    kwargs: dict[str, Any] = dict(
        batch_size=args.batch_size or prof.batch_size,
        memory_per_gpu=memory,
        schedule=args.schedule,
        optimizer=args.optimizer,
        bandwidth_bytes_per_s=bandwidth,
    )
    verify = _verifies(args, prof)
    candidates = plan_candidates(prof, args.gpus, top_k=3 if verify else 1,
                                 split_size=args.split_size, solver=args.solver, **kwargs)
    plan = candidates[0]
    reference = _manual_reference(prof, source, args, kwargs)
    if verify:
        others = {} if reference is None else {reference[0]: reference[1]}
        plan, checked = _verify(args, model, inputs, prof, candidates, others, console)
        reference = None if reference is None else (reference[0], checked[reference[0]])
    code = None
    if args.emit:
        from autosplit.codegen import emit

        code = emit(plan, source.ref, model=model, command=shlex.join(["autosplit", *args.argv]))
    console.print()
    print_plan(console, plan, reference)
    if memory is not None and args.gpus > 1:
        _one_device_note(console, prof, memory, kwargs)
    writes: dict[str, Any] = {"-o": plan.save}
    if code is not None:
        writes["--emit"] = lambda path: path.write_text(code)
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


def _measure_plans(args: argparse.Namespace, plans: dict[str, Plan], console: Console) -> dict[str, float]:
    """Train every plan side by side on the multi-process runtime: median step time (ms)."""
    import statistics

    import torch

    from autosplit import distributed as dist_run

    runnable = {k: p for k, p in plans.items() if p.batch_size == p.microbatches * p.split_size}
    for name in plans.keys() - runnable.keys():
        console.print(f" {name}: not measured (its micro-batches are not all of one size)")
    if not runnable:
        return {}
    first = next(iter(runnable.values()))
    backend = "nccl" if torch.cuda.device_count() >= args.gpus else "gloo"
    spec = dist_run.RunSpec(args.model, args.entry, first, input_shape=tuple(args.input_shape)
                            if args.input_shape else None, model_args=tuple(_model_args(args).items()))
    console.print(f"measuring {len(runnable)} plans on {args.gpus} ranks ({backend}), "
                  f"{args.rounds} timed step(s) each, taken in turn …")
    results = dist_run.launch(dist_run.measure_plans, args.gpus, spec, list(runnable.values()),
                              args.rounds, backend=backend, timeout_s=args.timeout,
                              threads=1 if backend == "gloo" else None)
    times = results[0]
    return {name: 1000.0 * statistics.median(t) for name, t in zip(runnable, times)}


def _model_args(args: argparse.Namespace) -> dict[str, Any]:
    from autosplit.modelfile import parse_model_args

    return parse_model_args(getattr(args, "model_arg", None) or [])


def _one_device_note(console: Console, prof: Profile, memory: float, kwargs: dict[str, Any]) -> None:
    """Say whether one device of ``memory`` bytes could hold the model, and what it needs."""
    from autosplit.errors import InfeasiblePlanError
    from autosplit.planner import plan as make_plan
    from autosplit.units import format_bytes

    try:
        make_plan(prof, 1, **{**kwargs, "memory_per_gpu": memory})
    except InfeasiblePlanError as exc:
        console.print(
            f" one device of {format_bytes(memory)} cannot hold it: it needs "
            f"{format_bytes(exc.min_capacity_bytes)} ({kwargs.get('optimizer', 'sgd')} state "
            "included)"
        )
    else:
        console.print(f" one device of {format_bytes(memory)} could hold it too")


def _cmd_compare(args: argparse.Namespace) -> int:
    from autosplit.comparison import baseline_plans, compare
    from autosplit.planner import plan_candidates
    from autosplit.report import comparison_table

    console = _console()
    memory = args.memory
    spec = None if args.profile else _spec(args)
    if spec is not None:
        memory = memory or spec.memory_bytes
    source, model, inputs = _load(args, on_meta=spec is not None)
    size = args.manual_split_size or source.manual_split_size
    prof = _profile_for(args, source, model, inputs, console, size)
    kwargs: dict[str, Any] = dict(
        batch_size=args.batch_size or prof.batch_size,
        memory_per_gpu=memory,
        schedule=args.schedule,
        optimizer=args.optimizer,
    )
    verify = _verifies(args, prof)
    candidates = plan_candidates(prof, args.gpus, top_k=3 if verify else 1, **kwargs)
    plans = {"autosplit": candidates[0]}
    reference = _manual_reference(prof, source, args, kwargs)
    if reference is not None:
        plans["hand split"] = reference[1]
    plans.update(baseline_plans(prof, args.gpus, **kwargs))
    if verify:
        others = {k: v for k, v in plans.items() if k != "autosplit"}
        best, checked = _verify(args, model, inputs, prof, candidates, others, console)
        plans = {"autosplit": best, **checked}
    measured = _measure_plans(args, plans, console) if args.measure else None
    rows = compare(prof, plans, measured)
    console.print()
    console.print(comparison_table([(r.name, r.plan, r.measured_step_ms) for r in rows]))
    console.print()
    how = ("stage times verified: each plan's stages timed as they run, taking turns"
           if verify else "from block sums")
    console.print(f" all predicted by one simulator, {how} (profile {prof.describe()})")
    if args.plot:
        from autosplit.figures import comparison_figure

        title = (f"{prof.model} on {args.gpus} devices, batch {kwargs['batch_size']}: "
                 "predicted step time")
        args.outputs.commit({"--plot": lambda path: comparison_figure(rows, path, title)})
        console.print(f" wrote {args.plot}")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from autosplit.report import print_plan

    plan = Plan.load(args.plan)
    if args.model:
        from autosplit.graph import trace
        from autosplit.modelfile import load_model_file

        graph = trace(load_model_file(args.model, args.entry).build())
        plan.check_model(graph.fingerprint, args.model)
        plan.check_blocks(graph.block_names, args.model)
    console = _console()
    print_plan(console, plan)
    if args.plot:
        from autosplit.figures import plan_figure

        args.outputs.commit({"--plot": lambda path: plan_figure(plan, path)})
        console.print(f"\n wrote {args.plot}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from autosplit.analytic import count_costs
    from autosplit.specs import calibrate, get_spec, load_spec

    console = _console()
    spec = load_spec(args.device_spec) if args.device_spec else get_spec(args.device)
    measured = Profile.load(args.profile)
    if measured.source != "measured":
        raise InvalidInputError(
            f"{args.profile!r} is an {measured.source} profile: calibrate on a measured one"
        )
    _, model, _ = _load(args)
    import torch

    shapes = measured.input_shapes
    dtypes = [getattr(torch, d.replace("torch.", "")) for d in measured.input_dtypes]
    inputs = tuple(torch.zeros(shape, dtype=dt, device="meta") for shape, dt in zip(shapes, dtypes))
    costs = count_costs(model, inputs, microbatch_sizes=list(measured.microbatch_sizes))
    if tuple(costs.block_names) != measured.block_names:
        raise InvalidInputError(
            f"profile {args.profile!r} was made for another model ({measured.model}): profile "
            f"{args.model} and calibrate on that"
        )
    fitted = calibrate(spec, measured, costs, sizes=[args.split_size] if args.split_size else None)
    args.outputs.commit({"-o": fitted.save})
    console.print(f"{spec.name}: efficiency {spec.efficiency:.3f} → {fitted.efficiency:.3f}, "
                  f"bandwidth efficiency {spec.bandwidth_efficiency:.3f} → "
                  f"{fitted.bandwidth_efficiency:.3f}")
    console.print(f"calibrated on {measured.describe()}")
    console.print(fitted.source.rsplit("; ", 1)[-1])
    console.print(f"wrote {args.output} · plan with --device-spec {args.output}")
    return 0


def _cmd_devices(args: argparse.Namespace) -> int:
    from rich.table import Table

    from autosplit.specs import KNOWN_DEVICES

    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("name", "bf16 TFLOP/s", "fp32 TFLOP/s", "memory", "bandwidth", "link"):
        table.add_column(name, justify="left" if name in ("name", "link") else "right")
    for spec in KNOWN_DEVICES.values():
        table.add_row(
            spec.name,
            f"{spec.peak_flops_per_s('bf16') / 1e12:.3g}",
            f"{spec.peak_flops_per_s('fp32') / 1e12:.3g}",
            f"{spec.memory_bytes / 1e9:.0f} GB",
            f"{spec.memory_bandwidth_bytes_per_s / 1e9:.0f} GB/s",
            f"{spec.link} {spec.link_bandwidth_bytes_per_s / 1e9:.0f} GB/s",
        )
    console = _console()
    console.print(table)
    console.print("\n dense peaks from the vendors' datasheets (sources: autosplit.specs); "
                  "plan with --device NAME, calibrate with `autosplit calibrate`")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    import torch

    from autosplit import distributed as dist_run

    plan = Plan.load(args.plan)
    p, b, m = len(plan.stages), plan.split_size, plan.microbatches
    if args.batch_size is not None and args.batch_size != m * b:
        raise InvalidInputError(
            f"--batch-size {args.batch_size}: the plan runs {m} micro-batches of {b} = {m * b} rows; "
            "give that batch size or make a plan for yours"
        )
    if plan.batch_size != m * b:
        raise InvalidInputError(
            f"the plan splits its batch of {plan.batch_size} into {m} micro-batches of {b} (the last "
            f"smaller); torch.distributed.pipelining needs equal micro-batches: make a plan with a "
            f"--split-size that divides {plan.batch_size}"
        )
    if not args.timeout > 0:
        raise InvalidInputError(f"--timeout must be positive, got {args.timeout}")
    spec = dist_run.RunSpec(args.model, args.entry, plan, args.steps,
                            tuple(args.input_shape) if args.input_shape else None, args.lr,
                            model_args=tuple(_model_args(args).items()))
    console = _console()
    stages = " | ".join(s.blocks[0] if len(s.blocks) == 1 else f"{s.blocks[0]} … {s.blocks[-1]}"
                        for s in plan.stages)
    header = (f"{plan.model} · {p} stages ({stages}) · batch {m * b} = {m} × {b} · "
              f"schedule {plan.schedule}")
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ or all(
        k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    if torchrun:  # one rank of a torchrun job: rank 0 prints
        world = int(os.environ.get("WORLD_SIZE", "1"))
        backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        result = dist_run.run_rank(dist_run.train_model_file, (spec,), backend, args.timeout,
                                   args.threads if backend == "gloo" else None)
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
        where = f"{world} ranks (torchrun)"
    else:
        from autosplit.modelfile import load_model_file

        # the model and the plan are checked here, so that mistakes end before any process starts
        dist_run.graph_for_plan(load_model_file(args.model, args.entry).build(**_model_args(args)), plan)
        nproc = args.nproc or p
        dist_run.stage_indices(p, 0, nproc)
        backend = args.backend or ("nccl" if torch.cuda.device_count() >= nproc else "gloo")
        threads = args.threads if backend == "gloo" else None
        console.print(header)
        console.print(f"starting {nproc} rank{'s' if nproc != 1 else ''} on 127.0.0.1 · {backend}"
                      + (f" · {threads} thread{'s' if threads != 1 else ''} each" if threads else ""))
        try:
            results = dist_run.launch(dist_run.train_model_file, nproc, spec, backend=backend,
                                      timeout_s=args.timeout, threads=threads)
        except dist_run.RankFailedError as exc:
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
    console.print(f"median step {result.steady_step_s:.2f} s on {where} ({result.device}) · the plan "
                  f"predicted {predicted / 1000:.2f} s")
    return 0


# --------------------------------------------------------------------------------------- main


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
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            args.outputs = _check_outputs(args)
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
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        rank_failed = getattr(sys.modules.get("autosplit.distributed"), "RankFailedError", ())
        return EXIT_INTERNAL if isinstance(exc, rank_failed) else EXIT_USAGE
    except Exception as exc:  # a bug of autosplit's
        if args.debug:
            raise
        print(f"internal error: {type(exc).__name__}: {_one_line(exc)} (run with --debug for "
              "the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


def _one_line(exc: object) -> str:
    """An error message on one line (whitespace, newlines included, collapsed)."""
    text = " ".join(str(exc).split())
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        text = f"{exc.strerror}: {str(exc.filename)!r}"  # no "[Errno 13]"
    return text or type(exc).__name__


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
