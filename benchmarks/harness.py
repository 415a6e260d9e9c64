"""The measuring harness every multi-process benchmark shares (``tutorial.py``, ``compare.py``).

:func:`measure` launches the ranks once (``autosplit.launch``) and times groups of
configurations in them: plans run one process per stage (a ``Trainer`` per rank), or the whole
model on one device on rank 0, interleaved round by round (A B C, C B A, …) after untimed
warm-up rounds, and more of them until no configuration's step faults in fresh memory
(:func:`settled`), a short step after untimed steps of its own (``Group.lead_in_s``). A timing is
the slowest rank's wall time from a common barrier; one during which other processes took more
than a share of the machine's CPU time (``/proc/stat``'s busy time minus the ranks' own), or
whose steps faulted in fresh memory on a rank, is taken again, every rank deciding alike on
rank 0's reading.

A model whose spec gives keyword inputs (:meth:`ModelSpec.make_kwargs`: a Hugging Face model's
``input_ids``, ``attention_mask``, ``labels``) and that returns its own loss with them is
trained on that loss (:func:`autosplit.measure.losses.model_loss`, as ``autosplit run`` trains it); any
other on the tutorial's MSE against one-hot targets.

Also here: :class:`ModelSpec` (a model and its batch, rebuilt identically in every process),
:func:`stage_check` (each stage of a plan timed alone in this process), :func:`summary`
(mean, std, median, min, max) and the command-line options of the retake rule.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import torch.distributed as dist
from common import load_example
from torch import nn

from autosplit import distributed
from autosplit.distributed.job import returns_own_loss
from autosplit.measure import steal_time
from autosplit.measure.losses import model_loss
from autosplit.measure.peak_memory import rise_during, tensor_bytes
from autosplit.measure.spread import relative_spread
from autosplit.records import Plan

LR = 0.001  # SGD's learning rate, the tutorial's


# ------------------------------------------------------------------------------ the models


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

    def make_kwargs(self) -> dict[str, torch.Tensor]:
        """The model's keyword inputs, B rows each (none here; a subclass for a Hugging Face
        model gives ``input_ids``, ``attention_mask``, ``labels``, with ``make_inputs()``
        then ``()``)."""
        return {}


# ----------------------------------------------------------------- the measuring engine


@dataclass(frozen=True)
class Config:
    """One thing to time: a plan run one process per stage, or (``plan=None``) the whole model
    on one device (rank 0; the other ranks wait at a barrier), the batch at once or, with
    ``split``, in micro-batches of that many samples whose gradients add up (as a plan's
    ``single_device_split`` says its one-device figure runs)."""

    label: str
    plan: Plan | None
    split: int | None = None


@dataclass(frozen=True)
class Group:
    """Configurations of one model timed together, interleaved round by round.

    Every configuration first runs ``warmup`` untimed rounds, then ``rounds`` timed ones; a
    timing is ``steps`` training steps back to back (the slowest rank's wall time, every rank
    starting after a barrier). A configuration whose step took less than ``lead_in_s`` seconds
    in the warm-up round runs ``ceil(lead_in_s / step)`` untimed steps right before each of its
    timings, so that a short step is timed as training runs it, after steps of its own, not as
    the first step after another configuration or an idle wait (GPT small's 2-rank GPipe step,
    0.33 s: 2–4 % slower right after a one-device step, 5–8 % after both ranks sat idle for
    0.5 s, medians of 20–30 interleaved pairs on 2 AMD EPYC cores); a step of ``lead_in_s`` or
    more is timed as it comes (such a transient is a small share of it). Rounds alternate
    direction (A B C, C B A, …). A timing during
    which other processes, or the hypervisor, took more than ``max_others`` of the machine's CPU
    time (:func:`disturbance`) is taken again
    (at most ``retries`` times). After the ``warmup`` rounds (if any), untimed rounds go on
    while a configuration's steps faulted in fresh memory on a rank (:func:`settled`), at most
    ``settle_rounds`` more: training's steady state reuses its memory, and the first tens of
    steps may not (the big-vocabulary model's head cut, 2 ranks at b = 16: 16,000 pages, its
    65 MB of logits, faulted in on some of its first ~30 steps, each then 150–190 ms longer
    than its ~280 ms step; none after). A timed run that still faults in fresh memory is
    taken again too, at once (within the same ``retries``). With ``refine``, the ``refine``
    fastest configurations by median (and those in ``keep``) are timed ``refine_rounds`` more
    times afterwards, interleaved among themselves. With ``memory``, each plan's peak tensor
    memory per rank is measured afterwards, untimed (:func:`peak_memory`). With
    ``more_rounds``, timed rounds go on after the ``rounds`` while a configuration's timings spread by more than ``max_spread``
    (half their interquartile range over their median, the slowest rank's), at most
    ``more_rounds`` more: whole rounds, every configuration alike, so that rounds stay paired
    (the big-vocabulary head cut's 5 timings in one accuracy run: 291, 485, 296, 337, 659 ms,
    its median moved by two slow steps that its next 30, timed in another job, did not repeat).
    """

    name: str
    spec: ModelSpec
    configs: tuple[Config, ...]
    rounds: int
    warmup: int = 1
    steps: int = 1
    lead_in_s: float = 0.0
    refine: int = 0
    refine_rounds: int = 0
    keep: tuple[str, ...] = ()
    settle_rounds: int = 10
    max_others: float = 0.10
    retries: int = 3
    memory: bool = False
    more_rounds: int = 0
    max_spread: float = 0.03


def measure(groups: Sequence[Group], nprocs: int = 2, backend: str = "gloo",
            timeout_s: float = 600.0) -> dict[str, dict[str, Any]]:
    """Launch ``nprocs`` ranks once and time every group in them (see :class:`Group`).

    Returns ``{group name: {"times": {label: [s, …]}, "refined": {label: [s, …]}, "load": {…},
    "peak_bytes": {label: [rank 0's, rank 1's, …]}, "lead_in_steps": {label: n},
    "steps_run": {label: n}}}``: seconds per timing, the slowest rank's;
    ``load`` says how much CPU time other processes took during the timed rounds
    (``others_share``: of all cores' time); ``peak_bytes`` (plans only, with ``Group.memory``)
    is each rank's peak tensor memory in a training step (:func:`peak_memory`).
    """
    return distributed.launch(_rank_main, nprocs, list(groups), backend, timeout_s=timeout_s)[0]


def _rank_main(groups: list[Group], backend: str) -> dict[str, Any] | None:
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    out = {}
    for group in groups:
        out[group.name] = _run_group(group, device, rank)
        gc.collect()
    return out if rank == 0 else None


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_device_parts(inputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...],
                     split: int | None) -> list[tuple[tuple[torch.Tensor, ...],
                                                      tuple[torch.Tensor, ...], float]]:
    """The batch as one device runs it: micro-batches of ``split`` samples (the last one may
    be smaller; ``None`` or the batch size or more: the batch at once), each with its share of
    the batch (samples / batch), by which its mean loss is scaled so that the gradients added
    up are the whole batch's."""
    batch = int(inputs[0].shape[0])
    b = min(split or batch, batch)
    return [(tuple(x[i:i + b] for x in inputs), tuple(t[i:i + b] for t in targets),
             min(b, batch - i) / batch) for i in range(0, batch, b)]


def _runner(config: Config, model: nn.Module, inputs: tuple[torch.Tensor, ...], targets: Any,
            device: torch.device, rank: int, steps: int,
            kwargs: dict[str, torch.Tensor] | None = None) -> Any:
    """A function ``run(lead=0)`` that runs ``lead`` untimed training steps of ``config`` on this
    rank, then times ``steps`` more, back to back after a barrier (seconds). ``targets``
    ``None``: the model returns its own loss from ``kwargs`` (its labels), which is trained."""
    kwargs = kwargs or {}
    if config.plan is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        local_inputs = tuple(x.to(device) for x in inputs)
        if targets is None:  # the model's own loss: the keyword inputs split like the inputs
            names, n = list(kwargs), len(local_inputs)
            rows = local_inputs + tuple(kwargs[name].to(device) for name in names)
            parts = [(xs[:n], dict(zip(names, xs[n:])), share)
                     for xs, _, share in one_device_parts(rows, (), config.split)]
        else:
            local_targets = tuple(t.to(device) for t in targets)
            parts = one_device_parts(local_inputs, local_targets, config.split)

        def single_step() -> None:
            if rank == 0:
                optimizer.zero_grad(set_to_none=True)
                for xs, ts, share in parts:  # (one part, share 1: the batch at once)
                    loss = (model_loss(model(*xs, **ts)) if targets is None
                            else distributed.tutorial_loss(model(*xs), ts))
                    (loss * share).backward()
                optimizer.step()

        return _timed(single_step, steps, device)
    trainer = _trainer(config.plan, model, device, inputs, kwargs, targets is None)

    def pipeline_step() -> None:
        if trainer.holds_first:
            trainer.step(inputs, targets if trainer.holds_last else None, kwargs=kwargs or None)
        else:
            trainer.step(None, targets if trainer.holds_last else None)

    return _timed(pipeline_step, steps, device)


SETTLED_BYTES = 1 << 20
"""A run of a configuration's timed steps that faulted in more fresh memory than this on a
rank (bytes) is not yet training's steady state (:func:`settled`)."""


def page_faults() -> int:
    """Pages this process has faulted in so far: fresh memory the kernel zeroed (minor faults)
    or read (major)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def settled(faults: Sequence[int], page_bytes: int | None = None) -> bool:
    """Whether a run whose ranks faulted in ``faults`` pages each (of ``page_bytes``, default
    the system's) took no more than :data:`SETTLED_BYTES` of fresh memory on any rank."""
    size = resource.getpagesize() if page_bytes is None else page_bytes
    return max(faults, default=0) * size <= SETTLED_BYTES


def _timed(step: Any, steps: int, device: torch.device) -> Any:
    """``run(lead=0)``: ``lead`` untimed calls of ``step``, a barrier, then ``steps`` timed ones
    (seconds on this rank); ``run.steps_run`` counts the calls, ``run.faults`` the pages the
    last run's timed steps faulted in (:func:`page_faults`)."""

    def counted() -> None:
        step()
        run.steps_run += 1  # type: ignore[attr-defined]

    def run(lead: int = 0) -> float:
        for _ in range(lead):
            dist.barrier()
            counted()
        dist.barrier()
        sync(device)
        faults = page_faults()
        start = time.perf_counter()
        for _ in range(steps):
            counted()
        sync(device)
        seconds = time.perf_counter() - start
        run.faults = page_faults() - faults  # type: ignore[attr-defined]
        return seconds

    run.steps_run = 0  # type: ignore[attr-defined]
    run.faults = 0  # type: ignore[attr-defined]
    return run


def _trainer(plan: Plan, model: nn.Module, device: torch.device,
             inputs: tuple[torch.Tensor, ...] = (), kwargs: dict[str, torch.Tensor] | None = None,
             own_loss: bool = False) -> Any:
    """This rank's ``Trainer`` of ``plan``: the tutorial's loss (``own_loss``: the model's own,
    :func:`autosplit.measure.losses.model_loss`), SGD at its learning rate; the replicas' losses not
    averaged every step, as ``autosplit run`` trains. A model with keyword inputs is captured
    from its call (``inputs``, ``kwargs``), as ``autosplit run`` captures it."""
    example = {"example_inputs": inputs, "example_kwargs": kwargs} if kwargs else {}
    return distributed.Trainer(model, plan, model_loss if own_loss else distributed.tutorial_loss,
                               lambda params: torch.optim.SGD(params, lr=LR), device=device,
                               reduce_loss=False, **example)


def start_marks() -> dict[str, Any]:
    """The wall clock, this process's CPU time and the machine's (:func:`autosplit.measure.steal_time.cpu_seconds`)
    now, for :func:`add_machine_load` at the end of a measurement."""
    return {"wall": time.perf_counter(), "own": time.process_time(),
            "machine": steal_time.cpu_seconds()}


def add_machine_load(load: dict[str, Any], marks: dict[str, Any],
                     after: tuple[float, float] | None) -> None:
    """Into ``load`` (which holds ``wall_s`` and ``ranks_cpu_s``): the machine's busy and stolen
    CPU time since ``marks`` (core-seconds), what other processes took of it and their share of
    all cores' time; nothing where /proc/stat cannot be read."""
    if marks["machine"] is not None and after is not None:
        busy = after[0] - marks["machine"][0]
        load["machine_cpu_s"] = busy
        load["steal_s"] = after[1] - marks["machine"][1]
        load["others_cpu_s"] = max(0.0, busy - load["ranks_cpu_s"])
        load["others_share"] = load["others_cpu_s"] / (load["wall_s"] * (os.cpu_count() or 1))


def _checked(runner: Any, group: Group, rank: int, label: str,
             faults: Callable[[], int] = lambda: 0) -> tuple[float, float, int, int]:
    """Time ``runner`` once; while other processes or the hypervisor take more than
    ``group.max_others`` of the machine's CPU time during the timing (:func:`disturbance`),
    time it again (at most ``group.retries`` times, after a pause that lets the other job
    pass); and while a rank's timed steps faulted in fresh memory (``faults()``: the pages
    the timing faulted in on this rank; not :func:`settled`), time it again at once: such a
    timing is not training's steady state (one step of the big-vocabulary model that faulted
    in its 65 MB of logits took 1.3 s beside 0.35 s, and moved a median of five). Every rank
    takes the same decision: the ranks' own CPU time and faults are gathered and rank 0's
    reading of the machine's decides.

    Returns (seconds on this rank, the share lost to others in the kept timing, the timings
    taken again for the others' load, those taken again for fresh memory)."""
    cores = os.cpu_count() or 1
    retaken = [0, 0]  # disturbed, faulted
    for attempt in range(group.retries + 1):
        before, own = steal_time.cpu_seconds(), time.process_time()
        start = time.perf_counter()
        seconds = runner()
        wall = time.perf_counter() - start
        own = time.process_time() - own
        after = steal_time.cpu_seconds()
        used = (None if before is None or after is None
                else (after[0] - before[0], after[1] - before[1]))
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (own, used, wall, faults()))
        # decide on gathered values only (rank 0's clock and reading), so that every rank
        # decides alike: a rank that retook a timing alone would wait for its peer forever
        fresh = not settled([g[3] for g in gathered])
        if gathered[0][1] is None:
            share, judged = math.nan, False
        else:
            busy, stolen = gathered[0][1]
            share, judged = disturbance(busy, stolen, sum(g[0] for g in gathered),
                                        gathered[0][2], cores)
        disturbed = judged and share > group.max_others
        if not (disturbed or fresh) or attempt == group.retries:
            break
        retaken[0 if disturbed else 1] += 1
        if rank == 0:
            why = (f"other processes or the hypervisor took {share:.0%} of the CPU"
                   if disturbed else "its steps faulted in fresh memory")
            print(f"  {group.name}: {label}: {why}, timing it again", flush=True)
        if disturbed:
            time.sleep(1.0 + attempt)
    return seconds, share, retaken[0], retaken[1]


def disturbance(busy_s: float, stolen_s: float, ranks_cpu_s: float, wall_s: float,
                cores: int) -> tuple[float, bool]:
    """How much of the machine a timing lost to others: the CPU time other processes used
    (the machine's busy time ``busy_s`` less the ranks' own ``ranks_cpu_s``) plus the time the
    hypervisor stole from this machine's virtual cores (``stolen_s``: they were ready to run,
    and waited), as a share of all ``cores``' time over ``wall_s`` (all in seconds); and
    whether that is enough to judge at all (under :data:`autosplit.measure.steal_time.MIN_JUDGED_S`, too
    few ticks of /proc/stat).

    Stolen time counts like another process's: the ranks were ready to run and did not (what it
    did to one accuracy run: :mod:`autosplit.measure.steal_time`)."""
    lost = max(0.0, busy_s - ranks_cpu_s) + max(0.0, stolen_s)
    return lost / max(wall_s * cores, 1e-9), lost >= steal_time.MIN_JUDGED_S


def _rounds(group: Group, labels: Sequence[str], runners: dict[str, Any], count: int,
            skip: int, rank: int, what: str, leads: dict[str, int] | None = None
            ) -> tuple[dict[str, list[float]], dict[str, Any], dict[str, int]]:
    """Time ``count`` rounds after ``skip`` untimed ones and, if there were any, untimed rounds
    until every configuration's steps settled (:func:`settled`; at most ``group.settle_rounds``),
    each timing after its configuration's lead-in steps (``leads``; else from the untimed
    rounds' steps, see :class:`Group`; see :func:`_checked`); also what other processes took of
    the machine during the timed rounds (the whole machine's busy CPU time minus the ranks'
    own, discarded timings included), the settling rounds run and the timings that still
    faulted in fresh memory. Returns the times, the load and the lead-in steps per
    configuration."""
    untimed: dict[str, list[float]] = {label: [] for label in labels}
    faulted: list[str] = []  # no warm-up asked for: no settling either
    for r in range(skip):
        faulted = _untimed_round(group, labels, runners, r, rank, "warm-up", untimed, {})
    if leads is None:
        leads = _lead_ins(group, untimed) if skip else {}
    settling = 0
    while faulted and settling < group.settle_rounds:
        faulted = _untimed_round(group, labels, runners, skip + settling, rank,
                                 f"settling {settling + 1}", untimed, leads)
        settling += 1
    times: dict[str, list[float]] = {label: [] for label in labels}
    faults: dict[str, list[int]] = {label: [] for label in labels}
    shares: list[float] = []
    retried = retaken_fresh = 0
    marks = start_marks()
    r = 0
    while r < count or (r < count + group.more_rounds
                        and _noisy(times, labels, group.max_spread)):
        order = _direction(labels, skip + settling + r)
        start = time.perf_counter()
        for label in order:
            run = functools.partial(runners[label], leads.get(label, 0))
            seconds, share, retries, fresh = _checked(
                run, group, rank, label, functools.partial(getattr, runners[label], "faults"))
            times[label].append(seconds)
            faults[label].append(runners[label].faults)
            shares.append(share)
            retried += retries
            retaken_fresh += fresh
        r += 1
        if rank == 0:
            extra = f" (more: timings spread over {group.max_spread:.0%})" if r > count else ""
            print(f"  {group.name}: {what} {r}/{count} round of {len(order)} configurations "
                  f"in {time.perf_counter() - start:.1f} s{extra}", flush=True)
    wall = time.perf_counter() - marks["wall"]
    own = time.process_time() - marks["own"]
    after = steal_time.cpu_seconds()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (times, own, faults))  # every rank gets every rank's
    merged = {label: [max(col) for col in zip(*(g[0][label] for g in gathered))] for label in labels}
    judged = [x for x in shares if not math.isnan(x)]
    load: dict[str, Any] = {
        "wall_s": wall, "ranks_cpu_s": sum(g[1] for g in gathered), "timings": len(shares),
        "retried": retried, "retaken_fresh": retaken_fresh,
        "max_others": group.max_others, "steal_counted": True,
        "kept_over_limit": sum(x > group.max_others for x in judged),
        "max_kept_share": max(judged, default=math.nan),
        "settling_rounds": settling, "unsettled": faulted,
        "extra_rounds": r - count,
        "faulted_timings": sum(not settled(col) for label in labels
                               for col in zip(*(g[2][label] for g in gathered))),
        "fault_pages": {label: [max(col) for col in zip(*(g[2][label] for g in gathered))]
                        for label in labels},
    }
    add_machine_load(load, marks, after)
    return merged, load, dict(leads)


def _noisy(times: dict[str, list[float]], labels: Sequence[str], max_spread: float) -> bool:
    """Whether some configuration's timings so far, the slowest rank's (gathered: every rank
    decides alike), spread by more than ``max_spread``
    (:func:`autosplit.measure.spread.relative_spread`). Collective."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    return any(relative_spread([max(col) for col in zip(*(g[label] for g in gathered))])
               > max_spread for label in labels)


def _direction(labels: Sequence[str], r: int) -> list[str]:
    """Round ``r``'s order: A B C in even rounds, C B A in odd ones."""
    return list(labels) if r % 2 == 0 else list(reversed(labels))


def _untimed_round(group: Group, labels: Sequence[str], runners: dict[str, Any], r: int,
                   rank: int, kind: str, untimed: dict[str, list[float]],
                   leads: dict[str, int]) -> list[str]:
    """Run every configuration once, untimed (its lead-in steps first), in round ``r``'s
    direction; append each one's seconds per step to ``untimed``. Collective: returns, on every
    rank alike, the configurations whose steps (lead-in steps included) faulted in fresh memory
    on some rank (:func:`settled`)."""
    order = _direction(labels, r)
    start = time.perf_counter()
    faults: dict[str, int] = {}
    for label in order:
        before = page_faults()  # over its lead-in steps too
        untimed[label].append(runners[label](leads.get(label, 0)) / group.steps)
        faults[label] = page_faults() - before
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, faults)
    faulted = [label for label in labels if not settled([g[label] for g in gathered])]
    if rank == 0:
        note = f"; fresh memory faulted in by {', '.join(faulted)}" if faulted else ""
        print(f"  {group.name}: {kind} round of {len(order)} configurations "
              f"in {time.perf_counter() - start:.1f} s{note}", flush=True)
    return faulted


def _lead_ins(group: Group, untimed: dict[str, list[float]]) -> dict[str, int]:
    """Per configuration, the untimed steps to run before each timing (:class:`Group`), from
    its steps in the untimed rounds (the slowest rank's last; none timed: none). Collective:
    every rank decides on the same gathered times."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, untimed)
    return {label: lead_in_steps(group.lead_in_s, max(
        (g[label][-1] for g in gathered if g[label]), default=math.inf)) for label in untimed}


def lead_in_steps(lead_in_s: float, step_s: float) -> int:
    """Untimed steps before each timing of a configuration whose step takes ``step_s``
    seconds: ``ceil(lead_in_s / step_s)`` for a step shorter than ``lead_in_s``, else none."""
    if lead_in_s <= 0 or step_s >= lead_in_s:
        return 0
    return math.ceil(lead_in_s / max(step_s, 1e-3))


def _run_group(group: Group, device: torch.device, rank: int) -> dict[str, Any]:
    model = group.spec.build().to(device)
    inputs = group.spec.make_inputs()
    kwargs = group.spec.make_kwargs()
    own = bool(kwargs) and returns_own_loss(model, inputs, kwargs)
    targets = None if own else distributed.tutorial_targets(model, inputs, kwargs=kwargs or None)
    labels = [c.label for c in group.configs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"group {group.name}: configuration labels repeat")
    runners: dict[str, Any] = {}
    for config in group.configs:  # every rank builds them in the same order (collectives)
        # FSDP2 shards the modules it is given in place: a sharded plan trains a copy of its own
        sharded = config.plan is not None and config.plan.replica_mode != "ddp"
        runners[config.label] = _runner(config, copy.deepcopy(model) if sharded else model,
                                        inputs, targets, device, rank, group.steps, kwargs)
    times, load, leads = _rounds(group, labels, runners, group.rounds, group.warmup, rank, "round")
    refined: dict[str, list[float]] = {}
    if group.refine and group.refine_rounds:
        # the same choice on every rank: all hold the same gathered times
        ranked = sorted(labels, key=lambda lb: (statistics.median(times[lb]), labels.index(lb)))
        chosen = ranked[: group.refine] + [lb for lb in group.keep if lb not in ranked[: group.refine]]
        chosen = [lb for lb in labels if lb in chosen]  # original order
        refined, refine_load, _ = _rounds(group, chosen, runners, group.refine_rounds, 0, rank,
                                          "refine round", leads)
        summed = ("wall_s", "ranks_cpu_s", "timings", "retried", "retaken_fresh",
                  "kept_over_limit", "machine_cpu_s", "steal_s", "others_cpu_s",
                  "faulted_timings", "extra_rounds")
        load = {k: load[k] + refine_load[k] if k in summed else load[k]
                for k in load if k in refine_load}
        load["max_kept_share"] = max(load["max_kept_share"], refine_load["max_kept_share"])
        if "others_cpu_s" in load:
            load["others_share"] = load["others_cpu_s"] / (load["wall_s"] * (os.cpu_count() or 1))
    steps_run = {label: runner.steps_run for label, runner in runners.items()}
    del runners
    peaks: dict[str, list[int]] = {}
    if group.memory:
        for config in group.configs:
            if config.plan is not None:
                peaks[config.label] = peak_memory(config.plan, model, inputs, targets, device,
                                                  kwargs=kwargs)
    return {"times": times, "refined": refined, "load": load, "peak_bytes": peaks,
            "lead_in_steps": leads, "steps_run": steps_run}


def peak_memory(plan: Plan, model: nn.Module, inputs: tuple[torch.Tensor, ...], targets: Any,
                device: torch.device, steps: int = 2,
                kwargs: dict[str, torch.Tensor] | None = None) -> list[int]:
    """Every rank's peak tensor memory (bytes) while a fresh ``Trainer`` of ``plan`` is built
    and trains ``steps`` steps: its stages' parameters and buffers, plus the highest rise of
    allocated memory above the level before (gradients, optimizer state, activations in flight,
    received values; :func:`autosplit.measure.peak_memory.rise_during`). Untimed: the profiler that
    measures it on a CPU slows the step. Collective: every rank calls it alike."""
    model.zero_grad(set_to_none=True)  # gradients left by earlier configurations
    gc.collect()

    def build_and_train() -> Any:
        trainer = _trainer(plan, model, device, inputs, kwargs, targets is None)
        for _ in range(steps):
            if trainer.holds_first:
                trainer.step(inputs, targets if trainer.holds_last else None,
                             kwargs=kwargs or None)
            else:
                trainer.step(None, targets if trainer.holds_last else None)
        return trainer

    trainer, rise = rise_during(build_and_train, device)
    static = tensor_bytes([*trainer.parameters(), *(b for _, b in trainer.named_buffers())])
    del trainer
    model.zero_grad(set_to_none=True)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, static + rise)
    return [int(x) for x in gathered]


def summary(values: Sequence[float]) -> dict[str, float]:
    """Mean, population std (``np.std``, as the tutorial), median, min and max."""
    return {
        "mean": statistics.fmean(values),
        "std": statistics.pstdev(values) if len(values) > 1 else 0.0,
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def stage_check(plan: Plan, model: nn.Module, inputs: tuple[torch.Tensor, ...], device: torch.device,
                repeats: int = 3) -> list[float]:
    """Each stage's forward + backward of one micro-batch with its blocks run together in this
    process (one CPU thread), as a pipeline rank runs them: stage 0 computes no gradient for the
    model's inputs, later stages do for what they receive. Median of ``repeats`` after a warm-up,
    in ms: what the profile's per-block sums (``Stage.compute_ms``) predict."""
    modules = distributed.stage_modules(model, plan)
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
                sync(device)
                start = time.perf_counter()
                out = module(*received)
                leaves = [t for t in ((out,) if isinstance(out, torch.Tensor) else out) if t.requires_grad]
                torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
                sync(device)
                if r:
                    times.append((time.perf_counter() - start) * 1000)
            result.append(statistics.median(times))
            values = tuple(t.detach() for t in ((out,) if isinstance(out, torch.Tensor) else out))
    finally:
        torch.set_num_threads(threads)
        model.zero_grad(set_to_none=True)
    return result


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """--max-others and --retries: what to do about other processes on a shared machine;
    --lead-in and --settle-rounds: how steps are brought to the steady state of training
    (:class:`Group`; :func:`load_options` turns them into a group's settings)."""
    parser.add_argument("--max-others", type=float, default=0.10,
                        help="retake a timing during which other processes used more than this "
                             "share of the machine's CPU time (default 0.10)")
    parser.add_argument("--retries", type=_count, default=3,
                        help="at most this many retakes per timing, for the others' load or "
                             "fresh memory (default 3; 0: never)")
    parser.add_argument("--lead-in", type=float, default=1.0, metavar="S", dest="lead_in",
                        help="a configuration whose step is shorter than S seconds runs untimed "
                             "steps of its own for S seconds before each timing (default 1.0; "
                             "0: never)")
    parser.add_argument("--settle-rounds", type=_count, default=10, metavar="N",
                        dest="settle_rounds",
                        help="after the warm-up round, at most N more untimed rounds while a "
                             "configuration's steps fault in fresh memory (over 1 MiB on a "
                             "rank; default 10; 0: never)")
    parser.add_argument("--more-rounds", type=_count, default=5, metavar="N", dest="more_rounds",
                        help="after the timed rounds, at most N more while a configuration's "
                             "timings spread by over --max-spread (default 5; 0: never)")
    parser.add_argument("--max-spread", type=_fraction, default=0.03, metavar="F",
                        dest="max_spread",
                        help="the spread (half the interquartile range over the median) that "
                             "asks for more timed rounds (default 0.03)")


def _count(text: str) -> int:
    """A whole number of at least 0 (an option's value), else a one-line usage error."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"a whole number of 0 or more; got {text!r}")
    return value


def _fraction(text: str) -> float:
    """A number above 0 (an option's value), else a one-line usage error."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a number above 0; got {text!r}")
    return value


def load_options(args: argparse.Namespace) -> dict[str, Any]:
    """A :class:`Group`'s settings from :func:`add_load_arguments`' options."""
    return {"max_others": args.max_others, "retries": args.retries, "lead_in_s": args.lead_in,
            "settle_rounds": args.settle_rounds, "more_rounds": args.more_rounds,
            "max_spread": args.max_spread}
