"""CPU memory that stays with the process: glibc's malloc told to keep what a step frees.

glibc's ``malloc`` serves a large block with fresh ``mmap`` pages (above a threshold that
adapts only up to 32 MiB) and hands the top of its heap back to the kernel when it is freed.
A training step that frees its activations and allocates them again next step then has the
kernel fault in and zero every page anew. Blocks profiled one at a time hardly see this (the
same few tensors come back at once); a pipeline holding several micro-batches in flight, or
one device running a whole batch, does. Measured on a 2-core AMD EPYC: ResNet50's first two
stages at b = 15 (3×128×128) took 0.81–1.47 s per micro-batch in GPipe's order against
0.83–0.86 s one micro-batch at a time, and the whole model at B = 120 took 15.9–18.4 s against
12.1 s for two halves; with the settings below both pairs agreed (0.76–0.79 s; 12.1 s).

The settings are read when a process starts, so autosplit gives them to the processes it
starts: the ranks of :func:`autosplit.launch.launch` (``autosplit run``, the benchmarks)
and the ``autosplit`` command itself, which starts again once with them (under torchrun too).
A process that already names a malloc setting, preloads another allocator (jemalloc,
tcmalloc) or sets ``AUTOSPLIT_SYSTEM_MALLOC=1`` is left as it is; so is every platform
without glibc. The cost: freed memory is kept for reuse, so the process holds its peak.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from collections.abc import Iterator, Mapping

__all__ = ["KEEP_FREED", "OPT_OUT", "applies", "configured", "environment", "for_children",
           "describe", "restart_keeping_freed_memory"]

KEEP_FREED: Mapping[str, str] = {
    "MALLOC_MMAP_THRESHOLD_": str(16 << 30),  # bytes: no block is given its own mmap pages
    "MALLOC_TRIM_THRESHOLD_": str(16 << 30),  # bytes: the heap's top is never given back
}
"""glibc's settings that keep freed memory in the process (read at process start)."""

OPT_OUT = "AUTOSPLIT_SYSTEM_MALLOC"
"""Set to 1 to leave the C allocator as the system starts it."""

_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def applies() -> bool:
    """Whether this platform's C library is glibc (the settings mean nothing elsewhere)."""
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def configured(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``env`` (default: this process's) already decides the allocator: a malloc
    setting of glibc's, a preloaded allocator or the opt-out."""
    env = os.environ if env is None else env
    if env.get(OPT_OUT, "") not in ("", "0"):
        return True
    if any(key.startswith("MALLOC_") for key in env):
        return True
    if "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        return True
    return any(name in env.get("LD_PRELOAD", "") for name in _OTHER_ALLOCATORS)


def environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with :data:`KEEP_FREED` added where they apply and
    nothing decides the allocator yet."""
    out = dict(os.environ if env is None else env)
    if applies() and not configured(out):
        out.update(KEEP_FREED)
    return out


def describe(env: Mapping[str, str] | None = None) -> str:
    """How processes started with ``env`` allocate CPU memory, in a few words."""
    env = os.environ if env is None else env
    if not applies():
        return f"the system's allocator ({platform.system() or 'unknown'}, not glibc)"
    if all(env.get(k) == v for k, v in KEEP_FREED.items()):
        return "glibc malloc keeping freed memory (" + ", ".join(
            f"{k}={v}" for k, v in KEEP_FREED.items()) + ")"
    preloaded = [n for n in _OTHER_ALLOCATORS if n in env.get("LD_PRELOAD", "")]
    if preloaded:
        return f"{preloaded[0]} (LD_PRELOAD)"
    if configured(env):
        return "glibc malloc as the environment sets it"
    return "glibc malloc with its defaults (freed memory goes back to the kernel)"


@contextlib.contextmanager
def for_children() -> Iterator[None]:
    """While open, processes started from this one get :data:`KEEP_FREED` (where they apply
    and nothing decides the allocator); this process's environment is restored on exit."""
    added = {k: v for k, v in environment().items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def restart_keeping_freed_memory() -> None:
    """Start this Python program again, in this process and with the same command line
    (``sys.orig_argv``), with :data:`KEEP_FREED` set; unless they do not apply or the
    allocator is decided already, in which case this returns at once. Call it first thing in
    a program's entry point (the restart costs the interpreter's start-up, ~0.1 s)."""
    if not applies() or configured():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), environment())
