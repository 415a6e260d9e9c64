"""Hugging Face transformers on 2 CPU workers: autosplit's plan against torchtitan's even layers,
PiPPy's equal sizes and DDP, predicted and measured side by side in one launch.

Models (random weights, trained on their own causal-LM loss, which HF returns when ``labels``
are given; SGD lr 0.001): a tiny Llama (``LlamaForCausalLM``, examples/llama.py's sizes) and a
tiny GPT-2 (``GPT2LMHeadModel``, tied embeddings; both in ``hf_models.py``), inputs
``input_ids``, ``attention_mask``, ``labels`` of 32 tokens.

Each model is profiled by autosplit (``autosplit.profile(model, (), kwargs)``: one CPU worker of
one thread; the model's own loss is timed with its last block), given the machine's figures as
``autosplit plan`` gives them (DDP's all-reduce, the link, the pipeline runtime's cost per
action: ``autosplit.measure.machine.with_machine_figures``, from the machine's cache), and these configurations are trained for real,
one process per stage and replica (gloo), interleaved round by round in one launch of
``harness.py`` (its retake rule for timings disturbed by other processes):

1. **autosplit layouts**: autosplit's choice, the best plan over every layout of 2 workers
   (``plan_layouts(profile, 2)``, as ``autosplit plan --gpus 2`` chooses: the pipeline or
   1 stage × 2 replicas), compared with the best of the three others; and **autosplit**, its
   2-stage pipeline (``autosplit.plan(profile, 2)``, GPipe; its cut and micro-batch size),
   compared with the two split rules. A plan that is another row's is measured once.
2. **torchtitan**: torchtitan's ``generate_llm_fqn_per_model_part(num_stages, num_layers,
   input_weight=1, output_weight=1)`` (torchtitan/distributed/pipeline_parallel.py): the
   embedding counts as ``input_weight`` layers on the first stage and norm + output head as
   ``output_weight`` layers on the last; ``num_layers + input_weight + output_weight``
   effective layers are shared out evenly, ``// num_stages`` each, the remainder one more to the
   first stages, and each stage takes its share of transformer layers less its weight. For 2
   stages and L layers: stage 0 gets the embedding and ``(L + 2) // 2 + (L + 2) % 2 - 1``
   layers. Mapped to autosplit's blocks: the cut goes before the block of that layer
   (``model.layers.k`` / ``transformer.h.k``); the embedding blocks (GPT-2's ``wpe``,
   Llama's ``rotary_emb`` included) go with stage 0, the norm and head with the last stage.
   Run at autosplit's micro-batch size.
3. **PiPPy equal size**: ``split_into_equal_size(2)`` of PiPPy / torch.distributed.pipelining
   (``_IR.py`` of the torch releases that had it; the installed torch 2.14 no longer does):
   threshold = (parameter + buffer elements) // nstages; walking the graph's nodes in order, a
   node joins the current stage while the stage's size plus the node's stays ≤ threshold; a
   node bigger than the threshold on an empty stage becomes a stage of its own; otherwise a new
   stage starts before it; only the first nstages − 1 split points are kept. A submodule call
   counts all its parameters, so a tied weight counts again in every module that uses it
   (GPT-2's ``lm_head``). Mapped to blocks: autosplit's blocks in order are the nodes, each
   sized by its parameter bytes plus the shared parameters it uses but does not own
   (``autosplit.planner.layouts.stage_grad_bytes``); the threshold is the model's unique
   parameter bytes // 2 (all float32: bytes ∝ elements; buffers left out, they hold no
   parameters here beyond Llama's 32-float rotary table). Run at autosplit's micro-batch size.
4. **DDP**: 1 stage × 2 replicas, the whole model on each worker (``plan_replicated(profile,
   1, 2)`` with ``replica_mode="ddp"``: its own best micro-batch size per replica, the measured all-reduce).

Every plan carries autosplit's predicted step by block sums (the hand-made balances scored by
``plan_with_balance``, the same model); each row gives it beside the measured median, min, max
and interquartile range, and the prediction's error (predicted − measured) / measured.
autosplit's two plans are also verified as ``autosplit plan`` verifies what it prints: their
stages timed as they run, beside the neighbouring worker (``autosplit.verify.plans.verify_plans``),
before the launch; the choice's error is that of the verified prediction, the figure the
command prints.

    python benchmarks/hf_transformers.py           # ~5 min on 2 quiet cores; writes benchmarks/results/transformers.*
    python benchmarks/hf_transformers.py --smoke   # tiny sizes, about a minute

(The script is not named ``transformers.py``: ``python benchmarks/<script>.py`` puts
benchmarks/ first on ``sys.path``, where a ``transformers.py`` would shadow the transformers
package itself.)
"""

from __future__ import annotations

if __name__ == "__main__":  # started again first, before the imports below pay twice: the C
    # allocator keeping freed memory, as the ranks run (see autosplit/measure/allocator.py)
    from autosplit.measure.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from common import RESULTS, command_line, describe, machine, write_results
from harness import Config, Group, add_load_arguments, load_options, measure, summary
from hf_models import HFSpec
from torch import nn

import autosplit
from autosplit import PlanOptions, ProfileOptions
from autosplit.measure.machine import with_machine_figures
from autosplit.planner import plan_with_balance
from autosplit.planner.layouts import plan_layouts, plan_replicated, stage_grad_bytes
from autosplit.records import Plan, Profile

AUTO, TITAN, PIPPY, DDP = "autosplit", "torchtitan even layers", "PiPPy equal size", "DDP"
LAYOUT = "autosplit layouts"
def torchtitan_balance(names: Sequence[str], layers: int, prefix: str,
                       input_weight: int = 1, output_weight: int = 1) -> tuple[int, int]:
    """torchtitan's 2-stage split (see the module docstring) as block counts."""
    effective = layers + input_weight + output_weight
    per, extra = effective // 2, effective % 2
    first_layers = min(per + (extra > 0) - input_weight, layers)
    cut = names.index(f"{prefix}{first_layers}")
    return cut, len(names) - cut


def pippy_balance(profile: Profile, nstages: int = 2) -> tuple[int, ...]:
    """``split_into_equal_size(nstages)``'s greedy rule over autosplit's blocks (see the module
    docstring)."""
    sizes = stage_grad_bytes(profile)
    threshold = sum(int(b.param_bytes) for b in profile.blocks) // nstages
    starts: list[int] = []  # blocks a new stage starts at
    accumulated = 0.0
    for i, size in enumerate(sizes):
        if accumulated + size <= threshold:
            accumulated += size
        elif accumulated == 0 and size > threshold:  # this block is a stage of its own
            if i + 1 < len(sizes):
                starts.append(i + 1)
        else:
            starts.append(i)
            accumulated = size
    starts = sorted({s for s in starts if 0 < s < len(sizes)})[: nstages - 1]
    if len(starts) != nstages - 1:
        raise SystemExit(f"PiPPy's rule gives {len(starts) + 1} stages, not {nstages}")
    bounds = [0, *starts, len(sizes)]
    return tuple(bounds[i + 1] - bounds[i] for i in range(nstages))


def prepare(spec: HFSpec, sizes: list[int], budget_s: float | None) -> dict[str, Any]:
    model, kwargs = spec.build(), spec.make_kwargs()
    start = time.perf_counter()
    profile = autosplit.profile(model, (), kwargs,
                                options=ProfileOptions(microbatch_sizes=sizes, budget_s=budget_s))
    profile_s = time.perf_counter() - start
    profile, figures, note = with_machine_figures(profile, ["gpipe"])
    actions = ", ".join(f"{name} {ms:.2f} ms" for name, ms in figures.action_ms)
    print(f"  {note}\n  DDP's all-reduce {figures.allreduce_bytes_per_s / 1e9:.2f} GB/s (bus) "
          f"after {figures.allreduce_latency_ms:.2f} ms; the link "
          f"{figures.link_bytes_per_s / 1e9:.2f} GB/s; the runtime per action: {actions}, one "
          f"stage {figures.one_stage_action_ms:.2f} ms", flush=True)
    auto = autosplit.plan(profile, 2)
    names = list(profile.block_names)
    prefix = "model.layers." if spec.family == "llama" else "transformer.h."
    titan = torchtitan_balance(names, spec.config()["layers"], prefix)
    pippy = pippy_balance(profile)
    plans = {
        AUTO: auto,
        TITAN: plan_with_balance(profile, titan, auto.split_size, solver="torchtitan"),
        PIPPY: plan_with_balance(profile, pippy, auto.split_size, solver="pippy equal size"),
        DDP: plan_replicated(profile, 1, 2, PlanOptions(replica_mode="ddp")),
        # what `autosplit plan --gpus 2` chooses: the best of every layout (2 stages, or
        # 1 stage × 2 replicas), GPipe
        LAYOUT: plan_layouts(profile, 2, options=PlanOptions(schedule="gpipe")).best,
    }
    print(f"  profiled in {profile_s:.0f} s; loss {profile.loss!r}; blocks {names}", flush=True)
    for name, plan in plans.items():
        print(f"  {name}: balance {list(plan.balance)} × {plan.replicas}, b={plan.split_size}, "
              f"predicted {plan.predicted_step_ms:.1f} ms", flush=True)
    start = time.perf_counter()
    verified = verified_plans(model, kwargs, profile, {n: plans[n] for n in (AUTO, LAYOUT)})
    verify_s = time.perf_counter() - start
    for name, plan in verified.items():
        print(f"  {name}: verified {plan.predicted_step_ms:.1f} ms ± {plan.step_spread:.1%} "
              f"(in {verify_s:.0f} s)", flush=True)
    return {"profile": profile, "plans": plans, "verified": verified, "profile_s": profile_s,
            "verify_s": verify_s, "names": names}


def verified_plans(model: nn.Module, kwargs: dict[str, torch.Tensor], profile: Profile,
                   plans: dict[str, Plan]) -> dict[str, Plan]:
    """``plans`` predicted again from their stages timed as they run, as ``autosplit plan``
    verifies (one session; the command chooses on a first one and predicts from a second)."""
    from autosplit.capture.trace import trace
    from autosplit.measure.profiler import check_inputs
    from autosplit.verify.plans import verify_plans

    graph = trace(model, example_inputs=(), example_kwargs=kwargs)
    flat = check_inputs(graph.signature.flatten((), kwargs, graph.model_name))
    return verify_plans(graph, flat, profile, plans, one_device=False)


def key(plan: Plan) -> tuple[Any, ...]:
    return tuple(plan.balance), int(plan.split_size), int(plan.replicas), plan.replica_mode


def iqr(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[2] - q[0]


def row(name: str, plan: Plan, names: Sequence[str], times: list[float], same_as: str | None,
        verified: Plan | None = None) -> dict[str, Any]:
    ms = [t * 1000 for t in times]
    s = summary(ms)
    checked = {} if verified is None else {
        "verified_ms": verified.predicted_step_ms, "verified_spread": verified.step_spread,
        "verified_error": (verified.predicted_step_ms - s["median"]) / s["median"]}
    cut = [names[sum(plan.balance[: i + 1])] for i in range(len(plan.balance) - 1)]
    return {
        "name": name, "balance": list(plan.balance), "replicas": plan.replicas,
        "replica_mode": plan.replica_mode,
        "cut_before": cut, "split_size": plan.split_size, "microbatches": plan.microbatches,
        "predicted_ms": plan.predicted_step_ms, "measured_ms": ms,
        "update_ms": plan.update_ms, "allreduce_ms": plan.replica_sync_ms,
        "median_ms": s["median"], "min_ms": s["min"], "max_ms": s["max"], "iqr_ms": iqr(ms),
        "error": abs(plan.predicted_step_ms - s["median"]) / s["median"],
        "signed_error": (plan.predicted_step_ms - s["median"]) / s["median"],
        "same_plan_as": same_as, **checked,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.smoke:
        specs = [HFSpec("hf-llama-tiny", 8), HFSpec("hf-gpt2-tiny", 8)]
        sizes, budget = [2, 4, 8], 10.0
    else:
        specs = [HFSpec("hf-llama-small", 32), HFSpec("hf-gpt2-small", 32)]
        sizes, budget = [4, 8, 16, 32], None
    started = time.perf_counter()
    prepared, groups = [], []
    for spec in specs:
        print(f"profiling and planning {spec.key} ({spec.describe}) …", flush=True)
        p = prepare(spec, sizes, budget)
        measured: dict[Any, str] = {}
        configs = []
        for name, plan in p["plans"].items():
            if key(plan) not in measured:
                measured[key(plan)] = name
                configs.append(Config(name, plan))
        p["measured"] = measured
        prepared.append((spec, p))
        groups.append(Group(spec.key, spec, tuple(configs), rounds=args.rounds, warmup=1,
                            **load_options(args)))
    print(f"measuring {sum(len(g.configs) for g in groups)} configurations, 2 ranks (gloo) …",
          flush=True)
    start = time.perf_counter()
    results = measure(groups, nprocs=2, backend="gloo", timeout_s=args.timeout)
    measure_s = time.perf_counter() - start
    models = []
    for spec, p in prepared:
        res = results[spec.key]
        rows = []
        for name, plan in p["plans"].items():
            label = p["measured"][key(plan)]
            rows.append(row(name, plan, p["names"], res["times"][label],
                            None if label == name else label, p["verified"].get(name)))
        auto = rows[0]
        choice = next(r for r in rows if r["name"] == LAYOUT)  # what `autosplit plan` gives
        others = [r for r in rows if r["name"] in (TITAN, PIPPY, DDP)]
        best = min(others, key=lambda r: r["median_ms"])
        splits = [r for r in rows if r["name"] in (TITAN, PIPPY)]
        best_split = min(splits, key=lambda r: r["median_ms"])
        models.append({
            "model": spec.key, "config": spec.config(), "batch": spec.batch,
            "blocks": p["names"], "profile_s": p["profile_s"],
            "microbatch_sizes": list(p["profile"].microbatch_sizes),
            "loss": p["profile"].loss, "rows": rows,
            "best_other": best["name"],
            "choice_vs_best_other": choice["median_ms"] / best["median_ms"],
            "choice_within_best_spread": choice["median_ms"] <= best["max_ms"],
            "choice_prediction_error": choice["verified_error"],
            "choice_block_sum_error": choice["signed_error"],
            "verify_s": p["verify_s"],
            "best_split": best_split["name"],
            "pipeline_vs_best_split": auto["median_ms"] / best_split["median_ms"],
            "layouts_choice": next(r for r in rows if r["name"] == LAYOUT),
            "load": res["load"], "lead_in_steps": res["lead_in_steps"],
        })
    return {
        "settings": {
            "machine": machine(), "command": args.command, "smoke": args.smoke,
            "devices": "2 CPU workers of 1 thread each (gloo), one process per stage and replica",
            "schedule": "gpipe", "rounds": args.rounds, "warmup": 1,
            "steps_per_timing": 1, "lead_in_s": args.lead_in,
            "settle_rounds": args.settle_rounds, "more_rounds": args.more_rounds,
            "max_spread": args.max_spread, "max_others": args.max_others,
            "retries": args.retries, "profiled_sizes": sizes, "profile_budget_s": budget,
            "loss": "the model's own causal-LM loss (labels = input_ids), SGD lr 0.001",
        },
        "phases_seconds": {"measure (one launch)": measure_s,
                           "total": time.perf_counter() - started},
        "models": models,
    }


def markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    title = "HF transformers on 2 CPU workers" + (" (SMOKE: tiny sizes, not a measurement)"
                                                   if s["smoke"] else "")
    lines = [f"# {title}", "", describe(s["machine"]), "",
             f"`{s['command']}`; {s['devices']}; {s['rounds']} timed rounds (+ up to "
             f"{s['more_rounds']} more while spread > {s['max_spread']:.0%}) after a warm-up, "
             f"interleaved; {s['loss']}.", ""]
    for m in data["models"]:
        c = m["config"]
        lines += [f"## {m['model']}: {c['layers']} layers, hidden {c['hidden']}, vocabulary "
                  f"{c['vocab']}, B={m['batch']} × {c['tokens']} tokens", "",
                  "| configuration | balance × replicas | b | predicted ms (block sums) | of which "
                  "all-reduce / optimizer step | error | verified ms | error | measured median "
                  "ms | min–max | IQR |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in m["rows"]:
            same = f" (= {r['same_plan_as']})" if r["same_plan_as"] else ""
            checked = ("– | –" if "verified_ms" not in r else
                       f"{r['verified_ms']:.1f} ± {r['verified_spread']:.0%} | "
                       f"{r['verified_error']:+.1%}")
            lines.append(
                f"| {r['name']}{same} | {r['balance']} × {r['replicas']} | {r['split_size']} | "
                f"{r['predicted_ms']:.1f} | {r.get('allreduce_ms', 0.0):.1f} / "
                f"{r.get('update_ms', 0.0):.1f} | {r['signed_error']:+.1%} | {checked} | "
                f"{r['median_ms']:.1f} | {r['min_ms']:.1f}–{r['max_ms']:.1f} | "
                f"{r['iqr_ms']:.1f} |")
        choice = m["layouts_choice"]
        lines += ["", f"autosplit's choice over every layout (`plan_layouts`, as `autosplit plan "
                  f"--gpus 2`): {choice['balance']} × {choice['replicas']}"
                  f"{' (= ' + choice['same_plan_as'] + ')' if choice['same_plan_as'] else ''}; "
                  f"against the best of torchtitan, PiPPy and DDP ({m['best_other']}): "
                  f"{m['choice_vs_best_other']:.3f} (within its min–max: "
                  f"{m['choice_within_best_spread']}); its verified prediction (what the "
                  f"command prints) {m['choice_prediction_error']:+.1%} off the measured median, "
                  f"by block sums {m['choice_block_sum_error']:+.1%} (verified in "
                  f"{m['verify_s']:.0f} s).", "",
                  f"autosplit's 2-stage pipeline (`autosplit.plan(profile, 2)`) against the best "
                  f"split rule ({m['best_split']}): {m['pipeline_vs_best_split']:.3f}. Others took "
                  f"{m['load'].get('others_share', float('nan')):.1%} of the CPU, "
                  f"{m['load']['retried']} timings retaken.", ""]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds per configuration (default 20; --smoke 1)")
    parser.add_argument("--timeout", type=float, default=900.0, help="process-group timeout (s)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, about a minute")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the results")
    add_load_arguments(parser)
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.smoke else 20
    args.command = command_line("hf_transformers.py",
                                sys.argv[1:] if argv is None else list(argv))
    data = run(args)
    stem = "transformers_smoke" if args.smoke else "transformers"
    text = markdown(data)
    write_results(args.out, stem, data, text)
    print(text)
    print(f"wrote {args.out / (stem + '.json')} and .md", flush=True)


if __name__ == "__main__":
    main()
