"""How accurate autosplit's predictions are: predicted against measured step times on 2 CPU
workers, for several independent profiles of each model.

For each model, ``--profiles`` independent profiles (``autosplit.profile``, one CPU worker of one
thread, with torch's pipeline runtime's cost per action of GPipe measured in each profile as
``autosplit plan --schedule gpipe`` measures it); for each profile the plans below, predicted
by autosplit from that profile:

* autosplit's plan, made as ``autosplit plan`` makes it: the best candidates by block sums
  (``plan_candidates``), their stages and those of every other plan timed as they run
  (``autosplit.verify.choice.verify_and_choose``), the fastest verified candidate kept
  (among those within noise or 3 % of it, the best by block sums);
* the hand split where the model file has one (examples/resnet50.py's ``MANUAL_SPLIT``);
* uniform block counts and balanced parameter bytes (``baseline_plans``);
* torchgpipe 0.0.7's ``balance_by_time`` (``torchgpipe_peer.py``, optional) at the split size of
  autosplit's best candidate by block sums;
* one device (predicted: the verification's whole-model timing), trained the way that
  prediction runs it (``Plan.single_device_split``: the batch at once, or micro-batches
  whose gradients add up, whichever was timed faster).

Each profile's distinct plans and one device are then trained for real right after that profile's
plans were made, as a user trains right after planning (the machine drifts 20-30 % over tens of
minutes; a profile's prediction is compared with its own timed rounds, a few minutes later), one
process per stage (``harness.py``: two gloo ranks, GPipe, interleaved rounds A B … B A after a
warm-up round and untimed rounds until no plan's steps fault in fresh memory, a timing
disturbed by other processes taken again); then the distinct plans
autosplit chose from the profiles, timed together over ``--agreement-rounds`` rounds (15: two
plans about 1 % apart, each round's spread about 1 %), for the agreement. Reported: the median
and p90 of |predicted − measured| / measured over every (profile, plan); each profile's predicted ratio
autosplit / other plan against the measured ratio, with that ratio's own spread over the paired
rounds (each round times both plans) and how many errors exceed it; whether the profiles gave the
same plan (or plans within 1 % measured). Models (``--models``): ResNet50 (B=120, 3×128×128),
ResNet101 (B=48, 3×64×64), GPT small (examples/gpt.py, B=64 × 64 tokens) and examples/bigvocab.py
(a 32,000-token vocabulary on 2 small blocks, B=32 × 32 tokens). A step under ``--lead-in``
seconds is timed after untimed steps of its own (``harness.py``).

    python benchmarks/accuracy.py            # writes benchmarks/results/accuracy.{json,md}
    python benchmarks/accuracy.py --smoke --out /tmp/acc   # toy sizes in seconds (tests)
"""

from __future__ import annotations

if __name__ == "__main__":  # started again first, before the imports below pay twice: the C
    # allocator keeping freed memory, as the ranks run (see autosplit/measure/allocator.py)
    from autosplit.measure.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from accuracy_cases import (
    AUTO,
    GOALS,
    HAND,
    ONE,
    Case,
    agreement,
    default_cases,
    distinct_choices,
    errors,
    goals,
    plan_key,
    quantile,
    repeated_ratios,
    smoke_cases,
    spread,
)
from common import describe, machine
from harness import Config, Group, load_options, measure
from report import lead_in_words, load_sentence, plural
from run_options import benchmark_parser, chosen_cases, verify_options, write_and_show
from torchgpipe_peer import INSTALL_TORCHGPIPE, TORCHGPIPE, balance_by_time, torchgpipe_balance

import autosplit
from autosplit import ProfileOptions
from autosplit.comparison import baseline_plans, manual_plan
from autosplit.measure.collectives import measure_link_bandwidth
from autosplit.measure.runtime_cost import action_costs, forget_measurements
from autosplit.measure.spread import PREDICTION_ERROR
from autosplit.planner import plan_candidates, plan_with_balance
from autosplit.records import Plan, Profile
from autosplit.simulator import simulate_plan
from autosplit.verify.choice import verify_and_choose

TORCHGPIPE_ROW = "torchgpipe"


def plans_of(case: Case, profile: Profile, model: Any, inputs: tuple[torch.Tensor, ...],
             device: torch.device) -> tuple[list[Plan], dict[str, Plan], dict[str, Any]]:
    """autosplit's candidates and the other plans made from ``profile``; torchgpipe's notes."""
    candidates = list(plan_candidates(profile, 2, top_k=3))
    others: dict[str, Plan] = {}
    if case.hand is not None:
        others[HAND] = manual_plan(profile, list(case.hand[0]), case.hand[1])
    base = baseline_plans(profile, 2)
    others["uniform"], others["by parameters"] = base["uniform"], base["parameters"]
    notes: dict[str, Any] = {}
    if balance_by_time is not None and case.sequential is not None:
        b = candidates[0].split_size
        notes = torchgpipe_balance(case.sequential, model, inputs, b, profile.block_names, device)
        others[TORCHGPIPE_ROW] = plan_with_balance(
            profile, notes["balance"], b, solver=f"torchgpipe {TORCHGPIPE}")
    return candidates, others, notes


def plan_row(plan: Plan, block_sum_ms: float, names: Sequence[str]) -> dict[str, Any]:
    ends = [sum(plan.balance[: i + 1]) for i in range(len(plan.balance) - 1)]
    bare = simulate_plan(dataclasses.replace(plan, action_ms=0.0)).step_ms + plan.sync_after_ms
    return {"balance": list(plan.balance), "split_size": plan.split_size,
            "cut_before": [names[e] for e in ends], "predicted_ms": plan.predicted_step_ms,
            "step_spread": plan.step_spread, "block_sum_ms": block_sum_ms,
            "action_ms": plan.action_ms, "without_actions_ms": bare}


def profile_case(case: Case, p: int, args: argparse.Namespace, device: torch.device
                 ) -> tuple[dict[str, Any], list[Config]]:
    """One independent profile of ``case`` and its plans, verified; what to measure for it (one
    device and each distinct plan once, labelled ``<first plan's name> (profile p)``)."""
    model, inputs = case.spec.build(), case.spec.make_inputs()
    graph = autosplit.trace(model, example_inputs=inputs)
    start = time.perf_counter()
    include = [case.hand[1]] if case.hand is not None else []
    profile = autosplit.profile(model, inputs, device=device,
                                options=ProfileOptions(include=include, microbatch_sizes=args.sizes,
                                                       budget_s=args.profile_budget))
    if not args.smoke:  # the runtime's cost per action and the link, as `autosplit plan` does
        forget_measurements()  # each profile its own, as each `autosplit plan` measures its own
        profile = dataclasses.replace(profile, **action_costs(schedules=("gpipe",)),
                                      link_bytes_per_s=measure_link_bandwidth())
    profile_s = time.perf_counter() - start
    candidates, others, notes = plans_of(case, profile, model, inputs, device)
    sums = {**{plan_key(c): c.predicted_step_ms for c in candidates},
            **{plan_key(o): o.predicted_step_ms for o in others.values()}}
    auto, checked = verify_and_choose(graph, inputs, profile, candidates, others,
                                      options=verify_options(args, device=device))
    plans = {AUTO: auto, **checked}
    rows = {name: plan_row(plan, sums[plan_key(plan)], profile.block_names)
            for name, plan in plans.items()}
    one_split = auto.single_device_split or case.spec.batch  # as its prediction runs it
    rows[ONE] = {"balance": [len(profile.blocks)], "split_size": one_split, "cut_before": [],
                 "predicted_ms": auto.single_device_ms, "step_spread": auto.single_device_spread,
                 "block_sum_ms": None, "label": ONE}
    labels: dict[tuple[tuple[int, ...], int], str] = {}
    configs = [Config(ONE, None, one_split)]
    for name, plan in plans.items():
        key = plan_key(plan)
        if key not in labels:
            labels[key] = f"{name} (profile {p + 1})"
            configs.append(Config(labels[key], plan))
        rows[name]["label"] = labels[key]
    result = {"profile_s": profile_s, "plan_and_verify_s": time.perf_counter() - start - profile_s,
              "microbatch_sizes": list(profile.microbatch_sizes), "plans": rows,
              "verification": auto.verification, "torchgpipe": notes}
    return result, configs


def estimate_s(cases: Sequence[Case], args: argparse.Namespace) -> float:
    """A rough duration up front: profiles and verification within their budgets, then each
    profile's timed rounds at about 6 configurations (pipelines ~0.6 of one device's step) and
    the agreement's at 2 pipelines."""
    planning = args.profiles * (args.profile_budget + args.verify_budget + 10)
    steps = sum(c.step_s * args.profiles * (1 + 0.6 * 5) for c in cases)
    together = sum(c.step_s * 0.6 * 2 for c in cases)
    return len(cases) * planning + ((args.rounds + 1) * steps
                                    + (args.agreement_rounds + 1) * together) * 1.15  # retakes


def measure_group(group: Group, predicted: dict[str, float], args: argparse.Namespace
                  ) -> dict[str, Any]:
    """Time ``group`` on 2 gloo ranks (``predicted``: ms by label, for the duration printed);
    each label's spread and timings, and the other processes' load."""
    lead_ms = args.lead_in * 1000  # a step under it: as long again before each timing
    guess = sum(ms + (lead_ms if ms < lead_ms else 0.0) for ms in
                (predicted[c.label] for c in group.configs)) * (group.rounds + 1) / 1000 * 1.2
    print(f"  measuring {len(group.configs)} configurations, {group.rounds} rounds + warm-up "
          f"(about {guess:.0f} s by the predictions) …", flush=True)
    got = measure([group], nprocs=2, backend="gloo", timeout_s=args.timeout)[group.name]
    return {"measured": {label: {**spread(times), "seconds": times}
                         for label, times in got["times"].items()}, "load": got["load"],
            "lead_in_steps": got["lead_in_steps"]}


def measure_agreement(case: Case, profiles: Sequence[dict[str, Any]], configs: dict[str, Config],
                      args: argparse.Namespace) -> dict[str, Any] | None:
    """The distinct plans autosplit chose from the profiles timed together, interleaved (None
    when every profile chose the same plan): plans measured in different windows are not
    compared through the machine's drift between them."""
    chosen = distinct_choices(profiles)
    if len(chosen) < 2:
        return None
    print(f"{case.label}: the {len(chosen)} plans of its profiles together …", flush=True)
    group = Group(f"{case.label}, agreement", case.spec,
                  tuple(configs[row["label"]] for row in chosen.values()),
                  rounds=args.agreement_rounds, warmup=1, **load_options(args))
    predicted = {row["label"]: row["predicted_ms"] for row in chosen.values()}
    return measure_group(group, predicted, args)


def run(args: argparse.Namespace, cases: Sequence[Case]) -> dict[str, Any]:
    device = torch.device("cpu")
    started = time.perf_counter()
    models: list[dict[str, Any]] = []
    measure_s = 0.0
    for case in cases:
        profiles, configs = [], {}
        for p in range(args.profiles):
            print(f"{case.label} ({case.spec.describe}): profile {p + 1}/{args.profiles} …",
                  flush=True)
            result, todo = profile_case(case, p, args, device)
            # measured right after the plans were made, as a user trains right after planning:
            # the machine's drift between prediction and measurement is a few minutes' drift
            group = Group(f"{case.label}, profile {p + 1}", case.spec, tuple(todo),
                          rounds=args.rounds, warmup=1, **load_options(args))
            predicted = {r["label"]: r["predicted_ms"] for r in result["plans"].values()}
            start = time.perf_counter()
            result.update(measure_group(group, predicted, args))
            measure_s += time.perf_counter() - start
            profiles.append(result)
            configs.update({c.label: c for c in todo})
        start = time.perf_counter()
        together = measure_agreement(case, profiles, configs, args)
        measure_s += time.perf_counter() - start
        model = {"model": case.label, "key": case.name, "input": case.spec.describe,
                 "hand": None if case.hand is None else
                 {"cut_before": list(case.hand[0]), "split_size": case.hand[1]},
                 "profiles": profiles, "agreement_measured": together}
        models.append(scored(model))
    steps = [e["error"] for m in models for e in m["step_errors"]]
    return {
        "settings": {
            "machine": machine(), "command": args.command, "smoke": args.smoke,
            "devices": "2 CPU workers of 1 thread each, one process per stage (gloo), GPipe",
            "profiles": args.profiles, "rounds": args.rounds,
            "agreement_rounds": args.agreement_rounds, "warmup_rounds": 1,
            "steps_per_timing": 1, "lead_in_s": args.lead_in,
            "settle_rounds": args.settle_rounds,
            "more_rounds": args.more_rounds, "max_spread": args.max_spread,
            "profile_budget_s": args.profile_budget,
            "verify_budget_s": args.verify_budget, "max_others": args.max_others,
            "retries": args.retries, "torchgpipe": TORCHGPIPE,
            "loss": "MSE against one-hot labels (the tutorial's), SGD lr 0.001",
        },
        "seconds": {"total": time.perf_counter() - started, "measure": measure_s},
        "models": models,
        "errors": {"median": quantile(steps, 0.5), "p90": quantile(steps, 0.9),
                   "count": len(steps)},
        "goals": goals(models),
    }


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def _interval(e: dict[str, Any]) -> str:
    """The printed interval of a ratio, "(outside)" when the measured ratio is not in it."""
    if e.get("within_printed") is None:
        return "–"
    return (f"{e['printed_low']:.3f}–{e['printed_high']:.3f}"
            + ("" if e["within_printed"] else " (outside)"))


def scored(model: dict[str, Any]) -> dict[str, Any]:
    """``model`` (its profiles' predictions and timings) with its errors and agreement."""
    model = dict(model)
    model["step_errors"], model["ratio_errors"] = errors(model)
    steps = [e["error"] for e in model["step_errors"]]
    model["median_error"], model["p90_error"] = quantile(steps, 0.5), quantile(steps, 0.9)
    model["agreement"] = agreement(model)
    model["repeated_ratios"] = repeated_ratios(model)
    return model


def rederive(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (an accuracy.json) with its errors, agreement and goals computed again from the
    predictions and timings it holds (``--render``: a results file written before a figure
    was reported; nothing is measured)."""
    models = [scored(m) for m in data["models"]]
    return {**data, "models": models, "goals": goals(models)}


def _ratio_spread(e: dict[str, Any]) -> str:
    """A measured ratio's spread over the paired rounds (results written before it: –)."""
    return "–" if "measured_ratio_spread" not in e else f"{e['measured_ratio_spread']:.1%}"


def _measured_row(prefix: str, label: str, x: dict[str, Any], row: dict[str, Any]) -> str:
    return (f"| {prefix}{label} | {', '.join(row['cut_before']) or '–'} | {row['split_size']} | "
            f"{x['median_ms']:.0f} | {x['min_ms']:.0f}–{x['max_ms']:.0f} | "
            f"{x['half_range']:.1%} | {x['n']} |")


def measured_table(m: dict[str, Any]) -> list[str]:
    """Each profile's timed rounds (taken right after its plans were made), then the distinct
    plans of the profiles timed together; the load of other processes under each."""
    lines = ["| profile | measured plan | cut before | b | median ms | min–max ms | ± | n |",
             "|---|---|---|---|---|---|---|---|"]
    rows = {r["label"]: r for prof in m["profiles"] for r in prof["plans"].values()}
    for p, prof in enumerate(m["profiles"]):
        lines += [_measured_row(f"{p + 1} | ", label, x, rows[label])
                  for label, x in prof["measured"].items()]
    loads = [load_sentence(prof["load"]) for prof in m["profiles"]]
    lines += ["", " ".join(f"Profile {p + 1}'s rounds: {x[0].lower()}{x[1:]}"
                           for p, x in enumerate(loads) if x)]
    together = m.get("agreement_measured")
    if together:
        lines += ["", "autosplit's plans of the profiles, timed together:", "",
                  "| | measured plan | cut before | b | median ms | min–max ms | ± | n |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [_measured_row("together | ", label, x, rows[label])
                  for label, x in together["measured"].items()]
        lines += ["", load_sentence(together["load"])]
    return lines


def agreement_sentence(m: dict[str, Any]) -> str:
    a = m["agreement"]
    same = ("the same plan" if a["same"] else
            f"{a['distinct']} plans, {a['gap']:.1%} apart measured together; "
            f"{a['agreeing']} within {GOALS['agreement']:.0%} of the fastest")
    return f"autosplit's plan from the {a['profiles']} profiles: {same} ({'; '.join(a['plans'])})."


def repeated_sentence(data: dict[str, Any]) -> list[str]:
    """How far the same two plans' measured ratio moved between the profiles' windows (none
    where no two profiles measured the same two plans)."""
    rows = [(m["model"], r) for m in data["models"] for r in m.get("repeated_ratios", [])]
    if not rows:
        return []
    model, worst = max(rows, key=lambda x: x[1]["best_single"])
    beyond = sum(r["best_single"] > GOALS["ratio"] for _, r in rows)
    return ["", (f"The same two plans measured in several profiles' windows, minutes apart: "
                 f"{plural(len(rows), 'ratio')}, whose measured values moved by up to "
                 f"{worst['range']:.1%} between windows ({model}, autosplit / "
                 f"{' = '.join(worst['plans'])}: "
                 f"{', '.join(f'{x:.3f}' for x in worst['measured'])}); "
                 + (f"for {beyond} of them no one number is within ±{GOALS['ratio']:.0%} of "
                    "every window's value, whatever predicted it" if beyond else
                    f"one number is within ±{GOALS['ratio']:.0%} of every window's value of "
                    "each")
                 + " (benchmarks/reproducibility.py measures this alone, on more windows).")]


def markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    lines = [
        "# Accuracy: predicted against measured step times", "",
        f"Machine: {describe(s['machine'])}.  ",
        f"Command: `{s['command']}`.  ",
        (f"{s['devices']}; {plural(s['profiles'], 'independent profile')} per model, each "
         f"profile's plans measured right after they were made, {plural(s['rounds'], 'time')} "
         f"each after a warm-up round{lead_in_words(s)}, interleaved; "
         f"torchgpipe {s['torchgpipe'] or 'not installed (' + INSTALL_TORCHGPIPE + ')'}; "
         f"{s['loss']}. Total {data['seconds']['total']:.0f} s."), "",
        "## Goals", "", "| goal | value | target | |", "|---|---|---|---|",
    ]
    for g in data["goals"]:
        value = g["value"] if isinstance(g["value"], str) else f"{g['value']:.1%}"
        met = "met" if g["met"] else "missed"
        lines.append(f"| {g['goal']} | {value} | {g['target']} | {met} |")
    resolved = [g["beyond_noise"] for g in data["goals"] if "beyond_noise" in g]
    if resolved:
        lines += ["", (f"Ratio errors larger than their measured ratio's own spread (half the "
                       f"interquartile range of the per-round ratios, each round timing both "
                       f"plans): {resolved[0]}; the others are within what the rounds resolve.")]
    held = [g["within_printed"] for g in data["goals"] if g.get("within_printed")]
    if held:
        lines += ["", (f"Measured ratios inside the interval autosplit prints for them (both "
                       f"plans' verified spreads and ±{PREDICTION_ERROR:.0%} for a ratio of "
                       f"two predictions, `autosplit.measure.spread.PREDICTION_ERROR`): {held[0]}.")]
    lines += repeated_sentence(data)
    for m in data["models"]:
        lines += ["", f"## {m['model']} ({m['input']})", ""] + measured_table(m)
        lines += ["", "| profile | plan | predicted ms | measured ms | error |",
                  "|---|---|---|---|---|"]
        lines += [f"| {e['profile']} | {e['plan']} | {e['predicted_ms']:.0f} | "
                  f"{e['measured_ms']:.0f} | {e['error']:.1%} |" for e in m["step_errors"]]
        lines += ["", f"Step error: median {m['median_error']:.1%}, p90 {m['p90_error']:.1%}.", "",
                  ("| profile | autosplit / | predicted ratio | printed interval | measured "
                   "ratio | ± (paired rounds) | error |"),
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {e['profile']} | {e['plan']} | {e['predicted_ratio']:.3f} | "
                  f"{_interval(e)} | {e['measured_ratio']:.3f} | {_ratio_spread(e)} | "
                  f"{_pct(e['error'])} |" for e in m["ratio_errors"]]
        lines += ["", agreement_sentence(m)]
    return "\n".join(lines) + "\n"


def render(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--render``: the results of a saved run, their figures derived again, under ``--out``
    (never over the file read)."""
    if args.out is None:
        parser.error("--render needs --out (a folder other than the file's)")
    target = args.out / "accuracy.json"
    if target.resolve() == args.render.resolve():
        parser.error(f"--out {args.out} would overwrite --render {args.render}")
    try:
        data = json.loads(args.render.read_text())
    except (OSError, ValueError) as e:
        parser.error(f"--render {args.render}: {e}")
    args.smoke = False
    try:
        data = rederive(data)
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        parser.error(f"--render {args.render}: not an accuracy.json ({type(e).__name__}: {e})")
    write_and_show(args, "accuracy.py", data, markdown(data))


def main(argv: Sequence[str] | None = None) -> None:
    parser = benchmark_parser(__doc__, [c.name for c in default_cases()])
    parser.add_argument("--profiles", type=int, default=3, help="independent profiles per model")
    parser.add_argument("--agreement-rounds", type=int, default=15, dest="agreement_rounds",
                        help="timed rounds of the profiles' distinct plans together (default "
                             "15: plans about 1 %% apart, each round's spread about 1 %%)")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="measure nothing: compute the errors and goals of this "
                             "accuracy.json again and write them under --out")
    args = parser.parse_args(argv)
    if args.render is not None:
        render(parser, args)
        return
    if args.profiles < 1:
        parser.error("--profiles must be positive")
    if args.agreement_rounds < 1:
        parser.error("--agreement-rounds must be positive")
    cases = chosen_cases(parser, args, argv, "accuracy.py", default_cases, smoke_cases)
    if args.smoke:
        args.profiles, args.agreement_rounds = min(args.profiles, 2), 1
    print(f"{', '.join(c.label for c in cases)}; {args.profiles} profiles, {args.rounds} rounds: "
          f"about {estimate_s(cases, args) / 60:.0f} min on 2 quiet CPU cores", flush=True)
    if TORCHGPIPE is None:
        print(f"torchgpipe is not installed: no torchgpipe rows ({INSTALL_TORCHGPIPE})", flush=True)
    data = run(args, cases)
    write_and_show(args, "accuracy.py", data, markdown(data))


if __name__ == "__main__":
    main()
