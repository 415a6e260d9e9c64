"""One prepared check of every CUDA path of autosplit, in under 6 minutes on one H200.

    python benchmarks/gpu_check.py             # on a GPU machine: benchmarks/results/gpu.{json,md}
                                               # and gpu_profile_{resnet,gpt}.json
    python benchmarks/gpu_check.py --dry-run   # the same steps on the CPU, tiny, to a temp dir

Steps, most valuable first, each with a time limit inside a global budget (a step that fails
or runs out of time is recorded with its error, and the next one runs; the results are
rewritten after every step): ``tests`` (``pytest -n 0 -m cuda``); ``resnet50`` (the tutorial's
B=120, 3×128×128: profile with CUDA events, plan 2 stages, the predicted step against the
measured step of ``partition()`` and of the emitted module); ``memory`` (predicted peak against
``torch.cuda.max_memory_allocated``); ``analytic`` (the GPU's named spec against the measured
blocks, before and after ``calibrate``); ``gpt`` (GPT small, B=64 × 64 tokens, as resnet50 and
memory); ``bf16`` (both models in bfloat16, the GPT only in a dry run: profile, plan, measured
step). With one GPU both stages run on cuda:0, one after the other, so the step to expect is
m · Σ stage compute.
"""

from __future__ import annotations

if __name__ == "__main__":  # started again first, before the imports below pay twice: the C
    # allocator keeping freed memory, as the ranks run (see autosplit/measure/allocator.py)
    from autosplit.measure.allocator import restart_keeping_freed_memory

    restart_keeping_freed_memory()

import argparse
import contextlib
import gc
import importlib.util
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # this checkout's autosplit, even uninstalled
import torch
import torchvision
from common import RESULTS, block_errors, describe, machine, write_results
from torch.utils import _pytree as pytree

import autosplit
from autosplit import PlanOptions, ProfileOptions
from autosplit.capture.trace import trace
from autosplit.estimate.analytic import count_costs, profile_from_costs
from autosplit.estimate.options import EstimateOptions
from autosplit.specs import KNOWN_DEVICES, calibrate, get_spec
from autosplit.verify.options import TimingOptions
from autosplit.verify.plans import verify_plans

STEPS = [("tests", 150), ("resnet50", 75), ("memory", 20), ("analytic", 40), ("gpt", 50),
         ("bf16", 45)]
"""(step, time limit in seconds), in the order they run."""

FULL = {"resnet": ("ResNet50", 120, 128, [20, 24, 30, 40, 60]), "gpt": ("small", 64, [8, 16, 32]),
        "warmup": 2, "repeats": 5, "step_warmup": 2, "step_repeats": 10, "pytest": [],
        "bf16": ("gpt", "resnet"), "verify": {}}
DRY = {"resnet": ("ResNet18", 4, 32, [2, 4]), "gpt": ("tiny", 4, [2, 4]), "warmup": 0,
       "repeats": 1, "step_warmup": 0, "step_repeats": 2, "pytest": ["tests/test_pipeline.py"],
       "bf16": ("gpt",), "verify": {"warmup": 1, "rounds": 2, "max_rounds": 2}}
"""Sizes: ResNet (name, B, image side, micro-batch sizes), GPT (size, B, sizes), repeats, the
models run in bfloat16 (the dry run's CPU: the GPT only, since a CPU without bfloat16
convolution kernels takes seconds per ResNet18 step: 2.1 s predicted at B = 4 on one 2-core
machine, past the step's limit), and the verification's timing options (the dry run: two
rounds)."""

_START = time.perf_counter()


def log(text: str) -> None:
    """A progress line with the wall clock and the seconds since the start."""
    stamp = time.strftime("%H:%M:%S")
    print(f"[{stamp} +{time.perf_counter() - _START:6.1f} s] {text}", flush=True)


class StepFailed(RuntimeError):
    """A step failed with results worth keeping (:attr:`result`)."""

    def __init__(self, message: str, result: dict[str, Any]) -> None:
        super().__init__(message)
        self.result = result


class StepTimeout(BaseException):
    """A step ran past its time limit (not an Exception, so no ``except Exception`` in the
    library or the model swallows it)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`StepTimeout` in the main thread after ``seconds`` (SIGALRM)."""
    def expire(signum: int, frame: Any) -> None:
        raise StepTimeout(f"over its time limit of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def spread(samples: list[float]) -> dict[str, Any]:
    """Median, min, max and (max − min) / median of timings (ms)."""
    med = statistics.median(samples)
    return {"median": med, "min": min(samples), "max": max(samples),
            "spread": (max(samples) - min(samples)) / med if med else 0.0, "samples": samples}


def sync(devices: list[torch.device]) -> None:
    for d in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(d)


def time_ms(run: Callable[[], Any], devices: list[torch.device], warmup: int, repeats: int
            ) -> dict[str, Any]:
    """Timings of ``run()`` in ms: CUDA events on the first device's stream after every other
    device has finished (with one GPU: pure event timing), else ``perf_counter``."""
    for _ in range(warmup):
        run()
    sync(devices)
    cuda = devices[0].type == "cuda"
    samples = []
    for _ in range(repeats):
        if cuda:
            with torch.cuda.device(devices[0]):
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                run()
                sync(devices[1:])
                end.record()
                end.synchronize()
                samples.append(float(start.elapsed_time(end)))
        else:
            t0 = time.perf_counter()
            run()
            samples.append((time.perf_counter() - t0) * 1000.0)
    return spread(samples)


def train_step(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    """Forward and backward of one batch (what a plan's step time covers; no optimizer)."""
    for p in module.parameters():
        p.grad = None
    out = module(*inputs)
    leaves = [t for t in pytree.tree_leaves(out) if torch.is_tensor(t) and t.is_floating_point()]
    sum(t.float().square().mean() for t in leaves).backward()


def spec_for(device_name: str) -> str:
    """The known spec whose name's parts all appear in the CUDA device's name (the memory part,
    e.g. ``80gb``, may be missing); the most parts matched wins."""
    text = re.sub(r"[^a-z0-9]", "", device_name.lower())
    best, score = None, 0
    for name, spec in KNOWN_DEVICES.items():
        parts = name.split("-")
        chip = [p for p in parts if not p.endswith("gb")]
        if spec.kind == "cuda" and all(p in text for p in chip):
            hits = sum(p in text for p in parts)
            if hits > score:
                best, score = name, hits
    if best is None:
        raise LookupError(f"no known spec matches {device_name!r}: {', '.join(KNOWN_DEVICES)}")
    return best


def build(ctx: dict[str, Any], which: str) -> tuple[torch.nn.Module, tuple[Any, ...], str]:
    """A fresh model (seeded), its example batch, and the model file the emitted code imports."""
    torch.manual_seed(0)
    if which == "resnet":
        name, batch, side, _ = ctx["sizes"]["resnet"]
        model = getattr(torchvision.models, name.lower())()
        return model, (torch.randn(batch, 3, side, side),), str(ROOT / "examples" / "resnet50.py")
    size, batch, _ = ctx["sizes"]["gpt"]
    gpt = load(ROOT / "examples" / "gpt.py")
    return gpt.build_model(size), gpt.example_inputs(batch, size), str(ROOT / "examples" / "gpt.py")


def load(path: Path) -> Any:
    """Import a Python file as a module."""
    spec = importlib.util.spec_from_file_location(f"gpu_check_{path.stem}", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plan_and_measure(ctx: dict[str, Any], which: str, dtype: torch.dtype | None = None,
                     sizes: list[int] | None = None) -> dict[str, Any]:
    """Profile on devices[0], plan 2 stages, time ``partition()`` and the emitted module."""
    s, devs = ctx["sizes"], ctx["devices"]
    foreign = allocated(devs)  # bytes on the GPUs that this model's objects do not hold
    model, inputs, model_ref = build(ctx, which)
    if dtype is not None:
        model = model.to(dtype)
        inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    sizes = sizes or s[which][-1]
    log(f"{which}: profiling {type(model).__name__} at micro-batch sizes {sizes} on {devs[0]}")
    prof = autosplit.profile(model, inputs, device=devs[0],
                             options=ProfileOptions(microbatch_sizes=sizes, warmup=s["warmup"],
                                                    repeats=s["repeats"], budget_s=None))
    plan = autosplit.plan(prof, 2, options=PlanOptions(devices=[str(d) for d in devs]))
    serial = plan.microbatches * math.fsum(st.compute_ms for st in plan.stages)
    shared = len(set(devs)) < len(devs)
    log(f"{which}: plan {plan.balance} blocks, {plan.microbatches} × {plan.split_size}; "
        f"predicted {plan.predicted_step_ms:.1f} ms on 2 devices, {serial:.1f} ms serially")
    verified = verify(model, inputs, prof, plan, TimingOptions(device=devs[0], **s["verify"]))
    if dtype is None:  # the measured blocks, for fitting the analytic model without a GPU
        prof.save(ctx["out"] / f"gpu_profile_{which}.json")
    pm = autosplit.partition(model, plan=plan, devices=devs)
    on_dev = tuple(x.to(devs[0]) for x in inputs)
    label = s["resnet"][0] if which == "resnet" else f"GPT {s['gpt'][0]}"
    result: dict[str, Any] = {
        "model": label, "dtype": str(dtype or torch.float32), "batch": plan.batch_size,
        "input_shapes": [list(x.shape) for x in inputs], "profile_seconds": prof.seconds,
        "devices": [str(d) for d in devs], "balance": list(plan.balance),
        "cut_before": list(plan.split_points), "split_size": plan.split_size,
        "microbatches": plan.microbatches, "predicted_step_ms": plan.predicted_step_ms,
        "serial_ms": serial, "single_device_ms": plan.single_device_ms,
        "expected_ms": serial if shared else plan.predicted_step_ms,
        "expected_is": "serial (stages share a device)" if shared else "predicted_step_ms",
        "stage_compute_ms": [st.compute_ms for st in plan.stages],
        "foreign_bytes": foreign, **verified,
    }
    log(f"{which}: timing partition() ({s['step_repeats']} steps)")
    result["partition"] = time_ms(lambda: train_step(pm, on_dev), devs, s["step_warmup"],
                                  s["step_repeats"])
    with torch.no_grad():
        reference = pm(*on_dev)
    emitted = ctx["out"] / "code" / f"pipelined_{which}_{str(dtype or 'fp32')[-8:]}.py"
    emitted.parent.mkdir(parents=True, exist_ok=True)
    emitted.write_text(autosplit.emit(plan, model_ref, model=model, devices=result["devices"]))
    (cls,) = [v for k, v in vars(load(emitted)).items()
              if k.startswith("Pipelined") and isinstance(v, type)]
    em = cls(model=model, devices=result["devices"])
    with torch.no_grad():
        diff = (em(*on_dev).float() - reference.float()).abs().max().item()
    result["emitted_vs_partition_max_abs_diff"] = diff
    log(f"{which}: timing the emitted module {emitted.name}")
    result["emitted"] = time_ms(lambda: train_step(em, on_dev), devs, s["step_warmup"],
                                s["step_repeats"])
    for key in ("partition", "emitted"):
        result[f"{key}_error"] = result[key]["median"] / result["expected_ms"] - 1
        if result.get("verified_expected_ms"):
            result[f"{key}_verified_error"] = (result[key]["median"]
                                               / result["verified_expected_ms"] - 1)
    log(f"{which}: measured {result['partition']['median']:.1f} ms (partition), "
        f"{result['emitted']['median']:.1f} ms (emitted), expected {result['expected_ms']:.1f} ms")
    ctx[which] = {"model": model, "inputs": on_dev, "plan": plan, "profile": prof, "pm": pm,
                  "em": em, "foreign": foreign}
    return result


def allocated(devs: list[torch.device]) -> dict[str, int]:
    """Bytes the caching allocator has handed out on each GPU now (none on a CPU)."""
    sync(devs)
    return {str(d): torch.cuda.memory_allocated(d) for d in dict.fromkeys(devs)
            if d.type == "cuda"}


def release(ctx: dict[str, Any], which: str) -> None:
    """Drop a finished model's tensors (its plan and profile stay), so that the next model's
    peak memory is its own."""
    if which in ctx:
        for key in ("model", "inputs", "pm", "em"):
            ctx[which].pop(key, None)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def verify(model: torch.nn.Module, inputs: tuple[Any, ...], prof: autosplit.Profile,
           plan: autosplit.Plan, timing: TimingOptions) -> dict[str, Any]:
    """The plan's stages timed as they run (autosplit's verification, :mod:`autosplit.verify.plans`):
    the step to expect with both stages on one device, m · Σ verified stage compute, and the
    verified prediction on 2 devices; a failure is recorded, not raised."""
    try:
        graph = trace(model, example_inputs=inputs)
        checked = verify_plans(graph, inputs, prof, {"plan": plan},
                               options=timing)["plan"]
    except Exception as exc:  # noqa: BLE001 - the block-sum figures still stand
        return {"verified_error_text": f"{type(exc).__name__}: {exc}"[:500]}
    return {"verified_expected_ms": checked.microbatches
            * math.fsum(st.compute_ms for st in checked.stages),
            "verified_predicted_step_ms": checked.predicted_step_ms,
            "verified_stage_compute_ms": [st.compute_ms for st in checked.stages],
            "verified_single_device_ms": checked.single_device_ms,
            "verification": checked.verification}


def memory(ctx: dict[str, Any], which: str) -> dict[str, Any]:
    """Each device's predicted peak (the sum over its stages) against the allocator's peak
    during one training step of partition() and of the emitted module."""
    if which not in ctx:
        raise RuntimeError(f"no {which} plan to check (its step did not finish)")
    run, devs = ctx[which], ctx["devices"]
    plan = run["plan"]
    rows = []
    for dev in dict.fromkeys(devs):
        predicted = sum(st.memory_bytes for st, d in zip(plan.stages, devs) if d == dev)
        rows.append({"device": str(dev), "stages": [i for i, d in enumerate(devs) if d == dev],
                     "predicted_bytes": predicted})
    for key in ("pm", "em"):
        module = run[key]
        for p in module.parameters():
            p.grad = None
        gc.collect()
        if devs[0].type == "cuda":
            torch.cuda.empty_cache()
            sync(devs)
            base = {d: torch.cuda.memory_allocated(d) for d in devs}
            for d in set(devs):
                torch.cuda.reset_peak_memory_stats(d)
        train_step(module, run["inputs"])
        sync(devs)
        for row, dev in zip(rows, dict.fromkeys(devs)):
            name = "partition" if key == "pm" else "emitted"
            if dev.type == "cuda":  # the peak less what other models' objects held
                peak = torch.cuda.max_memory_allocated(dev) - run["foreign"].get(str(dev), 0)
                row[f"{name}_peak_bytes"] = peak
                row[f"{name}_before_step_bytes"] = base[dev] - run["foreign"].get(str(dev), 0)
                row[f"{name}_error"] = row["predicted_bytes"] / peak - 1
            else:
                row[f"{name}_peak_bytes"] = None  # the CPU allocator keeps no peak
    return {"stage_predicted_bytes": [st.memory_bytes for st in plan.stages], "devices": rows}


def analytic(ctx: dict[str, Any]) -> dict[str, Any]:
    """The named spec's roofline times against ResNet's measured profile, before and after
    calibration: on every size (in sample), and on the plan's size only (others held out)."""
    if "resnet" not in ctx:
        raise RuntimeError("no measured ResNet profile (the resnet50 step did not finish)")
    run = ctx["resnet"]
    dev = ctx["devices"][0]
    name = spec_for(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else "cpu-core"
    spec, measured = get_spec(name), run["profile"]
    log(f"analytic: counting FLOPs and bytes on meta; spec {name}")
    costs = count_costs(run["model"], run["inputs"],
                        options=EstimateOptions(microbatch_sizes=measured.microbatch_sizes))
    floorless = calibrate(spec, measured, costs, fit_overhead=False)
    fitted = calibrate(spec, measured, costs)
    held = calibrate(spec, measured, costs, sizes=[run["plan"].split_size])
    result = {"spec": name, "device_name": device_name(dev)}
    for label, s in (("before", spec), ("calibrated_without_floor", floorless),
                     ("calibrated", fitted), ("calibrated_on_plan_size", held)):
        result[label] = {"efficiency": s.efficiency, "bandwidth_efficiency": s.bandwidth_efficiency,
                         "op_overhead_s": s.op_overhead_s,
                         "errors": block_errors(measured, profile_from_costs(costs, s))}
    result["calibrated_on"] = run["plan"].split_size
    return result


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def tests(ctx: dict[str, Any], limit_s: float) -> dict[str, Any]:
    """``pytest -n 0 -m cuda`` in a child process (its own session, killed whole on timeout)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "cuda", "-rfEs",  # one process: one GPU
           *ctx["sizes"]["pytest"]]
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    log(f"tests: {' '.join(cmd[1:])}")
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": path}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=max(limit_s - 5, 1))
    except (subprocess.TimeoutExpired, StepTimeout):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise StepTimeout(f"pytest ran past {limit_s:.0f} s") from None
    last = output.splitlines()[-1] if output else ""
    words = r"(\d+) (passed|failed|skipped|errors?|deselected)"
    counts = {k: int(n) for n, k in re.findall(words, last)}
    lines = [ln for ln in output.splitlines() if ln.startswith(("FAILED", "ERROR", "SKIPPED"))]
    result = {"command": " ".join(cmd[1:]), "counts": counts, "lines": lines,
              "output_tail": output[-TESTS_TAIL:]}
    if proc.returncode != 0:
        raise StepFailed(f"pytest exit code {proc.returncode}, {counts}: "
                         f"{'; '.join(lines)[:2000]}", result)
    return result


TESTS_TAIL = 30000
"""The characters of pytest's output kept in the results (its failures' tracebacks)."""


def bf16(ctx: dict[str, Any]) -> dict[str, Any]:
    """The models of ``sizes["bf16"]`` in bfloat16 (``.to(torch.bfloat16)``), one profiled size
    (the fp32 plan's)."""
    out = {}
    for which in ctx["sizes"]["bf16"]:
        b = ctx[which]["plan"].split_size if which in ctx else ctx["sizes"][which][-1][0]
        out[which] = plan_and_measure(ctx, which, torch.bfloat16, [b])
    return out


def versions() -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "torchvision": torchvision.__version__,
                            "cuda": torch.version.cuda, "autosplit": autosplit.__version__,
                            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
                            "tf32_cudnn": torch.backends.cudnn.allow_tf32}
    if torch.cuda.is_available():
        try:  # a version that cannot be read is recorded as such; the checks still run
            info["cudnn"] = torch.backends.cudnn.version()
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            info["gpus"] = [f"{p.name} ({p.total_memory / 2**30:.0f} GiB, sm {p.major}.{p.minor}"
                            f", {p.multi_processor_count} SMs)"
                            for p in map(torch.cuda.get_device_properties,
                                         range(torch.cuda.device_count()))]
        except Exception as exc:  # noqa: BLE001
            info["unreadable"] = f"{type(exc).__name__}: {exc}"
    return info


def _ms(t: dict[str, Any]) -> str:
    return f"{t['median']:.1f} [{t['min']:.1f}–{t['max']:.1f}]"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:+.0%}"


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    return ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(map(str, r)) + " |" for r in rows)]


def markdown(data: dict[str, Any]) -> str:
    st = data["settings"]
    lines = ["# autosplit on a GPU: every CUDA path, measured", "",
             f"Machine: {describe(st['machine'])}. Versions: "
             + ", ".join(f"{k} {v}" for k, v in st["versions"].items())
             + f". Command: `{st['command']}`. Total {data['total_s']:.0f} s of a "
             f"{st['budget_s']:.0f} s budget. Times in ms, median [min–max]."]
    lines += _table(["step", "status", "seconds", "note"],
                    [[r["name"], r["status"], f"{r['seconds']:.1f}",
                      (r.get("error") or "").replace("|", "/")[:200]] for r in data["steps"]])
    res = {r["name"]: r["result"] for r in data["steps"] if r.get("result")}
    if "tests" in res:
        lines += ["", f"## CUDA tests\n\n`{res['tests']['command']}`: {res['tests']['counts']}"]
        lines += [f"- {line}" for line in res["tests"]["lines"]]
    runs = [res[k] for k in ("resnet50", "gpt") if k in res] + list(res.get("bf16", {}).values())
    if runs:
        lines += ["", "## Plan against measured step (forward + backward of the batch)", "",
                  "Expected here: the plan's prediction on 2 devices, or m · Σ stage compute "
                  "when the stages share one device (they then run one after the other): from "
                  "the blocks timed one by one (the search's figures), and from the stages "
                  "timed as they run (autosplit's verification). Error: measured / expected "
                  "− 1."]
        lines += _table(
            ["model", "dtype", "devices", "cut before", "m × b", "predicted (2 devices)",
             "expected: block sums", "expected: verified stages", "partition()",
             "error (sums, verified)", "emitted", "error (sums, verified)", "max |Δ| outputs"],
            [[r["model"], r["dtype"].replace("torch.", ""), ", ".join(r["devices"]),
              ", ".join(r["cut_before"]), f"{r['microbatches']} × {r['split_size']}",
              f"{r['predicted_step_ms']:.1f}", f"{r['expected_ms']:.1f}",
              "–" if r.get("verified_expected_ms") is None
              else f"{r['verified_expected_ms']:.1f}",
              _ms(r["partition"]),
              f"{_pct(r['partition_error'])}, {_pct(r.get('partition_verified_error'))}",
              _ms(r["emitted"]),
              f"{_pct(r['emitted_error'])}, {_pct(r.get('emitted_verified_error'))}",
              f"{r['emitted_vs_partition_max_abs_diff']:.2g}"] for r in runs])
    mem = [(st["sizes"]["resnet"][0], res.get("memory")),
           (f"GPT {st['sizes']['gpt'][0]}", res.get("gpt", {}).get("memory"))]
    rows = [[name, d["device"], d["stages"], f"{d['predicted_bytes'] / 2**20:.0f}",
             *(x for k in ("partition", "emitted") for x in (
                 "–" if d.get(f"{k}_peak_bytes") is None
                 else f"{d[f'{k}_peak_bytes'] / 2**20:.0f}",
                 _pct(d.get(f"{k}_error"))))]
            for name, m in mem if m for d in m["devices"]]
    if rows:
        lines += ["", "## Peak memory (MiB): predicted against torch.cuda.max_memory_allocated",
                  "", "Error: predicted / measured − 1; a device's prediction sums its stages."]
        lines += _table(["model", "device", "stages", "predicted", "partition()", "error",
                         "emitted", "error"], rows)
    if "analytic" in res:
        a = res["analytic"]
        sizes = list(a["before"]["errors"])
        lines += ["", f"## Analytic {a['spec']} ({a['device_name']}) against measured blocks", "",
                  f"Per size b: Σ analytic / Σ measured − 1, and a block's median |error|; "
                  f"`calibrated_on_plan_size` is fitted on b={a['calibrated_on']} only."]
        lines += _table(
            ["spec", "efficiency", "bandwidth efficiency", "floor per operator (µs)",
             *(f"b={b}" for b in sizes)],
            [[label, f"{e['efficiency']:.3f}", f"{e['bandwidth_efficiency']:.3f}",
              f"{e.get('op_overhead_s', 0.0) * 1e6:.1f}",
              *(f"{_pct(v['total_error'])}, {v['median_abs_block_error']:.0%}"
                for v in e["errors"].values())]
             for label, e in ((k, a[k]) for k in ("before", "calibrated_without_floor",
                                                  "calibrated", "calibrated_on_plan_size")
                              if k in a)])
    return "\n".join(lines) + "\n"


NO_GPU = ("gpu_check: no CUDA device on this machine, nothing to check "
          "(--dry-run runs the same steps on the CPU)")
"""The one line printed, with exit code 0, on a machine without a GPU."""


def parse(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The command line's parser and arguments."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU, tiny")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write gpu.{json,md} and the profiles (default: benchmarks/results, or a "
                             "new temp dir with --dry-run)")
    parser.add_argument("--budget-s", type=float, default=330.0, help="global time budget (s)")
    parser.add_argument("--steps", nargs="+", choices=[n for n, _ in STEPS], default=None,
                        help="run only these steps")
    return parser, parser.parse_args(argv)


def nothing_to_check(args: argparse.Namespace) -> bool:
    """No GPU and no ``--dry-run``: :data:`NO_GPU` is all there is to say."""
    return not args.dry_run and not torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser, args = parse(argv)
    if nothing_to_check(args):
        print(NO_GPU)
        return 0
    out = args.out or (Path(tempfile.mkdtemp(prefix="gpu-check-")) if args.dry_run else RESULTS)
    if args.dry_run and out.resolve() == RESULTS.resolve():
        parser.error("--dry-run never writes to benchmarks/results (the committed GPU results)")
    n = torch.cuda.device_count() if not args.dry_run else 0
    devices = [torch.device("cuda", i % n) if n else torch.device("cpu") for i in range(2)]
    ctx: dict[str, Any] = {"sizes": DRY if args.dry_run else FULL, "devices": devices, "out": out}
    actions: dict[str, Callable[[float], Any]] = {
        "tests": lambda limit: tests(ctx, limit),
        "resnet50": lambda limit: plan_and_measure(ctx, "resnet"),
        "memory": lambda limit: memory(ctx, "resnet"),
        "analytic": lambda limit: analytic(ctx),
        "gpt": lambda limit: (release(ctx, "resnet"),
                              {**plan_and_measure(ctx, "gpt"), "memory": memory(ctx, "gpt")})[1],
        "bf16": lambda limit: bf16(ctx),
    }
    command = "python benchmarks/gpu_check.py" + (" --dry-run" if args.dry_run else "")
    data: dict[str, Any] = {"settings": {"machine": machine(), "versions": versions(),
                                         "dry_run": args.dry_run, "budget_s": args.budget_s,
                                         "devices": [str(d) for d in devices], "command": command,
                                         "sizes": ctx["sizes"], "step_limits_s": dict(STEPS)},
                            "steps": [], "total_s": 0.0}
    log(f"gpu_check on {', '.join(map(device_name, devices))}; writing to {out}")
    for name, limit in STEPS:
        if args.steps and name not in args.steps:
            continue
        left = args.budget_s - (time.perf_counter() - _START)
        record: dict[str, Any] = {"name": name, "status": "skipped", "seconds": 0.0}
        if left < min(limit, 15):
            record["error"] = f"skipped: {left:.0f} s left of the {args.budget_s:.0f} s budget"
            log(f"{name}: {record['error']}")
        else:
            t0 = time.perf_counter()
            log(f"{name}: start (limit {min(limit, left):.0f} s)")
            try:
                with time_limit(min(limit, left)):
                    record["result"] = actions[name](min(limit, left))
                record["status"] = "ok"
            except (Exception, StepTimeout) as exc:  # noqa: BLE001 - recorded; the other steps run
                record["status"] = "timeout" if isinstance(exc, StepTimeout) else "failed"
                record["error"] = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, StepFailed):
                    record["result"] = exc.result
                record["traceback"] = traceback.format_exc()[-4000:]
            record["seconds"] = time.perf_counter() - t0
            log(f"{name}: {record['status']} in {record['seconds']:.1f} s"
                + (f" — {record['error'][:300]}" if record.get("error") else ""))
        data["steps"].append(record)
        data["total_s"] = time.perf_counter() - _START
        write_results(out, "gpu", data, markdown(data))
    failed = [r["name"] for r in data["steps"] if r["status"] in ("failed", "timeout")]
    log(f"done in {data['total_s']:.0f} s; wrote {out / 'gpu.json'} and gpu.md"
        + (f"; failed: {', '.join(failed)}" if failed else "; no step failed"))
    return 1 if failed else 0


if __name__ == "__main__":
    if nothing_to_check(parse()[1]):  # said before restarting: one line, at once
        print(NO_GPU)
        sys.exit(0)
    sys.exit(main())
