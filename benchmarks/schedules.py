"""Schedules and recomputation on 2 CPU workers: autosplit's choice against the tutorial's hand
split with GPipe and against the best plan of every schedule, predicted and measured.

For each model: one profile (``autosplit.profile``: one CPU worker of one thread, the backward
split into input and weight gradients, the training loss with the last block); the joint
search of ``schedule="auto"`` (``autosplit.planner.schedules.plan_schedules``: schedule, stages
per rank, cuts, micro-batch size and per-stage recomputation) gives the best plan of every
schedule; autosplit's choice is made as ``autosplit plan`` makes it (``command_choice``: the
best plans at the three best micro-batch sizes by block sums, verified, the fastest kept); the
hand split (examples/resnet50.py's, GPipe, split 20) is scored on the same profile. Every
plan's stages are then timed as they run (``autosplit.verify.plans.time_plans``: on a CPU, a
pipeline's stages alone and beside the neighbouring worker's stage) and its step predicted
again from them
(``autosplit.verify.plans.predict_verified``); from the same timings, each pipeline is also
predicted with every stage as timed alone and as timed beside, to show where the measured step
lies between the two. Measured right
after (each model's plans measured before the next model is profiled, so that the machine's
drift between prediction and measurement is that of minutes), interleaved on 2 gloo ranks (``harness.py``: a ``Trainer`` per rank on torch's own schedule
classes, rounds A B … B A after a warm-up round and untimed rounds until no plan's steps fault
in fresh memory, a timing disturbed by other processes taken again). A memory-limited case plans again with each device's memory set below what the hand
split with GPipe needs, and reports what autosplit chooses then (predicted). After each
model's measurement its stage runs are timed again and every step predicted again from them
("re-timed after"): the machine's speed drifts between planning and measuring (on these
shared machines by up to a quarter within minutes), and the re-timed prediction tells that
drift apart from the model's own error.

Each plan's peak tensor memory per rank is measured after the timed rounds (``harness.py``'s
``peak_memory``: a fresh ``Trainer`` built and trained two steps under torch's profiler, whose
memory events give the highest level of allocated tensor memory) and set against the plan's
predicted memory per rank.

Goals (issue 14): autosplit's choice ≥ 1.10× the hand split with GPipe, measured, for ResNet50
at the tutorial's size; every schedule's predicted step within 5 % of its measured step;
predicted peak memory per rank within 10 % of the measured peak.

    python benchmarks/schedules.py              # writes benchmarks/results/schedules.{json,md}
    python benchmarks/schedules.py --smoke --out /tmp/sch   # toy sizes in seconds (tests)
"""

from __future__ import annotations

if __name__ == "__main__":  # started again first, before the imports below pay twice: the C
    # allocator keeping freed memory, as the ranks run (see autosplit/measure/allocator.py)
    from autosplit.measure.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy_cases import Case, resnet50_hand, spread
from common import describe, machine
from harness import Config, Group, ModelSpec, load_options, measure
from report import lead_in_words, load_sentence
from run_options import benchmark_parser, chosen_cases, verify_options, write_and_show

import autosplit
from autosplit import PlanOptions, ProfileOptions
from autosplit.comparison import manual_plan
from autosplit.errors import InfeasiblePlanError
from autosplit.measure.collectives import measure_link_bandwidth
from autosplit.measure.runtime_cost import action_costs
from autosplit.planner import plan_candidates
from autosplit.planner.schedules import plan_schedules
from autosplit.planner.search import candidate_sizes
from autosplit.planner.settings import PlanSettings
from autosplit.records import Plan, Profile
from autosplit.schedules.placement import V_SCHEDULES, stage_ranks
from autosplit.verify.choice import verify_and_choose
from autosplit.verify.options import TimingOptions
from autosplit.verify.plans import predict_verified, time_plans, verify_plans

AUTO, HAND, LIMITED = "autosplit", "hand split (GPipe)", "autosplit, memory-limited"
GOALS = {"vs_hand": 1.10, "step_error": 0.05, "memory_error": 0.10}


def default_cases() -> list[Case]:
    return [
        Case("resnet50", "ResNet50 (tutorial size)", ModelSpec("resnet50", 120, (3, 128, 128)),
             resnet50_hand(), None, 10.5),
        Case("resnet50-64", "ResNet50", ModelSpec("resnet50", 48, (3, 64, 64)),
             resnet50_hand(16), None, 1.2),
        Case("gpt-small", "GPT small", ModelSpec("gpt-small", 64), None, None, 0.45),
    ]


def smoke_cases() -> list[Case]:
    """ResNet18 at toy sizes: every schedule, the hand split and the memory-limited choice (the
    big-vocabulary model is layouts.py's smoke run)."""
    return [
        Case("resnet18", "ResNet18", ModelSpec("resnet18", 8, (3, 32, 32)), (("layer3",), 4),
             None, 0.05),
    ]


def key(plan: Plan) -> tuple[Any, ...]:
    """What makes two plans run alike."""
    return (tuple(plan.balance), plan.split_size, plan.schedule, plan.stages_per_rank,
            tuple(s.checkpoint for s in plan.stages))


def schedule_plans(profile: Profile) -> tuple[dict[str, Plan], dict[str, str]]:
    """The best plan of every schedule (by name), and why the others have none."""
    settings = PlanSettings.check(profile, 2, options=PlanOptions(schedule="auto"))
    sizes = candidate_sizes(profile, None, settings.batch_size, "the batch")
    choice = plan_schedules(settings, profile, sizes)
    plans = {f"{o.schedule}" + (f" v={o.v}" if o.v > 1 else ""): o.plan
             for o in choice.options if o.plan is not None}
    why = {o.schedule: o.why for o in choice.options if o.plan is None}
    return plans, why


def command_choice(graph: Any, inputs: Any, profile: Profile, memory: int | None,
                   timing: TimingOptions) -> tuple[Plan, str]:
    """autosplit's choice as ``autosplit plan`` makes it: the best pipelines of
    ``schedule="auto"`` at the three best micro-batch sizes by block sums, their stages timed as
    they run and the fastest verified one kept (among those within noise or 3 %, the best by block sums:
    ``autosplit.verify.choice``); returned as planned (block sums), to be timed again with
    every other plan, with how it was chosen (the first session's figures, in words)."""
    candidates = plan_candidates(profile, 2, top_k=3,
                                 options=PlanOptions(schedule="auto", memory_per_gpu=memory))
    chosen, _ = verify_and_choose(graph, inputs, profile, candidates, {}, options=timing)
    _, found, how = chosen.verification.partition("; chosen among ")
    return (next(c for c in candidates if key(c) == key(chosen)),
            f"chosen among {how}" if found else "the only candidate")


def plans_of(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    model, inputs = case.spec.build(), case.spec.make_inputs()
    graph = autosplit.trace(model, example_inputs=inputs)
    start = time.perf_counter()
    include = [case.hand[1]] if case.hand is not None else []
    profile = autosplit.profile(model, inputs,
                                options=ProfileOptions(include=include, microbatch_sizes=args.sizes,
                                                       budget_s=args.profile_budget))
    if not args.smoke:  # the runtime's cost per action and the link, as `autosplit plan` does
        # (tests/test_runtime_cost.py measures them; a smoke run is about the benchmark's code)
        profile = dataclasses.replace(profile, **action_costs(),
                                      link_bytes_per_s=measure_link_bandwidth())
    profile_s = time.perf_counter() - start
    by_schedule, why = schedule_plans(profile)
    best, chose = command_choice(graph, inputs, profile, None, verify_options(args))
    others: dict[str, Plan] = {AUTO: best, **by_schedule}
    limited: dict[str, Any] = {}
    if case.hand is not None:
        hand = manual_plan(profile, list(case.hand[0]), case.hand[1])
        others[HAND] = hand
        need = max(s.memory_bytes for s in hand.stages)
        try:
            others[LIMITED], _ = command_choice(graph, inputs, profile, int(need * 0.8),
                                                verify_options(args))
            limited = {"memory_bytes": int(need * 0.8), "hand_needs_bytes": need}
        except InfeasiblePlanError as exc:
            limited = {"memory_bytes": int(need * 0.8), "hand_needs_bytes": need,
                       "none": str(exc)}
    timed = time_plans(graph, inputs, profile, others,
                       options=verify_options(args))
    verified = predict_verified(profile, others, timed)
    # the same timings, each pipeline stage taken as timed alone, and as timed beside its
    # neighbour (autosplit weighs the two by the share of a rank's work that overlaps)
    bounds = {share: {name: p.predicted_step_ms
                      for name, p in predict_verified(profile, others, timed, share).items()}
              for share in (0.0, 1.0)} if timed.beside else {}

    def again() -> dict[str, Plan]:  # the same stages timed again, after the measurement
        return verify_plans(graph, inputs, profile, others,
                            options=verify_options(args))

    return {"plans": verified, "block_sums": others, "why": why, "limited": limited,
            "choice": chose,
            "retime": again, "alone_ms": bounds.get(0.0), "beside_ms": bounds.get(1.0),
            "profile_s": profile_s, "plan_and_verify_s": time.perf_counter() - start - profile_s,
            "names": profile.block_names, "backward_split": profile.backward_split,
            "action_ms": dict(profile.action_ms), "action_spread": dict(profile.action_spread)}


def rank_memory(plan: Plan, ranks: int = 2) -> list[int]:
    """The plan's predicted memory of each rank (bytes): the most of its stages'."""
    place = stage_ranks(len(plan.stages), ranks, plan.schedule in V_SCHEDULES)
    return [max(s.memory_bytes for s, r in zip(plan.stages, place) if r == rank)
            for rank in range(ranks)]


def plan_row(plan: Plan, block_sums: Plan, names: Sequence[str]) -> dict[str, Any]:
    ends = [sum(plan.balance[: i + 1]) for i in range(len(plan.balance) - 1)]
    return {"schedule": plan.schedule, "v": plan.stages_per_rank, "balance": list(plan.balance),
            "split_size": plan.split_size, "cut_before": [names[e] for e in ends],
            "checkpointed": [s.index for s in plan.stages if s.checkpoint],
            "predicted_ms": plan.predicted_step_ms, "step_spread": plan.step_spread,
            "block_sum_ms": block_sums.predicted_step_ms,
            "memory_per_stage_bytes": [s.memory_bytes for s in plan.stages],
            "memory_per_rank_bytes": rank_memory(plan)}


def run(args: argparse.Namespace, cases: Sequence[Case]) -> dict[str, Any]:
    started = time.perf_counter()
    models: list[dict[str, Any]] = []
    results: dict[str, Any] = {}
    measure_s = 0.0
    for case in cases:
        print(f"{case.label} ({case.spec.describe}): profile, plan, verify …", flush=True)
        found = plans_of(case, args)
        labels: dict[Any, str] = {}
        rows = {}
        for name, plan in found["plans"].items():
            labels.setdefault(key(plan), name)
            rows[name] = {**plan_row(plan, found["block_sums"][name], found["names"]),
                          "label": labels[key(plan)],
                          "alone_ms": (found["alone_ms"] or {}).get(name),
                          "beside_ms": (found["beside_ms"] or {}).get(name)}
        configs = tuple(Config(label, found["plans"][label])
                        for label in dict.fromkeys(labels.values()))
        models.append({"model": case.label, "key": case.name, "input": case.spec.describe,
                       "profile_s": found["profile_s"],
                       "plan_and_verify_s": found["plan_and_verify_s"], "plans": rows,
                       "not_offered": found["why"], "limited": found["limited"],
                       "choice": found["choice"],
                       "backward_split": found["backward_split"],
                       "action_ms": found["action_ms"],
                       "action_spread": found["action_spread"]})
        group = Group(case.label, case.spec, configs, rounds=args.rounds, warmup=1,
                      memory=True, **load_options(args))
        # measured right after its plans were verified: the machine's drift between the
        # prediction and the measurement is that of a few minutes, not of the whole run
        print(f"  measuring {len(configs)} configurations …", flush=True)
        start = time.perf_counter()
        results.update(measure([group], nprocs=2, backend="gloo", timeout_s=args.timeout))
        measure_s += time.perf_counter() - start
        # the machine's drift, told apart from the model's error: the same stage runs timed
        # again right after the measurement predict each step again
        print("  timing the stages again …", flush=True)
        retimed = found["retime"]()
        for name, row in rows.items():
            row["retimed_ms"] = retimed[name].predicted_step_ms
    for m in models:
        got = results[m["model"]]
        m["measured"] = {label: {**spread(t), "seconds": t} for label, t in got["times"].items()}
        m["load"], m["lead_in_steps"] = got["load"], got["lead_in_steps"]
        for row in m["plans"].values():
            row["measured_ms"] = m["measured"][row["label"]]["median_ms"]
            row["error"] = (row["predicted_ms"] - row["measured_ms"]) / row["measured_ms"]
            row["retimed_error"] = (row["retimed_ms"] - row["measured_ms"]) / row["measured_ms"]
            for way in ("alone", "beside"):
                row[f"{way}_error"] = (None if row[f"{way}_ms"] is None else
                                       (row[f"{way}_ms"] - row["measured_ms"])
                                       / row["measured_ms"])
            peaks = got["peak_bytes"].get(row["label"])
            row["measured_peak_bytes"] = peaks
            row["memory_errors"] = None if not peaks else [
                (pred - peak) / peak for pred, peak in zip(row["memory_per_rank_bytes"], peaks)]
        if HAND in m["plans"]:
            m["vs_hand"] = m["plans"][HAND]["measured_ms"] / m["plans"][AUTO]["measured_ms"]
    tutorial = [m for m in models if m["key"] in ("resnet50", "resnet18")]
    errors = [abs(r["error"]) for m in models for r in m["plans"].values()]
    retimed = [abs(r["retimed_error"]) for m in models for r in m["plans"].values()]
    memory_errors = [abs(e) for m in models for r in m["plans"].values()
                     for e in r["memory_errors"] or []]
    return {
        "settings": {
            "machine": machine(), "command": args.command, "smoke": args.smoke,
            "devices": "2 CPU workers of 1 thread each (gloo), torch's schedule classes",
            "rounds": args.rounds, "warmup_rounds": 1, "lead_in_s": args.lead_in,
            "settle_rounds": args.settle_rounds,
            "more_rounds": args.more_rounds, "max_spread": args.max_spread,
            "profile_budget_s": args.profile_budget,
            "verify_budget_s": args.verify_budget, "max_others": args.max_others,
            "retries": args.retries,
            "loss": "MSE against one-hot labels (the tutorial's), SGD lr 0.001",
        },
        "seconds": {"total": time.perf_counter() - started, "measure": measure_s},
        "models": models,
        "goals": {"vs_hand": tutorial[0]["vs_hand"] if tutorial else None,
                  "step_error": max(errors),
                  "memory_error": max(memory_errors) if memory_errors else None,
                  "retimed_error": max(retimed), "retimed_within": sum(
                      e <= GOALS["step_error"] for e in retimed), "plans": len(retimed),
                  "within": sum(e <= GOALS["step_error"] for e in errors)},
    }


def memory_cell(row: dict[str, Any]) -> str:
    """Each rank's predicted / measured MiB and the error, or what is missing."""
    peaks = row.get("measured_peak_bytes")
    if not peaks:
        return "not measured"
    return "; ".join(f"{p / 2**20:.0f} / {q / 2**20:.0f} ({e:+.0%})" for p, q, e in
                     zip(row["memory_per_rank_bytes"], peaks, row["memory_errors"]))


def contention_table(m: dict[str, Any]) -> list[str]:
    """Each pipeline's prediction from the same stage timings taken alone, beside the
    neighbour and weighed by the simulated overlap (autosplit's), against the measured step."""
    rows = [(name, r) for name, r in m["plans"].items()
            if r.get("alone_ms") is not None and r["label"] == name and len(r["balance"]) > 1]
    if not rows:
        return []
    between = sum(min(r["alone_ms"], r["beside_ms"]) <= r["measured_ms"]
                  <= max(r["alone_ms"], r["beside_ms"]) for _, r in rows)
    out = ["", ("The same stage timings, each pipeline stage taken as timed alone (the other "
                "core idle), as timed beside its neighbouring worker's stage, and weighed by "
                "the share of its rank's work that overlaps the other's (autosplit's "
                f"prediction); the measured step lay between alone and beside for {between} of "
                f"{len(rows)} plans:"), "",
           "| plan | alone ms | error | beside ms | error | weighed ms | error | measured ms |",
           "|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        out.append(f"| {name} | {r['alone_ms']:.0f} | {r['alone_error']:+.1%} | "
                   f"{r['beside_ms']:.0f} | {r['beside_error']:+.1%} | "
                   f"{r['predicted_ms']:.0f} | {r['error']:+.1%} | "
                   f"{m['measured'][r['label']]['median_ms']:.0f} |")
    return out


def markdown(data: dict[str, Any]) -> str:
    s, g = data["settings"], data["goals"]
    met = {True: "met", False: "missed"}
    lines = [
        "# Schedules and recomputation on 2 CPU workers: predicted and measured", "",
        f"Machine: {describe(s['machine'])}.  ", f"Command: `{s['command']}`.  ",
        (f"{s['devices']}; every plan measured {s['rounds']} times after a warm-up round"
         f"{lead_in_words(s)}, "
         f"interleaved; {s['loss']}. Total {data['seconds']['total']:.0f} s."), "",
        "## Goals", "", "| goal | value | target | |", "|---|---|---|---|",
    ]
    if g["vs_hand"] is not None:
        lines.append(f"| autosplit's choice against the hand split with GPipe, measured "
                     f"({data['models'][0]['model']}) | ×{g['vs_hand']:.2f} | "
                     f"≥ ×{GOALS['vs_hand']:.2f} | {met[g['vs_hand'] >= GOALS['vs_hand']]} |")
    lines += [
        (f"| every plan's predicted step against its measured step (largest error) | "
         f"{g['step_error']:.1%} | ≤ {GOALS['step_error']:.0%} | "
         f"{met[g['step_error'] <= GOALS['step_error']]} |"),
    ]
    if g.get("memory_error") is None:
        lines.append("| predicted peak memory per rank against measured | not measured | ≤ 10 % | "
                     "missed |")
    else:
        lines.append(f"| predicted peak memory per rank against measured (largest error) | "
                     f"{g['memory_error']:.1%} | ≤ {GOALS['memory_error']:.0%} | "
                     f"{met[g['memory_error'] <= GOALS['memory_error']]} |")
    lines += ["", (f"{g['within']} of {g['plans']} plans' predicted steps within "
                   f"{GOALS['step_error']:.0%} of the measured ones. The machine's speed drifts "
                   f"between the prediction and the measurement: each model's stage runs were "
                   f"timed again right after its measurement and every step predicted again "
                   f"from them (column \"re-timed after\"): {g['retimed_within']} of "
                   f"{g['plans']} within {GOALS['step_error']:.0%}, largest error "
                   f"{g['retimed_error']:.1%}.")]
    for m in data["models"]:
        lines += ["", f"## {m['model']} ({m['input']})", "",
                  ("| plan | schedule | v | cut before | b | recomputed | predicted ms | "
                   "block sums ms | measured ms | min–max ms | error | re-timed after, ms | "
                   "error | memory per rank, predicted / measured MiB |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in m["plans"].items():
            x = m["measured"][r["label"]]
            same = "" if r["label"] == name else f" (= {r['label']})"
            spread_txt = "" if r["step_spread"] is None else f" ± {r['step_spread']:.0%}"
            lines.append(
                f"| {name}{same} | {r['schedule']} | {r['v']} | "
                f"{', '.join(r['cut_before']) or '–'} | {r['split_size']} | "
                f"{', '.join(map(str, r['checkpointed'])) or '–'} | "
                f"{r['predicted_ms']:.0f}{spread_txt} | {r['block_sum_ms']:.0f} | "
                f"{x['median_ms']:.0f} | {x['min_ms']:.0f}–{x['max_ms']:.0f} | "
                f"{r['error']:+.1%} | {r['retimed_ms']:.0f} | {r['retimed_error']:+.1%} | "
                f"{memory_cell(r)} |")
        lines += contention_table(m)
        notes = [f"{k}: {v}" for k, v in m["not_offered"].items()]
        if notes:
            lines += ["", "Not offered: " + "; ".join(notes) + "."]
        lim = m["limited"]
        if lim:
            what = (f"nothing fits ({lim['none']})" if "none" in lim else
                    f"row \"{LIMITED}\"")
            lines += ["", (f"Memory-limited: {lim['memory_bytes'] / 2**20:.0f} MiB per device, "
                           f"where the hand split with GPipe needs "
                           f"{lim['hand_needs_bytes'] / 2**20:.0f} MiB: {what}.")]
        if m.get("choice"):
            lines += ["", f"autosplit's choice, as `autosplit plan` makes it: {m['choice']}."]
        if "vs_hand" in m:
            lines += ["", f"autosplit's choice: ×{m['vs_hand']:.2f} the hand split, measured."]
        spreads = m.get("action_spread", {})
        cost = ", ".join(f"{k} {v:.2f}" + (f" ± {spreads[k]:.2f}" if k in spreads else "")
                         + " ms" for k, v in m.get("action_ms", {}).items())
        lines += ["", (f"Runtime cost per action, measured (`autosplit.measure.runtime_cost`; ± its "
                       f"spread over the rounds, in each verified plan's ±) and in "
                       f"every prediction: {cost or 'not measured'}.")]
        lines += ["", (f"Backward split: {m['backward_split'] or 'none'}. Profile "
                       f"{m['profile_s']:.0f} s, plan and verification "
                       f"{m['plan_and_verify_s']:.0f} s. {load_sentence(m['load'])}")]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = benchmark_parser(__doc__, [c.name for c in default_cases()])
    args = parser.parse_args(argv)
    cases = chosen_cases(parser, args, argv, "schedules.py", default_cases, smoke_cases)
    data = run(args, cases)
    write_and_show(args, "schedules.py", data, markdown(data))


if __name__ == "__main__":
    main()
