"""``autosplit devices`` (the named device specs) and ``autosplit calibrate`` (a spec fitted
to a measured profile)."""

from __future__ import annotations

import argparse

from autosplit.cli.common import load_model, make_console
from autosplit.errors import InvalidInputError
from autosplit.estimate.options import EstimateOptions
from autosplit.records import Profile

__all__ = ["calibrate_command", "devices_command"]


def calibrate_command(args: argparse.Namespace) -> int:
    """Fit the spec's efficiencies to ``--profile``; write the calibrated spec."""
    from autosplit.estimate.analytic import count_costs
    from autosplit.specs import calibrate, get_spec, load_spec

    console = make_console()
    spec = load_spec(args.device_spec) if args.device_spec else get_spec(args.device)
    measured = Profile.load(args.profile)
    if measured.source != "measured":
        raise InvalidInputError(
            f"{args.profile!r} is an {measured.source} profile: calibrate on a measured one"
        )
    _, model, _ = load_model(args)
    import torch

    shapes = measured.input_shapes
    dtypes = [getattr(torch, d.replace("torch.", "")) for d in measured.input_dtypes]
    inputs = tuple(torch.zeros(shape, dtype=dt, device="meta")
                   for shape, dt in zip(shapes, dtypes))
    costs = count_costs(model, inputs,
                        options=EstimateOptions(microbatch_sizes=list(measured.microbatch_sizes)))
    if tuple(costs.block_names) != measured.block_names:
        raise InvalidInputError(
            f"profile {args.profile!r} was made for another model ({measured.model}): profile "
            f"{args.model} and calibrate on that"
        )
    fitted = calibrate(spec, measured, costs, sizes=[args.split_size] if args.split_size else None)
    args.outputs.commit({"-o": fitted.save})
    console.print(f"{spec.name}: efficiency {spec.efficiency:.3f} → {fitted.efficiency:.3f}, "
                  f"bandwidth efficiency {spec.bandwidth_efficiency:.3f} → "
                  f"{fitted.bandwidth_efficiency:.3f}"
                  + (f", at least {fitted.op_overhead_s * 1e6:.1f} µs per operator"
                     if fitted.op_overhead_s > 0 else ""))
    console.print(f"calibrated on {measured.describe()}")
    console.print(fitted.source.rsplit("; ", 1)[-1])
    console.print(f"wrote {args.output} · plan with --device-spec {args.output}")
    return 0


def devices_command(args: argparse.Namespace) -> int:
    """Print the table of named device specs."""
    from rich.table import Table

    from autosplit.specs import KNOWN_DEVICES

    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("name", "bf16 TFLOP/s", "fp32 TFLOP/s", "memory", "bandwidth", "link"):
        table.add_column(name, justify="left" if name in ("name", "link") else "right")
    for spec in KNOWN_DEVICES.values():
        table.add_row(
            spec.name,
            f"{spec.peak_flops_per_s('bf16') / 1e12:.3g}",
            f"{spec.peak_flops_per_s('fp32') / 1e12:.3g}",
            f"{spec.memory_bytes / 1e9:.0f} GB",
            f"{spec.memory_bandwidth_bytes_per_s / 1e9:.0f} GB/s",
            f"{spec.link} {spec.link_bandwidth_bytes_per_s / 1e9:.0f} GB/s",
        )
    console = make_console()
    console.print(table)
    console.print("\n dense peaks from the vendors' datasheets (sources: autosplit.specs); "
                  "plan with --device NAME, calibrate with `autosplit calibrate`")
    return 0
