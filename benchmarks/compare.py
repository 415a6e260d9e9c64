"""autosplit's plan measured against one device, the tutorial's hand split, the peers' heuristics
and torchgpipe, side by side in one run; and against an exhaustive sweep (the oracle).

For each model: autosplit profiles it (one CPU worker of one thread, or cuda:0), plans for two
devices, and the plans below are trained for real, one process per stage on
``autosplit.distributed`` (torch.distributed.pipelining, GPipe; gloo on CPUs, NCCL on GPUs),
all in one job of two ranks, interleaved round by round (A B C … C B A …) after a warm-up round,
so that the machine's drift hits every row alike. One device is the whole model on rank 0
(one thread on CPUs) while rank 1 waits.

* one device;
* the tutorial's hand split (cut before ``layer3``, split size 20) where it applies;
* uniform block counts and balanced parameter bytes (DeepSpeed's ``uniform`` and
  ``parameters``), each given the measured micro-batch size that autosplit's cost model
  predicts fastest for its cut (the most favourable reading of them);
* torchgpipe 0.0.7's own ``balance_by_time`` on the model flattened into an ``nn.Sequential``,
  its layer counts mapped back to autosplit's blocks, run with autosplit's number of
  micro-batches (torchgpipe's default ``chunks=1`` would not pipeline at all);
* autosplit's plan: its own cut points and split size.

Every row gives autosplit's predicted step time for that plan (``predicted_step_ms``, the event
simulation of the schedule, and ``bound_step_ms``, the closed form (m + p − 1) · t_max) beside
the measured one. The oracle times every cut between blocks × every
micro-batch count m ≤ ``--oracle-max-m`` that divides the batch for ResNet50 (B=48, 3×64×64),
then times the fastest few again (with autosplit's and the hand split's points) and compares
autosplit's plan with the best point found.

    python benchmarks/compare.py             # ~12 min on 2 quiet cores; writes benchmarks/results/compare.*
    python benchmarks/compare.py --smoke     # toy sizes in well under a minute (used by the tests)
    pip install torchgpipe==0.0.7            # optional: adds the torchgpipe rows

Settings (default): ResNet50 at the tutorial's input (B=120, 3×128×128), ResNet101 at B=48,
3×64×64 (hand split at split 16: 20 does not divide 48), GPT "small" from examples/gpt.py at
B=64 × 64 tokens; micro-batch counts m ≤ 10 that divide B are profiled and planned over; three
timed rounds of one training step per configuration.
Modules: the timing is ``harness.py``'s (shared with ``tutorial.py``); torchgpipe's partition
is ``torchgpipe_peer.py``; the rows, the oracle and the goals are assembled in
``compare_results.py`` and written out by ``compare_report.py``.
"""

from __future__ import annotations

if __name__ == "__main__":  # started again first, before the imports below pay twice: the C
    # allocator keeping freed memory, as the ranks run (see autosplit/measure/allocator.py)
    from autosplit.measure.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from common import RESULTS, command_line, machine, write_results
from compare_report import figures, markdown
from compare_results import (
    AUTO,
    HAND,
    ONE,
    Case,
    assemble_case,
    assemble_oracle,
    error_summary,
    goals,
    plan_key,
    sizes_for,
)
from harness import Config, Group, ModelSpec, add_load_arguments, load_options, measure, stage_check
from torch import nn
from torchgpipe_peer import (
    INSTALL_TORCHGPIPE,
    TORCHGPIPE,
    balance_by_time,
    torchgpipe_balance,
)

import autosplit
from autosplit import ProfileOptions
from autosplit.comparison import baseline_plans, manual_plan
from autosplit.planner import plan_with_balance
from autosplit.records import Plan, Profile


def default_cases() -> tuple[list[Case], Case, int]:
    cases = [
        Case("ResNet50", ModelSpec("resnet50", 120, (3, 128, 128)), (("layer3",), 20),
             "the tutorial's: cut before layer3, split 20", 10),
        Case("ResNet101", ModelSpec("resnet101", 48, (3, 64, 64)), (("layer3",), 16),
             "the tutorial's cut before layer3; split 16 (20 does not divide 48)", 10),
        Case("GPT small", ModelSpec("gpt-small", 64), None, "no hand split", 10),
    ]
    oracle = Case("ResNet50", ModelSpec("resnet50", 48, (3, 64, 64)), (("layer3",), 16),
                  "cut before layer3, split 16", 6)
    return cases, oracle, 6


def smoke_cases() -> tuple[list[Case], Case, int]:
    cases = [
        Case("ResNet18", ModelSpec("resnet18", 8, (3, 32, 32)), (("layer3",), 4),
             "cut before layer3, split 4", 4),
        Case("GPT tiny", ModelSpec("gpt-tiny", 8), None, "no hand split", 4),
    ]
    oracle = Case("ResNet18", ModelSpec("resnet18", 8, (3, 32, 32)), (("layer3",), 4),
                  "cut before layer3, split 4", 2)
    return cases, oracle, 2


# ----------------------------------------------------------------------------------- plans


def case_plans(case: Case, profile: Profile, model: nn.Module, inputs: tuple[torch.Tensor, ...],
               device: torch.device) -> tuple[dict[str, Plan], dict[str, Any]]:
    """Every plan of the comparison, by row name, and notes on how each was made."""
    notes: dict[str, Any] = {}
    auto = autosplit.plan(profile, 2)
    plans: dict[str, Plan] = {}
    if case.hand is not None:
        points, split = case.hand
        plans[HAND] = manual_plan(profile, list(points), split)
    base = baseline_plans(profile, 2)
    plans["uniform"] = base["uniform"]
    plans["by parameters"] = base["parameters"]
    if balance_by_time is not None:
        tg = torchgpipe_balance(case.spec.key, model, inputs, auto.split_size, profile.block_names, device)
        plans["torchgpipe"] = plan_with_balance(
            profile, tg["balance"], auto.split_size, solver=f"torchgpipe {TORCHGPIPE}")
        notes["torchgpipe"] = tg
    plans[AUTO] = auto
    return plans, notes



# ---------------------------------------------------------------------------------- the run


def profile_case(case: Case, device: torch.device) -> tuple[Profile, nn.Module, tuple[torch.Tensor, ...], float]:
    model = case.spec.build()
    inputs = case.spec.make_inputs()
    sizes = sizes_for(case.spec.batch, case.max_m)
    start = time.perf_counter()
    profile = autosplit.profile(model, inputs, device=device,
                                options=ProfileOptions(microbatch_sizes=sizes, budget_s=None))
    return profile, model, inputs, time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    cases, oracle_case, oracle_max_m = smoke_cases() if args.smoke else default_cases()
    if args.oracle_max_m:
        oracle_max_m = args.oracle_max_m
    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus >= 2 else "gloo"
    device = torch.device("cuda", 0) if gpus >= 2 else torch.device("cpu")
    phases: dict[str, float] = {}
    started = time.perf_counter()
    groups: list[Group] = []
    prepared = []
    for case in cases:
        print(f"profiling {case.label} ({case.spec.describe}) …", flush=True)
        profile, model, inputs, seconds = profile_case(case, device)
        phases[f"profile {case.label}"] = seconds
        start = time.perf_counter()
        plans, notes = case_plans(case, profile, model, inputs, device)
        phases[f"plan {case.label}"] = time.perf_counter() - start
        measured: dict[tuple[tuple[int, ...], int], str] = {}
        configs = [Config(ONE, None)]
        for name, plan in plans.items():
            if plan_key(plan) not in measured:
                measured[plan_key(plan)] = name
                configs.append(Config(name, plan))
        start = time.perf_counter()
        notes["stages"] = {name: stage_check(plans[name], model, inputs, device)
                           for name in measured.values()}
        phases[f"stage check {case.label}"] = time.perf_counter() - start
        groups.append(Group(case.label, case.spec, tuple(configs), rounds=args.rounds, warmup=1,
                            **load_options(args)))
        prepared.append((case, profile, plans, notes, measured))
        del model

    # the oracle: every cut × every m ≤ oracle_max_m dividing B, for ResNet50 at B=48, 64×64
    print(f"profiling the oracle's {oracle_case.label} ({oracle_case.spec.describe}) …", flush=True)
    oprofile, omodel, _, seconds = profile_case(oracle_case, device)
    del omodel
    phases["profile oracle"] = seconds
    oauto = autosplit.plan(oprofile, 2)
    ohand = manual_plan(oprofile, list(oracle_case.hand[0]), oracle_case.hand[1]) if oracle_case.hand else None
    n = len(oprofile.blocks)
    grid = []
    for cut in range(1, n):
        for b in reversed(sizes_for(oracle_case.spec.batch, oracle_max_m)):
            plan = plan_with_balance(oprofile, (cut, n - cut), b, solver="sweep")
            grid.append({"label": f"cut {cut} b {b}", "cut": cut, "before": oprofile.block_names[cut],
                         "split_size": b, "microbatches": plan.microbatches, "plan": plan})
    keep = [g["label"] for g in grid if plan_key(g["plan"]) == plan_key(oauto)]
    if ohand is not None:
        keep += [g["label"] for g in grid if plan_key(g["plan"]) == plan_key(ohand)]
    groups.append(Group("oracle", oracle_case.spec, tuple(Config(g["label"], g["plan"]) for g in grid),
                        rounds=args.oracle_rounds, warmup=1, refine=args.refine,
                        refine_rounds=args.refine_rounds, keep=tuple(keep),
                        **load_options(args)))

    print(f"measuring: {sum(len(g.configs) for g in groups)} configurations in {len(groups)} "
          f"groups, 2 ranks ({backend}) …", flush=True)
    start = time.perf_counter()
    results = measure(groups, nprocs=2, backend=backend, timeout_s=args.timeout)
    phases["measure (one launch)"] = time.perf_counter() - start

    models = [assemble_case(case, profile, plans, notes, measured, results[case.label], gpus >= 2)
              for case, profile, plans, notes, measured in prepared]
    oracle = assemble_oracle(oracle_case, oprofile, oauto, ohand, grid, results["oracle"], oracle_max_m)
    phases["total"] = time.perf_counter() - started
    errors = error_summary(models, oracle)
    return {
        "settings": {
            "machine": machine(),
            "command": args.command,
            "backend": backend,
            "devices": "2 GPUs (NCCL), one per rank" if gpus >= 2 else
                       "2 CPU workers of 1 thread each, one process per stage (gloo)",
            "schedule": "gpipe",
            "rounds": args.rounds,
            "oracle_rounds": args.oracle_rounds,
            "refine": args.refine,
            "refine_rounds": args.refine_rounds,
            "oracle_max_m": oracle_max_m,
            "max_others": args.max_others,
            "retries": args.retries,
            "torchgpipe": TORCHGPIPE,
            "steps_per_timing": 1, "lead_in_s": args.lead_in,
            "settle_rounds": args.settle_rounds,
            "more_rounds": args.more_rounds, "max_spread": args.max_spread,
            "loss": "MSE against one-hot labels (the tutorial's), SGD lr 0.001",
            "gpus": gpus,
        },
        "phases_seconds": phases,
        "models": models,
        "oracle": oracle,
        "errors": errors,
        "goals": goals(models, oracle, errors, gpus >= 2),
    }



def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per configuration (default 3)")
    parser.add_argument("--oracle-rounds", type=int, default=2, help="timed rounds per sweep point (default 2)")
    parser.add_argument("--oracle-max-m", type=int, default=None, help="largest m in the sweep (default 6)")
    parser.add_argument("--refine", type=int, default=6, help="sweep points timed again (default the 6 fastest)")
    parser.add_argument("--refine-rounds", type=int, default=4, help="rounds of the refined points (default 4)")
    parser.add_argument("--timeout", type=float, default=600.0, help="process-group timeout (s)")
    add_load_arguments(parser)
    parser.add_argument("--smoke", action="store_true", help="toy sizes, in well under a minute (tests)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the results")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.oracle_rounds, args.refine, args.refine_rounds = 1, 1, 2, 1
        # a smoke run checks that it runs, not how fast
        args.retries, args.lead_in, args.settle_rounds, args.more_rounds = 0, 0.0, 0, 0
    if min(args.rounds, args.oracle_rounds) < 1 or args.refine < 0 or args.refine_rounds < 0:
        parser.error("--rounds and --oracle-rounds must be positive, --refine and --refine-rounds ≥ 0")
    args.command = command_line("compare.py", sys.argv[1:] if argv is None else argv)
    if TORCHGPIPE is None:
        print(f"torchgpipe is not installed: its rows are skipped ({INSTALL_TORCHGPIPE} adds them)",
              flush=True)
    data = run(args)
    stem = "compare_smoke" if args.smoke else "compare"
    args.out.mkdir(parents=True, exist_ok=True)
    data["figures"] = figures(data, args.out, stem)
    text = markdown(data)
    write_results(args.out, stem, data, text)
    print(text)


if __name__ == "__main__":
    main()
