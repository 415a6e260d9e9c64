"""The PyTorch model-parallel tutorial, reproduced: ResNet50 on one device, split by hand over
two (the tutorial's ModelParallelResNet50), pipelined (PipelineParallelResNet50) and its
split-size sweep.

The hand split is the tutorial's: ``conv1 … layer2`` on the first device, ``layer3 … fc`` on the
second. Training as in the tutorial: SGD (lr 0.001), MSE against one-hot labels, 3 batches per
timing, several timings per configuration, mean and standard deviation; unlike the tutorial, one
untimed warm-up step per configuration first, and configurations interleaved round by round
(A B C … A B C …) so that the machine's drift hits all of them alike.

* On two or more GPUs it runs as the tutorial does: one process, the two halves on cuda:0 and
  cuda:1, the pipelined forward overlapping through CUDA's asynchronous launches.
* On CPUs a "device" is one CPU worker with one thread. One device is one process; the split
  and pipelined versions run one process per stage on ``autosplit.distributed``
  (torch.distributed.pipelining, gloo, GPipe): the hand split with one micro-batch is the model
  parallel version, with micro-batches of ``split_size`` the pipelined one. All of them run in
  one job of two ranks (the one-device runs on rank 0 while rank 1 waits).

torch.distributed.pipelining needs equal micro-batches (B = m·b). Where a split size of the
tutorial does not divide the batch, the nearest divisors are measured instead (both on a tie)
and the tables say so; at ``--tutorial-size`` (B = 120) every tutorial size divides the batch.

    python benchmarks/tutorial.py                    # B=48, 3×64×64: a few minutes on 2 cores
    python benchmarks/tutorial.py --tutorial-size    # the tutorial's B=120, 3×128×128 (tutorial_120.*)
    python benchmarks/tutorial.py --smoke            # a tiny run in seconds (used by the tests)

Writes ``tutorial.{json,md}``, ``tutorial_bars.png`` and ``tutorial_split_size.png`` under
``benchmarks/results/`` (``--out`` to change). This file also holds the measuring engine that
``benchmarks/compare.py`` uses: :func:`measure` runs groups of configurations in one launch.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, describe, machine, write_results  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from autosplit import distributed as D  # noqa: E402
from autosplit.graph import trace  # noqa: E402
from autosplit.records import Plan, Stage  # noqa: E402
from autosplit.solve import manual  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TUTORIAL_SPLITS = (1, 3, 5, 8, 10, 12, 20, 40, 60)
TUTORIAL_SPLIT = 20
HAND_SPLIT = ("layer3",)
LR = 0.001
# the tutorial's own numbers (unnamed GPU, B=120, 3×128×128, 3 batches per timing), for context
TUTORIAL_NUMBERS = {"one device": 3.75, "model parallel": 4.02, "pipelined (split 20)": 2.51,
                    "best split (12)": 2.43}


# ------------------------------------------------------------------------------ the models


def load_example(name: str) -> Any:
    """A model file from examples/ as a module."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class ModelSpec:
    """A model and its batch, rebuilt identically (seeded) in every process.

    ``key``: ``resnet18`` / ``resnet50`` / ``resnet101`` (torchvision, images of
    ``sample_shape``) or ``gpt-<size>`` (examples/gpt.py, token ids; ``sample_shape`` unused).
    """

    key: str
    batch: int
    sample_shape: tuple[int, ...] = (3, 64, 64)
    seed: int = 0

    @property
    def describe(self) -> str:
        if self.key.startswith("gpt-"):
            return f"B={self.batch} × {self.make_inputs()[0].shape[1]} tokens"
        return f"B={self.batch}, {'×'.join(map(str, self.sample_shape))}"

    def build(self) -> nn.Module:
        torch.manual_seed(self.seed)
        if self.key.startswith("gpt-"):
            return load_example("gpt").build_model(self.key[4:])
        import torchvision

        return getattr(torchvision.models, self.key)()

    def make_inputs(self) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(self.seed + 1)
        if self.key.startswith("gpt-"):
            return tuple(load_example("gpt").example_inputs(self.batch, self.key[4:]))
        return (torch.randn(self.batch, *self.sample_shape),)


def bare_plan(model: nn.Module, split_points: Sequence[str], split_size: int, batch: int,
              balance: Sequence[int] | None = None, schedule: str = "gpipe") -> Plan:
    """A Plan with the given cut points (or balance) and micro-batch size, without profiling
    (its predictions are zero): enough for :class:`autosplit.distributed.Trainer`."""
    if batch % split_size:
        raise ValueError(f"split size {split_size} does not divide the batch {batch}")
    graph = trace(model)
    if balance is None:
        balance = manual(graph.block_names, split_points)
    stages, first = [], 0
    for s, count in enumerate(balance):
        names = graph.block_names[first:first + count]
        stages.append(Stage(s, "cpu", names, 0.0, 0.0, 0, 0.0, 0))
        first += count
    return Plan(graph.model_name, graph.fingerprint, tuple(stages), split_size,
                batch // split_size, batch, schedule, 0.0, 0.0, "manual", (split_size,),
                "not profiled")


# ----------------------------------------------------------------- the measuring engine


@dataclass(frozen=True)
class Config:
    """One thing to time: a plan run one process per stage, or (``plan=None``) the whole model
    on one device (rank 0; the other ranks wait at a barrier)."""

    label: str
    plan: Plan | None


@dataclass(frozen=True)
class Group:
    """Configurations of one model timed together, interleaved round by round.

    Every configuration first runs ``warmup`` untimed rounds, then ``rounds`` timed ones; a
    timing is ``steps`` training steps back to back (the slowest rank's wall time, every rank
    starting after a barrier). Rounds alternate direction (A B C, C B A, …). A timing during
    which other processes took more than ``max_others`` of the machine's CPU time is taken again
    (at most ``retries`` times). With ``refine``, the ``refine`` fastest configurations by
    median (and those in ``keep``) are timed ``refine_rounds`` more times afterwards,
    interleaved among themselves.
    """

    name: str
    spec: ModelSpec
    configs: tuple[Config, ...]
    rounds: int
    warmup: int = 1
    steps: int = 1
    refine: int = 0
    refine_rounds: int = 0
    keep: tuple[str, ...] = ()
    max_others: float = 0.10
    retries: int = 3


def measure(groups: Sequence[Group], nprocs: int = 2, backend: str = "gloo",
            timeout_s: float = 600.0) -> dict[str, dict[str, Any]]:
    """Launch ``nprocs`` ranks once and time every group in them (see :class:`Group`).

    Returns ``{group name: {"times": {label: [s, …]}, "refined": {label: [s, …]}, "load": {…}}}``:
    seconds per timing, the slowest rank's; ``load`` says how much CPU time other processes took
    during the timed rounds (``others_share``: of all cores' time).
    """
    return D.launch(_rank_main, nprocs, list(groups), backend, timeout_s=timeout_s)[0]


def _rank_main(groups: list[Group], backend: str) -> dict[str, Any] | None:
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    out = {}
    for group in groups:
        out[group.name] = _run_group(group, device, rank)
        gc.collect()
    return out if rank == 0 else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _runner(config: Config, model: nn.Module, inputs: tuple[torch.Tensor, ...], targets: Any,
            device: torch.device, rank: int, steps: int) -> Any:
    """A function that times ``steps`` training steps of ``config`` on this rank (seconds)."""
    if config.plan is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        local_inputs = tuple(x.to(device) for x in inputs)
        local_targets = tuple(t.to(device) for t in targets)

        def run_single() -> float:
            dist.barrier()
            _sync(device)
            start = time.perf_counter()
            if rank == 0:
                for _ in range(steps):
                    optimizer.zero_grad(set_to_none=True)
                    D.tutorial_loss(model(*local_inputs), local_targets).backward()
                    optimizer.step()
                _sync(device)
            return time.perf_counter() - start

        return run_single
    trainer = D.Trainer(model, config.plan, D.tutorial_loss,
                        lambda params: torch.optim.SGD(params, lr=LR), device=device)

    def run_pipeline() -> float:
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            trainer.step(inputs if trainer.holds_first else None,
                         targets if trainer.holds_last else None)
        _sync(device)
        return time.perf_counter() - start

    return run_pipeline


def machine_cpu_seconds() -> tuple[float, float] | None:
    """CPU time used on the whole machine so far (busy, and stolen by the hypervisor), in
    core-seconds, from /proc/stat; ``None`` where there is none."""
    try:
        with open("/proc/stat") as fh:
            values = [int(v) for v in fh.readline().split()[1:9]]
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = values
    return (user + nice + system + irq + softirq) / tick, steal / tick


def _checked(runner: Any, group: Group, rank: int, label: str) -> tuple[float, float, int]:
    """Time ``runner`` once; while other processes take more than ``group.max_others`` of the
    machine's CPU time during the timing, time it again (at most ``group.retries`` times, after
    a pause that lets the other job pass). Every rank takes the same decision: the ranks' own
    CPU time is gathered and rank 0's reading of the machine's decides.

    Returns (seconds on this rank, the other processes' share of the kept timing, retries)."""
    cores = os.cpu_count() or 1
    for attempt in range(group.retries + 1):
        before, own = machine_cpu_seconds(), time.process_time()
        start = time.perf_counter()
        seconds = runner()
        wall = time.perf_counter() - start
        own = time.process_time() - own
        after = machine_cpu_seconds()
        busy = after[0] - before[0] if before is not None and after is not None else None
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (own, busy, wall))
        # decide on gathered values only (rank 0's clock and reading), so that every rank
        # decides alike: a rank that retook a timing alone would wait for its peer forever
        if gathered[0][1] is None:
            return seconds, math.nan, attempt
        others = max(0.0, gathered[0][1] - sum(g[0] for g in gathered))
        share = others / (gathered[0][2] * cores)
        # a tick of /proc/stat is 10 ms: very short timings cannot be judged
        if share <= group.max_others or others < 0.05 or attempt == group.retries:
            return seconds, share, attempt
        if rank == 0:
            print(f"  {group.name}: {label}: other processes took {share:.0%} of the CPU, "
                  "timing it again", flush=True)
        time.sleep(1.0 + attempt)


def _rounds(group: Group, labels: Sequence[str], runners: dict[str, Any], count: int,
            skip: int, rank: int, what: str) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Time ``count`` rounds after ``skip`` untimed ones (see :func:`_checked`); also what other
    processes took of the machine during the timed rounds (the whole machine's busy CPU time
    minus the ranks' own, discarded timings included)."""
    times: dict[str, list[float]] = {label: [] for label in labels}
    shares: list[float] = []
    retried = 0
    marks: dict[str, Any] = {}
    for r in range(skip + count):
        if r == skip:
            marks = {"wall": time.perf_counter(), "own": time.process_time(),
                     "machine": machine_cpu_seconds()}
        order = list(labels) if r % 2 == 0 else list(reversed(labels))
        start = time.perf_counter()
        for label in order:
            if r < skip:
                runners[label]()
                continue
            seconds, share, retries = _checked(runners[label], group, rank, label)
            times[label].append(seconds)
            shares.append(share)
            retried += retries
        if rank == 0:
            kind = "warm-up" if r < skip else f"{what} {r - skip + 1}/{count}"
            print(f"  {group.name}: {kind} round of {len(order)} configurations "
                  f"in {time.perf_counter() - start:.1f} s", flush=True)
    wall = time.perf_counter() - marks["wall"]
    own = time.process_time() - marks["own"]
    after = machine_cpu_seconds()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (times, own))  # every rank gets every rank's times
    merged = {label: [max(col) for col in zip(*(g[0][label] for g in gathered))] for label in labels}
    judged = [x for x in shares if not math.isnan(x)]
    load: dict[str, Any] = {
        "wall_s": wall, "ranks_cpu_s": sum(g[1] for g in gathered), "timings": len(shares),
        "retried": retried, "max_others": group.max_others,
        "kept_over_limit": sum(x > group.max_others for x in judged),
        "max_kept_share": max(judged, default=math.nan),
    }
    if marks["machine"] is not None and after is not None:
        busy = after[0] - marks["machine"][0]
        load["machine_cpu_s"] = busy
        load["steal_s"] = after[1] - marks["machine"][1]
        load["others_cpu_s"] = max(0.0, busy - load["ranks_cpu_s"])
        load["others_share"] = load["others_cpu_s"] / (wall * (os.cpu_count() or 1))
    return merged, load


def _run_group(group: Group, device: torch.device, rank: int) -> dict[str, Any]:
    model = group.spec.build().to(device)
    inputs = group.spec.make_inputs()
    targets = D.tutorial_targets(model, inputs)
    labels = [c.label for c in group.configs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"group {group.name}: configuration labels repeat")
    runners: dict[str, Any] = {}
    for config in group.configs:  # every rank builds them in the same order (collectives)
        runners[config.label] = _runner(config, model, inputs, targets, device, rank, group.steps)
    times, load = _rounds(group, labels, runners, group.rounds, group.warmup, rank, "round")
    refined: dict[str, list[float]] = {}
    if group.refine and group.refine_rounds:
        # the same choice on every rank: all hold the same gathered times
        ranked = sorted(labels, key=lambda lb: (statistics.median(times[lb]), labels.index(lb)))
        chosen = ranked[: group.refine] + [lb for lb in group.keep if lb not in ranked[: group.refine]]
        chosen = [lb for lb in labels if lb in chosen]  # original order
        refined, refine_load = _rounds(group, chosen, runners, group.refine_rounds, 0, rank, "refine round")
        load = {k: load[k] + refine_load[k] if k in ("wall_s", "ranks_cpu_s", "timings", "retried",
                                                     "kept_over_limit", "machine_cpu_s", "steal_s",
                                                     "others_cpu_s") else load[k]
                for k in load if k in refine_load}
        load["max_kept_share"] = max(load["max_kept_share"], refine_load["max_kept_share"])
        if "others_cpu_s" in load:
            load["others_share"] = load["others_cpu_s"] / (load["wall_s"] * (os.cpu_count() or 1))
    del runners
    return {"times": times, "refined": refined, "load": load}


def summary(values: Sequence[float]) -> dict[str, float]:
    """Mean, population std (``np.std``, as the tutorial), median, min and max."""
    return {
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values) if len(values) > 1 else 0.0,
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


# -------------------------------------------------------- the tutorial's one-process version


class TwoDeviceResNet(nn.Module):
    """The tutorial's hand split of a torchvision ResNet in one process: ``conv1 … layer2`` on
    ``devices[0]``, ``layer3 … fc`` on ``devices[1]``. ``split_size=None`` runs the whole batch
    through (ModelParallelResNet50); a split size pipelines micro-batches: while the second half
    runs micro-batch i, the first half is launched on micro-batch i + 1
    (PipelineParallelResNet50; the overlap comes from CUDA's asynchronous launches)."""

    def __init__(self, resnet: nn.Module, devices: Sequence[torch.device],
                 split_size: int | None = None) -> None:
        super().__init__()
        self.devices = tuple(torch.device(d) for d in devices)
        r: Any = resnet
        self.front = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, r.layer2).to(self.devices[0])
        self.back = nn.Sequential(r.layer3, r.layer4, r.avgpool, nn.Flatten(1), r.fc).to(self.devices[1])
        self.split_size = split_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_size is None:
            return self.back(self.front(x).to(self.devices[1]))
        chunks = iter(x.split(self.split_size))
        ahead = self.front(next(chunks)).to(self.devices[1])
        outputs = []
        for chunk in chunks:
            outputs.append(self.back(ahead))  # queued on the second device …
            ahead = self.front(chunk).to(self.devices[1])  # … while the first takes the next
        outputs.append(self.back(ahead))
        return torch.cat(outputs)


def _in_process(spec: ModelSpec, configs: list[tuple[str, int | None]], devices: list[torch.device],
                repeats: int, batches: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """The tutorial on two devices in this process. ``configs``: (label, split size or None for
    the model-parallel version, or -1 for one device)."""
    if any(d.type == "cpu" for d in devices):
        torch.set_num_threads(1)  # a CPU "device" is one worker of one thread, as in process mode
    inputs = spec.make_inputs()[0]
    single = spec.build().to(devices[0])
    split = TwoDeviceResNet(spec.build(), devices)
    targets = D.tutorial_targets(single, (inputs,))[0]
    models = {"single": (single, torch.optim.SGD(single.parameters(), lr=LR)),
              "split": (split, torch.optim.SGD(split.parameters(), lr=LR))}

    def timing(label: str, split_size: int | None) -> float:
        model, optimizer = models["single" if split_size == -1 else "split"]
        if split_size != -1:
            split.split_size = split_size
        for d in devices:
            _sync(d)
        start = time.perf_counter()
        for _ in range(batches):
            optimizer.zero_grad(set_to_none=True)
            out = model(inputs.to(devices[0]))
            D.tutorial_loss(out, (targets.to(out.device),)).backward()
            optimizer.step()
        for d in devices:
            _sync(d)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {label: [] for label, _ in configs}
    marks: dict[str, Any] = {}
    for r in range(repeats + 1):  # round 0: warm-up
        if r == 1:
            marks = {"wall": time.perf_counter(), "own": time.process_time(),
                     "machine": machine_cpu_seconds()}
        order = configs if r % 2 == 0 else list(reversed(configs))
        for label, split_size in order:
            seconds = timing(label, split_size)
            if r:
                times[label].append(seconds)
        print(f"  {'warm-up' if r == 0 else f'round {r}/{repeats}'} done", flush=True)
    wall = time.perf_counter() - marks["wall"]
    load: dict[str, Any] = {"wall_s": wall, "ranks_cpu_s": time.process_time() - marks["own"]}
    after = machine_cpu_seconds()
    if marks["machine"] is not None and after is not None:
        load["machine_cpu_s"] = after[0] - marks["machine"][0]
        load["steal_s"] = after[1] - marks["machine"][1]
        load["others_cpu_s"] = max(0.0, load["machine_cpu_s"] - load["ranks_cpu_s"])
        load["others_share"] = load["others_cpu_s"] / (wall * (os.cpu_count() or 1))
    return times, load


# ------------------------------------------------------------------------------ the benchmark


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


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """--max-others and --retries: what to do about other processes on a shared machine."""
    parser.add_argument("--max-others", type=float, default=0.10,
                        help="retake a timing during which other processes used more than this "
                             "share of the machine's CPU time (default 0.10)")
    parser.add_argument("--retries", type=int, default=3,
                        help="at most this many retakes per timing (default 3; 0: never)")


def nearest_divisors(size: int, batch: int) -> list[int]:
    """The divisors of ``batch`` nearest to ``size`` (two on a tie)."""
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    gap = min(abs(d - size) for d in divisors)
    return [d for d in divisors if abs(d - size) == gap]


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = ModelSpec("resnet50", args.batch, (3, args.image, args.image))
    batch = args.batch
    sweep_map = {s: nearest_divisors(s, batch) for s in args.split_sizes}
    sweep = sorted({d for ds in sweep_map.values() for d in ds})
    pipelined = min(nearest_divisors(TUTORIAL_SPLIT, batch))  # a tie goes to more micro-batches
    gpus = torch.cuda.device_count()
    mode = args.mode if args.mode != "auto" else ("in-process" if gpus >= 2 else "processes")
    # what is timed: one device, the model-parallel split (m = 1) and every swept split size
    split_configs = {f"split {s}": s for s in sweep if s != batch}
    labels = {"one device": "one device", "model parallel": "model parallel",
              "pipelined": f"split {pipelined}" if pipelined != batch else "model parallel"}
    print(f"tutorial: {spec.describe}, mode {mode}, split sizes {sweep}, pipelined at split "
          f"{pipelined}, {args.repeats} timings × {args.batches} batches each", flush=True)
    start = time.perf_counter()
    if mode == "processes":
        model = spec.build()
        configs = [Config("one device", None),
                   Config("model parallel", bare_plan(model, HAND_SPLIT, batch, batch))]
        configs += [Config(label, bare_plan(model, HAND_SPLIT, s, batch))
                    for label, s in split_configs.items()]
        group = Group("tutorial", spec, tuple(configs), rounds=args.repeats, warmup=1,
                      steps=args.batches, max_others=args.max_others, retries=args.retries)
        result = measure([group], backend="gloo", timeout_s=args.timeout)["tutorial"]
        times, load = result["times"], result["load"]
        devices_text = "CPU workers of 1 thread: one process per stage (gloo)"
    else:
        devices = [torch.device(d) for d in (args.devices or ["cuda:0", "cuda:1"])]
        configs_ip: list[tuple[str, int | None]] = [("one device", -1), ("model parallel", None)]
        configs_ip += list(split_configs.items())
        times, load = _in_process(spec, configs_ip, devices, args.repeats, args.batches)
        devices_text = f"one process, devices {', '.join(map(str, devices))}"
    wall = time.perf_counter() - start
    rows = []
    single = summary(times["one device"])["mean"]
    for label, values in times.items():
        s = batch if label == "model parallel" else (None if label == "one device" else split_configs[label])
        stats = summary(values)
        rows.append({"config": label, "split_size": s, "microbatches": batch // s if s else None,
                     "seconds": values, **stats, "speedup_vs_one_device": single / stats["mean"]})
    by_label = {r["config"]: r for r in rows}
    sweep_rows = [by_label["model parallel" if s == batch else f"split {s}"] for s in sweep]
    best = min(sweep_rows, key=lambda r: r["mean"])
    return {
        "settings": {
            "machine": machine(),
            "model": "torchvision resnet50",
            "input": spec.describe,
            "batch": batch,
            "image": args.image,
            "mode": mode,
            "devices": devices_text,
            "repeats": args.repeats,
            "batches_per_timing": args.batches,
            "max_others": args.max_others,
            "retries": args.retries,
            "warmup": "one untimed round: one timing of every configuration",
            "tutorial_splits": list(args.split_sizes),
            "split_sizes_measured": {str(k): v for k, v in sweep_map.items()},
            "pipelined_split": pipelined,
            "hand_split": list(HAND_SPLIT),
            "command": args.command,
            "wall_seconds": wall,
            "load": load,
        },
        "rows": rows,
        "bars": {name: by_label[label] for name, label in labels.items()},
        "sweep": [{"split_size": s, **{k: r[k] for k in ("mean", "std", "median", "min", "max")}}
                  for s, r in zip(sweep, sweep_rows)],
        "best_split": best["split_size"],
    }


def plural(count: int, word: str, suffix: str = "s") -> str:
    return f"{count} {word}{'' if count == 1 else suffix}"


def load_sentence(load: dict[str, Any]) -> str:
    """What other processes took of the machine while the timings ran, in words."""
    if "others_share" not in load:
        return ""
    text = (f"During the timed rounds other processes used {load['others_share']:.0%} of the "
            f"machine's CPU time ({load['others_cpu_s']:.0f} core-s in {load['wall_s']:.0f} s)")
    if load.get("steal_s", 0) > 1:
        text += f", and the hypervisor took {load['steal_s']:.0f} core-s"
    if "retried" in load:
        limit = f"{load['max_others']:.0%}"
        text += (f"; {load['retried']} timing(s) during which they took more than {limit} were "
                 "discarded and taken again")
        if load["kept_over_limit"]:
            text += (f", and {load['kept_over_limit']} of the {load['timings']} kept timings still "
                     f"saw more than {limit} (up to {load['max_kept_share']:.0%}): read those rows "
                     "with care")
    return text + "."


def markdown(data: dict[str, Any]) -> str:
    st = data["settings"]
    bars = data["bars"]
    mapped = ", ".join(f"{k}→{'/'.join(map(str, v))}" for k, v in st["split_sizes_measured"].items()
                       if [int(k)] != v)
    lines = [
        "# The tutorial, reproduced",
        "",
        f"Machine: {describe(st['machine'])}. ResNet50, {st['input']}, SGD lr 0.001, MSE on "
        f"one-hot labels; {st['devices']}; hand split before `layer3` (the tutorial's). Each timing "
        f"is {plural(st['batches_per_timing'], 'training batch', 'es')}; "
        f"{plural(st['repeats'], 'timing')} per configuration, interleaved round by round after a warm-up round; mean ± std (population, "
        f"as `np.std`). Whole run {st['wall_seconds']:.0f} s. Command: `{st['command']}`.",
        "",
        "Timings on this shared 2-core machine drift 20–30 % between runs (other jobs may run "
        "beside it); compare rows of one run, not across runs. A timing during which other "
        f"processes used more than {st['max_others']:.0%} of the machine's CPU time is taken again "
        f"(at most {st['retries']} times). " + load_sentence(st["load"]),
        "",
        "| configuration | split size | micro-batches | mean (s) | std (s) | vs one device |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in bars.items():
        text = name if name != "pipelined" else f"pipelined (split {st['pipelined_split']})"
        lines.append(
            f"| {text} | {row['split_size'] or '–'} | {row['microbatches'] or '–'} | "
            f"{row['mean']:.2f} | {row['std']:.2f} | ×{row['speedup_vs_one_device']:.2f} |"
        )
    lines += [
        "",
        f"Split-size sweep (the tutorial's sizes {', '.join(map(str, st['tutorial_splits']))}"
        + (f"; where one does not divide B={st['batch']}, the nearest divisors: {mapped}" if mapped else "")
        + f"). Best: split {data['best_split']}.",
        "",
        "| split size | micro-batches | mean (s) | std (s) |",
        "|---|---|---|---|",
    ]
    for row in data["sweep"]:
        lines.append(f"| {row['split_size']} | {st['batch'] // row['split_size']} | {row['mean']:.2f} | {row['std']:.2f} |")
    lines += [
        "",
        "The tutorial's own numbers (an unnamed GPU pair, B=120, 3×128×128): one GPU 3.75 s, model "
        "parallel 4.02 s, pipelined at split 20 2.51 s, best split 12 2.43 s.",
    ]
    if st["pipelined_split"] != TUTORIAL_SPLIT:
        lines += [
            "",
            f"Split 20 does not divide B={st['batch']}; the pipelined bar uses split "
            f"{st['pipelined_split']} (m = {st['batch'] // st['pipelined_split']}), the "
            "nearest divisor (torch.distributed.pipelining needs equal micro-batches).",
        ]
    return "\n".join(lines) + "\n"


def figures(data: dict[str, Any], out: Path, stem: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st = data["settings"]
    where = "CPU workers (1 thread each)" if st["mode"] == "processes" else st["devices"]
    paths = []
    bars = data["bars"]
    names = ["one device", "model parallel", f"pipelined\n(split {st['pipelined_split']})"]
    rows = [bars["one device"], bars["model parallel"], bars["pipelined"]]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100, layout="constrained")
    colors = ["#8C8C8C", "#DD8452", "#4C72B0"]
    means = [r["mean"] for r in rows]
    ax.bar(range(3), means, yerr=[r["std"] for r in rows], color=colors, capsize=6, width=0.6)
    for x, r in enumerate(rows):
        ax.text(x, r["mean"] + r["std"], f"{r['mean']:.2f} s\n×{r['speedup_vs_one_device']:.2f}",
                ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(3), names)
    ax.set_ylim(0, max(m + r["std"] for m, r in zip(means, rows)) * 1.3)
    ax.set_ylabel(f"seconds per {st['batches_per_timing']} training batches")
    ax.set_title(f"ResNet50, {st['input']}, on {where}\nmean ± std of {st['repeats']} timings "
                 "(lower is faster; ×: speed-up over one device)", fontsize=10, loc="left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    path = out / f"{stem}_bars.png"
    fig.savefig(path)
    plt.close(fig)
    paths.append(path.name)

    fig, ax = plt.subplots(figsize=(6.5, 4), dpi=100, layout="constrained")
    sizes = [r["split_size"] for r in data["sweep"]]
    ax.errorbar(sizes, [r["mean"] for r in data["sweep"]], yerr=[r["std"] for r in data["sweep"]],
                marker="o", color="#4C72B0", capsize=4, label="hand split, pipelined (GPipe)")
    single = bars["one device"]
    ax.axhline(single["mean"], color="#8C8C8C", linestyle="--", label=f"one device ({single['mean']:.2f} s)")
    for r in data["sweep"]:
        ax.annotate(f"m={st['batch'] // r['split_size']}", (r["split_size"], r["mean"] + r["std"]),
                    textcoords="offset points", xytext=(0, 5), ha="center", fontsize=7, color="#555555")
    jumps = [(a["mean"] / b["mean"], a, b) for a, b in zip(data["sweep"], data["sweep"][1:])]
    ratio, small, large = max(jumps, key=lambda j: j[0]) if jumps else (1.0, None, None)
    if ratio > 1.5 and small is not None and large is not None:  # a per-sample cost cliff
        x = math.sqrt(small["split_size"] * large["split_size"])
        ax.annotate(f"cliff: split {small['split_size']} is\n×{ratio:.1f} slower than {large['split_size']}",
                    (x, (small["mean"] + large["mean"]) / 2), xytext=(x * 1.15, (small["mean"] + large["mean"]) / 2),
                    fontsize=8, color="#C44E52", va="center")
    best = min(data["sweep"], key=lambda r: r["mean"])
    ax.annotate(f"best: split {best['split_size']}\n{best['mean']:.2f} s",
                (best["split_size"], best["mean"]), textcoords="offset points", xytext=(10, -28),
                fontsize=9, arrowprops={"arrowstyle": "->", "color": "black"})
    ax.set_xscale("log")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.minorticks_off()
    ax.set_xlabel(f"split size (micro-batch size b; batch {st['batch']} = m · b)")
    ax.set_ylabel(f"seconds per {st['batches_per_timing']} training batches")
    ax.set_ylim(0, None)
    ax.set_title(f"Split-size trade-off: ResNet50, {st['input']}, on {where}\n"
                 "small splits: many small, slow micro-batches; large: a long pipeline bubble",
                 fontsize=10, loc="left")
    ax.legend(fontsize=8, frameon=False, loc="lower left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    path = out / f"{stem}_split_size.png"
    fig.savefig(path)
    plt.close(fig)
    paths.append(path.name)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=48, help="batch size B (default 48)")
    parser.add_argument("--image", type=int, default=64, help="image side (default 64)")
    parser.add_argument("--tutorial-size", action="store_true",
                        help="the tutorial's batch of 120 images of 3×128×128")
    parser.add_argument("--repeats", type=int, default=5, help="timings per configuration (default 5; the tutorial 10)")
    parser.add_argument("--batches", type=int, default=3, help="training batches per timing (default 3, the tutorial's)")
    parser.add_argument("--split-sizes", type=int, nargs="+", default=list(TUTORIAL_SPLITS),
                        help="split sizes to sweep (default the tutorial's)")
    parser.add_argument("--mode", choices=("auto", "processes", "in-process"), default="auto",
                        help="auto: one process on ≥ 2 GPUs, else one process per stage")
    parser.add_argument("--devices", nargs=2, default=None, help="the two devices of --mode in-process")
    parser.add_argument("--timeout", type=float, default=600.0, help="process-group timeout (s)")
    add_load_arguments(parser)
    parser.add_argument("--smoke", action="store_true", help="a tiny run in seconds (tests)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the results")
    args = parser.parse_args(argv)
    args.command = command_line("tutorial.py", sys.argv[1:] if argv is None else argv)
    if args.tutorial_size:
        args.batch, args.image = 120, 128
    if args.smoke:
        args.batch, args.image, args.repeats, args.batches = 4, 64, 1, 1
        args.split_sizes = [1, 2]
        args.retries = 0  # a smoke run checks that it runs, not how fast
    if args.batch < 1 or args.repeats < 1 or args.batches < 1:
        parser.error("--batch, --repeats and --batches must be positive")
    data = run(args)
    stem = "tutorial_smoke" if args.smoke else ("tutorial_120" if args.tutorial_size else "tutorial")
    args.out.mkdir(parents=True, exist_ok=True)
    data["figures"] = figures(data, args.out, stem)
    text = markdown(data)
    write_results(args.out, stem, data, text)
    print(text)


if __name__ == "__main__":
    main()
