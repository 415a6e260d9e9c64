"""The accuracy benchmark's models and its arithmetic (``accuracy.py``): which models at which
sizes, each one's hand split, and the errors and goals computed from predicted and measured
step times. No timing happens here.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from common import load_example
from harness import ModelSpec
from torch import nn

from autosplit.measure.spread import PREDICTION_ERROR, ratio_with_spread

ONE = "one device"
AUTO = "autosplit"
HAND = "hand split"
GOALS = {"median": 0.03, "p90": 0.08, "ratio": 0.03, "agreement": 0.01}
"""Median and p90 step error, every predicted ratio's error, plans within 1 % measured."""


@dataclass(frozen=True)
class ExampleSpec(ModelSpec):
    """A model file of examples/ (``build_model(size)``, ``example_inputs(batch, size)``), rebuilt
    seeded in every rank like :class:`harness.ModelSpec`; ``key`` is ``<example>-<size>``."""

    @property
    def describe(self) -> str:
        return f"B={self.batch} × {self.make_inputs()[0].shape[1]} tokens"

    def _parts(self) -> tuple[Any, str]:
        example, size = self.key.split("-", 1)
        return load_example(example), size

    def build(self) -> nn.Module:
        torch.manual_seed(self.seed)
        module, size = self._parts()
        return module.build_model(size)

    def make_inputs(self) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(self.seed + 1)
        module, size = self._parts()
        return tuple(module.example_inputs(self.batch, size))


@dataclass(frozen=True)
class Case:
    """One model of the benchmark. ``hand``: (cut points, split size) or None; ``sequential``:
    the key torchgpipe_peer.flatten knows the model's layout by (None: no torchgpipe row);
    ``step_s``: a rough one-device step on one CPU thread (s), for the estimate up front."""

    name: str
    label: str
    spec: ModelSpec
    hand: tuple[tuple[str, ...], int] | None
    sequential: str | None
    step_s: float


def resnet50_hand(split_size: int | None = None) -> tuple[tuple[str, ...], int]:
    """examples/resnet50.py's hand split: its cut and split size 20, or ``split_size`` for a
    batch that 20 does not divide (torch's pipelining runs equal micro-batches only)."""
    example = load_example("resnet50")
    return tuple(example.MANUAL_SPLIT), int(split_size or example.MANUAL_SPLIT_SIZE)


def default_cases() -> list[Case]:
    return [
        Case("resnet50", "ResNet50", ModelSpec("resnet50", 120, (3, 128, 128)), resnet50_hand(),
             "resnet50", 10.5),
        Case("resnet101", "ResNet101", ModelSpec("resnet101", 48, (3, 64, 64)), None,
             "resnet101", 1.3),
        Case("gpt-small", "GPT small", ModelSpec("gpt-small", 64), None, "gpt-small", 0.45),
        # bigvocab has gpt.py's layout and module names: torchgpipe_peer flattens it as a GPT
        Case("bigvocab", "Big vocabulary", ExampleSpec("bigvocab-small", 32), None,
             "gpt-bigvocab", 0.7),
    ]


def smoke_cases() -> list[Case]:
    """ResNet18 at toy sizes: a hand split, torchgpipe's balance and two profiles (the
    big-vocabulary model, with no hand split, is layouts.py's smoke run)."""
    return [
        Case("resnet18", "ResNet18", ModelSpec("resnet18", 8, (3, 32, 32)), (("layer3",), 4),
             "resnet18", 0.05),
    ]


def plan_key(plan: Any) -> tuple[tuple[int, ...], int]:
    """What makes two plans run alike: the cut (stage block counts) and the micro-batch size."""
    return tuple(plan.balance), int(plan.split_size)


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile, linear between order statistics (numpy's default); NaN if empty."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(seconds: Sequence[float]) -> dict[str, float]:
    """A measured figure's median, min, max (ms) and half its min–max range over the median."""
    ms = [s * 1000 for s in seconds]
    mid = statistics.median(ms)
    return {"median_ms": mid, "min_ms": min(ms), "max_ms": max(ms), "n": len(ms),
            "half_range": (max(ms) - min(ms)) / 2 / mid if mid else math.nan}


def errors(model: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each (profile, plan)'s step error |predicted − measured| / measured, and each profile's
    predicted ratio autosplit / other plan against the measured ratio (ratio / ratio − 1), every
    figure measured in that profile's own timed rounds; plans identical to autosplit's are left
    out of the ratios (both ratios are 1)."""
    steps, ratios = [], []
    for p, prof in enumerate(model["profiles"]):
        measured = {label: m["median_ms"] for label, m in prof["measured"].items()}
        for name, row in prof["plans"].items():
            meas = measured[row["label"]]
            steps.append({"profile": p + 1, "plan": name, "predicted_ms": row["predicted_ms"],
                          "measured_ms": meas,
                          "error": abs(row["predicted_ms"] - meas) / meas})
        auto = prof["plans"][AUTO]
        for name, row in prof["plans"].items():
            if name == AUTO or row["label"] == auto["label"]:
                continue
            predicted = auto["predicted_ms"] / row["predicted_ms"]
            actual = measured[auto["label"]] / measured[row["label"]]
            noise = paired_spread(prof["measured"][auto["label"]]["seconds"],
                                  prof["measured"][row["label"]]["seconds"])
            error = predicted / actual - 1
            ratios.append({"profile": p + 1, "plan": name, "predicted_ratio": predicted,
                           "measured_ratio": actual, "error": error,
                           "measured_ratio_spread": noise,
                           "beyond_noise": bool(abs(error) > noise),
                           **printed_interval(auto, row, actual)})
    return steps, ratios


def printed_interval(auto: dict[str, Any], other: dict[str, Any], measured: float
                     ) -> dict[str, Any]:
    """The interval of the ratio autosplit / other plan that autosplit prints (both plans'
    verified spreads and a predicted ratio's error, ``PREDICTION_ERROR``: "vs one device",
    "vs hand split", "vs best" read the same interval the other way round) and whether the
    measured ratio lies in it; ``None`` where a plan has no spread (not verified)."""
    if auto.get("step_spread") is None or other.get("step_spread") is None:
        return {"printed_low": None, "printed_high": None, "within_printed": None}
    claim = ratio_with_spread(auto["predicted_ms"], auto["step_spread"], other["predicted_ms"],
                              other["step_spread"], error=PREDICTION_ERROR)
    return {"printed_low": claim.low, "printed_high": claim.high,
            "within_printed": bool(claim.low <= measured <= claim.high)}


def paired_spread(first: Sequence[float], second: Sequence[float]) -> float:
    """How well two configurations' measured ratio is known: half the interquartile range of
    the per-round ratios ``first[k] / second[k]`` (timed in the same round, interleaved) over
    their median, a fraction; 0 with fewer than 2 rounds."""
    ratios = [a / b for a, b in zip(first, second)]
    if len(ratios) < 2:
        return 0.0
    q1, mid, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return (q3 - q1) / 2 / mid


def repeated_ratios(model: dict[str, Any]) -> list[dict[str, Any]]:
    """The measured ratios autosplit / other plan of the same two plans (by :func:`plan_key`,
    whatever each profile named the other: ``plans``) measured in more than one profile's
    window, each with its windows' range, max / min − 1, and the smallest error one number
    reaches on all of them, √(max/min) − 1: how far the measured ratio itself moves between
    windows minutes apart, whatever predicted it."""
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in model["ratio_errors"]:
        plans = model["profiles"][e["profile"] - 1]["plans"]
        auto, other = plans[AUTO], plans[e["plan"]]
        key = (tuple(auto["balance"]), auto["split_size"], tuple(other["balance"]),
               other["split_size"])
        row = seen.setdefault(key, {"plans": [], "profiles": [], "measured": []})
        if e["plan"] not in row["plans"]:
            row["plans"].append(e["plan"])
        if e["profile"] not in row["profiles"]:  # plans alike in a profile: one measurement
            row["profiles"].append(e["profile"])
            row["measured"].append(e["measured_ratio"])
    out = []
    for row in seen.values():
        if len(row["measured"]) > 1:
            high, low = max(row["measured"]), min(row["measured"])
            out.append({**row, "range": high / low - 1, "best_single": math.sqrt(high / low) - 1})
    return out


def distinct_choices(profiles: Sequence[dict[str, Any]]
                     ) -> dict[tuple[tuple[int, ...], int], dict[str, Any]]:
    """autosplit's plan of each profile, once per distinct plan (by :func:`plan_key`): the
    first profile's row of each."""
    chosen: dict[tuple[tuple[int, ...], int], dict[str, Any]] = {}
    for prof in profiles:
        row = prof["plans"][AUTO]
        chosen.setdefault((tuple(row["balance"]), int(row["split_size"])), row)
    return chosen


def agreement(model: dict[str, Any]) -> dict[str, Any]:
    """Whether the profiles gave the same autosplit plan, or plans within 1 % measured: the
    distinct plans timed together (``model["agreement_measured"]``), interleaved."""
    profiles = model["profiles"]
    chosen = distinct_choices(profiles)
    keys = [(tuple(p["plans"][AUTO]["balance"]), int(p["plans"][AUTO]["split_size"]))
            for p in profiles]
    labels = [chosen[k]["label"] for k in keys]
    if len(chosen) == 1:
        return {"plans": labels, "distinct": 1, "same": True, "gap": 0.0,
                "agreeing": len(labels), "profiles": len(labels), "fastest": labels[0]}
    measured = {x: m["median_ms"] for x, m in model["agreement_measured"]["measured"].items()}
    times = {row["label"]: measured[row["label"]] for row in chosen.values()}
    fastest = min(times, key=times.__getitem__)
    limit = times[fastest] * (1 + GOALS["agreement"])
    return {"plans": labels, "distinct": len(chosen), "same": False,
            "gap": max(times.values()) / times[fastest] - 1,
            "agreeing": sum(1 for x in labels if times[x] <= limit), "profiles": len(labels),
            "fastest": fastest}


def goals(models: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The README's goals for the accuracy benchmark, each with its value and met / missed."""
    steps = [e["error"] for m in models for e in m["step_errors"]]
    ratios = [abs(e["error"]) for m in models for e in m["ratio_errors"]]
    agreeing = [(m["agreement"]["agreeing"], m["agreement"]["profiles"]) for m in models]
    rows = [
        ("median step error", quantile(steps, 0.5), f"≤ {GOALS['median']:.0%}", GOALS["median"]),
        ("p90 step error", quantile(steps, 0.9), f"≤ {GOALS['p90']:.0%}", GOALS["p90"]),
        ("largest predicted-ratio error", max(ratios, default=0.0),
         f"every one within ±{GOALS['ratio']:.0%}", GOALS["ratio"]),
    ]
    out = [{"goal": g, "value": v, "target": t, "met": bool(v <= limit)} for g, v, t, limit in rows]
    beyond = [e for m in models for e in m["ratio_errors"] if e["beyond_noise"]]
    out[-1]["beyond_noise"] = f"{len(beyond)} of {len(ratios)}"  # errors the rounds resolve
    held = [e["within_printed"] for m in models for e in m["ratio_errors"]
            if e.get("within_printed") is not None]
    out[-1]["within_printed"] = f"{sum(held)} of {len(held)}"  # the printed claims that held
    repeated = [r for m in models for r in m.get("repeated_ratios", [])]
    out[-1]["repeated"] = {"ratios": len(repeated),
                           "beyond_goal": sum(r["best_single"] > GOALS["ratio"] for r in repeated),
                           "best_single": max((r["best_single"] for r in repeated), default=0.0)}
    worst = min(agreeing, key=lambda a: a[0] / a[1]) if agreeing else (0, 0)
    out.append({"goal": "profiles giving the same plan (or within 1 % measured), worst model",
                "value": f"{worst[0]} of {worst[1]}", "target": "all of them",
                "met": all(a == n for a, n in agreeing)})
    return out
