"""The C allocator's settings for the processes autosplit starts (autosplit/measure/allocator.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from autosplit.measure import allocator

glibc = pytest.mark.skipif(not allocator.applies(), reason="the settings are glibc's")


@glibc
def test_environment_adds_the_settings_to_a_plain_environment():
    env = allocator.environment({"PATH": "/bin"})
    assert env["PATH"] == "/bin"
    for key, value in allocator.KEEP_FREED.items():
        assert env[key] == value
    assert "keeping freed memory" in allocator.describe(env)


@pytest.mark.parametrize("decided", [
    {"MALLOC_ARENA_MAX": "2"},
    {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
    {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
    {allocator.OPT_OUT: "1"},
])
def test_an_environment_that_decides_the_allocator_is_left_alone(decided):
    assert allocator.configured(decided)
    assert allocator.environment(decided) == decided


def test_opt_out_zero_does_not_opt_out():
    assert not allocator.configured({allocator.OPT_OUT: "0"})


@glibc
def test_for_children_sets_and_restores(monkeypatch):
    for key in [*allocator.KEEP_FREED, allocator.OPT_OUT, "GLIBC_TUNABLES", "LD_PRELOAD"]:
        monkeypatch.delenv(key, raising=False)
    for key in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(key)
    with allocator.for_children():
        seen = subprocess.run(
            [sys.executable, "-c", "import os; print(os.environ['MALLOC_TRIM_THRESHOLD_'])"],
            capture_output=True, text=True, check=True).stdout.strip()
    assert seen == allocator.KEEP_FREED["MALLOC_TRIM_THRESHOLD_"]
    assert "MALLOC_TRIM_THRESHOLD_" not in os.environ


@glibc
def test_restart_runs_the_program_again_with_the_settings():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in (allocator.OPT_OUT, "GLIBC_TUNABLES")}
    code = ("import os, sys; print('start', flush=True); "
            "from autosplit.measure.allocator import restart_keeping_freed_memory as r; r(); "
            "print(os.environ.get('MALLOC_MMAP_THRESHOLD_'), sys.argv[1:])")
    out = subprocess.run([sys.executable, "-c", code, "a", "b"], env=env, capture_output=True,
                         text=True, check=True).stdout.split("\n")
    assert out[:3] == ["start", "start",
                       f"{allocator.KEEP_FREED['MALLOC_MMAP_THRESHOLD_']} ['a', 'b']"]


def test_restart_leaves_a_decided_process_alone():
    env = {**os.environ, allocator.OPT_OUT: "1"}
    code = ("print('start', flush=True); "
            "from autosplit.measure.allocator import restart_keeping_freed_memory as r; r(); print('on')")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["start", "on"]


def _settings_worker() -> dict[str, str | None]:
    return {key: os.environ.get(key) for key in allocator.KEEP_FREED}


@glibc
def test_launched_ranks_start_with_the_settings(monkeypatch):
    from autosplit import distributed

    for key in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(key)
    for key in (allocator.OPT_OUT, "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(key, raising=False)
    results = distributed.launch(_settings_worker, 2, timeout_s=60)
    assert results == {0: dict(allocator.KEEP_FREED), 1: dict(allocator.KEEP_FREED)}
    assert not any(k in os.environ for k in allocator.KEEP_FREED)
