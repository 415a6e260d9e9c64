"""The analytic model against blocks measured on a real GPU, without one.

``benchmarks/gpu_check.py`` keeps the profiles it measured on a GPU
(``benchmarks/results/gpu_profile_{resnet,gpt}.json``). Here the same models are counted on the
meta device at the same shapes, and the GPU's named spec turns the counts into block times:
before calibration, calibrated without a floor per operator (efficiencies only) and with one
(:attr:`autosplit.specs.DeviceSpec.op_overhead_s`), each fitted on every size (in sample) and
on the largest size alone (the others held out). Per size: Σ analytic / Σ measured − 1, and a
block's median |analytic / measured − 1|. No timing is taken: the figures depend only on the
kept profiles.

    python benchmarks/gpu_analytic.py          # writes benchmarks/results/gpu_analytic.{json,md}
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import torchvision
from common import EXAMPLES, RESULTS, block_errors, write_results

import autosplit
from autosplit.estimate.analytic import count_costs, profile_from_costs
from autosplit.estimate.options import EstimateOptions
from autosplit.specs import calibrate, get_spec

SPEC = "h200"
"""The named spec of the GPU the kept profiles were measured on (gpu.json says which)."""


def model_for(profile: autosplit.Profile) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The profiled model, seeded as gpu_check builds it, and meta inputs of its shapes."""
    torch.manual_seed(0)
    if profile.model.startswith("ResNet"):
        model = torchvision.models.resnet50()
    else:
        spec = importlib.util.spec_from_file_location("gpu_analytic_gpt", EXAMPLES / "gpt.py")
        assert spec and spec.loader
        gpt = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gpt)
        model = gpt.build_model("small")
    inputs = tuple(torch.zeros(shape, dtype=getattr(torch, dt.replace("torch.", "")),
                               device="meta")
                   for shape, dt in zip(profile.input_shapes, profile.input_dtypes))
    return model, inputs


def evaluate(path: Path) -> dict[str, Any]:
    """Every spec variant's errors on one kept profile."""
    measured = autosplit.Profile.load(path)
    model, inputs = model_for(measured)
    costs = count_costs(model, inputs,
                        options=EstimateOptions(microbatch_sizes=list(measured.microbatch_sizes)))
    nominal = get_spec(SPEC)
    largest = [max(measured.microbatch_sizes)]
    specs = {
        "before": nominal,
        "efficiencies, every size": calibrate(nominal, measured, costs, fit_overhead=False),
        "with floor, every size": calibrate(nominal, measured, costs),
        f"efficiencies, b={largest[0]} only": calibrate(nominal, measured, costs, sizes=largest,
                                                        fit_overhead=False),
        f"with floor, b={largest[0]} only": calibrate(nominal, measured, costs, sizes=largest),
    }
    rows = {}
    for label, spec in specs.items():
        rows[label] = {"efficiency": spec.efficiency,
                       "bandwidth_efficiency": spec.bandwidth_efficiency,
                       "op_overhead_s": spec.op_overhead_s,
                       "errors": block_errors(measured, profile_from_costs(costs, spec))}
    return {"profile": str(path.relative_to(RESULTS.parent.parent)), "model": measured.model,
            "device": measured.device.name, "sizes": list(measured.microbatch_sizes),
            "block_sums_ms": {str(b): math.fsum(x.fwd_ms[measured.size_index(b)]
                                                + x.bwd_ms[measured.size_index(b)]
                                                for x in measured.blocks)
                              for b in measured.microbatch_sizes},
            "specs": rows}


def markdown(data: dict[str, Any]) -> str:
    lines = ["# The analytic model against blocks measured on a GPU", "",
             f"Spec `{SPEC}` against the profiles `gpu_check.py` kept; no timing taken here. "
             "Per size b: Σ analytic / Σ measured − 1, then a block's median |error|. "
             "`python benchmarks/gpu_analytic.py`."]
    for run in data["runs"]:
        sums = ", ".join(f"b={b}: {ms:.1f}" for b, ms in run["block_sums_ms"].items())
        lines += ["", f"## {run['model']} on {run['device']}", "",
                  f"Measured block sums (ms): {sums}.", "",
                  "| spec | efficiency | bandwidth efficiency | floor per operator (µs) | "
                  + " | ".join(f"b={b}" for b in run["sizes"]) + " |",
                  "|---|---|---|---|" + "---|" * len(run["sizes"])]
        for label, row in run["specs"].items():
            cells = [f"{v['total_error']:+.0%}, {v['median_abs_block_error']:.0%}"
                     for v in row["errors"].values()]
            lines.append(f"| {label} | {row['efficiency']:.3f} | "
                         f"{row['bandwidth_efficiency']:.3f} | {row['op_overhead_s'] * 1e6:.1f} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    paths = [RESULTS / f"gpu_profile_{name}.json" for name in ("resnet", "gpt")]
    data = {"spec": SPEC, "runs": [evaluate(p) for p in paths if p.exists()]}
    if not data["runs"]:
        print("gpu_analytic: no kept GPU profile in benchmarks/results (run gpu_check.py on a GPU)")
        return 0
    write_results(args.out, "gpu_analytic", data, markdown(data))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
