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
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, describe, machine, write_results  # noqa: E402
from tutorial import (  # noqa: E402
    Config,
    Group,
    ModelSpec,
    add_load_arguments,
    command_line,
    load_sentence,
    measure,
    summary,
)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import autosplit  # noqa: E402
from autosplit import distributed as D  # noqa: E402
from autosplit.cost import block_time_ms  # noqa: E402
from autosplit.records import Plan, Profile  # noqa: E402

try:  # optional peer: pip install torchgpipe==0.0.7
    from torchgpipe.balance import balance_by_time

    TORCHGPIPE = importlib.metadata.version("torchgpipe")
except ImportError:  # pragma: no cover - depends on the machine
    balance_by_time = None
    TORCHGPIPE = None

INSTALL_TORCHGPIPE = "pip install torchgpipe==0.0.7"
ONE = "one device"
HAND = "hand split"
AUTO = "autosplit"
ORDER = (ONE, HAND, "uniform", "by parameters", "torchgpipe", AUTO)


@dataclass(frozen=True)
class Case:
    """A model to compare on: its batch, the hand split (cut points, split size) if any."""

    label: str
    spec: ModelSpec
    hand: tuple[tuple[str, ...], int] | None
    hand_note: str
    max_m: int


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


def sizes_for(batch: int, max_m: int) -> list[int]:
    """Micro-batch sizes b = B / m for every m ≤ max_m that divides B, ascending."""
    return sorted(batch // m for m in range(1, min(max_m, batch) + 1) if batch % m == 0)


# ----------------------------------------------------------------------- torchgpipe's plan


class _Embeddings(nn.Module):
    """examples/gpt.py's token + position embedding as one layer (torchgpipe needs a Sequential)."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.tok_emb = gpt.tok_emb
        self.pos_emb = gpt.pos_emb

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))


def flatten(key: str, model: Any) -> list[tuple[str, nn.Module]]:
    """The model as a list of (autosplit block that the layer belongs to, layer) for torchgpipe's
    nn.Sequential. A layer covers the blocks from the previous layer's block up to its own."""
    if key.startswith("resnet"):
        # torchgpipe times each layer on a detached leaf input: the stem's in-place ReLU would
        # fail there, so the flattened copy uses an out-of-place one (same function)
        layers = [("conv1", model.conv1), ("bn1", model.bn1), ("bn1", nn.ReLU()), ("bn1", model.maxpool)]
        for stage in ("layer1", "layer2", "layer3", "layer4"):
            layers += [(f"{stage}.{i}", block) for i, block in enumerate(getattr(model, stage))]
        last = layers[-1][0]
        return layers + [(last, model.avgpool), (last, nn.Flatten(1)), ("fc", model.fc)]
    if key.startswith("gpt-"):
        layers = [("pos_emb", _Embeddings(model))]
        layers += [(f"blocks.{i}", block) for i, block in enumerate(model.blocks)]
        return layers + [("ln_f", model.ln_f), ("lm_head", model.lm_head)]
    raise ValueError(f"no nn.Sequential form of {key}")


def to_block_balance(layer_balance: Sequence[int], owners: Sequence[str],
                     block_names: Sequence[str]) -> tuple[tuple[int, ...], list[str]]:
    """torchgpipe's layer counts as autosplit block counts; a cut inside a block moves to the
    block's end (noted)."""
    index = {name: i for i, name in enumerate(block_names)}
    ranks = [index[o] for o in owners]
    assert ranks == sorted(ranks) and ranks[-1] == len(block_names) - 1, "layers out of block order"
    notes, ends, start = [], [], 0
    for count in layer_balance[:-1]:
        start += count
        before, after = owners[start - 1], owners[start]
        if before == after:
            notes.append(f"torchgpipe's cut inside block {before} moved to its end")
        ends.append(index[before] + 1)
    bounds = [0, *ends, len(block_names)]
    balance = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    if min(balance) < 1:
        raise ValueError(f"torchgpipe's balance {list(layer_balance)} maps to an empty stage")
    return balance, notes


def torchgpipe_balance(case: Case, model: nn.Module, inputs: tuple[torch.Tensor, ...],
                       split_size: int, block_names: Sequence[str], device: torch.device) -> dict[str, Any]:
    """torchgpipe 0.0.7's balance_by_time for 2 partitions on one micro-batch of ``split_size``."""
    pairs = flatten(case.spec.key, model)
    sequential = nn.Sequential(*(layer for _, layer in pairs))
    sample = tuple(x[:split_size].to(device) for x in inputs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one CPU worker, as autosplit's profile
    start = time.perf_counter()
    try:
        layer_balance = balance_by_time(2, sequential, sample[0] if len(sample) == 1 else sample,
                                        device=device)
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - start
    balance, notes = to_block_balance(layer_balance, [o for o, _ in pairs], block_names)
    return {"layer_balance": list(layer_balance), "layers": len(pairs), "balance": balance,
            "notes": notes, "seconds": seconds, "sample_rows": split_size}


# ----------------------------------------------------------------------------------- plans


def single_predicted_ms(profile: Profile) -> float:
    """The whole batch in one micro-batch on one device: Σ block fwd + bwd at b = B."""
    k = profile.size_index(profile.batch_size)
    return math.fsum(block_time_ms(blk, k) for blk in profile.blocks)


def case_plans(case: Case, profile: Profile, model: nn.Module, inputs: tuple[torch.Tensor, ...],
               device: torch.device) -> tuple[dict[str, Plan], dict[str, Any]]:
    """Every plan of the comparison, by row name, and notes on how each was made."""
    notes: dict[str, Any] = {}
    auto = autosplit.plan(profile, 2)
    plans: dict[str, Plan] = {}
    if case.hand is not None:
        points, split = case.hand
        plans[HAND] = autosplit.manual_plan(profile, list(points), split)
    base = autosplit.baseline_plans(profile, 2)
    plans["uniform"] = base["uniform"]
    plans["by parameters"] = base["parameters"]
    if balance_by_time is not None:
        tg = torchgpipe_balance(case, model, inputs, auto.split_size, profile.block_names, device)
        plans["torchgpipe"] = autosplit.plan_with_balance(
            profile, tg["balance"], auto.split_size, solver=f"torchgpipe {TORCHGPIPE}")
        notes["torchgpipe"] = tg
    plans[AUTO] = auto
    return plans, notes


def plan_key(plan: Plan) -> tuple[tuple[int, ...], int]:
    return plan.balance, plan.split_size


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stage_check(plan: Plan, model: nn.Module, inputs: tuple[torch.Tensor, ...], device: torch.device,
                repeats: int = 3) -> list[float]:
    """Each stage's forward + backward of one micro-batch with its blocks run together in this
    process (one CPU thread), as a pipeline rank runs them: stage 0 computes no gradient for the
    model's inputs, later stages do for what they receive. Median of ``repeats`` after a warm-up,
    in ms: what the profile's per-block sums (``Stage.compute_ms``) predict."""
    modules = D.stage_modules(model, plan)
    values: tuple[torch.Tensor, ...] = tuple(x[: plan.split_size].to(device) for x in inputs)
    result = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for s, module in enumerate(modules):
            module.to(device)
            times, out = [], None
            for r in range(1 + repeats):
                received = tuple(v.detach().requires_grad_(s > 0 and v.is_floating_point()) for v in values)
                _sync(device)
                start = time.perf_counter()
                out = module(*received)
                leaves = [t for t in ((out,) if isinstance(out, torch.Tensor) else out) if t.requires_grad]
                torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
                _sync(device)
                if r:
                    times.append((time.perf_counter() - start) * 1000)
            result.append(statistics.median(times))
            values = tuple(t.detach() for t in ((out,) if isinstance(out, torch.Tensor) else out))
    finally:
        torch.set_num_threads(threads)
        model.zero_grad(set_to_none=True)
    return result


# ---------------------------------------------------------------------------------- the run


def profile_case(case: Case, device: torch.device) -> tuple[Profile, nn.Module, tuple[torch.Tensor, ...], float]:
    model = case.spec.build()
    inputs = case.spec.make_inputs()
    sizes = sizes_for(case.spec.batch, case.max_m)
    start = time.perf_counter()
    profile = autosplit.profile(model, inputs, device=device, microbatch_sizes=sizes, budget_s=None)
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
                            max_others=args.max_others, retries=args.retries))
        prepared.append((case, profile, plans, notes, measured))
        del model

    # the oracle: every cut × every m ≤ oracle_max_m dividing B, for ResNet50 at B=48, 64×64
    print(f"profiling the oracle's {oracle_case.label} ({oracle_case.spec.describe}) …", flush=True)
    oprofile, omodel, _, seconds = profile_case(oracle_case, device)
    del omodel
    phases["profile oracle"] = seconds
    oauto = autosplit.plan(oprofile, 2)
    ohand = autosplit.manual_plan(oprofile, list(oracle_case.hand[0]), oracle_case.hand[1]) if oracle_case.hand else None
    n = len(oprofile.blocks)
    grid = []
    for cut in range(1, n):
        for b in reversed(sizes_for(oracle_case.spec.batch, oracle_max_m)):
            plan = autosplit.plan_with_balance(oprofile, (cut, n - cut), b, solver="sweep")
            grid.append({"label": f"cut {cut} b {b}", "cut": cut, "before": oprofile.block_names[cut],
                         "split_size": b, "microbatches": plan.microbatches, "plan": plan})
    keep = [g["label"] for g in grid if plan_key(g["plan"]) == plan_key(oauto)]
    if ohand is not None:
        keep += [g["label"] for g in grid if plan_key(g["plan"]) == plan_key(ohand)]
    groups.append(Group("oracle", oracle_case.spec, tuple(Config(g["label"], g["plan"]) for g in grid),
                        rounds=args.oracle_rounds, warmup=1, refine=args.refine,
                        refine_rounds=args.refine_rounds, keep=tuple(keep),
                        max_others=args.max_others, retries=args.retries))

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
            "steps_per_timing": 1,
            "loss": "MSE against one-hot labels (the tutorial's), SGD lr 0.001",
            "gpus": gpus,
        },
        "phases_seconds": phases,
        "models": models,
        "oracle": oracle,
        "errors": errors,
        "goals": goals(models, oracle, errors, gpus >= 2),
    }


def _prediction(plan: Plan | None, profile: Profile) -> tuple[float, float]:
    if plan is None:
        single = single_predicted_ms(profile)
        return single, single
    return plan.predicted_step_ms, plan.bound_step_ms


def assemble_case(case: Case, profile: Profile, plans: dict[str, Plan], notes: dict[str, Any],
                  measured: dict[Any, str], result: dict[str, Any], on_gpus: bool) -> dict[str, Any]:
    times = result["times"]
    rows = []
    for name in ORDER:
        if name != ONE and name not in plans:
            continue
        plan = plans.get(name)
        source = ONE if plan is None else measured[plan_key(plan)]
        stats = summary(times[source])
        predicted, bound = _prediction(plan, profile)
        rows.append({
            "name": name,
            "same_as": None if source == name else source,
            "split_points": list(plan.split_points) if plan else [],
            "balance": list(plan.balance) if plan else [len(profile.blocks)],
            "split_size": plan.split_size if plan else case.spec.batch,
            "microbatches": plan.microbatches if plan else 1,
            "measured_s": times[source],
            **{f"{k}_s": v for k, v in stats.items()},
            "spread": (stats["max"] - stats["min"]) / stats["median"],
            "throughput": case.spec.batch / stats["median"],
            "predicted_ms": predicted,
            "bound_ms": bound,
            "predicted_error": predicted / 1000 / stats["median"] - 1,
            "bound_error": bound / 1000 / stats["median"] - 1,
            "stage_predicted_ms": [st.compute_ms for st in plan.stages] if plan else [],
            "stage_measured_ms": notes.get("stages", {}).get(source, []) if plan else [],
        })
    by = {r["name"]: r for r in rows}
    for r in rows:
        r["vs_one_device"] = by[ONE]["median_s"] / r["median_s"]
        r["vs_hand_split"] = by[HAND]["median_s"] / r["median_s"] if HAND in by else None
    auto = by[AUTO]
    others = [r for r in rows if r["name"] not in (AUTO, ONE)]
    result_notes = []
    if balance_by_time is None:
        result_notes.append(f"torchgpipe is not installed: its row is skipped ({INSTALL_TORCHGPIPE})")
    return {
        "model": case.label,
        "input": case.spec.describe,
        "batch": case.spec.batch,
        "blocks": len(profile.blocks),
        "hand_split": case.hand_note,
        "profile": {"microbatch_sizes": list(profile.microbatch_sizes), "seconds": profile.seconds,
                    "device": profile.device.name},
        "rows": rows,
        "autosplit_vs_best_other": min((r["median_s"] for r in others), default=math.nan) / auto["median_s"],
        "torchgpipe": notes.get("torchgpipe"),
        "notes": result_notes,
        "load": result.get("load", {}),
        "stage_error": _median_abs([p / m - 1 for r in rows if r["same_as"] is None and r["stage_measured_ms"]
                                    for p, m in zip(r["stage_predicted_ms"], r["stage_measured_ms"])]),
    }


def assemble_oracle(case: Case, profile: Profile, auto: Plan, hand: Plan | None, grid: list[dict],
                    result: dict[str, Any], max_m: int) -> dict[str, Any]:
    times, refined = result["times"], result["refined"]
    points = []
    for g in grid:
        plan = g["plan"]
        stats = summary(times[g["label"]])
        point = {k: g[k] for k in ("label", "cut", "before", "split_size", "microbatches")}
        point.update(
            measured_s=times[g["label"]], median_s=stats["median"], predicted_ms=plan.predicted_step_ms,
            bound_ms=plan.bound_step_ms, refined_s=refined.get(g["label"]),
            refined_median_s=statistics.median(refined[g["label"]]) if g["label"] in refined else None,
            autosplit=plan_key(plan) == plan_key(auto),
            hand=hand is not None and plan_key(plan) == plan_key(hand),
        )
        points.append(point)
    auto_point = next(p for p in points if p["autosplit"])
    coarse_best = min(points, key=lambda p: p["median_s"])
    refined_points = [p for p in points if p["refined_median_s"] is not None]
    out: dict[str, Any] = {
        "model": case.label,
        "input": case.spec.describe,
        "batch": case.spec.batch,
        "load": result.get("load", {}),
        "max_m": max_m,
        "microbatch_sizes": sizes_for(case.spec.batch, max_m),
        "points": points,
        "autosplit": {"before": auto_point["before"], "split_size": auto.split_size,
                      "microbatches": auto.microbatches, "predicted_ms": auto.predicted_step_ms},
        "coarse_best": {k: coarse_best[k] for k in ("label", "before", "split_size", "microbatches", "median_s")},
        "autosplit_vs_best_coarse": coarse_best["median_s"] / auto_point["median_s"],
    }
    if refined_points:
        best = min(refined_points, key=lambda p: p["refined_median_s"])
        out["refined_best"] = {k: best[k] for k in ("label", "before", "split_size", "microbatches",
                                                    "refined_median_s")}
        out["autosplit_vs_best"] = best["refined_median_s"] / auto_point["refined_median_s"]
    else:
        out["autosplit_vs_best"] = out["autosplit_vs_best_coarse"]
    best_median = min(p["median_s"] for p in points)
    per_m = {}
    for m in sorted({p["microbatches"] for p in points}):
        row = min((p for p in points if p["microbatches"] == m), key=lambda p: p["median_s"])
        per_m[str(m)] = {"best_before": row["before"], "median_s": row["median_s"],
                         "vs_best": row["median_s"] / best_median}
    out["best_per_m"] = per_m
    if hand is not None:
        hand_point = next(p for p in points if p["hand"])
        out["hand"] = {"before": hand_point["before"], "split_size": hand.split_size,
                       "median_s": hand_point["median_s"], "refined_median_s": hand_point["refined_median_s"]}
    return out


def _median_abs(values: Sequence[float]) -> float:
    return statistics.median(abs(v) for v in values) if values else math.nan


def error_summary(models: list[dict], oracle: dict) -> dict[str, Any]:
    rows = [r for m in models for r in m["rows"] if r["same_as"] is None]
    points = oracle["points"]

    def point_error(p: dict, key: str) -> float:
        return p[key] / 1000 / p["median_s"] - 1

    return {
        "compare_rows": len(rows),
        "compare_predicted": _median_abs([r["predicted_error"] for r in rows]),
        "compare_bound": _median_abs([r["bound_error"] for r in rows]),
        "compare_pipelined_predicted": _median_abs([r["predicted_error"] for r in rows if r["name"] != ONE]),
        "oracle_points": len(points),
        "oracle_predicted": _median_abs([point_error(p, "predicted_ms") for p in points]),
        "oracle_bound": _median_abs([point_error(p, "bound_ms") for p in points]),
    }


def goals(models: list[dict], oracle: dict, errors: dict, on_gpus: bool) -> list[dict[str, Any]]:
    hand_goal = 1.10 if on_gpus else 1.00
    out = [{"goal": f"{oracle['model']} oracle: autosplit ≥ 0.98× the sweep's best point",
            "value": oracle["autosplit_vs_best"], "target": 0.98,
            "met": oracle["autosplit_vs_best"] >= 0.98}]
    for m in models:
        by = {r["name"]: r for r in m["rows"]}
        if HAND in by:
            v = by[AUTO]["vs_hand_split"]
            out.append({"goal": f"{m['model']}: autosplit ≥ {hand_goal:.2f}× the hand split",
                        "value": v, "target": hand_goal, "met": v >= hand_goal})
        v = m["autosplit_vs_best_other"]
        out.append({"goal": f"{m['model']}: autosplit ≥ 1.00× every other plan", "value": v,
                    "target": 1.0, "met": v >= 1.0})
    v = errors["compare_predicted"]
    out.append({"goal": "cost model: median absolute error of the predicted step ≤ 10 % (compared plans)",
                "value": v, "target": 0.10, "met": v <= 0.10})
    return out


# ------------------------------------------------------------------------------- reporting


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _stages(row: dict) -> str:
    if not row["stage_predicted_ms"] or not row["stage_measured_ms"]:
        return "–"
    before = " / ".join(f"{v:.0f}" for v in row["stage_predicted_ms"])
    after = " / ".join(f"{v:.0f}" for v in row["stage_measured_ms"])
    return f"{before} → {after}"


def _cut(row: dict) -> str:
    return ", ".join(row["split_points"]) or "–"


def markdown(data: dict[str, Any]) -> str:
    st = data["settings"]
    lines = [
        "# autosplit against the hand split, one device and the peers",
        "",
        f"Machine: {describe(st['machine'])}. Devices: {st['devices']}; schedule GPipe; "
        f"{st['loss']}. Every configuration of a model is trained in one job, interleaved round "
        f"by round after a warm-up round; {st['rounds']} timed rounds of one step each, the "
        "median is reported (spread = (max − min) / median). Command: "
        f"`{st['command']}`; whole run {data['phases_seconds']['total'] / 60:.1f} min.",
        "",
        "Timings on this shared 2-core machine drift 20–30 % between runs (other jobs, tests "
        "included, may run beside it); compare rows of one run, not across runs. A timing during "
        f"which other processes used more than {st['max_others']:.0%} of the machine's CPU time "
        f"is taken again (at most {st['retries']} times; /proc/stat's busy time minus the ranks' own).",
        "",
        "Ratios are speed-ups: the other configuration's step time over this row's (> 1: this "
        "row is faster). Predicted: autosplit's prediction for that plan (`predicted_step_ms`, the "
        "event simulation of the schedule on the profiled block times); bound: the closed form "
        "(m + p − 1) · t_max (`bound_step_ms`). Heuristics without their own micro-batch choice (uniform, by "
        "parameters) get the measured size the cost model predicts fastest for their cut; "
        f"torchgpipe {st['torchgpipe'] or '(not installed)'} `balance_by_time` runs on the model "
        "flattened into an nn.Sequential, timed on one micro-batch, with autosplit's m.",
        "",
    ]
    for m in data["models"]:
        lines += [
            f"## {m['model']} ({m['input']}, {m['blocks']} blocks)",
            "",
            f"Hand split: {m['hand_split']}. Profiled micro-batch sizes: "
            f"{', '.join(map(str, m['profile']['microbatch_sizes']))} ({m['profile']['seconds']:.0f} s).",
            "",
            "| plan | cut before | m × b | measured (s) | spread | samples/s | predicted (s) | bound (s) "
            "| vs hand split | vs one device | stage compute (ms): profiled → run together |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in m["rows"]:
            same = f" (= {r['same_as']})" if r["same_as"] else ""
            hand = f"×{r['vs_hand_split']:.2f}" if r["vs_hand_split"] is not None else "–"
            lines.append(
                f"| {r['name']}{same} | {_cut(r)} | {r['microbatches']} × {r['split_size']} | "
                f"{r['median_s']:.3f} | {r['spread']:.0%} | {r['throughput']:.1f} | "
                f"{r['predicted_ms'] / 1000:.3f} | {r['bound_ms'] / 1000:.3f} | {hand} | "
                f"×{r['vs_one_device']:.2f} | {_stages(r)} |"
            )
        tg = m.get("torchgpipe")
        if tg:
            lines += ["", f"torchgpipe's balance_by_time: layers {tg['layer_balance']} of {tg['layers']} "
                          f"→ blocks {list(tg['balance'])}, timed on a micro-batch of {tg['sample_rows']} "
                          f"in {tg['seconds']:.1f} s" + (f"; {'; '.join(tg['notes'])}" if tg["notes"] else "") + "."]
        lines += ["", f"Stage compute per micro-batch: the profile's sum over the stage's blocks (each "
                      f"timed alone) against the stage's blocks run together in one process; median "
                      f"error {m['stage_error']:.0%}."]
        for note in m["notes"]:
            lines += ["", note + "."]
        if load_sentence(m["load"]):
            lines += ["", load_sentence(m["load"])]
        lines.append("")
    o = data["oracle"]
    sizes = list(reversed(o["microbatch_sizes"]))
    lines += [
        f"## The oracle: {o['model']} ({o['input']}), every cut × m ≤ {o['max_m']}",
        "",
        f"{len(o['points'])} points, {_n(st['oracle_rounds'], 'timed round')} each (median below); then "
        f"the {st['refine']} fastest and autosplit's and the hand split's points again, "
        f"{_n(st['refine_rounds'], 'round')} among themselves (refined). Step time in seconds; "
        "**bold**: autosplit's plan; *italic*: the hand split. " + load_sentence(o["load"]),
        "",
        "| cut before | " + " | ".join(f"m={o['batch'] // b} (b={b})" for b in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    by_cut: dict[str, dict[int, dict]] = {}
    for p in o["points"]:
        by_cut.setdefault(p["before"], {})[p["split_size"]] = p
    for before, row in by_cut.items():
        cells = []
        for b in sizes:
            p = row[b]
            text = f"{p['median_s']:.2f}"
            if p["autosplit"]:
                text = f"**{text}**"
            elif p["hand"]:
                text = f"*{text}*"
            cells.append(text)
        lines.append(f"| {before} | " + " | ".join(cells) + " |")
    lines += ["", "| refined point | cut before | m × b | refined median (s) | coarse median (s) | predicted (s) |",
              "|---|---|---|---|---|---|"]
    for p in sorted((p for p in o["points"] if p["refined_median_s"] is not None),
                    key=lambda p: p["refined_median_s"]):
        who = "autosplit" if p["autosplit"] else ("hand split" if p["hand"] else "")
        lines.append(f"| {who} | {p['before']} | {p['microbatches']} × {p['split_size']} | "
                     f"{p['refined_median_s']:.3f} | {p['median_s']:.3f} | {p['predicted_ms'] / 1000:.3f} |")
    per_m = ", ".join(f"m={m}: ×{v['vs_best']:.2f} (best cut before {v['best_before']})"
                      for m, v in o["best_per_m"].items())
    lines += [
        "",
        f"autosplit's plan (cut before {o['autosplit']['before']}, {o['autosplit']['microbatches']} × "
        f"{o['autosplit']['split_size']}) is ×{o['autosplit_vs_best']:.3f} the best point found "
        f"(refined; ×{o['autosplit_vs_best_coarse']:.3f} against the coarse sweep's best, cut before "
        f"{o['coarse_best']['before']} at m={o['coarse_best']['microbatches']}). "
        f"Best step per m relative to the best overall (coarse): {per_m}.",
        "",
    ]
    e = data["errors"]
    lines += [
        "## Cost model error and goals",
        "",
        f"Median absolute error of the predicted step, |predicted − measured| / measured: "
        f"{e['compare_predicted']:.1%} over the {e['compare_rows']} measured configurations of the "
        f"comparison ({e['compare_pipelined_predicted']:.1%} without the one-device rows; the "
        f"closed-form bound {e['compare_bound']:.1%}); {e['oracle_predicted']:.1%} over the "
        f"oracle's {e['oracle_points']} points (bound {e['oracle_bound']:.1%}).",
        "",
        "| goal | value | met |",
        "|---|---|---|",
    ]
    for g in data["goals"]:
        value = f"{g['value']:.1%}" if g["target"] == 0.10 else f"×{g['value']:.3f}"
        lines.append(f"| {g['goal']} | {value} | {'yes' if g['met'] else '**no**'} |")
    lines += ["", "Phases (s): " + ", ".join(f"{k} {v:.0f}" for k, v in data["phases_seconds"].items()) + "."]
    return "\n".join(lines) + "\n"


def figures(data: dict[str, Any], out: Path, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    names = []
    colors = {ONE: "#8C8C8C", HAND: "#DD8452", "uniform": "#BBBBBB", "by parameters": "#BBBBBB",
              "torchgpipe": "#8172B2", AUTO: "#4C72B0"}
    models = data["models"]

    # 1. measured throughput per plan per model, predicted marker
    fig, axes = plt.subplots(len(models), 1, figsize=(7.5, 1.0 + 1.9 * len(models)), dpi=100,
                             layout="constrained", squeeze=False)
    for ax, m in zip(axes[:, 0], models):
        rows = m["rows"]
        ys = list(range(len(rows)))[::-1]
        vals = [r["throughput"] for r in rows]
        lo = [v - m["batch"] / r["max_s"] for v, r in zip(vals, rows)]
        hi = [m["batch"] / r["min_s"] - v for v, r in zip(vals, rows)]
        ax.barh(ys, vals, xerr=[lo, hi], color=[colors[r["name"]] for r in rows], height=0.65,
                error_kw={"elinewidth": 1, "capsize": 2})
        ax.scatter([m["batch"] / (r["predicted_ms"] / 1000) for r in rows], ys, marker="D",
                   color="black", s=18, zorder=3)
        labels = []
        for r in rows:
            same = " (same plan)" if r["same_as"] else ""
            where = f"{_cut(r)} · {r['microbatches']}×{r['split_size']}" if r["name"] != ONE else f"1×{r['split_size']}"
            labels.append(f"{r['name']}{same}\n{where}")
        ax.set_yticks(ys, labels, fontsize=7)
        for y, v, r in zip(ys, vals, rows):
            ax.text(v * 0.02, y, f"{v:.1f}/s ×{r['vs_one_device']:.2f}", va="center", fontsize=7,
                    color="white", fontweight="bold")
        ax.set_title(f"{m['model']} ({m['input']})", loc="left", fontsize=9)
        ax.set_xlim(0, max(vals + [m["batch"] / (r["predicted_ms"] / 1000) for r in rows]) * 1.12)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    axes[-1, 0].set_xlabel("training throughput (samples/s; median, whiskers min–max); "
                           "×: speed-up over one device", fontsize=8)
    fig.legend(handles=[Line2D([], [], marker="D", color="black", linestyle="", markersize=5,
                               label="autosplit's prediction for that plan")],
               fontsize=8, frameon=False, loc="upper right")
    fig.suptitle("Plans measured side by side on 2 devices (higher is faster)", fontsize=10, x=0.02,
                 ha="left")
    path = out / f"{stem}_throughput.png"
    fig.savefig(path)
    plt.close(fig)
    names.append(path.name)

    # 2. predicted vs measured
    fig, ax = plt.subplots(figsize=(5.5, 5), dpi=100, layout="constrained")
    o = data["oracle"]
    ox = [p["predicted_ms"] / 1000 for p in o["points"]]
    oy = [p["median_s"] for p in o["points"]]
    ax.scatter(ox, oy, s=12, color="#BBBBBB", label=f"oracle sweep points ({o['model']}, {o['input']})")
    markers = "osD^v"
    for i, m in enumerate(models):
        rows = [r for r in m["rows"] if r["same_as"] is None]
        ax.scatter([r["predicted_ms"] / 1000 for r in rows], [r["median_s"] for r in rows],
                   marker=markers[i % len(markers)], s=30, label=f"{m['model']} plans")
    lo = min(ox + oy + [r["predicted_ms"] / 1000 for m in models for r in m["rows"]]) * 0.8
    hi = max(ox + oy + [r["median_s"] for m in models for r in m["rows"]]) * 1.25
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="y = x")
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="#4C72B0",
                    alpha=0.12, label="±10 %")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted step time (s), autosplit's cost model")
    ax.set_ylabel("measured step time (s), median")
    e = data["errors"]
    ax.set_title(f"Predicted vs measured: median error {e['compare_predicted']:.0%} (compared plans), "
                 f"{e['oracle_predicted']:.0%} (sweep)", fontsize=9, loc="left")
    ax.legend(fontsize=7, frameon=False, loc="upper left")
    path = out / f"{stem}_predicted.png"
    fig.savefig(path)
    plt.close(fig)
    names.append(path.name)

    # 3. the oracle's grid
    sizes = list(reversed(o["microbatch_sizes"]))
    befores = list(dict.fromkeys(p["before"] for p in o["points"]))
    cell = {(p["before"], p["split_size"]): p for p in o["points"]}
    grid = [[cell[(bf, b)]["median_s"] for b in sizes] for bf in befores]
    fig, ax = plt.subplots(figsize=(6.2, 0.3 * len(befores) + 1.8), dpi=100, layout="constrained")
    image = ax.imshow(grid, cmap="viridis_r", aspect="auto")
    best = min(o["points"], key=lambda p: p["median_s"])
    for i, bf in enumerate(befores):
        for j, b in enumerate(sizes):
            v = grid[i][j]
            light = v > (min(map(min, grid)) + max(map(max, grid))) / 2
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if light else "black")
            p = cell[(bf, b)]
            if p["autosplit"]:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.2))
            if p["hand"]:
                ax.add_patch(Rectangle((j - 0.45, i - 0.45), 0.9, 0.9, fill=False, edgecolor="orange",
                                       linewidth=1.5, linestyle="--"))
    bi, bj = befores.index(best["before"]), sizes.index(best["split_size"])
    ax.plot(bj + 0.36, bi, marker="*", color="white", markersize=9, markeredgecolor="black")
    ax.set_xticks(range(len(sizes)), [f"m={o['batch'] // b}\nb={b}" for b in sizes], fontsize=8)
    ax.set_yticks(range(len(befores)), befores, fontsize=7)
    ax.set_ylabel("cut before block")
    fig.colorbar(image, ax=ax, label="measured step time (s)", shrink=0.8)
    ax.set_title(f"Oracle sweep: {o['model']}, {o['input']}, 2 devices\n"
                 f"red box: autosplit (×{o['autosplit_vs_best']:.3f} of the best found); "
                 "dashed: hand split; ★ fastest (coarse)", fontsize=9, loc="left")
    path = out / f"{stem}_oracle.png"
    fig.savefig(path)
    plt.close(fig)
    names.append(path.name)
    return names


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
        args.retries = 0  # a smoke run checks that it runs, not how fast
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
