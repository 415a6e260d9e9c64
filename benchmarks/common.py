"""What every benchmark shares: a description of the machine, the example models, the command
that made a result, and writing results."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import autosplit
from autosplit.cli.outputs import check_outputs
from autosplit.measure import allocator

RESULTS = Path(__file__).resolve().parent / "results"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def machine() -> dict[str, Any]:
    """CPU model, core count, memory, Python and torch versions, CUDA devices."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = None
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory_gib = round(pages / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "system": platform.system(),
        "python": platform.python_version(),
        "allocator": allocator.describe(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda_devices"] = [
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        ]
    except ImportError:
        pass
    return info


def describe(info: dict[str, Any]) -> str:
    """One line for a results table's header."""
    gpus = ", ".join(info.get("cuda_devices") or []) or "no GPU"
    return (
        f"{info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, {gpus}; "
        f"Python {info['python']}, torch {info.get('torch', '–')}"
        + (f"; {info['allocator']}" if info.get("allocator") else "")
    )


def write_results(out: Path, stem: str, data: dict[str, Any], markdown: str) -> None:
    """``out/stem.json`` and ``out/stem.md``, both or neither, each replaced atomically
    (:mod:`autosplit.cli.outputs`, as the CLI writes its files)."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    check_outputs({"json": str(json_path), "md": str(md_path)}, {}).commit({
        "json": lambda path: path.write_text(json.dumps(data, indent=1) + "\n"),
        "md": lambda path: path.write_text(markdown),
    })


@functools.cache
def load_example(name: str) -> Any:
    """A model file from examples/ as a module (loaded once per process)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def command_line(script: str, argv: Sequence[str]) -> str:
    """The command that made the results, without ``--out`` (a local path)."""
    words, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == "--out":
            skip = True
        elif not word.startswith("--out="):
            words.append(word)
    return " ".join(["python", f"benchmarks/{script}", *words])


def block_errors(measured: autosplit.Profile, analytic: autosplit.Profile) -> dict[str, Any]:
    """Per micro-batch size: Σ analytic / Σ measured − 1, and the blocks' median |error|."""
    out = {}
    for b in measured.microbatch_sizes:
        k, j = measured.size_index(b), analytic.size_index(b)
        pairs = [(a.fwd_ms[j] + a.bwd_ms[j], m.fwd_ms[k] + m.bwd_ms[k])
                 for a, m in zip(analytic.blocks, measured.blocks)]
        pairs = [(a, m) for a, m in pairs if m > 0]
        out[str(b)] = {
            "total_error": math.fsum(a for a, _ in pairs) / math.fsum(m for _, m in pairs) - 1,
            "median_abs_block_error": statistics.median(abs(a / m - 1) for a, m in pairs),
        }
    return out


def timed_in_turn(steps: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """Each of ``steps`` (name: function) once untimed, then ``rounds`` rounds taking them in
    turn, every rank starting each together (``dist.barrier()``): their seconds, by name."""
    import time

    import torch.distributed as dist

    for fn in steps.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times
