"""Figures of the machine, not of the model: measured once per machine, kept in a cache file.

Planning for several devices needs, besides the model's profile, how fast the machine moves
data and runs torch's pipeline runtime: DDP's all-reduce (bus bandwidth and latency), a
stage's send to the next (link bandwidth) and the runtime's cost per action of each schedule
(:mod:`autosplit.measure.runtime_cost`). They depend on the host, the backend, the devices, the
threads per worker and torch, and take a minute or more to measure: they are measured once
and kept under the user's cache folder (``$XDG_CACHE_HOME/autosplit/machine.json``, else
``~/.cache/autosplit/machine.json``, or ``$AUTOSPLIT_CACHE``), one entry per
:class:`MachineKey`. An entry that is older than :data:`MAX_AGE_S`, of another machine, or
unreadable is measured again, and the caller says why in one line; so does ``remeasure``.

:func:`figures_for` is the policy (cache or measure); the measuring itself is passed in
(:class:`Measurers`), so that tests use synthetic figures and no test reads this machine's
cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autosplit.atomic_write import write_text_atomic

__all__ = ["MAX_AGE_S", "MachineFigures", "MachineKey", "Measurers", "cache_path", "describe_age",
           "figures_for", "load", "save"]

MAX_AGE_S = 7 * 24 * 3600.0
"""An entry older than this (seconds) is measured again: the machine may have changed."""

_VERSION = 1
"""The cache file's format; a file of another one is measured again (and rewritten)."""


@dataclass(frozen=True, slots=True)
class MachineKey:
    """What the machine figures depend on.

    Attributes:
        host: the host name.
        backend: ``"gloo"`` (CPU workers) or ``"nccl"`` (GPUs).
        device: ``"cpu"``, or the GPU's name.
        count: CPU cores, or GPUs.
        threads: intra-op threads per worker.
        torch: torch's version.
    """

    host: str
    backend: str
    device: str
    count: int
    threads: int
    torch: str

    @staticmethod
    def here(backend: str, device_kind: str, threads: int = 1) -> MachineKey:
        """This machine's key for workers of ``device_kind`` (``"cpu"``/``"cuda"``)."""
        import torch

        if device_kind == "cuda":
            device, count = torch.cuda.get_device_name(0), torch.cuda.device_count()
        else:
            device, count = "cpu", os.cpu_count() or 1
        return MachineKey(socket.gethostname(), backend, device, count, threads,
                          torch.__version__)

    @property
    def name(self) -> str:
        """The entry's name in the cache file."""
        return (f"{self.host}/{self.backend}/{self.device}×{self.count}/"
                f"{self.threads} thread{'s' if self.threads != 1 else ''}/torch {self.torch}")


@dataclass(frozen=True, slots=True)
class MachineFigures:
    """The machine's figures, as a profile records them (the profile's fields of those names).

    Attributes:
        key: the machine they are of.
        measured_at: when (Unix time, s).
        allreduce_bytes_per_s: DDP's all-reduce bus bandwidth (bytes/s).
        allreduce_latency_ms: its latency, whatever the size (ms).
        link_bytes_per_s: a stage's send to the next (bytes/s).
        action_ms: torch's runtime cost per action, by schedule (ms; none on GPUs so far).
        action_spread: the spread of each (ms).
        one_stage_action_ms: the cost per action of a one-stage pipeline, and its spread (ms).
        one_stage_action_spread: its spread (ms).
    """

    key: MachineKey
    measured_at: float
    allreduce_bytes_per_s: float
    allreduce_latency_ms: float
    link_bytes_per_s: float
    action_ms: tuple[tuple[str, float], ...] = ()
    action_spread: tuple[tuple[str, float], ...] = ()
    one_stage_action_ms: float | None = None
    one_stage_action_spread: float | None = None

    def has(self, schedules: Sequence[str]) -> bool:
        """Whether the runtime's cost per action is here for every one of ``schedules``."""
        known = dict(self.action_ms)
        return all(name in known for name in schedules)

    def profile_fields(self) -> dict[str, Any]:
        """``dataclasses.replace(profile, **figures.profile_fields())`` records them."""
        fields = {"allreduce_bytes_per_s": self.allreduce_bytes_per_s,
                  "allreduce_latency_ms": self.allreduce_latency_ms,
                  "link_bytes_per_s": self.link_bytes_per_s}
        if self.action_ms:
            fields.update(action_ms=self.action_ms, action_spread=self.action_spread)
        if self.one_stage_action_ms is not None:
            fields.update(one_stage_action_ms=self.one_stage_action_ms,
                          one_stage_action_spread=self.one_stage_action_spread)
        return fields

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["action_ms"] = dict(self.action_ms)
        data["action_spread"] = dict(self.action_spread)
        return data

    @staticmethod
    def from_json(data: dict[str, Any]) -> MachineFigures:
        """The figures of :meth:`to_json` (raises ``KeyError``/``TypeError``/``ValueError`` on
        anything else)."""
        def costs(name: str) -> tuple[tuple[str, float], ...]:
            return tuple((str(k), float(v)) for k, v in dict(data[name]).items())

        def optional(name: str) -> float | None:
            return None if data[name] is None else float(data[name])

        figures = MachineFigures(
            MachineKey(**data["key"]), float(data["measured_at"]),
            float(data["allreduce_bytes_per_s"]), float(data["allreduce_latency_ms"]),
            float(data["link_bytes_per_s"]), costs("action_ms"), costs("action_spread"),
            optional("one_stage_action_ms"), optional("one_stage_action_spread"))
        if min(figures.allreduce_bytes_per_s, figures.link_bytes_per_s) <= 0 \
                or figures.allreduce_latency_ms < 0:
            raise ValueError("a bandwidth that is not positive")
        return figures


@dataclass(frozen=True)
class Measurers:
    """How to measure each figure (the functions of :mod:`autosplit.measure.collectives` and
    :mod:`autosplit.measure.runtime_cost`, or synthetic ones in tests).

    Attributes:
        collectives: ``() -> (all-reduce bytes/s, latency ms, link bytes/s)``.
        actions: ``(schedules) -> (action_ms, action_spread)`` (``None`` where the device's
            runtime cost is not measured).
        one_stage: ``() -> (ms, spread ms)``, or ``None`` as ``actions``.
    """

    collectives: Callable[[], tuple[float, float, float]]
    actions: Callable[[Sequence[str]], tuple[tuple[tuple[str, float], ...],
                                             tuple[tuple[str, float], ...]]] | None = None
    one_stage: Callable[[], tuple[float, float]] | None = None


def cache_path() -> Path:
    """The cache file: ``$AUTOSPLIT_CACHE``, else ``$XDG_CACHE_HOME/autosplit/machine.json``,
    else ``~/.cache/autosplit/machine.json``."""
    if os.environ.get("AUTOSPLIT_CACHE"):
        return Path(os.environ["AUTOSPLIT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "autosplit" / "machine.json"


def load(path: Path, key: MachineKey, now: float | None = None,
         max_age_s: float = MAX_AGE_S) -> tuple[MachineFigures | None, str]:
    """The figures of ``key`` in the cache file, or ``None`` and why not (a phrase)."""
    now = time.time() if now is None else now
    if not path.exists():
        return None, "none measured on this machine yet"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("version") != _VERSION:
            return None, f"the cache {path} is of another version"
        entry = data["machines"].get(key.name)
        if entry is None:
            return None, f"none measured for {key.name} yet"
        figures = MachineFigures.from_json(entry)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, f"the cache {path} is unreadable ({type(exc).__name__})"
    if figures.key != key:
        return None, f"the cache's entry is of another machine ({figures.key.name})"
    age = now - figures.measured_at
    if age > max_age_s or age < 0:
        return None, f"the cached ones are {describe_age(age)} old"
    return figures, ""


def save(path: Path, figures: MachineFigures) -> None:
    """Write ``figures`` into the cache file (atomically; other machines' entries kept)."""
    machines: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("version") == _VERSION:
            machines = dict(data["machines"])
    machines[figures.key.name] = figures.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"version": _VERSION, "machines": machines}, indent=1))


def figures_for(key: MachineKey, schedules: Sequence[str], measurers: Measurers, *,
                path: Path | None = None, remeasure: bool = False,
                now: float | None = None,
                have: MachineFigures | None = None) -> tuple[MachineFigures, str]:
    """The machine's figures for planning ``schedules``, and one line that says where they
    come from: the cache (with their age), else measured now (saying why) and cached.

    A cached entry that lacks some of ``schedules`` keeps what it has and measures the rest;
    so do figures the caller already ``have`` (the cache is not read then).
    A cache that cannot be written is left as it is (the figures are still returned).
    """
    path = cache_path() if path is None else path
    now = time.time() if now is None else now
    if have is not None:
        cached, why = have, ""
    else:
        cached, why = (None, "--remeasure") if remeasure else load(path, key, now)
    wanted = list(schedules) if measurers.actions is not None else []
    if cached is not None and cached.has(wanted) and (
            measurers.one_stage is None or cached.one_stage_action_ms is not None):
        return cached, (f"machine figures from {path} (measured {describe_age(now - cached.measured_at)}"
                        " ago; --remeasure to measure them again)")
    if cached is not None:  # some schedules' costs are missing: measure those only
        missing = [name for name in wanted if name not in dict(cached.action_ms)]
        figures = _with_actions(cached, missing, measurers)
        note = (f"machine figures from {path}, with the runtime's cost for "
                f"{', '.join(missing) or 'one stage'} measured now")
    else:
        allreduce, latency, link = measurers.collectives()
        figures = _with_actions(MachineFigures(key, now, allreduce, latency, link), wanted,
                                measurers)
        note = f"measured the machine's figures ({why}); kept in {path}"
    with contextlib.suppress(OSError):
        save(path, figures)
    return figures, note


def _with_actions(figures: MachineFigures, schedules: Sequence[str],
                  measurers: Measurers) -> MachineFigures:
    if measurers.actions is not None and schedules:
        ms, spread = measurers.actions(schedules)
        figures = dataclasses.replace(figures, action_ms=figures.action_ms + tuple(ms),
                                      action_spread=figures.action_spread + tuple(spread))
    if measurers.one_stage is not None and figures.one_stage_action_ms is None:
        one, one_spread = measurers.one_stage()
        figures = dataclasses.replace(figures, one_stage_action_ms=one,
                                      one_stage_action_spread=one_spread)
    return figures


def describe_age(seconds: float) -> str:
    """``seconds`` in the largest whole unit: ``"40 s"``, ``"3 min"``, ``"5 h"``, ``"9 days"``."""
    seconds = abs(seconds)
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            count = int(seconds // size)
            return f"{count} {'day' if unit == 'days' and count == 1 else unit}"
    return f"{int(seconds)} s"
