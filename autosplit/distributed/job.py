"""The ``autosplit run`` job: train a model file's model on a plan, or time plans side by side.

Every function here runs as one rank inside an initialised process group (torchrun or
:func:`autosplit.launch.launch`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from autosplit.distributed.trainer import Trainer
from autosplit.errors import InvalidInputError
from autosplit.measure.losses import model_loss, tutorial_loss
from autosplit.records import Plan


def tutorial_targets(
    model: nn.Module, inputs: Sequence[torch.Tensor], seed: int = 0,
    kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Targets for :func:`tutorial_loss` and a batch of ``inputs``: one-hot labels over the last
    dimension of every floating output with two or more dimensions (the tutorial's MSE on
    one-hot labels), random values for 1-D outputs.

    The output shapes come from a run on the meta device (nothing is computed; ``model`` is
    not changed); an operation without a meta kernel falls back to one real sample in eval mode.
    """
    gen = torch.Generator().manual_seed(seed)
    targets = []
    for shape in _output_shapes(model, inputs, kwargs or {}):
        if len(shape) >= 2:
            labels = torch.randint(0, shape[-1], tuple(shape[:-1]), generator=gen)
            targets.append(nn.functional.one_hot(labels, shape[-1]).float())
        else:
            targets.append(torch.randn(tuple(shape), generator=gen))
    return tuple(targets)


def _output_shapes(model: nn.Module, inputs: Sequence[torch.Tensor],
                   kwargs: dict[str, Any]) -> list[tuple[int, ...]]:
    return [tuple(x.shape) for x in pytree.tree_leaves(output_on_meta(model, inputs, kwargs))
            if isinstance(x, torch.Tensor) and x.is_floating_point()]


def output_on_meta(model: nn.Module, inputs: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The model's output for a batch of ``(inputs, kwargs)``, its tensors on the meta device
    (nothing is computed; ``model`` is not changed); an operation without a meta kernel falls
    back to one real sample in eval mode, its tensors widened to the batch again."""
    def to_meta(x: Any) -> Any:
        return x.to("meta") if isinstance(x, torch.Tensor) else x

    try:
        state = {k: torch.empty_like(v, device="meta")
                 for k, v in [*model.named_parameters(), *model.named_buffers()]}
        return torch.func.functional_call(model, state, pytree.tree_map(to_meta, tuple(inputs)),
                                          pytree.tree_map(to_meta, kwargs))
    except Exception:  # noqa: BLE001 - an op without a meta kernel: run one real sample
        flat = [x for x in pytree.tree_leaves((inputs, kwargs)) if isinstance(x, torch.Tensor)]
        batch = int(flat[0].shape[0])

        def first(x: Any) -> Any:
            return x[:1] if isinstance(x, torch.Tensor) and x.dim() else x

        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = model(*pytree.tree_map(first, tuple(inputs)),
                            **pytree.tree_map(first, kwargs))
        finally:
            model.train(was_training)

        def widen(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.dim():
                return torch.empty((batch, *x.shape[1:]), dtype=x.dtype, device="meta")
            return x.to("meta") if isinstance(x, torch.Tensor) else x

        return pytree.tree_map(widen, out)


def returns_own_loss(model: nn.Module, inputs: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether the model's output holds its own loss (a 0-dimensional floating tensor)."""
    return any(isinstance(x, torch.Tensor) and x.dim() == 0 and x.is_floating_point()
               for x in pytree.tree_leaves(output_on_meta(model, inputs, kwargs)))


@dataclass(frozen=True, slots=True)
class RunSpec:
    """What ``autosplit run`` trains: a model file, a plan and the batch.

    Attributes:
        model: the model file (path or module) and ``entry`` its factory, as for the CLI.
        plan: the plan (every rank gets this one).
        steps: training steps to run.
        input_shape: one float input of this per-sample shape instead of ``example_inputs``.
        lr: SGD learning rate (the tutorial's 0.001).
        seed: seeds the model's initial weights, the inputs and the targets on every rank.
        model_args: keyword arguments for the model file's factory and example inputs.
        granularity, leaf_modules: how the model is captured (``None``: as the plan says,
            the model file's ``LEAF_MODULES``).
    """

    model: str
    entry: str | None
    plan: Plan
    steps: int = 3
    input_shape: tuple[int, ...] | None = None
    lr: float = 0.001
    seed: int = 0
    model_args: tuple[tuple[str, Any], ...] = ()
    granularity: str | None = None
    leaf_modules: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class RunResult:
    """What ``autosplit run`` measured.

    Attributes:
        world_size: number of ranks.
        step_s: wall time of each step (s): the slowest rank's, all ranks starting together.
        rank_step_s: ``rank_step_s[r][i]`` is rank r's time for step i (s).
        losses: the loss of each step (mean over micro-batches and replicas), from the last
            stage's ranks.
        device: the devices, e.g. ``"cpu"`` or ``"cuda:0, cuda:1"``.
        threads: intra-op threads per rank.
    """

    world_size: int
    step_s: tuple[float, ...]
    rank_step_s: tuple[tuple[float, ...], ...]
    losses: tuple[float, ...]
    device: str
    threads: int

    @property
    def steady_step_s(self) -> float:
        """Median step time without the first step (which infers the stages' shapes)."""
        rest = self.step_s[1:] or self.step_s
        return statistics.median(rest)


def train_model_file(spec: RunSpec) -> RunResult:
    """One rank of ``autosplit run``: build the model and batch, train ``spec.steps`` steps.

    Runs inside an initialised process group (torchrun or :func:`launch`); every rank returns
    the same :class:`RunResult`.
    """

    plan = spec.plan
    model, inputs = model_and_batch(spec, plan_rows(plan))
    trainer, targets = _trainer(spec, model, inputs, plan)
    times, losses = [], []
    for _ in range(spec.steps):
        seconds, loss = _timed_step(trainer, inputs, targets)
        times.append(seconds)
        losses.append(loss)
    gathered: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(gathered, (trainer.rank, str(trainer.device), times, losses,
                                      trainer.holds_last, torch.get_num_threads()))
    gathered.sort(key=lambda g: g[0])
    per_rank = tuple(tuple(g[2]) for g in gathered)
    lasts = [g[3] for g in gathered if g[4]]  # each replica's last stage: its mean losses
    devices = sorted({g[1] for g in gathered})
    return RunResult(
        world_size=trainer.world_size,
        step_s=tuple(max(col) for col in zip(*per_rank)),
        rank_step_s=per_rank,
        losses=tuple(statistics.fmean(step) for step in zip(*lasts)),
        device=", ".join(devices),
        threads=int(gathered[0][5]),
    )


def plan_rows(plan: Plan) -> int:
    """The rows of one step's batch: d replicas × m micro-batches × b rows."""
    return plan.replicas * plan.microbatches * plan.split_size


Batch = tuple[tuple[Any, ...], dict[str, Any]]
"""One call's inputs: (positional, keyword)."""


def model_and_batch(spec: RunSpec, batch: int) -> tuple[nn.Module, Batch]:
    """The model file's model (seeded) and a batch of ``batch`` rows of its inputs."""
    from autosplit.capture.signature import example_call
    from autosplit.modelfile import load_model_file

    source = load_model_file(spec.model, spec.entry)
    kwargs = dict(spec.model_args)
    torch.manual_seed(spec.seed)
    model = source.build(**kwargs)
    torch.manual_seed(spec.seed + 1)
    if spec.input_shape:
        inputs: Any = (torch.randn(batch, *spec.input_shape),)
    else:
        inputs = source.example_inputs(batch, **kwargs)
    return model, example_call(inputs)


def capture_of(spec: RunSpec) -> dict[str, Any]:
    """How ``spec``'s model is captured: its options, else the model file's."""
    from autosplit.modelfile import load_model_file

    leaves = spec.leaf_modules
    if leaves is None:
        leaves = load_model_file(spec.model, spec.entry).leaf_modules
    return {"granularity": spec.granularity, "leaf_modules": tuple(leaves)}


def _trainer(spec: RunSpec, model: nn.Module, inputs: Batch, plan: Plan) -> tuple[Trainer, Any]:
    """The rank's Trainer and its targets: the model's own loss where it returns one (no
    targets), else the tutorial's MSE on one-hot targets."""
    lr = spec.lr
    args, kwargs = inputs
    own = returns_own_loss(model, args, kwargs)
    # the targets' shapes from the model before the Trainer shards it (FSDP2 runs a unit
    # only inside its stage's root)
    targets = None if own else tutorial_targets(model, args, spec.seed + 2, kwargs)
    trainer = Trainer(model, plan, model_loss if own else tutorial_loss,
                      lambda params: torch.optim.SGD(params, lr=lr),
                      reduce_loss=False,  # the replicas' losses averaged once, after the steps
                      example_inputs=args, example_kwargs=kwargs, **capture_of(spec))
    return trainer, targets if trainer.holds_last else None


def _timed_step(trainer: Trainer, inputs: Batch, targets: Any) -> tuple[float, float]:
    """One training step on every rank, started together: (seconds on this rank, loss)."""
    dist.barrier()
    start = time.perf_counter()
    args, kwargs = inputs
    loss = (trainer.step(args, targets, kwargs=kwargs) if trainer.holds_first
            else trainer.step(None, targets))
    return time.perf_counter() - start, float(loss) if loss is not None else math.nan


def measure_plans(spec: RunSpec, plans: Sequence[Plan], rounds: int = 2) -> list[list[float]]:
    """One rank of a side-by-side measurement: every plan trained in turn, A B A B ….

    All plans must need the same ranks (stages × replicas, one rank per stage and replica
    here) and batch: a pipeline and data parallelism on 2 ranks can be compared. Each plan
    first runs one untimed step (the stages' shapes are settled then); then ``rounds`` rounds
    time one step of each plan in turn, so drift in the machine's speed hits all alike.

    Returns:
        ``times[i]``: plan i's step times (s), the slowest rank's each, on every rank.
    """
    batch = {plan_rows(p) for p in plans}
    if len(batch) != 1 or len({len(p.stages) * p.replicas for p in plans}) != 1:
        raise InvalidInputError(
            "measure_plans needs plans of one batch size and one rank count (stages × replicas)")
    model, inputs = model_and_batch(spec, batch.pop())
    runs = [_trainer(spec, model, inputs, plan) for plan in plans]
    for trainer, targets in runs:
        _timed_step(trainer, inputs, targets)
    mine: list[list[float]] = [[] for _ in plans]
    for _ in range(rounds):
        for i, (trainer, targets) in enumerate(runs):
            mine[i].append(_timed_step(trainer, inputs, targets)[0])
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [[max(rank[i][r] for rank in gathered) for r in range(rounds)]
            for i in range(len(plans))]
