"""Planning at scale: the 7.5B GPT on 8, 64 and 512 H100s, from the analytic (meta-device) path.

The model is ``examples/gpt.py`` at ``size=7b`` (32 layers, width 4096, 2,048 tokens per
sample, a 128,256-token vocabulary: 7.5·10⁹ parameters), counted in bf16 on the meta device and
timed with the ``h100-80gb`` roofline (efficiency 0.5). For each N the devices are N / 8 nodes of
8 H100s (NVLink 450 GB/s per direction inside a node, 400 Gb/s InfiniBand = 50 GB/s per GPU
between nodes), the global batch is ``--batch`` sequences, the optimizer mixed-precision Adam
(16 bytes a parameter), the schedule 1F1B, 80 GB per device. ``plan_layouts`` weighs every
p stages × d replicas with p · d = N, d | B and p ≤ ``--max-stages`` (8 by default: the exact
1F1B search takes about a minute per micro-batch size at p = 16, see its docstring), each in
its best placement (pp or dp as the inner mesh dimension). The all-reduce is not overlapped
with the backward (o = 0, the planner's default; NCCL under DDP hides part of it in practice).

Every figure is a prediction from block sums of analytic estimates; nothing here ran on a GPU.

    python benchmarks/scale.py            # writes benchmarks/results/scale.{json,md}
    python benchmarks/scale.py --smoke    # GPT small on 2 × 2 devices, seconds (tests)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from common import (
    RESULTS,
    command_line,
    describe,
    load_example,
    machine,
    write_results,
)

from autosplit.analytic import analytic_profile, build_on_meta
from autosplit.planner import plan_layouts
from autosplit.records import Plan
from autosplit.specs import LINKS, get_spec, inter_node_link
from autosplit.topology import Topology, placement_text
from autosplit.units import format_bytes, format_ms

MEMORY_BYTES = 80 * 10**9


def _row(label: str, plan: Plan | None, need: float | None, per_node: int) -> dict[str, Any]:
    if plan is None:
        return {"layout": label, "fits": False, "need_bytes": need}
    p, d = len(plan.stages), plan.replicas
    return {
        "layout": label, "fits": True, "stages": p, "replicas": d,
        "placement": placement_text(plan.placement, p, d, per_node) if plan.placement else "",
        "split_size": plan.split_size, "microbatches": plan.microbatches,
        "step_ms": plan.predicted_step_ms, "allreduce_ms": plan.replica_sync_ms,
        "memory_bytes": max(s.memory_bytes for s in plan.stages), "solver": plan.solver,
    }


def plan_for(prof: Any, devices: int, per_node: int, batch: int, max_stages: int,
             spec: Any) -> dict[str, Any]:
    topology = Topology(devices // per_node, per_node, spec.link_bandwidth_bytes_per_s,
                        inter_node_link(spec)[1])
    start = time.perf_counter()
    layouts = plan_layouts(prof, topology=topology, batch_size=batch, schedule="1f1b",
                           optimizer="adam-mixed", memory_per_gpu=MEMORY_BYTES,
                           max_stages=max_stages)
    seconds = time.perf_counter() - start
    options = [_row(o.label, o.plan, o.need_bytes, per_node) for o in layouts.options]
    best = layouts.best
    chosen = _row(f"{len(best.stages)} × {best.replicas}", best, None, per_node)
    dp = next((r for o, r in zip(layouts.options, options) if o.stages == 1), None)
    pipe = next((r for o, r in zip(layouts.options, options) if o.replicas == 1), None)
    return {"devices": devices, "topology": topology.describe(), "batch": batch,
            "plan_seconds": seconds, "note": layouts.note, "chosen": chosen,
            "data_parallel": dp, "pipeline": pipe, "options": options}


def _cell(row: dict[str, Any] | None, why_none: str) -> str:
    if row is None:
        return why_none
    if not row["fits"]:
        need = row.get("need_bytes")
        return f"does not fit in 80 GB{f' (needs {format_bytes(need)})' if need else ''}"
    return f"{format_ms(row['step_ms'])}, {format_bytes(row['memory_bytes'])}"


def markdown(result: dict[str, Any], argv: list[str]) -> str:
    lines = [
        "# Planning the 7.5B GPT for 8, 64 and 512 H100s (analytic, predicted)", "",
        (f"Planned on: {describe(result['machine'])}. Profile (meta device, bf16, micro-batch "
         f"sizes {result['microbatch_sizes']}): {result['profile_seconds']:.1f} s. Command: "
         f"`{command_line('scale.py', argv)}`"), "",
        (f"{result['model']}; {result['spec']}; mixed-precision Adam, 1F1B, 80 GB per device, "
         f"nodes of {result['per_node']}, layouts of at most {result['max_stages']} stages; "
         "all-reduce not overlapped (o = 0). Every step and memory figure is a prediction "
         "from analytic block sums; nothing ran on a GPU."), "",
        ("| devices | topology | batch | chosen (p × d) | placement | micro-batches | "
         "predicted step | memory/device | best pure data parallel | best pure pipeline | "
         "planning time |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["scales"]:
        c = r["chosen"]
        no_pipe = (f"none: {r['devices']} stages > {result['blocks']} blocks"
                   if r["devices"] > result["blocks"] else "not searched (max stages)")
        lines.append(
            f"| {r['devices']} | {r['topology']} | {r['batch']} | {c['stages']} × "
            f"{c['replicas']} | {c['placement']} | {c['microbatches']} × {c['split_size']} | "
            f"{format_ms(c['step_ms'])} (all-reduce {format_ms(c['allreduce_ms'])}) | "
            f"{format_bytes(c['memory_bytes'])} | {_cell(r['data_parallel'], '–')} | "
            f"{_cell(r['pipeline'], no_pipe)} | "
            f"{r['plan_seconds']:.1f} s |")
    lines += ["", "Every layout considered:", ""]
    for r in result["scales"]:
        lines += [f"**{r['devices']} devices** ({r['note'] or 'every layout searched'})", "",
                  "| layout | placement | split | step | all-reduce | memory/device |",
                  "|---|---|---|---|---|---|"]
        for o in r["options"]:
            if not o["fits"]:
                lines.append(f"| {o['layout']} | | | {_cell(o, '')} | | |")
                continue
            lines.append(f"| {o['layout']} | {o['placement']} | {o['microbatches']} × "
                         f"{o['split_size']} | {format_ms(o['step_ms'])} | "
                         f"{format_ms(o['allreduce_ms'])} | {format_bytes(o['memory_bytes'])} |")
        lines.append("")
    lines.append(f"Total run time {result['seconds']:.1f} s.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="GPT small on 2 × 2 devices")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--batch", type=int, default=1024, help="global batch (sequences)")
    parser.add_argument("--max-stages", type=int, default=8)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    gpt = load_example("gpt")
    size, scales, per_node = ("small", [4], 2) if args.smoke else ("7b", [8, 64, 512], 8)
    batch = 8 if args.smoke else args.batch
    sizes = [1, 2] if args.smoke else [1, 2, 4]
    spec = get_spec("h100-80gb")
    model = build_on_meta(lambda: gpt.build_model(size))
    prof = analytic_profile(model, gpt.example_inputs(batch, size), spec,
                            microbatch_sizes=sizes, dtype=torch.bfloat16)
    profile_seconds = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    result: dict[str, Any] = {
        "machine": machine(), "model": f"GPT {size} ({params / 1e9:.2f}·10⁹ parameters, "
        f"{len(prof.blocks)} blocks)", "blocks": len(prof.blocks),
        "spec": f"{spec.label()}, NVLink {LINKS['nvlink4'] / 1e9:g} GB/s, InfiniBand "
        f"{inter_node_link(spec)[1] / 1e9:g} GB/s per GPU", "per_node": per_node,
        "max_stages": args.max_stages, "microbatch_sizes": sizes,
        "profile_seconds": profile_seconds,
        "scales": [plan_for(prof, n, per_node, batch, args.max_stages, spec) for n in scales],
    }
    result["seconds"] = time.perf_counter() - start
    text = markdown(result, argv)
    write_results(args.out, "scale_smoke" if args.smoke else "scale", result, text)
    print(text)


if __name__ == "__main__":
    main()
