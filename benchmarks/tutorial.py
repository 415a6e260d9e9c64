"""The PyTorch model-parallel tutorial, reproduced: ResNet50 on one device, split by hand over
two (the tutorial's ModelParallelResNet50), pipelined (PipelineParallelResNet50) and its
split-size sweep.

The hand split is the tutorial's: ``conv1 … layer2`` on the first device, ``layer3 … fc`` on the
second. Training as in the tutorial: SGD (lr 0.001), MSE against one-hot labels, 3 batches per
timing, several timings per configuration, mean and standard deviation; unlike the tutorial, one
untimed warm-up step per configuration first, and configurations interleaved round by round
(A B C … A B C …) so that the machine's drift hits all of them alike.

* On two or more GPUs it runs as the tutorial does: one process, the two halves on cuda:0 and
  cuda:1, the pipelined forward overlapping through CUDA's asynchronous launches.
* On CPUs a "device" is one CPU worker with one thread. One device is one process; the split
  and pipelined versions run one process per stage on ``autosplit.distributed``
  (torch.distributed.pipelining, gloo, GPipe): the hand split with one micro-batch is the model
  parallel version, with micro-batches of ``split_size`` the pipelined one. All of them run in
  one job of two ranks (the one-device runs on rank 0 while rank 1 waits).

torch.distributed.pipelining needs equal micro-batches (B = m·b). Where a split size of the
tutorial does not divide the batch, the nearest divisors are measured instead (both on a tie)
and the tables say so; at ``--tutorial-size`` (B = 120) every tutorial size divides the batch.

    python benchmarks/tutorial.py                    # B=48, 3×64×64: a few minutes on 2 cores
    python benchmarks/tutorial.py --tutorial-size    # the tutorial's B=120, 3×128×128 (tutorial_120.*)
    python benchmarks/tutorial.py --smoke            # a tiny run in seconds (used by the tests)

Writes ``tutorial.{json,md}``, ``tutorial_bars.png`` and ``tutorial_split_size.png`` under
``benchmarks/results/`` (``--out`` to change). The timing is ``harness.py``'s (shared with
``compare.py``); the one-process version is ``two_devices.py``.
"""

from __future__ import annotations

if __name__ == "__main__":  # started again first, before the imports below pay twice: the C
    # allocator keeping freed memory, as the ranks run (see autosplit/measure/allocator.py)
    from autosplit.measure.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import argparse
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from common import RESULTS, command_line, describe, machine, write_results
from harness import Config, Group, ModelSpec, add_load_arguments, load_options, measure, summary
from report import despine, lead_in_words, load_sentence, plural, pyplot, save_figure
from torch import nn
from two_devices import time_in_process

from autosplit.capture.trace import trace
from autosplit.records import Plan, Stage
from autosplit.solve import manual
from autosplit.stages import stage_layout

TUTORIAL_SPLITS = (1, 3, 5, 8, 10, 12, 20, 40, 60)
TUTORIAL_SPLIT = 20
HAND_SPLIT = ("layer3",)
# the tutorial's own numbers (unnamed GPU, B=120, 3×128×128, 3 batches per timing), for context
TUTORIAL_NUMBERS = {"one device": 3.75, "model parallel": 4.02, "pipelined (split 20)": 2.51,
                    "best split (12)": 2.43}


def bare_plan(model: nn.Module, split_points: Sequence[str], split_size: int, batch: int,
              balance: Sequence[int] | None = None, schedule: str = "gpipe") -> Plan:
    """A Plan with the given cut points (or balance) and micro-batch size, without profiling
    (its predictions are zero): enough for :class:`autosplit.distributed.Trainer`."""
    if batch % split_size:
        raise ValueError(f"split size {split_size} does not divide the batch {batch}")
    graph = trace(model)
    if balance is None:
        balance = manual(graph.block_names, split_points)
    stages = [Stage(s.index, "cpu", graph.block_names[s.first:s.end], 0.0, 0.0, 0, 0.0, 0)
              for s in stage_layout(graph, balance).stages]
    return Plan(graph.model_name, graph.fingerprint, tuple(stages), split_size,
                batch // split_size, batch, schedule, 0.0, 0.0, "manual", (split_size,),
                "not profiled")


def nearest_divisors(size: int, batch: int) -> list[int]:
    """The divisors of ``batch`` nearest to ``size`` (two on a tie)."""
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    gap = min(abs(d - size) for d in divisors)
    return [d for d in divisors if abs(d - size) == gap]


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = ModelSpec("resnet50", args.batch, (3, args.image, args.image))
    batch = args.batch
    sweep_map = {s: nearest_divisors(s, batch) for s in args.split_sizes}
    sweep = sorted({d for ds in sweep_map.values() for d in ds})
    pipelined = min(nearest_divisors(TUTORIAL_SPLIT, batch))  # a tie goes to more micro-batches
    gpus = torch.cuda.device_count()
    mode = args.mode if args.mode != "auto" else ("in-process" if gpus >= 2 else "processes")
    # what is timed: one device, the model-parallel split (m = 1) and every swept split size
    split_configs = {f"split {s}": s for s in sweep if s != batch}
    labels = {"one device": "one device", "model parallel": "model parallel",
              "pipelined": f"split {pipelined}" if pipelined != batch else "model parallel"}
    print(f"tutorial: {spec.describe}, mode {mode}, split sizes {sweep}, pipelined at split "
          f"{pipelined}, {args.repeats} timings × {args.batches} batches each", flush=True)
    start = time.perf_counter()
    if mode == "processes":
        model = spec.build()
        configs = [Config("one device", None),
                   Config("model parallel", bare_plan(model, HAND_SPLIT, batch, batch))]
        configs += [Config(label, bare_plan(model, HAND_SPLIT, s, batch))
                    for label, s in split_configs.items()]
        group = Group("tutorial", spec, tuple(configs), rounds=args.repeats, warmup=1,
                      steps=args.batches, **load_options(args))
        result = measure([group], backend="gloo", timeout_s=args.timeout)["tutorial"]
        times, load = result["times"], result["load"]
        devices_text = "CPU workers of 1 thread: one process per stage (gloo)"
    else:
        devices = [torch.device(d) for d in (args.devices or ["cuda:0", "cuda:1"])]
        configs_ip: list[tuple[str, int | None]] = [("one device", -1), ("model parallel", None)]
        configs_ip += list(split_configs.items())
        times, load = time_in_process(spec, configs_ip, devices, args.repeats, args.batches)
        devices_text = f"one process, devices {', '.join(map(str, devices))}"
    wall = time.perf_counter() - start
    rows = []
    single = summary(times["one device"])["mean"]
    for label, values in times.items():
        s = batch if label == "model parallel" else (None if label == "one device" else split_configs[label])
        stats = summary(values)
        rows.append({"config": label, "split_size": s, "microbatches": batch // s if s else None,
                     "seconds": values, **stats, "speedup_vs_one_device": single / stats["mean"]})
    by_label = {r["config"]: r for r in rows}
    sweep_rows = [by_label["model parallel" if s == batch else f"split {s}"] for s in sweep]
    best = min(sweep_rows, key=lambda r: r["mean"])
    return {
        "settings": {
            "machine": machine(),
            "model": "torchvision resnet50",
            "input": spec.describe,
            "batch": batch,
            "image": args.image,
            "mode": mode,
            "devices": devices_text,
            "repeats": args.repeats,
            "batches_per_timing": args.batches,
            "max_others": args.max_others,
            "retries": args.retries,
            "warmup": "one untimed round: one timing of every configuration",
            "lead_in_s": args.lead_in, "settle_rounds": args.settle_rounds,
            "more_rounds": args.more_rounds, "max_spread": args.max_spread,
            "tutorial_splits": list(args.split_sizes),
            "split_sizes_measured": {str(k): v for k, v in sweep_map.items()},
            "pipelined_split": pipelined,
            "hand_split": list(HAND_SPLIT),
            "command": args.command,
            "wall_seconds": wall,
            "load": load,
        },
        "rows": rows,
        "bars": {name: by_label[label] for name, label in labels.items()},
        "sweep": [{"split_size": s, **{k: r[k] for k in ("mean", "std", "median", "min", "max")}}
                  for s, r in zip(sweep, sweep_rows)],
        "best_split": best["split_size"],
    }


def markdown(data: dict[str, Any]) -> str:
    st = data["settings"]
    bars = data["bars"]
    mapped = ", ".join(f"{k}→{'/'.join(map(str, v))}" for k, v in st["split_sizes_measured"].items()
                       if [int(k)] != v)
    lines = [
        "# The tutorial, reproduced",
        "",
        f"Machine: {describe(st['machine'])}. ResNet50, {st['input']}, SGD lr 0.001, MSE on "
        f"one-hot labels; {st['devices']}; hand split before `layer3` (the tutorial's). Each timing "
        f"is {plural(st['batches_per_timing'], 'training batch', 'es')}; "
        f"{plural(st['repeats'], 'timing')} per configuration, interleaved round by round after a "
        f"warm-up round{lead_in_words(st)}; mean ± std (population, "
        f"as `np.std`). Whole run {st['wall_seconds']:.0f} s. Command: `{st['command']}`.",
        "",
        "Timings on this shared 2-core machine drift 20–30 % between runs (other jobs may run "
        "beside it); compare rows of one run, not across runs. A timing during which other "
        f"processes used more than {st['max_others']:.0%} of the machine's CPU time is taken again "
        f"(at most {st['retries']} times). " + load_sentence(st["load"]),
        "",
        "| configuration | split size | micro-batches | mean (s) | std (s) | vs one device |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in bars.items():
        text = name if name != "pipelined" else f"pipelined (split {st['pipelined_split']})"
        lines.append(
            f"| {text} | {row['split_size'] or '–'} | {row['microbatches'] or '–'} | "
            f"{row['mean']:.2f} | {row['std']:.2f} | ×{row['speedup_vs_one_device']:.2f} |"
        )
    lines += [
        "",
        f"Split-size sweep (the tutorial's sizes {', '.join(map(str, st['tutorial_splits']))}"
        + (f"; where one does not divide B={st['batch']}, the nearest divisors: {mapped}" if mapped else "")
        + f"). Best: split {data['best_split']}.",
        "",
        "| split size | micro-batches | mean (s) | std (s) |",
        "|---|---|---|---|",
    ]
    for row in data["sweep"]:
        lines.append(f"| {row['split_size']} | {st['batch'] // row['split_size']} | {row['mean']:.2f} | {row['std']:.2f} |")
    lines += [
        "",
        "The tutorial's own numbers (an unnamed GPU pair, B=120, 3×128×128): one GPU 3.75 s, model "
        "parallel 4.02 s, pipelined at split 20 2.51 s, best split 12 2.43 s.",
    ]
    if st["pipelined_split"] != TUTORIAL_SPLIT:
        lines += [
            "",
            f"Split 20 does not divide B={st['batch']}; the pipelined bar uses split "
            f"{st['pipelined_split']} (m = {st['batch'] // st['pipelined_split']}), the "
            "nearest divisor (torch.distributed.pipelining needs equal micro-batches).",
        ]
    return "\n".join(lines) + "\n"


def figures(data: dict[str, Any], out: Path, stem: str) -> list[str]:
    plt = pyplot()
    st = data["settings"]
    where = "CPU workers (1 thread each)" if st["mode"] == "processes" else st["devices"]
    paths = []
    bars = data["bars"]
    names = ["one device", "model parallel", f"pipelined\n(split {st['pipelined_split']})"]
    rows = [bars["one device"], bars["model parallel"], bars["pipelined"]]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100, layout="constrained")
    colors = ["#8C8C8C", "#DD8452", "#4C72B0"]
    means = [r["mean"] for r in rows]
    ax.bar(range(3), means, yerr=[r["std"] for r in rows], color=colors, capsize=6, width=0.6)
    for x, r in enumerate(rows):
        ax.text(x, r["mean"] + r["std"], f"{r['mean']:.2f} s\n×{r['speedup_vs_one_device']:.2f}",
                ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(3), names)
    ax.set_ylim(0, max(m + r["std"] for m, r in zip(means, rows)) * 1.3)
    ax.set_ylabel(f"seconds per {st['batches_per_timing']} training batches")
    ax.set_title(f"ResNet50, {st['input']}, on {where}\nmean ± std of {st['repeats']} timings "
                 "(lower is faster; ×: speed-up over one device)", fontsize=10, loc="left")
    despine(ax)
    paths.append(save_figure(fig, out / f"{stem}_bars.png"))

    fig, ax = plt.subplots(figsize=(6.5, 4), dpi=100, layout="constrained")
    sizes = [r["split_size"] for r in data["sweep"]]
    ax.errorbar(sizes, [r["mean"] for r in data["sweep"]], yerr=[r["std"] for r in data["sweep"]],
                marker="o", color="#4C72B0", capsize=4, label="hand split, pipelined (GPipe)")
    single = bars["one device"]
    ax.axhline(single["mean"], color="#8C8C8C", linestyle="--", label=f"one device ({single['mean']:.2f} s)")
    for r in data["sweep"]:
        ax.annotate(f"m={st['batch'] // r['split_size']}", (r["split_size"], r["mean"] + r["std"]),
                    textcoords="offset points", xytext=(0, 5), ha="center", fontsize=7, color="#555555")
    jumps = [(a["mean"] / b["mean"], a, b) for a, b in zip(data["sweep"], data["sweep"][1:])]
    ratio, small, large = max(jumps, key=lambda j: j[0]) if jumps else (1.0, None, None)
    if ratio > 1.5 and small is not None and large is not None:  # a per-sample cost cliff
        x = math.sqrt(small["split_size"] * large["split_size"])
        ax.annotate(f"cliff: split {small['split_size']} is\n×{ratio:.1f} slower than {large['split_size']}",
                    (x, (small["mean"] + large["mean"]) / 2), xytext=(x * 1.15, (small["mean"] + large["mean"]) / 2),
                    fontsize=8, color="#C44E52", va="center")
    best = min(data["sweep"], key=lambda r: r["mean"])
    ax.annotate(f"best: split {best['split_size']}\n{best['mean']:.2f} s",
                (best["split_size"], best["mean"]), textcoords="offset points", xytext=(10, -28),
                fontsize=9, arrowprops={"arrowstyle": "->", "color": "black"})
    ax.set_xscale("log")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.minorticks_off()
    ax.set_xlabel(f"split size (micro-batch size b; batch {st['batch']} = m · b)")
    ax.set_ylabel(f"seconds per {st['batches_per_timing']} training batches")
    ax.set_ylim(0, None)
    ax.set_title(f"Split-size trade-off: ResNet50, {st['input']}, on {where}\n"
                 "small splits: many small, slow micro-batches; large: a long pipeline bubble",
                 fontsize=10, loc="left")
    ax.legend(fontsize=8, frameon=False, loc="lower left")
    despine(ax)
    paths.append(save_figure(fig, out / f"{stem}_split_size.png"))
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=48, help="batch size B (default 48)")
    parser.add_argument("--image", type=int, default=64, help="image side (default 64)")
    parser.add_argument("--tutorial-size", action="store_true",
                        help="the tutorial's batch of 120 images of 3×128×128")
    parser.add_argument("--repeats", type=int, default=5, help="timings per configuration (default 5; the tutorial 10)")
    parser.add_argument("--batches", type=int, default=3, help="training batches per timing (default 3, the tutorial's)")
    parser.add_argument("--split-sizes", type=int, nargs="+", default=list(TUTORIAL_SPLITS),
                        help="split sizes to sweep (default the tutorial's)")
    parser.add_argument("--mode", choices=("auto", "processes", "in-process"), default="auto",
                        help="auto: one process on ≥ 2 GPUs, else one process per stage")
    parser.add_argument("--devices", nargs=2, default=None, help="the two devices of --mode in-process")
    parser.add_argument("--timeout", type=float, default=600.0, help="process-group timeout (s)")
    add_load_arguments(parser)
    parser.add_argument("--smoke", action="store_true", help="a tiny run in seconds (tests)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the results")
    args = parser.parse_args(argv)
    args.command = command_line("tutorial.py", sys.argv[1:] if argv is None else argv)
    if args.tutorial_size:
        args.batch, args.image = 120, 128
    if args.smoke:
        args.batch, args.image, args.repeats, args.batches = 4, 64, 1, 1
        args.split_sizes = [1, 2]
        # a smoke run checks that it runs, not how fast
        args.retries, args.lead_in, args.settle_rounds, args.more_rounds = 0, 0.0, 0, 0
    if args.batch < 1 or args.repeats < 1 or args.batches < 1:
        parser.error("--batch, --repeats and --batches must be positive")
    data = run(args)
    stem = "tutorial_smoke" if args.smoke else ("tutorial_120" if args.tutorial_size else "tutorial")
    args.out.mkdir(parents=True, exist_ok=True)
    data["figures"] = figures(data, args.out, stem)
    text = markdown(data)
    write_results(args.out, stem, data, text)
    print(text)


if __name__ == "__main__":
    main()
