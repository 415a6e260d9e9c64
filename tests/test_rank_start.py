"""Ranks forked from a fork server that has imported torch (autosplit/rank_start.py):
each reads its launcher's environment of that launch; a launch whose variables read at start
differ from the server's spawns its ranks."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from autosplit import distributed, rank_start
from autosplit.measure import allocator

VARIABLE = "AUTOSPLIT_TEST_RANK_START"


def _where_and_what() -> tuple[int, str | None, str, int]:
    """This rank's parent process, the test's variable, and its rank as RANK and its process
    group say."""
    return os.getppid(), os.environ.get(VARIABLE), os.environ["RANK"], dist.get_rank()


def test_ranks_come_from_the_server_with_each_launchs_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    for value in ("first", "second", None):
        if value is None:
            monkeypatch.delenv(VARIABLE, raising=False)
        else:
            monkeypatch.setenv(VARIABLE, value)
        seen.append(distributed.launch(_where_and_what, 2, timeout_s=30))
    servers = {parent for got in seen for parent, _, _, _ in got.values()}
    assert len(servers) == 1 and os.getpid() not in servers  # one server, not this process
    for got, value in zip(seen, ("first", "second", None), strict=True):
        assert got == {r: (next(iter(servers)), value, str(r), r) for r in (0, 1)}


def test_a_launch_whose_variables_read_at_start_differ_spawns_its_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    distributed.launch(_where_and_what, 1, timeout_s=30)  # the server runs
    with allocator.for_children():  # as launch() asks
        assert rank_start.start_method()[0] == rank_start.FORKSERVER
        monkeypatch.setenv("OMP_SCHEDULE", "static,7")  # read by OpenMP when a process starts
        assert rank_start.start_method() == (rank_start.SPAWN, None)
    got = distributed.launch(_where_and_what, 2, timeout_s=30)
    assert {parent for parent, _, _, _ in got.values()} == {os.getpid()}  # spawned here


def test_the_launchers_environment_replaces_the_servers_but_what_the_launch_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    server = {"KEPT": "1", "STALE": "old", "GONE": "x"}
    # a forked rank: the server's environment, with the launcher's RANK … set on top
    monkeypatch.setattr(os, "environ", {**server, "RANK": "1", "MASTER_PORT": "2"})
    rank_start.Environment({"KEPT": "1", "STALE": "new", "NEW": "y"}, server).apply()
    assert os.environ == {"KEPT": "1", "STALE": "new", "NEW": "y", "RANK": "1",
                          "MASTER_PORT": "2"}


def test_variables_read_at_start_are_told_from_the_others() -> None:
    env = {"MALLOC_TRIM_THRESHOLD_": "1", "LD_PRELOAD": "x", "PYTHONPATH": "p",
           "OMP_NUM_THREADS": "1", "TORCH_LOGS": "+dynamo", allocator.OPT_OUT: "1",
           "AUTOSPLIT_CACHE": "c", "RANK": "0", "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM"}
    assert set(rank_start.read_at_start(env)) == {
        "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD", "PYTHONPATH", "OMP_NUM_THREADS", "TORCH_LOGS",
        allocator.OPT_OUT}
