"""How the processes of a launch start: forked from a server that has imported torch.

A fresh Python process spends seconds importing torch (about 2.5 s of one core on a 2-core
AMD EPYC), and every rank of every launch paid it again. The ranks autosplit starts
(:func:`autosplit.launch.launch`) are instead forked from multiprocessing's fork server, which
imports torch once, when the process first launches ranks, and stays for the process's
lifetime (as multiprocessing's resource tracker does); a rank then starts in a fraction of a
second.

A rank forked there reads the environment of the process that launched it, as of that launch
(:meth:`Environment.apply`), as a spawned rank does: a variable set between two launches
reaches the second one's ranks. What a process reads only when it starts is the server's
instead: it starts inside the first launch, so with the C allocator's settings of
:mod:`autosplit.measure.allocator`, and a launch whose variables of that kind
(:data:`READ_AT_START`) differ from the server's spawns its ranks afresh, as before.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Mapping
from dataclasses import dataclass

from autosplit.measure import allocator

__all__ = ["FORKSERVER", "SPAWN", "READ_AT_START", "Environment", "start_method"]

FORKSERVER = "forkserver"
SPAWN = "spawn"

READ_AT_START = ("MALLOC_", "GLIBC_", "LD_", "PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_",
                 "OPENBLAS_", "TORCH_", "PYTORCH_", "CUDA_", allocator.OPT_OUT)
"""Prefixes of the variables read when a process starts or imports torch (the C allocator, the
dynamic loader, Python, the thread pools, torch's switches): ranks forked from the server hold
the server's values, so a launch whose values differ spawns its ranks."""

PRELOAD = ["torch", "torch._dynamo", "torch.export", "torch.distributed.elastic.multiprocessing",
           "torch.distributed.pipelining", "torch.distributed.fsdp"]
"""What the server imports: torch and the parts of it a rank loads (the compiler stack that
torchvision, torch.export and the pipelining import takes 1.4 s more), nothing else: torch's
place on ``sys.path`` is the same in every process of an interpreter, while the launching
process's own modules, which it may import from elsewhere, are imported by each rank from
the launcher's ``sys.path``."""

_server_environment: dict[str, str] | None = None
"""The environment the fork server started in (None: autosplit has not started it)."""


@dataclass(frozen=True)
class Environment:
    """The launching process's environment for a rank forked from the server, and the
    server's own, which the rank holds when it starts."""

    launcher: Mapping[str, str]
    server: Mapping[str, str]

    def apply(self) -> None:
        """Make this process's environment the launcher's, with what was set on top of the
        server's when the rank was started (the launcher's RANK, WORLD_SIZE, MASTER_PORT …)."""
        added = {k: v for k, v in os.environ.items() if self.server.get(k) != v}
        os.environ.clear()
        os.environ.update(self.launcher)
        os.environ.update(added)


def read_at_start(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that a process reads when it starts (:data:`READ_AT_START`)."""
    return {k: v for k, v in env.items() if k.startswith(READ_AT_START)}


def start_method() -> tuple[str, Environment | None]:
    """How to start the ranks of a launch from this process's environment now:
    ``("forkserver", the Environment each rank applies)``, starting the server on the first
    call; ``("spawn", None)`` where this platform has no fork server or where the variables
    read at start differ from the server's."""
    global _server_environment
    env = dict(os.environ)
    if FORKSERVER not in multiprocessing.get_all_start_methods():
        return SPAWN, None
    if _server_environment is None:
        from multiprocessing import forkserver

        forkserver.set_forkserver_preload(PRELOAD)
        forkserver.ensure_running()
        _server_environment = env
    if read_at_start(env) != read_at_start(_server_environment):
        return SPAWN, None
    return FORKSERVER, Environment(env, _server_environment)
