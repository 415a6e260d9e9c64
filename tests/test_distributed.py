"""One process per stage on torch.distributed.pipelining (gloo on 127.0.0.1).

Every multi-process test launches real ranks with autosplit.launch (the torchrun
launcher) and compares, on rank 0 after gathering, the loss, every parameter gradient, the
parameters after an SGD step and the BatchNorm statistics with the same model run in this
process on the same micro-batches: each micro-batch's loss backpropagated, the gradients then
divided by m (what the schedules do with ``scale_grads=True``: the gradient of the mean of the
micro-batch losses), BatchNorm seeing micro-batches in order.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torchvision
from models import (
    DropNorm,
    LongSkip,
    ReusedLayer,
    TiedLM,
    TokenModel,
    ToyModel,
    TupleAcross,
    TwoInOut,
)
from torch import nn
from torch.utils import _pytree as pytree

from autosplit import distributed
from autosplit.capture.trace import trace
from autosplit.cli import main
from autosplit.errors import InvalidInputError, PlanMismatchError
from autosplit.records import Plan, Stage

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 30.0  # process-group timeout of every launched test run
LONG_TIMEOUT_S = 150.0  # for tests that check a run ends before its timeout


# --------------------------------------------------------------------------------- models


class LateIds(nn.Module):
    """Token ids are read again at the head: an integer tensor crosses every cut."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)
        self.bias = nn.Embedding(vocab, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.embed(ids)))
        return self.head(h) + self.bias(ids)


class SizeLate(nn.Module):
    """``x.size(0)`` (a Python int) is read after the cut."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        return self.b(self.a(x)).view(n, -1)


def build(name: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A fresh model, the same on every rank and in the reference (seeded), in ``dtype``."""
    torch.manual_seed(0)
    if name == "resnet18":
        return torchvision.models.resnet18(num_classes=10).to(dtype)
    return {"toy": ToyModel, "skip": LongSkip, "twoinout": TwoInOut, "ids": LateIds,
            "tokens": TokenModel, "tied": TiedLM, "reused": ReusedLayer,
            "dropnorm": DropNorm}[name]().to(dtype)


def in_dtype(value: Any, dtype: torch.dtype) -> Any:
    """``value``'s floating tensors in ``dtype`` (any structure)."""
    return pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        value)


def batch(name: str, rows: int) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Inputs and targets of ``rows`` rows for model ``name`` (seeded)."""
    gen = torch.Generator().manual_seed(1)
    if name == "resnet18":
        return (torch.randn(rows, 3, 32, 32, generator=gen),), torch.randn(rows, 10, generator=gen)
    if name == "toy":
        return (torch.randn(rows, 10, generator=gen),), torch.randn(rows, 5, generator=gen)
    if name in ("skip", "reused", "dropnorm"):
        return (torch.randn(rows, 6, generator=gen),), torch.randn(rows, 3, generator=gen)
    if name == "twoinout":
        x, y = torch.randn(rows, 4, generator=gen), torch.randn(rows, 3, generator=gen)
        target = (torch.randn(rows, 6, generator=gen),
                  {"small": torch.randn(rows, 2, generator=gen), "big": torch.randn(rows, 5, generator=gen)})
        return (x, y), target
    ids = torch.randint(0, 11, (rows, 5), generator=gen)
    return (ids,), torch.randn(rows, 5, 11, generator=gen)


def loss_fn(output: Any, target: Any) -> torch.Tensor:
    """Weighted squared error over every output leaf (each element counts differently)."""
    total = torch.zeros(())
    for out, tgt in zip(pytree.tree_leaves(output), pytree.tree_leaves(target)):
        weights = torch.linspace(0.5, 1.5, out.numel(), device=out.device).reshape(out.shape)
        total = total + (weights * (out - tgt) ** 2).mean().cpu()
    return total


def make_plan(model: nn.Module, balance: tuple[int, ...], split: int, m: int,
              schedule: str = "gpipe", granularity: str = "block") -> Plan:
    """A plan with the given blocks per stage (no profiling: the numbers are placeholders)."""
    graph = trace(model, granularity=granularity)  # type: ignore[arg-type]
    stages, first = [], 0
    for i, count in enumerate(balance):
        names = graph.block_names[first:first + count]
        stages.append(Stage(i, "cpu", names, 1.0, 0.5, 0, 0.0, 0))
        first += count
    assert first == len(graph.blocks), graph.block_names
    return Plan(graph.model_name, graph.fingerprint, tuple(stages), split, m, split * m, schedule,
                1.0, 1.0, "manual", (split,), "test")


# --------------------------------------------------------------------------- rank workers


def _snapshot(trainer: distributed.Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """Gradients, parameters and buffers, copied to the CPU (NCCL ranks hold them on GPUs)."""
    return {
        "grads": {n: p.grad.cpu().clone() for n, p in trainer.named_parameters() if p.grad is not None},
        "params": {n: p.detach().cpu().clone() for n, p in trainer.named_parameters()},
        "buffers": {n: b.cpu().clone() for n, b in trainer.named_buffers()},
    }


def _gather_to_rank0(value: Any) -> list[Any] | None:
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def train_and_gather(name: str, plan: Plan, steps: int, lr: float = 0.1,
                     dtype: torch.dtype = torch.float32) -> list[Any] | None:
    """Train ``steps`` SGD steps of ``plan`` on this rank; rank 0 gets every rank's
    ``(losses, snapshots, stage indices)``, the other ranks ``None``."""
    model = build(name, dtype)
    inputs, targets = in_dtype(batch(name, plan.batch_size), dtype)  # d·m·b rows: every replica's
    trainer = distributed.Trainer(model, plan, loss_fn, lambda ps: torch.optim.SGD(ps, lr=lr))
    losses, snaps = [], []
    for _ in range(steps):
        loss = trainer.step(inputs if trainer.holds_first else None,
                            targets if trainer.holds_last else None)
        losses.append(None if loss is None else loss.cpu())
        snaps.append(_snapshot(trainer))
    return _gather_to_rank0((losses, snaps, [m.index for m in trainer.modules]))


def _equivalence_worker(name: str, plans: list[Plan], steps: int,
                        dtype: torch.dtype = torch.float32) -> Any:
    """Train ``steps`` SGD steps per plan; rank 0 returns every rank's results merged."""
    merged = []
    for plan in plans:
        gathered = train_and_gather(name, plan, steps, dtype=dtype)
        if gathered is not None:
            last = len(plan.stages) - 1
            loss_rows = [ls for ls, _, idx in gathered if last in idx]
            assert len(loss_rows) == 1 and all(x is not None for x in loss_rows[0])
            result: dict[str, Any] = {"losses": loss_rows[0], "steps": []}
            for step in range(steps):
                part: dict[str, dict[str, torch.Tensor]] = {"grads": {}, "params": {}, "buffers": {}}
                for _, rank_snaps, _ in gathered:
                    for key, values in part.items():
                        overlap = values.keys() & rank_snaps[step][key].keys()
                        assert not overlap, f"two ranks hold {sorted(overlap)}"
                        values.update(rank_snaps[step][key])
                result["steps"].append(part)
            result["stages_per_rank"] = [idx for _, _, idx in gathered]
            merged.append(result)
    return merged if dist.get_rank() == 0 else None


def reference(name: str, plan: Plan, steps: int, lr: float = 0.1,
              dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The same training in this process: one model, the same micro-batches and loss.

    One intra-op thread, like every launched rank: kernels then sum in the same order (with
    BatchNorm over micro-batches of 2, thread-dependent rounding is amplified past the
    default tolerances).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(name, plan, steps, lr, dtype)
    finally:
        torch.set_num_threads(threads)


def _reference(name: str, plan: Plan, steps: int, lr: float, dtype: torch.dtype
               ) -> dict[str, Any]:
    model = build(name, dtype)
    inputs, targets = in_dtype(batch(name, plan.batch_size), dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    b = plan.split_size
    count = plan.batch_size // b  # m·d: every replica's micro-batches, in order
    input_mbs = list(zip(*(x.split(b) for x in inputs)))
    leaves, spec = pytree.tree_flatten(targets)
    target_mbs = [pytree.tree_unflatten([t.split(b)[i] for t in leaves], spec)
                  for i in range(count)]
    losses, snaps = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for mb, t in zip(input_mbs, target_mbs):
            loss = loss_fn(model(*mb), t)
            loss.backward()  # gradients of the sum of the micro-batch losses …
            total = total + loss.detach()
        for p in model.parameters():
            p.grad /= count  # … scaled to the mean, as the schedules (and DDP) do
        losses.append(total / count)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        snaps.append({"grads": grads,
                      "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                      "buffers": {n: x.clone() for n, x in model.named_buffers()}})
    return {"losses": losses, "steps": snaps}


def assert_same_training(got: dict[str, Any], expected: dict[str, Any], **tol: Any) -> None:
    """``tol``: tolerances of ``torch.testing.assert_close`` (a GPU run against the CPU's)."""
    for step, (loss, ref_loss) in enumerate(zip(got["losses"], expected["losses"], strict=True)):
        torch.testing.assert_close(loss, ref_loss, msg=lambda m, s=step: f"loss of step {s}: {m}",
                                   **tol)
    for step, (part, ref) in enumerate(zip(got["steps"], expected["steps"], strict=True)):
        for key in ("grads", "params", "buffers"):
            assert part[key].keys() == ref[key].keys(), f"{key} differ in names at step {step}"
            for n, value in ref[key].items():
                torch.testing.assert_close(
                    part[key][n], value, msg=lambda m, k=key, n=n, s=step: f"{k} {n} at step {s}: {m}",
                    **tol,
                )


CASES = {
    # name: (model, blocks per stage, split size, micro-batches, steps, granularity)
    "toy-2": ("toy", (1, 1), 2, 3, 2, "block"),
    "toy-3": ("toy", (1, 1, 1), 2, 3, 2, "layer"),
    "resnet18-2": ("resnet18", (5, 6), 2, 2, 1, "block"),
    "resnet18-3": ("resnet18", (4, 4, 3), 2, 3, 1, "block"),
    "longskip-3": ("skip", (2, 2, 3), 3, 4, 2, "block"),
    "twoinout-2": ("twoinout", (2, 3), 2, 3, 2, "block"),
    "ids-2": ("ids", (2, 2), 2, 3, 2, "block"),
}


def _case_plans(case: str) -> list[Plan]:
    """The plans of ``case`` (of :data:`CASES`): GPipe's and 1F1B's."""
    name, balance, split, m, _, granularity = CASES[case]
    model = build(name)
    return [make_plan(model, balance, split, m, schedule, granularity)
            for schedule in ("gpipe", "1f1b")]


def _cases_worker(cases: list[tuple[str, str, list[Plan], int]]) -> dict[str, Any] | None:
    """:func:`_equivalence_worker` for each ``(case, model, plans, steps)`` in turn; rank 0
    returns the results by case. An error names its case."""
    found = {}
    for case, name, plans, steps in cases:
        try:
            found[case] = _equivalence_worker(name, plans, steps)
        except Exception as exc:  # noqa: BLE001 (raised again, naming its case)
            raise RuntimeError(f"case {case}: {type(exc).__name__}: {exc}") from None
    return found if dist.get_rank() == 0 else None


@functools.cache
def _launched_cases(ranks: int) -> tuple[set[int], dict[str, Any]]:
    """Every case of :data:`CASES` that runs on ``ranks`` ranks, trained in one launch: the
    ranks that returned, and rank 0's results by case."""
    cases = [(case, CASES[case][0], _case_plans(case), CASES[case][4])
             for case in CASES if len(CASES[case][1]) == ranks]
    results = distributed.launch(_cases_worker, ranks, cases, timeout_s=TIMEOUT_S)
    return set(results), results[0]


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_equals_single_process(case: str) -> None:
    """Each case's plans trained on its ranks (one launch for every case of as many ranks)."""
    name, balance, _, _, steps, _ = CASES[case]
    returned, results = _launched_cases(len(balance))
    assert returned == set(range(len(balance)))
    for plan, got in zip(_case_plans(case), results[case], strict=True):
        assert got["stages_per_rank"] == [[r] for r in range(len(balance))]
        assert_same_training(got, reference(name, plan, steps))


def test_interleaved_stages_equal_single_process() -> None:
    """Four stages on two ranks: ScheduleLoopedBFS (gpipe) and ScheduleInterleaved1F1B (1f1b)."""
    model = build("skip")
    plans = [make_plan(model, (2, 2, 2, 1), 2, 4, schedule) for schedule in ("gpipe", "1f1b")]
    results = distributed.launch(_equivalence_worker, 2, "skip", plans, 2, timeout_s=TIMEOUT_S)
    for plan, got in zip(plans, results[0], strict=True):
        assert got["stages_per_rank"] == [[0, 2], [1, 3]]
        assert_same_training(got, reference("skip", plan, 2))


def test_one_gloo_rank_trains_four_float64_stages_like_one_process() -> None:
    """The CPU twin of the NCCL test below: one rank, four stages, float64, tight tolerances."""
    model = build("skip")
    plans = [make_plan(model, (2, 2, 2, 1), 2, 4, schedule) for schedule in ("gpipe", "1f1b")]
    results = distributed.launch(_equivalence_worker, 1, "skip", plans, 2, torch.float64,
                                 timeout_s=TIMEOUT_S)
    for plan, got in zip(plans, results[0], strict=True):
        assert got["stages_per_rank"] == [[0, 1, 2, 3]]
        assert {v.dtype for step in got["steps"] for v in step["params"].values()} == {
            torch.float64}
        assert_same_training(got, reference("skip", plan, 2, dtype=torch.float64), rtol=1e-9,
                             atol=1e-12)


@pytest.mark.cuda
@pytest.mark.parametrize("ranks", [
    1, pytest.param(2, marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")),
])
def test_nccl_ranks_train_like_one_process(ranks: int) -> None:
    """NCCL, rank r on cuda:r. NCCL refuses two ranks on one GPU, so with one GPU a single rank
    holds all four stages (the plan checks and gathers still go through NCCL). In float64:
    the GPU's and the CPU's kernels then agree to ~1e-15, so tight tolerances test the
    pipeline, not the kernels (in float32, BatchNorm over micro-batches of 2 amplified their
    rounding to 4e-5 on an H200)."""
    model = build("skip")
    plans = [make_plan(model, (2, 2, 2, 1), 2, 4, schedule) for schedule in ("gpipe", "1f1b")]
    results = distributed.launch(_equivalence_worker, ranks, "skip", plans, 2, torch.float64,
                                 backend="nccl", timeout_s=TIMEOUT_S)
    for plan, got in zip(plans, results[0], strict=True):
        assert got["stages_per_rank"] == ([[0, 1, 2, 3]] if ranks == 1 else [[0, 2], [1, 3]])
        assert_same_training(got, reference("skip", plan, 2, dtype=torch.float64), rtol=1e-9,
                             atol=1e-12)


# ------------------------------------------------------------------------------ failures


def _failing_worker(plan: Plan, how: str) -> None:
    model = build("toy")
    inputs, targets = batch("toy", plan.batch_size)
    trainer = distributed.Trainer(model, plan, loss_fn)
    calls = []

    def hook(module: nn.Module, args: Any) -> None:
        if args[0].is_meta:  # the first step's shape propagation
            return
        calls.append(1)
        if len(calls) == 2:  # mid-step: in the second micro-batch of the first step
            if how == "exit":
                os._exit(7)
            if how == "hang":
                time.sleep(600)
            raise RuntimeError("injected failure in the second micro-batch")

    if dist.get_rank() == 1:
        trainer.modules[0].register_forward_pre_hook(hook)
    for _ in range(3):
        trainer.step(inputs if trainer.holds_first else None, targets if trainer.holds_last else None)


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_dead_rank_ends_the_run_with_its_rank(how: str) -> None:
    plan = make_plan(build("toy"), (1, 1), 2, 3)
    start = time.monotonic()
    with pytest.raises(distributed.RankFailedError) as info:
        distributed.launch(_failing_worker, 2, plan, how, timeout_s=LONG_TIMEOUT_S)
    elapsed = time.monotonic() - start
    assert info.value.rank == 1
    assert str(info.value).startswith("rank 1 failed: ")
    if how == "exit":
        assert "exited with code 7" in str(info.value)
    else:
        assert "RuntimeError" in str(info.value) and "injected failure" in str(info.value)
    # rank 0 was stopped by the launcher, not by its process-group timeout (which would take
    # LONG_TIMEOUT_S: long enough that a loaded machine cannot blur the two)
    assert elapsed < LONG_TIMEOUT_S


def test_stuck_rank_ends_the_run_after_the_timeout() -> None:
    plan = make_plan(build("toy"), (1, 1), 2, 3)
    start = time.monotonic()
    with pytest.raises(distributed.RankFailedError) as info:
        distributed.launch(_failing_worker, 2, plan, "hang", timeout_s=5)
    elapsed = time.monotonic() - start
    # rank 0 gives up waiting after the process-group timeout; rank 1 left no error
    assert str(info.value).startswith("rank 1 failed: stopped without an error")
    assert "rank 0: " in str(info.value)
    assert elapsed < LONG_TIMEOUT_S  # ended by the 5 s timeout, not by rank 1's 600 s sleep


def _mismatch_worker(plans: list[Plan]) -> None:
    model = build("skip")
    distributed.Trainer(model, plans[dist.get_rank()], loss_fn)


@pytest.mark.parametrize("differ", ["cuts", "checkpointing"])
def test_ranks_with_different_plans_are_refused_at_start(differ: str) -> None:
    model = build("skip")
    plan = make_plan(model, (3, 4), 2, 2)
    if differ == "cuts":
        other, shown = make_plan(model, (4, 3), 2, 2), ("stages [3, 4]", "stages [4, 3]")
    else:
        stages = (plan.stages[0], dataclasses.replace(plan.stages[1], checkpoint=True))
        other = dataclasses.replace(plan, stages=stages)
        shown = ("2×2, gpipe vs", "stages [1] checkpointed")
    with pytest.raises(distributed.RankFailedError) as info:
        distributed.launch(_mismatch_worker, 2, [plan, other], timeout_s=TIMEOUT_S)
    message = str(info.value)
    assert "ModelMismatchError" in message and "rank 1 holds another plan" in message
    assert all(text in message for text in shown), message


def _descendants() -> set[int]:
    """Live processes below this one (children, their children …), but multiprocessing's
    helpers, one each for the process's lifetime: its resource tracker and its fork server,
    whose children (the ranks) are counted."""
    parents: dict[int, int] = {}
    helpers = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
                if b"resource_tracker" in cmdline or b"multiprocessing.forkserver" in cmdline:
                    helpers.add(int(entry.name))
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found - helpers


def _noop_worker() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to list child processes")
def test_launch_returns_every_rank_and_leaves_nothing_behind(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    # a temporary folder of its own: other runs on the machine create launcher folders too
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = _descendants()
    temp = Path(tempfile.gettempdir())
    assert temp == tmp_path
    folders = set(temp.iterdir())
    port = distributed.free_port()
    assert distributed.launch(_noop_worker, 3, timeout_s=TIMEOUT_S,
                              ranks=distributed.RankSettings(port=port)) == {
        0: (0, 3), 1: (1, 3), 2: (2, 3)}
    assert _descendants() - before == set()
    left = [f.name for f in set(temp.iterdir()) - folders
            if f.name.startswith(("torchelastic_", "autosplit-launch-"))]
    assert left == [], "the launcher's folders are removed"
    with socket.socket() as s:  # the rendezvous port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    assert not dist.is_initialized()


# --------------------------------------------------------------------- one-process checks


@pytest.mark.parametrize("name, balance", [("skip", (2, 3, 2)), ("twoinout", (1, 2, 2)), ("ids", (1, 1, 2))])
def test_stage_modules_chain_to_the_model(name: str, balance: tuple[int, ...]) -> None:
    model = build(name)
    plan = make_plan(model, balance, 2, 2)
    stages = distributed.stage_modules(model, plan)
    inputs, _ = batch(name, 4)
    values: Any = inputs
    for stage in stages[:-1]:
        values = stage(*values)
        assert isinstance(values, tuple) and len(values) == len(stage.output_names)
    out = stages[-1].unflatten_output(stages[-1](*values))
    torch.testing.assert_close(out, model(*inputs))
    # stage s receives exactly what stage s-1 sends
    for before, after in itertools.pairwise(stages):
        assert before.output_names == after.input_names


def test_skip_connection_is_passed_through_the_middle_stage() -> None:
    model = build("skip")
    stages = distributed.stage_modules(model, make_plan(model, (2, 2, 3), 2, 2))
    # the skip ("inp") crosses both cuts: stage 1 receives it and sends it on untouched
    assert stages[0].output_names == ("inp", "tanh")
    assert stages[1].input_names == ("inp", "tanh") and stages[1].output_names == ("inp", "tanh_2")
    assert [n.name for n in stages[1].body.graph.nodes if n.op == "placeholder"] == ["tanh"]
    x = torch.randn(4, 6)
    sent = stages[0](x)
    assert stages[1](*sent)[0] is sent[0]


def test_non_tensor_crossing_a_cut_is_named() -> None:
    model = TupleAcross()
    plan = make_plan(model, (1, 2), 2, 1)
    first = distributed.stage_modules(model, plan)[0]
    assert "chunk" in first.output_names
    message = (r"value 'chunk' \(a tuple from a\.chunk\(\)\) produced by block 'a' crosses "
               r"the cut before stage 1 \(after block 'a'\): only tensors can cross stages")
    with pytest.raises(distributed.CutValueError, match=message):
        first(torch.randn(2, 4))
    assert issubclass(distributed.CutValueError, InvalidInputError)
    sized = SizeLate()  # a size is computed again where it is used, from x, sent instead
    stages = distributed.stage_modules(sized, make_plan(sized, (1, 1), 2, 1))
    assert "size" not in stages[0].output_names and "x" in stages[0].output_names
    x = torch.randn(2, 4)
    torch.testing.assert_close(stages[1](*stages[0](x)), sized(x))


@pytest.fixture
def one_rank_group() -> Any:
    """A process group of this process alone (gloo, in-memory store), destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_one_rank_holding_every_stage(one_rank_group: None) -> None:
    name = "skip"
    model = build(name)
    plan = make_plan(model, (2, 2, 3), 2, 3, "1f1b")
    trainer = distributed.Trainer(model, plan, loss_fn, lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert trainer.holds_first and trainer.holds_last and [m.index for m in trainer.modules] == [0, 1, 2]
    inputs, targets = batch(name, 6)
    loss = trainer.step(inputs, targets)
    expected = reference(name, plan, 1)
    got = {"losses": [loss], "steps": [_snapshot(trainer)]}
    assert_same_training(got, expected)
    with pytest.raises(InvalidInputError, match=r"the inputs have 5 rows; the plan runs 3 micro-batches of 2 = 6 rows"):
        trainer.step((inputs[0][:5],), targets)
    with pytest.raises(InvalidInputError, match="needs the targets"):
        trainer.step(inputs, None)


def test_a_schedule_whose_step_takes_no_micro_batches_trains_the_same(one_rank_group: None
                                                                       ) -> None:
    """torch 2.11's ``step()`` has no ``arg_mbs``: the trainer then runs the schedule's own
    micro-batch loop, and the training is the same as one process's."""
    name = "skip"
    model = build(name)
    plan = make_plan(model, (2, 2, 3), 2, 3, "1f1b")
    trainer = distributed.Trainer(model, plan, loss_fn, lambda ps: torch.optim.SGD(ps, lr=0.1))
    inputs, targets = batch(name, 6)
    losses, snaps = [trainer.step(inputs, targets)], [_snapshot(trainer)]

    def old_step(*args: Any, target: Any = None, losses: Any = None, return_outputs: bool = True,
                 **kwargs: Any) -> None:
        raise AssertionError("step() would split the micro-batches given as keywords")

    trainer.schedule.step = old_step
    losses.append(trainer.step(inputs, targets))
    snaps.append(_snapshot(trainer))
    assert_same_training({"losses": losses, "steps": snaps}, reference(name, plan, 2))


def test_1f1b_needs_as_many_micro_batches_as_stages(one_rank_group: None) -> None:
    model = build("skip")
    with pytest.raises(InvalidInputError, match=r"1f1b needs at least as many micro-batches as stages \(2 < 3\)"):
        distributed.Trainer(model, make_plan(model, (2, 2, 3), 2, 2, "1f1b"), loss_fn)


def test_trainer_needs_a_process_group() -> None:
    model = build("toy")
    with pytest.raises(InvalidInputError, match="init_distributed"):
        distributed.Trainer(model, make_plan(model, (1, 1), 2, 2), loss_fn)


def test_stage_indices() -> None:
    assert distributed.stage_indices(4, 1, 2) == (1, 3)
    assert distributed.stage_indices(3, 2, 3) == (2,)
    with pytest.raises(InvalidInputError, match="cannot be spread over 2 processes"):
        distributed.stage_indices(3, 0, 2)


def test_bad_launch_arguments() -> None:
    with pytest.raises(InvalidInputError, match="nprocs"):
        distributed.launch(_noop_worker, 0)
    with pytest.raises(InvalidInputError, match="backend"):
        distributed.launch(_noop_worker, 2, backend="mpi")


def test_plan_for_another_model_is_refused() -> None:
    plan = make_plan(build("toy"), (1, 1), 2, 2)
    with pytest.raises(PlanMismatchError, match="make a new plan"):
        distributed.stage_modules(build("skip"), plan)


def test_tutorial_targets_match_the_output_without_computing() -> None:
    model = torchvision.models.resnet18(num_classes=7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (target,) = distributed.tutorial_targets(model, (torch.randn(6, 3, 32, 32),))
    assert target.shape == (6, 7) and torch.equal(target.sum(dim=1), torch.ones(6))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    out = torch.randn(6, 7, requires_grad=True)
    distributed.tutorial_loss(out, (target,)).backward()
    assert out.grad is not None


# -------------------------------------------------------------------------- split specs


def test_to_split_spec_on_module_boundaries() -> None:
    from torch.distributed.pipelining import SplitPoint, pipeline

    model = build("skip")
    plan = make_plan(model, (2, 3, 2), 2, 2)
    spec = distributed.to_split_spec(plan)
    assert spec == {"layers.1": SplitPoint.BEGINNING, "norm": SplitPoint.BEGINNING}
    assert distributed.to_split_spec(plan, model) == spec
    pipe = pipeline(model, (torch.randn(2, 6),), split_spec=spec)
    assert pipe.num_stages == 3
    # pipeline() puts the same parameters on each stage as the plan and autosplit's stages do
    ours = distributed.stage_modules(model, plan)
    for s in range(3):
        names = [n for n, _ in pipe.get_stage_module(s).named_parameters()]
        assert names == [n for n, _ in ours[s].body.named_parameters()]


def test_to_split_spec_refuses_cuts_inside_modules() -> None:
    model = torchvision.models.resnet18(num_classes=10)
    graph = trace(model, granularity="layer")
    names = graph.block_names
    # with granularity="layer", the residual add of layer1.0 is its own block named "layer1.0"
    cut = names.index("layer1.0")
    plan = make_plan(model, (cut, len(names) - cut), 2, 2, granularity="layer")
    with pytest.raises(InvalidInputError, match=r"stage 1 begins inside module 'layer1.0'"):
        distributed.to_split_spec(plan, model)
    relu2 = next(n for n in names if n.endswith("#2"))
    cut = names.index(relu2)
    plan = make_plan(model, (cut, len(names) - cut), 2, 2, granularity="layer")
    with pytest.raises(InvalidInputError, match="not a module boundary"):
        distributed.to_split_spec(plan)


# ------------------------------------------------------------------------------- the CLI


def _toy_plan_file(tmp_path: Path, schedule: str = "1f1b") -> Path:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import toy  # examples/toy.py

        model = toy.build_model()
    finally:
        sys.path.remove(str(ROOT / "examples"))
    path = tmp_path / "plan.json"
    make_plan(model, (1, 1), 4, 5, schedule).save(path)
    return path


def test_cli_run_trains_and_prints_step_times(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _toy_plan_file(tmp_path)
    code = main(["run", str(ROOT / "examples" / "toy.py"), "--plan", str(plan), "--steps", "3"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "2 ranks" in out and "gloo" in out
    import re

    for step in (1, 2, 3):  # a step of the toy takes milliseconds: written in ms, not "0.00 s"
        assert re.search(rf"step {step} +\d+\.\d+ m?s +loss \d", out), out
    assert re.search(r"median step \d+\.\d+ m?s .* the plan predicted \d+\.\d+ m?s", out), out


def test_cli_run_says_when_the_ranks_share_cores(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from autosplit.cli import run

    plan = _toy_plan_file(tmp_path)
    for cores, said in ((1, True), (2, False)):
        monkeypatch.setattr(run, "_cores", lambda cores=cores: cores)
        assert main(["run", str(ROOT / "examples" / "toy.py"), "--plan", str(plan), "--steps",
                     "1"]) == 0
        out = capsys.readouterr().out
        assert ("note: 2 ranks × 1 thread on 1 core: the ranks take turns on the cores"
                in out) == said
        assert ("take turns" in out) == said


def test_cli_run_refuses_bad_input_before_launching(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _toy_plan_file(tmp_path)
    code = main(["run", str(ROOT / "tests" / "models.py"), "--entry", "LongSkip", "--plan", str(plan)])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "another model" in err and len(err.strip().splitlines()) == 1
    code = main(["run", str(ROOT / "examples" / "toy.py"), "--plan", str(plan), "--batch-size", "7"])
    err = capsys.readouterr().err
    assert code == 2 and "20 rows" in err


DYING_MODEL = '''
import os
import torch
from torch import nn

class Dies(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

def build_model():
    model = Dies()
    if os.environ.get("RANK") == "1":  # rank 1 dies in its third forward call of b
        calls = []
        def hook(module, args):
            if not args[0].is_meta:
                calls.append(1)
            if len(calls) == 3:
                os._exit(9)
        model.b.register_forward_pre_hook(hook)
    return model

def example_inputs(batch_size=8):
    return torch.randn(batch_size, 4)
'''


def test_cli_run_reports_a_dead_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "dies.py"
    path.write_text(DYING_MODEL)
    from autosplit.modelfile import load_model_file

    model = load_model_file(str(path)).build()
    plan = tmp_path / "plan.json"
    make_plan(model, (1, 1), 2, 4).save(plan)
    start = time.monotonic()
    code = main(["run", str(path), "--plan", str(plan), "--steps", "2",
                 "--timeout", str(LONG_TIMEOUT_S)])
    err = capsys.readouterr().err
    assert code == 1
    assert "error: rank 1 failed: exited with code 9" in err
    assert time.monotonic() - start < LONG_TIMEOUT_S  # the failure ended it, not the timeout


def test_a_rank_whose_rendezvous_has_no_rank_0_says_so_and_ends_at_the_timeout(
        tmp_path: Path) -> None:
    import subprocess

    toy = str(Path(__file__).resolve().parent.parent / "examples" / "toy.py")
    plan = tmp_path / "plan.json"
    assert main(["plan", toy, "--gpus", "2", "--microbatch-sizes", "2,4", "--repeats", "1",
                 "--no-verify", "--pipeline-only", "-o", str(plan)]) == 0
    port = distributed.free_port()
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autosplit", "run", toy, "--plan", str(plan),
                           "--steps", "1", "--timeout", "3"], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert f"rank 1 of 2 joining the rendezvous at 127.0.0.1:{port}" in lines[0]
    assert "waiting for the other ranks (up to --timeout 3 s)" in lines[0]
    assert lines[-1].startswith("error: rank 1 of 2 joining the rendezvous")
    assert "no process group within 3 s" in lines[-1] and "unset RANK" in lines[-1]
    assert "frame #" not in done.stderr and "Traceback" not in done.stderr
    assert time.perf_counter() - started < 60
