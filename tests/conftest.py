"""Shared helpers: the equivalence check every partition test relies on."""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import autosplit
from autosplit import PartitionOptions, PlanOptions, ProfileOptions
from autosplit.measure.contention import ALONE
from autosplit.measure.timing_process import IN_PROCESS
from autosplit.pipeline import PipelinedModule

os.environ.setdefault(IN_PROCESS, "1")  # CPU timings here, not in a fresh process each: the
# suite's timings assert nothing about speed; tests/test_fresh_process.py tests that path
os.environ.setdefault(ALONE, "1")  # and stages timed without a neighbouring process each;
# tests/test_neighbour.py tests that path


if os.environ.get("PYTEST_XDIST_WORKER"):  # one of pytest's workers, beside another: one
    torch.set_num_threads(1)  # intra-op thread each, not two threads each on two cores


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``long`` run last: a worker that is done takes half of what another has
    left (``--dist worksteal``), so the two share the long tests and end together. Tests
    marked ``cuda`` are skipped, saying so, on a machine without a CUDA device."""
    items.sort(key=lambda item: "long" in item.keywords)  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -n 0 -m cuda` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_and_quiet() -> None:
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", message=".*CPU stand-ins.*")


def own_machine_cache(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """A cache file at ``path`` (autosplit.measure.machine_cache) holding made-up figures for this
    machine, and ``AUTOSPLIT_CACHE`` naming it: nothing read from the cache of the machine it
    runs on, nothing that depends on what measuring the machine gives."""
    import time

    from autosplit.measure.machine_cache import MachineFigures, MachineKey, save
    from autosplit.measure.runtime_cost import MEASURED

    names = tuple(dict.fromkeys(name for name, _ in MEASURED))
    save(path, MachineFigures(MachineKey.here("gloo", "cpu", threads=1), time.time(),
                              allreduce_bytes_per_s=1e9, allreduce_latency_ms=0.5,
                              link_bytes_per_s=2e9,
                              action_ms=tuple((n, 1.0 + i / 10) for i, n in enumerate(names)),
                              action_spread=tuple((n, 0.1) for n in names),
                              one_stage_action_ms=0.3, one_stage_action_spread=0.05))
    monkeypatch.setenv("AUTOSPLIT_CACHE", str(path))


def quick_runtime_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime's cost per action measured on smaller stages over fewer rounds than
    ``autosplit plan`` takes (the suite's time: the defaults took 2 min per measurement of
    every schedule); what is measured is not asserted, only how."""
    from autosplit.measure import runtime_cost

    monkeypatch.setattr(runtime_cost, "LAYERS", 4)
    monkeypatch.setattr(runtime_cost, "ROUNDS", 5)
    monkeypatch.setattr(runtime_cost, "WARMUP_ROUNDS", 2)


@contextlib.contextmanager
def suite_settings(folder: Path) -> Iterator[None]:
    """What every test runs under (a machine cache of its own in ``folder``, the quick runtime
    costs), for a module- or session-scoped fixture: those are set up before the autouse
    fixtures of the test that first asks for them."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        own_machine_cache(monkeypatch, folder / "machine.json")
        quick_runtime_costs(monkeypatch)
        yield


@pytest.fixture(autouse=True)
def _own_machine_cache(tmp_path_factory, monkeypatch) -> None:
    """Each test has a cache file of its own (:func:`own_machine_cache`): no test reads the
    cache of the machine it runs on (the measurers are tested by calling them)."""
    own_machine_cache(monkeypatch, tmp_path_factory.mktemp("cache") / "machine.json")


@pytest.fixture(autouse=True)
def _quick_runtime_costs(monkeypatch) -> None:
    """:func:`quick_runtime_costs` in every test."""
    quick_runtime_costs(monkeypatch)


def loss_of(output: Any) -> torch.Tensor:
    """A loss that touches every floating output element with a different weight."""
    total = torch.zeros(())
    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            weights = torch.linspace(0.5, 1.5, leaf.numel(), device=leaf.device)
            total = total + (leaf * weights.reshape(leaf.shape)).sum().cpu()
    return total


def reference_run(model: nn.Module, inputs: Sequence[torch.Tensor], split: int) -> Any:
    """The original model on the same micro-batches, outputs concatenated."""
    outs = [model(*mb) for mb in zip(*(x.split(split) for x in inputs))]
    leaves = [pytree.tree_flatten(o) for o in outs]
    spec = leaves[0][1]
    joined = [torch.cat(ls) for ls in zip(*(lv for lv, _ in leaves))]
    return pytree.tree_unflatten(joined, spec)


def assert_equivalent(model: nn.Module, pm: nn.Module, ref: nn.Module, inputs: Sequence[torch.Tensor], split: int, **tol: Any) -> None:
    """Outputs, every parameter gradient and every buffer of ``pm`` equal ``ref``'s.

    ``tol``: extra arguments of ``torch.testing.assert_close`` (tolerances, ``check_device``),
    for a pipeline on other devices than the reference. The reference starts from the random
    state the pipeline started from (the same dropout masks where both draw in one order).
    """
    rng = torch.get_rng_state()
    out = pm(*inputs)
    torch.set_rng_state(rng)
    expected = reference_run(ref, inputs, split)
    torch.testing.assert_close(out, expected, **tol)
    loss_of(out).backward()
    loss_of(expected).backward()
    got = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        assert got[name].grad is not None, f"no gradient reached {name}"
        torch.testing.assert_close(got[name].grad, p.grad, msg=lambda m, n=name: f"gradient of {n}: {m}", **tol)
    bufs = dict(model.named_buffers())
    for name, b in ref.named_buffers():
        torch.testing.assert_close(bufs[name], b, msg=lambda m, n=name: f"buffer {n}: {m}", **tol)


def partition_and_check(model: nn.Module, inputs: Sequence[torch.Tensor], stages: int, split: int, **kw: Any) -> PipelinedModule:
    """Profile cheaply, plan for ``stages`` at ``split``, partition, and check equivalence."""
    ref = copy.deepcopy(model)
    prof = autosplit.profile(model, tuple(inputs), **kw,
                             options=ProfileOptions(microbatch_sizes=[split], warmup=0, repeats=1))
    plan = autosplit.plan(prof, gpus=stages, options=PlanOptions(split_size=split))
    pm = autosplit.partition(model, plan=plan, devices=["cpu"] * stages,
                             options=PartitionOptions(**kw))
    assert len(pm.stages) == stages
    assert_equivalent(model, pm, ref, inputs, split)
    return pm


@pytest.fixture(autouse=True)
def _model_files_forgotten() -> Iterator[None]:
    """The model files a test loads in this process (``autosplit_model_*`` modules, which a
    fresh timing process imports first) are forgotten after it: a later test's child process
    does not import them."""
    before = set(sys.modules)
    yield
    for name in [n for n in sys.modules if n.startswith("autosplit_model_") and n not in before]:
        del sys.modules[name]
