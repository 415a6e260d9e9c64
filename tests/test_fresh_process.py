"""CPU timings run in a fresh process, as the ranks do: same results, errors and progress as
in this process, and this process again (with a warning) for what cannot travel."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from models import LongSkip
from torch import nn

import autosplit
from autosplit import ProfileOptions
from autosplit.errors import InvalidInputError, ModelMismatchError, RankFailedError
from autosplit.measure import timing_process
from autosplit.measure.profiler import profile_graph
from autosplit.planner import plan_candidates
from autosplit.verify.choice import verify_and_choose
from autosplit.verify.options import TimingOptions
from autosplit.verify.plans import time_stages


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timings in a fresh process (the suite times in its own process otherwise)."""
    monkeypatch.delenv(timing_process.IN_PROCESS, raising=False)
    assert timing_process.enabled()


class Unloadable(nn.Module):
    """A leaf module of this test file: the fresh process cannot import its class."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _bytes(prof: autosplit.Profile) -> list[object]:
    return [(b.name, b.param_bytes, b.saved_bytes, b.output_bytes, b.checkpoint_saved_bytes)
            for b in prof.blocks] + [c.bytes for c in prof.cuts]


def test_profile_in_a_fresh_process_equals_one_here(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    graph = autosplit.trace(LongSkip())
    x = torch.randn(8, 6)
    seen: list[tuple[int, int, str]] = []
    options = ProfileOptions(microbatch_sizes=[4, 8], repeats=2)
    there = profile_graph(graph, (x,), options=options, progress=lambda *call: seen.append(call))
    monkeypatch.setenv(timing_process.IN_PROCESS, "1")
    here_seen: list[tuple[int, int, str]] = []
    here = profile_graph(graph, (x,), options=options,
                         progress=lambda *call: here_seen.append(call))
    assert there.microbatch_sizes == here.microbatch_sizes == (4, 8)
    assert _bytes(there) == _bytes(here)
    assert all(ms > 0 for b in there.blocks for ms in b.fwd_ms + b.bwd_ms)
    assert seen and seen[-1][0] == seen[-1][1]  # every progress call came back, the last done
    assert [c[1] for c in seen] == [c[1] for c in here_seen]


def test_stage_times_in_a_fresh_process(fresh: None) -> None:
    graph = autosplit.trace(LongSkip())
    runs = [(0, 2, 4), (2, len(graph.blocks), 4), (0, len(graph.blocks), 8)]
    times = time_stages(graph, (torch.randn(8, 6),), runs,
                        options=TimingOptions(rounds=2, max_rounds=2))
    assert set(times) == set(runs)
    assert all(t.forward_ms > 0 and t.backward_ms > 0 and t.rounds == 2 for t in times.values())


def test_the_childs_error_comes_back_with_its_class(fresh: None) -> None:
    graph = autosplit.trace(nn.Sequential(nn.Linear(6, 6), nn.Unflatten(1, (5, 2))))
    with pytest.raises(InvalidInputError, match="fails on a micro-batch of 4"):
        profile_graph(graph, (torch.randn(4, 6),),
                      options=ProfileOptions(microbatch_sizes=[4]))  # raised there


def _raise_rank_failed(message: str, progress: object = None) -> None:
    raise RankFailedError(message, rank=1, failures={1: message})


def test_an_error_class_that_needs_more_than_its_message_is_named(
        fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # the child imports this file (tests/ on its path); RankFailedError needs the failing
    # rank too, so it comes back as FreshProcessError naming it, with its message
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    with pytest.raises(timing_process.FreshProcessError, match="RankFailedError: rank 1 died"):
        timing_process.run_fresh(_raise_rank_failed, "rank 1 died")


def test_what_cannot_travel_is_timed_here_with_a_warning(fresh: None) -> None:
    graph = autosplit.trace(nn.Sequential(Unloadable(), nn.ReLU()), leaf_modules=[Unloadable])
    with pytest.warns(RuntimeWarning, match="timing in this process.*cannot load the model"):
        prof = profile_graph(graph, (torch.randn(4, 6),),
                             options=ProfileOptions(microbatch_sizes=[4], repeats=2))
    assert prof.microbatch_sizes == (4,)
    with pytest.warns(RuntimeWarning, match="do not pickle"):
        made = timing_process.run_fresh(dict, a=lambda: 7)  # a lambda does not pickle
    assert made["a"]() == 7 and made["progress"] is None


def test_an_unexpected_failure_is_named(fresh: None) -> None:
    with pytest.raises(timing_process.FreshProcessError, match="TypeError"):
        timing_process.run_fresh(int, "7")  # int() takes no progress= argument


def test_cheap_checks_come_before_any_process(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_process(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(timing_process, "run_fresh", no_process)
    graph = autosplit.trace(LongSkip())
    with pytest.raises(InvalidInputError, match="loss"):
        profile_graph(graph, (torch.randn(8, 6),), options=ProfileOptions(loss="hinge"))
    with pytest.raises(InvalidInputError, match="micro-batch size 9"):
        profile_graph(graph, (torch.randn(8, 6),), options=ProfileOptions(microbatch_sizes=[9]))
    with pytest.raises(InvalidInputError, match="micro-batch size 9"):
        time_stages(graph, (torch.randn(8, 6),), [(0, 1, 9)])


def _in_process_flag(progress: object = None) -> str | None:
    return os.environ.get(timing_process.IN_PROCESS)


def test_the_fresh_process_times_in_itself(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the child imports this file
    assert timing_process.run_fresh(_in_process_flag) == "1"  # no process of its own


@pytest.mark.long
def test_both_verification_sessions_run_in_one_fresh_process(
        fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = LongSkip(), torch.randn(8, 6)
    prof = autosplit.profile(model, x,
                             options=ProfileOptions(microbatch_sizes=[2, 4, 8], warmup=0,
                                                    repeats=1))
    candidates = plan_candidates(prof, 2, top_k=3)
    assert len(candidates) > 1
    started: list[object] = []
    run_fresh = timing_process.run_fresh

    def counted(fn: object, *args: object, **kwargs: object) -> object:
        started.append(fn)
        return run_fresh(fn, *args, **kwargs)

    monkeypatch.setattr(timing_process, "run_fresh", counted)
    seen: list[tuple[int, int, str]] = []
    best, others = verify_and_choose(autosplit.trace(model), x, prof, candidates,
                                     {"hand": candidates[-1]},
                                     progress=lambda *call: seen.append(call),
                                     options=TimingOptions(rounds=2, max_rounds=2))
    assert len(started) == 1  # one process for both sessions (the child times in itself)
    assert "first verification" in best.verification and others["hand"].verification
    assert seen and seen[-1][0] == seen[-1][1]  # the second session ends the progress


def test_a_plan_of_another_model_is_refused_before_any_process(
        fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = LongSkip(), torch.randn(8, 6)
    prof = autosplit.profile(model, x,
                             options=ProfileOptions(microbatch_sizes=[2, 4], warmup=0, repeats=1))
    candidates = plan_candidates(prof, 2, top_k=2)
    other = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6))

    def no_process(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(timing_process, "run_fresh", no_process)
    with pytest.raises(ModelMismatchError):
        verify_and_choose(autosplit.trace(other), x, prof, candidates)


def _pid(progress: object = None) -> int:
    progress(1, 2, "half")  # type: ignore[operator]
    return os.getpid()


def _refuse(progress: object = None) -> None:
    raise InvalidInputError(f"refused there, in {os.getpid()}")


def _crash(progress: object = None) -> None:
    os._exit(3)


def test_one_worker_takes_every_job_of_a_block(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # the child imports this file
    seen: list[tuple[int, int, str]] = []
    with timing_process.worker() as outer:
        first = timing_process.run_fresh(_pid, progress=lambda *a: seen.append(a))
        with timing_process.worker() as inner:  # a block inside uses the outer worker
            assert inner is outer
            second = timing_process.run_fresh(_pid)
        with pytest.raises(InvalidInputError, match="refused there"):  # errors come back
            timing_process.run_fresh(_refuse)
        third = timing_process.run_fresh(_pid)
    assert first == second == third != os.getpid()
    assert seen == [(1, 2, "half")]
    with timing_process.worker():  # a new block: a new process
        assert timing_process.run_fresh(_pid) != first
    assert timing_process.run_fresh(_pid) not in (first, os.getpid())  # outside: one per job


def test_a_worker_that_dies_is_named_and_replaced(fresh: None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    with timing_process.worker():
        with pytest.raises(timing_process.FreshProcessError, match="exit code 3"):
            timing_process.run_fresh(_crash)
        assert timing_process.run_fresh(_pid) != os.getpid()  # a new process takes the next job
