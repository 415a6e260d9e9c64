"""Process groups and the local launcher: ranks on this machine, failures named by rank.

Processes are started by torchrun, or on this machine by :func:`launch`
(``torch.distributed.run``'s launcher, one rank per stage), which turns any rank's death or
exception into a :class:`RankFailedError` that names the rank.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autosplit import checks, rank_start
from autosplit.atomic_write import write_text_atomic
from autosplit.errors import InvalidInputError, RankFailedError, RendezvousError
from autosplit.measure import allocator

DEFAULT_TIMEOUT_S = 120.0
"""Process-group timeout (s): a collective or send/recv that waits longer raises on its rank."""


def default_device(group: Any = None) -> torch.device:
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(
    backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> torch.device:
    """Join the process group described by the environment (torchrun's RANK, WORLD_SIZE …).

    Args:
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank, ``cuda:LOCAL_RANK``);
            default NCCL when CUDA is available, else gloo.
        timeout_s: how long (s) a collective or send/recv may wait for a peer before it
            raises; this bounds how long a dead or stuck peer can hold the others.

    Returns:
        This rank's device.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise InvalidInputError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not timeout_s > 0:
        raise InvalidInputError(f"timeout_s must be positive, got {timeout_s!r}")
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [k for k in needed if k not in os.environ]
    if missing and not dist.is_initialized():
        raise InvalidInputError(
            f"{', '.join(missing)} not set: start the ranks with torchrun or "
            "autosplit.distributed.launch()"
        )
    device = torch.device("cpu")
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise InvalidInputError("backend 'nccl' needs CUDA GPUs; use --backend gloo on CPUs")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    if not dist.is_initialized():
        try:
            with _native_stderr_held():  # c10d's retries print C++ frames: the line below says it
                dist.init_process_group(
                    backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs
                )
        except (RuntimeError, dist.DistError) as exc:  # the store timed out, or refused
            raise RendezvousError(
                f"{rendezvous_words()}: no process group within {timeout_s:g} s "
                f"({one_line(str(exc).split(' Exception raised from')[0])[:160]}); start "
                "every rank (rank 0 listens there), or unset RANK, WORLD_SIZE, MASTER_ADDR and "
                "MASTER_PORT to let autosplit start its own ranks") from None
    return device


@contextlib.contextmanager
def _native_stderr_held() -> Iterator[None]:
    """What native code writes to file descriptor 2 meanwhile is held in a file, and written
    out afterwards only if the block succeeds."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        held.seek(0)
        text = held.read()
        if text:
            os.write(2, text)


def rendezvous_words() -> str:
    """Which rendezvous this process joins, as which rank, and the variables that say so."""
    env = os.environ
    where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    read = "RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"
    if "TORCHELASTIC_RUN_ID" in env:
        read += f" (torchrun's, run {env['TORCHELASTIC_RUN_ID']})"
    elif "SLURM_JOB_ID" in env:
        read += f" (beside Slurm's job {env['SLURM_JOB_ID']})"
    return (f"rank {env.get('RANK', '?')} of {env.get('WORLD_SIZE', '?')} joining the "
            f"rendezvous at {where}, as {read} say")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def run_rank(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    threads: int | None = 1,
    status_dir: str | None = None,
    environment: rank_start.Environment | None = None,
) -> Any:
    """Run ``fn(*args)`` as one rank: set the CPU threads, join the process group (see
    :func:`init_distributed`), call ``fn`` and destroy the group again.

    The body of every rank :func:`launch` starts; under torchrun, call it in each process.
    With ``status_dir``, a rank that raises first writes ``rank<N>.json`` there (its error and
    the time), so that the launcher can tell the rank that failed first from the peers that
    failed because it was gone. With ``environment`` (a rank forked from the fork server of
    :mod:`autosplit.rank_start`), the launcher's environment is applied first.
    """
    if environment is not None:
        environment.apply()
    faulthandler.enable()  # a rank that crashes in C++ leaves its stack on stderr
    if threads:
        torch.set_num_threads(threads)
    try:
        init_distributed(backend, timeout_s)
        result = fn(*args)
    except BaseException as exc:
        if status_dir is not None and _is_knock_on(_write_status(status_dir, exc)):
            time.sleep(KNOCK_ON_HOLD_S)  # the launcher sees the peer that died first
        raise  # the process ends: its process group goes with it
    # stages and schedules hold reference cycles to pending work objects; collect them while
    # the group is alive (freed at interpreter exit instead, gloo's threads abort the process)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return result


KNOCK_ON_HOLD_S = 1.0
"""How long (s) a rank whose error is a peer's absence (:func:`_is_knock_on`) waits before it
ends: the launcher reports one failed process, the first it sees (it looks every 0.1 s), and
a peer that died without raising has nothing but its exit code to say why, which only that
report carries. A rank the launcher stops meanwhile ends then."""


def _write_status(status_dir: str, exc: BaseException) -> str:
    """Write this rank's error (its cause, on one line) and the time; the error's text."""
    rank = int(os.environ.get("RANK", "-1"))
    while exc.__cause__ is not None:  # PipelineStage wraps the model's error: report that one
        exc = exc.__cause__
    text = _shorten(one_line(f"{type(exc).__name__}: {exc}"), 400)
    record = {"rank": rank, "time": time.time(), "error": text}
    path = os.path.join(status_dir, f"rank{rank}.json")
    with contextlib.suppress(OSError):
        write_text_atomic(path, json.dumps(record))
    return text


def _read_statuses(status_dir: str) -> dict[int, tuple[float, str]]:
    found = {}
    for name in os.listdir(status_dir):
        if name.startswith("rank") and name.endswith(".json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                with open(os.path.join(status_dir, name)) as fh:
                    record = json.load(fh)
                found[int(record["rank"])] = (float(record["time"]), str(record["error"]))
    return found


_QUIET_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


@contextlib.contextmanager
def _launcher_quiet() -> Iterator[None]:
    """Silence the launcher's own log lines (failures are reported by RankFailedError)."""
    loggers = [
        logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
        if name.startswith(_QUIET_LOGGERS)
    ]
    saved = [(lg, lg.disabled) for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, disabled in saved:
            lg.disabled = disabled


@contextlib.contextmanager
def _signals_restored() -> Iterator[None]:
    """The launcher installs signal handlers; put the caller's back afterwards."""
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    saved = {}
    for name in names:
        sig = getattr(signal, name, None)
        if sig is not None:
            with contextlib.suppress(ValueError):  # not the main thread
                saved[sig] = signal.getsignal(sig)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)


@checks.known_options
@dataclass(frozen=True, slots=True)
class RankSettings:
    """How :func:`launch` starts its ranks.

    Attributes:
        threads: ``torch.set_num_threads`` in every rank (``None``: leave torch's default).
        host, port: where the rendezvous listens (``port=None``: a free port on ``host``).
        log_dir: where the ranks' stdout/stderr go (``None``: this process's terminal).
        quiet: keep the launcher's own log lines off the terminal.
    """

    threads: int | None = 1
    host: str = "127.0.0.1"
    port: int | None = None
    log_dir: str | None = None
    quiet: bool = True


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    ranks: RankSettings = RankSettings(),
) -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nprocs`` ranks on this machine, one process each.

    Uses ``torch.distributed.run``'s launcher (an elastic agent with a static rendezvous on
    ``host:port``, no restarts). The ranks are forked from a server that has imported torch
    (:mod:`autosplit.rank_start`), in this process's environment, and start with the
    C allocator keeping freed memory (:mod:`autosplit.measure.allocator`), unless this
    process's environment decides it. Every rank joins a process group first (see
    :func:`init_distributed`; ``timeout_s`` bounds every wait on a peer) and destroys it
    afterwards. When a rank dies or raises, the launcher stops the others and this function
    raises :class:`RankFailedError`.

    Args:
        fn: a module-level function (each rank imports it by name).
        nprocs: number of ranks.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout_s: process-group timeout (s).
        ranks: how the ranks start: threads, where the rendezvous listens, where their
            output goes (:class:`RankSettings`).

    Returns:
        ``{rank: fn's return value}``.

    Raises:
        RankFailedError: a rank exited with a non-zero code or raised; the message names the
            rank that failed first and its error.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise InvalidInputError(f"nprocs must be a positive integer, got {nprocs!r}")
    if backend not in ("gloo", "nccl"):
        raise InvalidInputError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < nprocs:
        raise InvalidInputError(
            f"backend 'nccl' runs one GPU per rank: {nprocs} ranks but "
            f"{torch.cuda.device_count()} CUDA device(s); use --backend gloo"
        )
    threads, host, log_dir = ranks.threads, ranks.host, ranks.log_dir
    port = ranks.port or free_port(host)
    status = tempfile.TemporaryDirectory(prefix="autosplit-launch-")
    status_dir = status.name
    logs = (DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL) if log_dir
            else DefaultLogsSpecs(log_dir=os.path.join(status_dir, "elastic")))  # removed after
    quiet_ctx = _launcher_quiet() if ranks.quiet else contextlib.nullcontext()
    with status:
        try:
            with quiet_ctx, _signals_restored(), allocator.for_children():
                method, environment = rank_start.start_method()
                config = _launch_config(nprocs, host, port, timeout_s, method, logs)
                results = elastic_launch(config, run_rank)(
                    fn, args, backend, timeout_s, threads, status_dir, environment
                )
        except ChildFailedError as exc:
            raise _rank_failure(exc, _read_statuses(status_dir), nprocs, log_dir) from None
        except SignalException as exc:
            raise KeyboardInterrupt(f"stopped by signal {exc.sigval}") from None
    return dict(results)


def _launch_config(nprocs: int, host: str, port: int, timeout_s: float, start_method: str,
                   logs: Any) -> Any:
    """torch's launcher settings: one node of ``nprocs`` ranks, a static rendezvous on
    ``host:port``, no restarts, the workers watched every 0.1 s.

    Static, not c10d: one node needs no dynamic membership, and the dynamic handler logs each
    event under the name it finds with ``inspect.stack()``, which reads the source of every
    frame (about 0.8 s a launch in a process that has imported many modules)."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"autosplit-{uuid.uuid4().hex[:8]}",
        rdzv_backend="static",
        rdzv_endpoint=f"{host}:{port}",
        rdzv_configs={"rank": 0, "timeout": int(max(timeout_s, 30))},
        max_restarts=0,
        monitor_interval=0.1,
        start_method=start_method,
        local_addr=host,
        logs_specs=logs,
    )


def one_line(text: str) -> str:
    return " ".join(str(text).split())


_KNOCK_ON = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout",
             "remote worker")


def _is_knock_on(text: str) -> bool:
    """Whether an error is what a rank sees when a peer is gone or stuck."""
    lower = text.lower()
    return any(w in lower for w in _KNOCK_ON)


def _rank_failure(
    exc: Any, statuses: dict[int, tuple[float, str]], nprocs: int, log_dir: str | None
) -> RankFailedError:
    """Name the rank that failed first.

    The launcher reports one failed process, not necessarily the first: when rank 1 dies, rank
    0 fails a moment later with "connection closed by peer", and either may be seen first. The
    ranks' own records (:func:`run_rank`) settle it: the earliest error that is not such a
    knock-on error; else a rank that died without raising (exit code or signal); else the
    rank that left no record while its peers failed waiting for it.
    """
    reasons = {rank: text for rank, (_, text) in statuses.items()}
    hard: dict[int, str] = {}
    for rank, failure in exc.failures.items():
        if rank in statuses:
            continue
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", "")
        text = one_line(message or "")
        if failure.exitcode and (not text or text.startswith("To enable traceback")):
            code = failure.exitcode
            text = f"exited with code {code}" if code > 0 else f"killed by signal {-code}"
        hard[rank] = text or "failed"
    reasons.update(hard)
    primary = sorted((t, r) for r, (t, text) in statuses.items() if not _is_knock_on(text))
    silent = [r for r in range(nprocs) if r not in reasons]
    if primary:
        first = primary[0][1]
    elif hard:
        first = min(hard)
    elif silent:
        first = silent[0]
        who = " or ".join(f"rank {r}" for r in silent)
        reasons[first] = (
            f"stopped without an error (crashed, killed or stuck) — {who}"
            if len(silent) > 1 else "stopped without an error (crashed, killed or stuck)"
        )
    else:
        first = min(statuses, key=lambda r: statuses[r][0])
    others = sorted(r for r in reasons if r != first)
    message = f"rank {first} failed: {reasons[first]}"
    if others:
        message += " (then " + "; ".join(f"rank {r}: {_shorten(reasons[r])}" for r in others) + ")"
    if log_dir:
        message += f"; logs in {log_dir}"
    return RankFailedError(message, rank=first, failures=reasons)


def _shorten(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
