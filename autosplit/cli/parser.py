"""The argument parser of every ``autosplit`` command and the types of its arguments.

A bad option is one line ``error: … (see autosplit --help)`` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, NoReturn

from autosplit.cli import compare, devices, profile_plan, run, show
from autosplit.cli.topology_args import add_topology_arguments
from autosplit.errors import InvalidInputError

__all__ = ["EXIT_USAGE", "build_parser"]

EXIT_USAGE = 2

MODEL_HELP = "model file defining build_model() (or model) and example_inputs(batch_size)"
ENTRY_HELP = "another model factory than build_model/model"
SHAPE_HELP = "one float input of this shape per sample, instead of example_inputs()"
GPUS_HELP = "number of devices (pipeline stages)"
SCHEDULE_HELP = "pipeline schedule (default gpipe)"
# "auto" and the names of autosplit.planner.schedules.SEARCHED (a test keeps them equal)
PLAN_SCHEDULES = ("auto", "gpipe", "1f1b", "looped-bfs", "interleaved-1f1b", "interleaved-zb",
                  "zbv", "dualpipev")
PLAN_SCHEDULE_HELP = ("pipeline schedule; auto (default) chooses it, the stages per rank and "
                      "each stage's recomputation with the cuts")
DEBUG_HELP = "show the traceback of an error instead of one line"


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
    p.add_argument("model", metavar="MODEL.py", help=MODEL_HELP)
    p.add_argument("--entry", metavar="FILE_OR_MODULE:CALLABLE", help=ENTRY_HELP)
    p.add_argument("--batch-size", type=_positive_int, metavar="B",
                   help="batch size B (default: the model file's)")
    p.add_argument("--input-shape", type=_int_list, metavar="C,H,W", help=SHAPE_HELP)
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the model file's factory and example_inputs, "
                        "e.g. size=7b (repeatable)")
    _add_capture_arguments(p)


def _add_capture_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--granularity", choices=("block", "layer"),
                   help="blocks: the model's repeated layers and the modules around them "
                        "(block, the default) or every leaf module (layer); default the model "
                        "file's GRANULARITY")
    p.add_argument("--leaf-modules", type=_name_list, metavar="NAME[,NAME]",
                   help="submodules (qualified names, e.g. encoder.layer.0.attention) that "
                        "torch.fx must not trace into; default the model file's LEAF_MODULES")


def _name_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no module, e.g. encoder.layer.0")
    return names


def _add_profile_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device",
                   help="cpu or cuda:N: measure there (default: cuda:0 if present, else cpu); "
                        "a device name such as h100-80gb (see `autosplit devices`): estimate "
                        "from FLOPs and bytes on the meta device, for hardware you do not have")
    p.add_argument("--device-spec", metavar="SPEC.json",
                   help="estimate for the device described in this file (see "
                        "`autosplit calibrate`)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"),
                   help="with an estimated device: count the model in this precision "
                        "(default: as built)")
    p.add_argument("--microbatch-sizes", type=_int_list, metavar="B1,B2,…",
                   help="micro-batch sizes to measure (default: chosen from the batch)")
    p.add_argument("--threads", type=_positive_int, default=1,
                   help="threads of a CPU worker while profiling (default 1)")
    p.add_argument("--repeats", type=_positive_int, default=3,
                   help="timed runs per block and size, at least; more (up to 3×) while their "
                        "spread is above 5%%; the median is kept (default 3)")
    p.add_argument("--budget", type=_budget_seconds, default=None, metavar="SECONDS",
                   help="about how long the whole command may take: profiling stops starting "
                        "new default sizes after 40%% of it (all of it for `autosplit "
                        "profile`; the sizes nearest m = 3p on both sides are measured "
                        "whatever it costs), and verification takes what is left, in the "
                        "sessions that fit, or none (default: profiling stops after 40 s, "
                        "verification after 60 s)")
    p.add_argument("--loss", choices=("model", "mse", "none"), default=None,
                   help="the loss timed with the last block: model (the model's own, as "
                        "`autosplit run` trains a model that returns one; the default for "
                        "those), mse (the tutorial's, which `autosplit run` trains other "
                        "models with; their default) or none")
    p.add_argument("--remeasure", action="store_true",
                   help="measure the machine's figures (links, all-reduce, the pipeline "
                        "runtime's cost) again rather than take them from the cache")


def _add_memory_arguments(p: argparse.ArgumentParser, optimizer_help: str,
                          plans: bool = False) -> None:
    p.add_argument("--memory", type=_byte_size("memory size"), metavar="SIZE",
                   help="memory per device, e.g. 16GiB")
    if plans:
        p.add_argument("--schedule", choices=PLAN_SCHEDULES, default="auto",
                       help=PLAN_SCHEDULE_HELP)
    else:
        p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe",
                       help=SCHEDULE_HELP)
    p.add_argument("--optimizer", default="sgd", help=optimizer_help)


def _add_profile_command(sub: Any) -> None:
    p = sub.add_parser("profile", help="measure every block of a model; write profile.json",
                       description="Measure forward/backward time, memory and crossing bytes "
                                   "of every block.")
    _add_model_arguments(p)
    _add_profile_arguments(p)
    p.add_argument("--gpus", type=_positive_int, default=2,
                   help="stages planned for (chooses default sizes; default 2)")
    p.add_argument("-o", "--output", default="profile.json",
                   help="where to write the profile (default profile.json)")
    p.set_defaults(run=profile_plan.profile_command)


def _add_plan_command(sub: Any) -> None:
    p = sub.add_parser("plan",
                       help="choose cut points and micro-batch size; print and save the plan",
                       description="Profile the model (or read --profile), plan it for N "
                                   "devices, print the stage table and write plan.json.")
    _add_model_arguments(p)
    _add_profile_arguments(p)
    p.add_argument("--gpus", type=_positive_int, metavar="N",
                   help=GPUS_HELP + "; required unless --nodes and --gpus-per-node are given")
    add_topology_arguments(p, _positive_int, _byte_size("bandwidth"))
    p.add_argument("--profile", metavar="profile.json",
                   help="plan from this profile instead of measuring")
    _add_memory_arguments(p, "optimizer the plan assumes, its state in the memory and its "
                             "update in the step: sgd, sgd-momentum, adam … (default sgd)",
                          plans=True)
    p.add_argument("--split-size", type=_positive_int, metavar="K",
                   help="fix the micro-batch size instead of choosing it")
    p.add_argument("--solver", choices=("dp", "milp"), default="dp",
                   help="exact dynamic program (default) or the PuLP MILP (same optimum, slower)")
    p.add_argument("--bandwidth", type=_byte_size("bandwidth"), metavar="BYTES_PER_S",
                   help="link bandwidth between stages, e.g. 16GB (per second); default "
                   "measured-free figures: see autosplit.devices")
    p.add_argument("--pipeline-only", action="store_true",
                   help="plan a pipeline of N stages only; do not show the data-parallel and "
                        "hybrid layouts")
    p.add_argument("--replicas", type=_positive_int, metavar="D",
                   help="plan N/D stages × D data-parallel replicas (D divides N and the "
                        "batch); autosplit run trains it on N ranks (DDP or FSDP2 along the "
                        "replicas)")
    p.add_argument("--replica-mode", choices=("auto", "ddp", "fsdp2", "fsdp2-no-reshard"),
                   default="auto",
                   help="how replicas keep equal: DDP, FSDP2's fully_shard resharding after "
                        "forward, or without resharding; auto (default): the fastest that "
                        "fits")
    p.add_argument("--allreduce-bandwidth", type=_byte_size("bandwidth"), metavar="BYTES_PER_S",
                   help="bandwidth of the replicas' gradient all-reduce, without the "
                        "measured latency (default: measured with it, else the link "
                        "bandwidth)")
    p.add_argument("-o", "--output", default="plan.json",
                   help="where to write the plan (default plan.json)")
    p.add_argument("--emit", metavar="FILE.py",
                   help="also write the pipelined model as readable Python")
    p.add_argument("--emit-torchtitan", metavar="JOB.toml",
                   help="also write the plan as torchtitan's parallelism, training and "
                        "activation-checkpoint sections (torchtitan 0.2's --job.config_file)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw the schedule timeline, time per stage and memory per device")
    _add_verify_argument(p)
    p.set_defaults(run=profile_plan.plan_command)


def _add_verify_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-verify", action="store_true",
                   help="skip timing the shown plans' stages as they run (predictions then "
                        "come from block sums)")


def _add_compare_command(sub: Any) -> None:
    p = sub.add_parser("compare",
                       help="autosplit's plan beside a hand-written split and the peers' "
                            "heuristics",
                       description="Predicted step time and memory of autosplit's plan, a "
                                   "hand-written split (default: the model file's "
                                   "MANUAL_SPLIT, e.g. the tutorial's for examples/resnet50.py) "
                                   "and the baselines (uniform, by parameters, torchgpipe-"
                                   "style), all scored by the same cost model.")
    _add_model_arguments(p)
    _add_profile_arguments(p)
    p.add_argument("--gpus", type=_positive_int, required=True, metavar="N", help=GPUS_HELP)
    p.add_argument("--profile", metavar="profile.json",
                   help="use this profile instead of measuring")
    p.add_argument("--manual", action="append", metavar="BLOCK",
                   help="first block (or module, e.g. layer3) of each stage after the first; "
                        "repeat for more stages")
    p.add_argument("--manual-split-size", type=_positive_int, metavar="K",
                   help="micro-batch size of the hand-written split")
    _add_memory_arguments(p, "optimizer the plans assume, its state in the memory and its "
                             "update in the step (default sgd)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw the plans' predicted (and measured) step times side by side")
    p.add_argument("--measure", action="store_true",
                   help="also train each plan, one process per stage (gloo on CPUs, NCCL on "
                        "GPUs), side by side, and show the measured step time")
    p.add_argument("--rounds", type=_positive_int, default=2,
                   help="with --measure: timed steps per plan, taken in turn A B A B "
                        "(default 2)")
    p.add_argument("--timeout", type=_positive_float, default=300.0, metavar="SECONDS",
                   help="with --measure: how long a rank waits for a peer (default 300)")
    _add_verify_argument(p)
    p.set_defaults(run=compare.compare_command)


def _add_show_command(sub: Any) -> None:
    p = sub.add_parser("show", help="print a saved plan",
                       description="Print the stage table of a plan file.")
    p.add_argument("plan", metavar="plan.json")
    p.add_argument("--model", metavar="MODEL.py",
                   help="check that the plan was made for this model file")
    p.add_argument("--entry", metavar="FILE_OR_MODULE:CALLABLE", help=ENTRY_HELP)
    p.add_argument("--plot", metavar="FILE.png", help="also draw the plan")
    p.set_defaults(run=show.show_command)


def _add_device_commands(sub: Any) -> None:
    p = sub.add_parser("calibrate", help="fit a device spec's efficiency to a measured profile",
                       description="Count the model's FLOPs and bytes at the measured "
                                   "profile's batch and sizes, fit the spec's compute and "
                                   "bandwidth efficiency so that its estimated block times "
                                   "match the measured ones, and write the calibrated spec "
                                   "(use it with --device-spec).")
    _add_model_arguments(p)
    p.add_argument("--profile", required=True, metavar="profile.json",
                   help="a measured profile of this model (autosplit profile …)")
    p.add_argument("--device", required=True, metavar="NAME",
                   help="the spec to start from (see `autosplit devices`), e.g. cpu-core")
    p.add_argument("--device-spec", metavar="SPEC.json",
                   help="start from this spec file instead of a named one")
    p.add_argument("--split-size", type=_positive_int, metavar="K",
                   help="fit only at this micro-batch size (the one you will plan with)")
    p.add_argument("-o", "--output", default="device.json",
                   help="where to write the calibrated spec (default device.json)")
    p.set_defaults(run=devices.calibrate_command)

    p = sub.add_parser("devices", help="list the named devices analytic plans can target",
                       description="The device specs autosplit knows (published figures, with "
                                   "their sources).")
    p.set_defaults(run=devices.devices_command)


def _add_run_command(sub: Any) -> None:
    p = sub.add_parser("run",
                       help="train a plan with one process per stage "
                            "(torch.distributed.pipelining)",
                       description="Start one process per stage on this machine (gloo on CPUs, "
                                   "NCCL on GPUs), run N training steps on the model file's "
                                   "example inputs and print the step times. Under torchrun it "
                                   "runs as one of the ranks (several machines: see the "
                                   "README).")
    p.add_argument("model", metavar="MODEL.py", help=MODEL_HELP)
    p.add_argument("--entry", metavar="FILE_OR_MODULE:CALLABLE", help=ENTRY_HELP)
    p.add_argument("--plan", required=True, metavar="plan.json",
                   help="the plan to run (autosplit plan … -o plan.json)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the model file's factory and example_inputs "
                        "(repeatable)")
    _add_capture_arguments(p)
    p.add_argument("--steps", type=_positive_int, default=3,
                   help="training steps to run (default 3)")
    p.add_argument("--backend", choices=("gloo", "nccl"),
                   help="gloo (CPUs) or nccl (one GPU per rank); default nccl when there is a "
                        "GPU per rank, else gloo")
    p.add_argument("--batch-size", type=_positive_int, metavar="B",
                   help="batch size; must be the plan's micro-batches × split size (the "
                        "default)")
    p.add_argument("--input-shape", type=_int_list, metavar="C,H,W", help=SHAPE_HELP)
    p.add_argument("--nproc", type=_positive_int, metavar="N",
                   help="processes on this machine (default one per stage and replica; "
                        "replicas × a divisor of the stage count interleaves stages)")
    p.add_argument("--threads", type=_positive_int, default=1,
                   help="intra-op threads per rank on CPUs (default 1)")
    p.add_argument("--timeout", type=_positive_float, default=120.0, metavar="SECONDS",
                   help="how long a rank waits for a peer before the run fails (default 120)")
    p.add_argument("--lr", type=_positive_float, default=0.001,
                   help="SGD learning rate (default 0.001, the tutorial's)")
    p.set_defaults(run=run.run_command)


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
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_profile_command(sub)
    _add_plan_command(sub)
    _add_compare_command(sub)
    _add_show_command(sub)
    _add_device_commands(sub)
    _add_run_command(sub)
    for command in sub.choices.values():  # --debug after the command name too
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help=DEBUG_HELP)
    return parser
