"""Named device specifications for planning on hardware you do not have (no torch import).

A :class:`DeviceSpec` holds a device's published figures: dense peak FLOP/s per data type, memory
size and bandwidth, and the bandwidth of the link between two such devices. With an
``efficiency`` (the share of the peak that a training step reaches) it turns counted work into
time with a roofline, applied operator by operator (see :mod:`autosplit.estimate.analytic`):

    t(op) = max(flops / (peak[dtype] · efficiency),
                bytes / (memory_bandwidth · bandwidth_efficiency),
                op_overhead_s)

and a block's time is the sum over its operators (eager PyTorch runs one kernel per operator;
an operator that moves nothing, a view, costs nothing). The floor ``op_overhead_s`` stands for
the host's time to launch an operator where the device would finish it sooner: 0 in the named
specs (it depends on the model and the host as much as on the device), fitted by
:func:`calibrate`.

Units: FLOP/s (``_flops_per_s``), bytes (``_bytes``), bytes per second (``_bytes_per_s``), one
direction for links. Every figure is the *dense* one (no 2:4 structured sparsity). Memory sizes
are the datasheets' decimal gigabytes (80 GB = 80·10⁹ bytes), a little below what the driver
reports, which leaves room for the CUDA context.

The default efficiencies are deliberately round guesses, not measurements: 0.5 of the Tensor
Core peak is what well-tuned large-model training reaches on A100/H100 (model FLOPs utilisation
of 40–55 % in the Megatron-LM and PaLM reports), and 0.8 of the memory bandwidth is what
streaming kernels reach. :func:`calibrate` replaces them with values fitted to one measured
profile.
"""

from __future__ import annotations

from autosplit.specs.calibration import OpCosts, calibrate
from autosplit.specs.device_spec import (
    DEFAULT_BANDWIDTH_EFFICIENCY,
    DEFAULT_EFFICIENCY,
    LINKS,
    DeviceSpec,
    load_spec,
    op_time_s,
    spec_from_mapping,
)
from autosplit.specs.named_devices import (
    INTER_NODE_LINKS,
    KNOWN_DEVICES,
    get_spec,
    inter_node_link,
    known_names,
)

__all__ = [
    "DeviceSpec",
    "KNOWN_DEVICES",
    "INTER_NODE_LINKS",
    "inter_node_link",
    "DEFAULT_EFFICIENCY",
    "DEFAULT_BANDWIDTH_EFFICIENCY",
    "LINKS",
    "OpCosts",
    "get_spec",
    "load_spec",
    "known_names",
    "op_time_s",
    "calibrate",
    "spec_from_mapping",
]
