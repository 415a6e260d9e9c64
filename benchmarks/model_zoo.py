"""Models nobody here wrote, beyond the test zoo: do they enter, and does a split equal them?

For every model of :data:`model_zoo_models.MODELS` (Hugging Face transformers, timm and
torchvision at tiny configurations, random weights, dropout off), each in a process of its
own with a time limit: capture it from one call (torch.fx or torch.export, as autosplit
chooses), count its blocks, then split it evenly on 2 and on 4 stages with
``autosplit.partition`` and check, as the test zoo does (tests/zoo_checks.py), that the output
(its type, structure and values) and every parameter gradient equal the unsplit model's on the
same micro-batches. Nothing is timed but the whole check.

    python benchmarks/model_zoo.py                 # every model (~11 min on 2 CPU cores)
    python benchmarks/model_zoo.py --models Qwen2ForCausalLM vgg11
    python benchmarks/model_zoo.py --smoke --out /tmp/zoo   # two models (tests)
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import RESULTS, command_line, describe, machine, write_results

ROWS, SPLIT = 4, 2
SMOKE = ("torchvision/squeezenet1_0", "DebertaV2ForSequenceClassification")
"""One model that enters (torch.fx) and one that torch.export cannot capture (a branch on data in
its loss): both paths of the table, in seconds."""


def check_one(name: str) -> dict[str, Any]:
    """Capture model ``name``, split it on 2 and 4 stages, and compare (in this process)."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    import torch
    from model_zoo_models import MODELS, without_dropout
    from synthetic import even_balance, plan_of
    from zoo_checks import assert_trains_like

    import autosplit
    from autosplit.capture.trace import trace

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model, call = MODELS[name][1]()
    model = without_dropout(model).train()
    args, kwargs = call(ROWS)
    row: dict[str, Any] = {"model": name, "family": MODELS[name][0]}
    try:
        graph = trace(model, example_inputs=args, example_kwargs=kwargs)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return {**row, "capture": "fails", "error": _line(exc)}
    row.update(capture=graph.capture.front if graph.capture else "fallback",
               blocks=len(graph.blocks), first=graph.block_names[:3],
               last=graph.block_names[-2:])
    for stages in (2, 4):
        if len(graph.blocks) < stages:
            row[f"stages_{stages}"] = "fewer blocks"
            continue
        split_model, reference = copy.deepcopy(model), copy.deepcopy(model)
        plan = plan_of(graph, even_balance(len(graph.blocks), stages), SPLIT, ROWS // SPLIT)
        try:
            pm = autosplit.partition(split_model, args, kwargs, plan=plan,
                                     devices=["cpu"] * stages)
            assert_trains_like(pm, split_model, reference, args, kwargs, SPLIT)
        except Exception as exc:  # noqa: BLE001 - the error is the result
            row[f"stages_{stages}"] = "differs"
            row["error"] = _line(exc)
        else:
            row[f"stages_{stages}"] = "equal"
    return row


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:500] if text else ''}"


def run(names: list[str], limit_s: float) -> list[dict[str, Any]]:
    """Each model checked in a process of its own (a hang or crash costs that model only)."""
    rows = []
    for name in names:
        start = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, __file__, "--one", name], check=False,
                                  capture_output=True,
                                  text=True, timeout=limit_s)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(lines[-1]) if lines else {
                "model": name, "capture": "crashed",
                "error": (done.stderr.strip().splitlines() or [""])[-1][:240]}
        except subprocess.TimeoutExpired:
            row = {"model": name, "capture": "timed out", "error": f"over {limit_s:.0f} s"}
        row["seconds"] = round(time.perf_counter() - start, 1)
        print(f"{name}: {row.get('capture')}, {row.get('blocks', '–')} blocks, "
              f"{row.get('stages_2', '–')} / {row.get('stages_4', '–')} "
              f"({row['seconds']} s){'; ' + row['error'] if 'error' in row else ''}", flush=True)
        rows.append(row)
    return rows


def markdown(data: dict[str, Any]) -> str:
    rows = data["rows"]
    entered = sum(r.get("stages_2") == "equal" for r in rows)
    lines = [
        "# Models nobody here wrote: captured, split, compared",
        "",
        f"Machine: {describe(data['machine'])}.  ",
        f"Command: `{data['command']}`; transformers {data['versions']['transformers']}, timm "
        f"{data['versions']['timm']}, torchvision {data['versions']['torchvision']}.  ",
        "Each model at a tiny configuration with random weights and dropout off, in its own "
        f"process: captured from one call of {ROWS} rows, split evenly on 2 and 4 stages with "
        f"`autosplit.partition` (micro-batches of {SPLIT}), its output and every parameter "
        "gradient compared with the unsplit model's (tests/zoo_checks.py).",
        "",
        f"**{entered} of {len(rows)} entries enter and split exactly on 2 stages** (an entry is a "
        "model and its call: DeBERTa-v2 and CLIP are called with their loss and without).",
        "",
        "| family | model | capture | blocks | first blocks … last | 2 stages | 4 stages | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        span = (", ".join(f"`{b}`" for b in r["first"]) + " … "
                + ", ".join(f"`{b}`" for b in r["last"])) if "first" in r else "–"
        lines.append(f"| {r.get('family', '–')} | {r['model'].strip()} | {r['capture']} | "
                     f"{r.get('blocks', '–')} | {span} | {r.get('stages_2', '–')} | "
                     f"{r.get('stages_4', '–')} | {r['seconds']} |")
    failed = [r for r in rows if "error" in r]
    if failed:
        lines += ["", "What stopped the others:", ""]
        lines += [f"- {r['model'].strip()}: {r['error']}" for r in failed]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=None, metavar="NAME")
    parser.add_argument("--smoke", action="store_true", help=f"only {', '.join(SMOKE)}")
    parser.add_argument("--limit", type=float, default=300.0, help="seconds per model")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(check_one(args.one)))
        return
    from model_zoo_models import MODELS

    names = list(SMOKE) if args.smoke else args.models or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; the models are: {', '.join(MODELS)}")
    import timm
    import torchvision
    import transformers

    data = {"machine": machine(), "command": command_line("model_zoo.py", argv),
            "versions": {"transformers": transformers.__version__, "timm": timm.__version__,
                         "torchvision": torchvision.__version__},
            "rows": run(names, args.limit)}
    write_results(args.out, "model_zoo_smoke" if args.smoke else "model_zoo", data,
                  markdown(data))


if __name__ == "__main__":
    main(sys.argv[1:])
