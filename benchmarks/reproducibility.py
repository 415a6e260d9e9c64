"""How reproducible a measured ratio is: the same configurations timed in separate windows.

accuracy.py compares a ratio autosplit predicted in one window (its verification, in processes
of its own) with the ratio measured in another (the training: fresh processes a few minutes
later). Here nothing is predicted: fixed configurations of each model — a 2-stage plan, and one
device or another plan — are timed in ``--windows`` windows, each a fresh launch of the 2 gloo
ranks timing them together exactly as accuracy.py times a profile's plans (``harness.py``: a
warm-up round, untimed rounds until no step faults in fresh memory, interleaved timed rounds,
a short step timed after steps of its own, a disturbed timing taken again). The models take
turns, so that one model's windows lie a few minutes apart, as a plan's verification and its
training do. Reported for each ratio plan / other: every window's measured ratio (medians,
as accuracy.py's) with its spread over the window's paired rounds, and what the best
predictions made without that window would have erred by: the previous window's ratio (a
prediction measured just before) and the median of the other windows (hindsight); and the
smallest error any one number reaches on every window, √(max/min) − 1. Where that exceeds a
goal, no prediction made before a window meets it on every window.

The configurations are the plans accuracy.py's autosplit chose (benchmarks/results/
accuracy.json): GPT small cut before blocks.3, b = 16, against one device (micro-batches of 32);
the big-vocabulary model cut before its head, b = 16, against one device and the uniform cut
(before blocks.1, b = 16); ResNet101 (B = 48, 3×64×64) cut before layer3.11, b = 16, against one
device; ResNet50 (B = 120, 3×128×128; ``--models resnet50``, ~40 s a window) autosplit's cut
before layer3.0 at b = 15 against the hand split (b = 20) and one device.

    python benchmarks/reproducibility.py   # writes benchmarks/results/reproducibility.{json,md}
    python benchmarks/reproducibility.py --smoke --out /tmp/rep   # toy sizes in seconds (tests)
"""

from __future__ import annotations

if __name__ == "__main__":  # started again first, before the imports below pay twice: the C
    # allocator keeping freed memory, as the ranks run (see autosplit/measure/allocator.py)
    from autosplit.measure.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import argparse
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy_cases import ExampleSpec, paired_spread, spread
from common import describe, machine
from harness import Config, Group, ModelSpec, load_options, measure
from report import lead_in_words, load_sentence, plural
from run_options import benchmark_parser, chosen_cases, write_and_show

import autosplit
from autosplit import ProfileOptions
from autosplit.planner import plan_with_balance

ONE = "one device"
GOAL = 0.03
"""accuracy.py's goal for a predicted ratio: within ±3 % of the measured one."""


@dataclass(frozen=True)
class Pipeline:
    """A 2-stage plan: the first block of stage 2 (a block name of the traced model) and the
    micro-batch size."""

    label: str
    cut_before: str
    split_size: int


@dataclass(frozen=True)
class Case:
    """One model: its plan (the ratios' numerator), the other plans and one device's split
    (its micro-batch size, whose gradients add up; the batch for the batch at once)."""

    name: str
    label: str
    spec: ModelSpec
    plan: Pipeline
    others: tuple[Pipeline, ...]
    one_device_split: int


def default_cases() -> list[Case]:
    gpt, vocab = ModelSpec("gpt-small", 64), ExampleSpec("bigvocab-small", 32)
    return [
        Case("gpt-small", "GPT small", gpt, Pipeline("autosplit", "blocks.3", 16), (), 32),
        Case("bigvocab", "Big vocabulary", vocab, Pipeline("autosplit", "lm_head", 16),
             (Pipeline("uniform", "blocks.1", 16),), 32),
        Case("resnet101", "ResNet101", ModelSpec("resnet101", 48, (3, 64, 64)),
             Pipeline("autosplit", "layer3.11", 16), (), 48),
        Case("resnet50", "ResNet50", ModelSpec("resnet50", 120, (3, 128, 128)),
             Pipeline("autosplit", "layer3.0", 15), (Pipeline("hand split", "layer3.0", 20),),
             15),
    ]


DEFAULT_MODELS = ("gpt-small", "bigvocab", "resnet101")


def smoke_cases() -> list[Case]:
    return [
        Case("resnet18", "ResNet18", ModelSpec("resnet18", 8, (3, 32, 32)),
             Pipeline("autosplit", "layer3.0", 4), (Pipeline("hand split", "layer3.0", 2),), 8),
    ]


def configs_of(case: Case, budget_s: float) -> tuple[Config, ...]:
    """The case's plans (scored on a short profile at their micro-batch sizes: only their cut
    and size matter here) and one device, as the harness runs them."""
    model, inputs = case.spec.build(), case.spec.make_inputs()
    pipelines = (case.plan, *case.others)
    sizes = sorted({p.split_size for p in pipelines})
    profile = autosplit.profile(model, inputs,
                                options=ProfileOptions(microbatch_sizes=sizes, budget_s=budget_s))
    names = list(profile.block_names)
    configs = []
    for p in pipelines:
        cut = names.index(p.cut_before)
        plan = plan_with_balance(profile, [cut, len(names) - cut], p.split_size)
        configs.append(Config(p.label, plan))
    return (*configs, Config(ONE, None, case.one_device_split))


def window_summary(ratios: Sequence[float], goal: float = GOAL) -> dict[str, Any]:
    """What windows' measured ratios of the same two configurations say about predicting them:
    their median and range; the largest error (prediction / measured − 1) and the count within
    ``goal`` of the previous window's ratio as the prediction (from the second window on) and of
    the median of the other windows (hindsight); the smallest largest error of any one number,
    √(max/min) − 1 (the geometric middle of the range)."""
    ratios = list(ratios)
    if not ratios or min(ratios) <= 0:
        raise ValueError(f"ratios must be positive and at least one; got {ratios}")
    previous = [ratios[k - 1] / ratios[k] - 1 for k in range(1, len(ratios))]
    others = [statistics.median(ratios[:k] + ratios[k + 1:]) / ratios[k] - 1
              for k in range(len(ratios))] if len(ratios) > 1 else []

    def scored(errors: list[float]) -> dict[str, Any]:
        return {"largest": max((abs(e) for e in errors), default=0.0),
                "within_goal": sum(1 for e in errors if abs(e) <= goal), "count": len(errors)}

    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "range": max(ratios) / min(ratios) - 1,
            "best_single": math.sqrt(max(ratios) / min(ratios)) - 1,
            "previous_window": scored(previous), "other_windows": scored(others)}


def run(args: argparse.Namespace, cases: Sequence[Case]) -> dict[str, Any]:
    started = time.perf_counter()
    groups = {}
    for case in cases:
        print(f"{case.label} ({case.spec.describe}): the plans' cuts …", flush=True)
        groups[case.name] = Group(case.label, case.spec, configs_of(case, args.profile_budget),
                                  rounds=args.rounds, warmup=1, **load_options(args))
    windows: dict[str, list[dict[str, Any]]] = {c.name: [] for c in cases}
    for w in range(args.windows):
        for case in cases:
            print(f"window {w + 1}/{args.windows}: {case.label} …", flush=True)
            at = time.perf_counter() - started
            got = measure([groups[case.name]], nprocs=2, backend="gloo",
                          timeout_s=args.timeout)[case.label]
            windows[case.name].append({
                "started_s": at, "load": got["load"],
                "measured": {label: {**spread(times), "seconds": times}
                             for label, times in got["times"].items()}})
    models = [scored_model(case, windows[case.name]) for case in cases]
    return {"settings": {"machine": machine(), "command": args.command, "smoke": args.smoke,
                         "devices": "2 CPU workers of 1 thread each, one process per stage "
                                    "(gloo), GPipe",
                         "windows": args.windows, "rounds": args.rounds, "warmup_rounds": 1,
                         "lead_in_s": args.lead_in, "settle_rounds": args.settle_rounds,
                         "more_rounds": args.more_rounds, "max_spread": args.max_spread,
                         "max_others": args.max_others, "retries": args.retries, "goal": GOAL},
            "seconds": time.perf_counter() - started, "models": models}


def scored_model(case: Case, windows: list[dict[str, Any]]) -> dict[str, Any]:
    """A model's windows and, for each ratio plan / other, each window's measured ratio and
    its paired rounds' spread, and :func:`window_summary` of them."""
    ratios = []
    for other in [p.label for p in case.others] + [ONE]:
        per = []
        for w in windows:
            a, b = w["measured"][case.plan.label], w["measured"][other]
            per.append({"ratio": a["median_ms"] / b["median_ms"],
                        "paired_spread": paired_spread(a["seconds"], b["seconds"])})
        ratios.append({"plan": case.plan.label, "other": other, "windows": per,
                       **window_summary([x["ratio"] for x in per])})
    pipelines = {p.label: {"cut_before": p.cut_before, "split_size": p.split_size}
                 for p in (case.plan, *case.others)}
    return {"model": case.label, "key": case.name, "input": case.spec.describe,
            "pipelines": pipelines, "one_device_split": case.one_device_split,
            "windows": windows, "ratios": ratios}


def markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    goal = f"±{s['goal']:.0%}"
    lines = ["# Reproducibility: one ratio measured in separate windows", "",
             f"Machine: {describe(s['machine'])}.  ", f"Command: `{s['command']}`.  ",
             (f"{s['devices']}; {plural(s['windows'], 'window')} per model, each a fresh launch "
              f"of the ranks timing the model's configurations {plural(s['rounds'], 'time')} "
              f"each after a warm-up round{lead_in_words(s)}, interleaved; the models take "
              f"turns. Total {data['seconds']:.0f} s."), "",
             "## Summary", "",
             ("| model | ratio | windows | median | min–max | range | one number, at best "
              f"| previous window: largest error | within {goal} | other windows' median: "
              f"largest error | within {goal} |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in data["models"]:
        for r in m["ratios"]:
            prev, rest = r["previous_window"], r["other_windows"]
            lines.append(
                f"| {m['model']} | {r['plan']} / {r['other']} | {len(r['windows'])} | "
                f"{r['median']:.3f} | {r['min']:.3f}–{r['max']:.3f} | {r['range']:.1%} | "
                f"±{r['best_single']:.1%} | {prev['largest']:.1%} | "
                f"{prev['within_goal']} of {prev['count']} | {rest['largest']:.1%} | "
                f"{rest['within_goal']} of {rest['count']} |")
    worst = max((r["best_single"] for m in data["models"] for r in m["ratios"]), default=0.0)
    lines += ["", (f"The smallest error one number reaches on every window of a ratio is "
                   f"√(max/min) − 1: up to ±{worst:.1%} here"
                   + (f", beyond the {goal} goal: no prediction made before a window meets it "
                      "on every window." if worst > s["goal"] else
                      f", within the {goal} goal."))]
    for m in data["models"]:
        lines += ["", f"## {m['model']} ({m['input']})", "",
                  "Plans: " + "; ".join(f"{k}: cut before {v['cut_before']}, b = "
                                         f"{v['split_size']}" for k, v in m["pipelines"].items())
                  + f"; one device in micro-batches of {m['one_device_split']}.", ""]
        labels = list(m["windows"][0]["measured"])
        lines += ["| window | started (min) | " + " | ".join(f"{x} ms (±)" for x in labels)
                  + " | " + " | ".join(f"{r['plan']} / {r['other']} (± paired)"
                                       for r in m["ratios"]) + " |",
                  "|---" * (2 + len(labels) + len(m["ratios"])) + "|"]
        for k, w in enumerate(m["windows"]):
            cells = [f"{w['measured'][x]['median_ms']:.0f} ({w['measured'][x]['half_range']:.1%})"
                     for x in labels]
            cells += [f"{r['windows'][k]['ratio']:.3f} ({r['windows'][k]['paired_spread']:.1%})"
                      for r in m["ratios"]]
            lines.append(f"| {k + 1} | {w['started_s'] / 60:.1f} | " + " | ".join(cells) + " |")
        loads = [load_sentence(w["load"]) for w in m["windows"]]
        lines += ["", " ".join(f"Window {k + 1}: {x[0].lower()}{x[1:]}"
                               for k, x in enumerate(loads) if x)]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    # a short profile: it only scores the plans, whose cuts and sizes are given
    parser = benchmark_parser(__doc__, [c.name for c in default_cases()], DEFAULT_MODELS,
                              verify=False, profile_budget=5.0)
    parser.add_argument("--windows", type=int, default=8, help="windows per model (default 8)")
    args = parser.parse_args(argv)
    if args.windows < 2:
        parser.error("--windows must be 2 or more (a ratio is compared between windows)")
    cases = chosen_cases(parser, args, argv, "reproducibility.py", default_cases, smoke_cases)
    if args.smoke:
        args.windows = 2
    data = run(args, cases)
    write_and_show(args, "reproducibility.py", data, markdown(data))


if __name__ == "__main__":
    main()
