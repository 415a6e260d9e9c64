"""The devices known by name (``autosplit devices``), with the datasheets their figures come from.

Every figure is the dense one; see :mod:`autosplit.specs` for the units.
"""

from __future__ import annotations

from autosplit import checks
from autosplit.errors import InvalidInputError
from autosplit.specs.device_spec import LINKS, DeviceSpec

__all__ = ["INTER_NODE_LINKS", "KNOWN_DEVICES", "get_spec", "inter_node_link", "known_names"]

# ------------------------------------------------------------------------------ the devices

_A100 = (
    "NVIDIA A100 Tensor Core GPU datasheet (SXM4): FP32 19.5 TFLOPS, BF16/FP16 Tensor Core "
    "312 TFLOPS dense (624 with sparsity), NVLink 600 GB/s total; "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_H100 = (
    "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): FP32 67 TFLOPS, BF16/FP16 Tensor Core "
    "1,979 TFLOPS with sparsity = 989.5 dense, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s total; "
    "https://www.nvidia.com/en-us/data-center/h100/"
)
_H200 = (
    "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): FP32 67 TFLOPS, BF16/FP16 Tensor Core "
    "1,979 TFLOPS with sparsity = 989.5 dense, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s total; "
    "https://www.nvidia.com/en-us/data-center/h200/"
)
_L4 = (
    "NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3 TFLOPS, BF16/FP16 Tensor Core 242 TFLOPS "
    "with sparsity = 121 dense, 24 GB GDDR6 at 300 GB/s, PCIe Gen4 x16 (64 GB/s total); "
    "https://www.nvidia.com/en-us/data-center/l4/"
)
_RTX4090 = (
    "NVIDIA Ada Lovelace GPU architecture whitepaper, GeForce RTX 4090 column: peak FP32 82.6 "
    "TFLOPS, peak FP16/BF16 Tensor TFLOPS with FP32 accumulate 165.2 dense (330.4 with "
    "sparsity), 24 GB GDDR6X at 1,008 GB/s, PCIe Gen4 x16, no NVLink; "
    "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
)
_CPU = (
    "NOMINAL, meant to be calibrated (autosplit calibrate): one core of an AMD EPYC Zen 5, "
    "this project's machine. Peak = FLOP per cycle × 3.6 GHz: AVX-512 with two 512-bit FMA "
    "pipes = 64 FP32 FLOP/cycle (230 GFLOP/s); AVX512_BF16 dot products = 128 bf16 FLOP/cycle "
    "(461 GFLOP/s); no native fp16 arithmetic (fp32 rate). 3.6 GHz is the sustained one-core "
    "clock that a bf16 GEMM reaching 460 GFLOP/s on this machine implies (the TSC runs at "
    "2.6 GHz). 30 GB/s is a typical one-core streaming bandwidth (a tensor copy here reads and "
    "writes ~33 GB/s). Memory: this machine's 24 GiB. Link: gloo over loopback between worker "
    "processes"
)

KNOWN_DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec("a100-40gb", 312e12, 312e12, 19.5e12, 40 * 10**9, 1555e9,
                   "nvlink3", LINKS["nvlink3"], _A100 + " (40 GB HBM2 at 1,555 GB/s)"),
        DeviceSpec("a100-80gb", 312e12, 312e12, 19.5e12, 80 * 10**9, 2039e9,
                   "nvlink3", LINKS["nvlink3"], _A100 + " (80 GB HBM2e at 2,039 GB/s)"),
        DeviceSpec("h100-80gb", 989.5e12, 989.5e12, 67e12, 80 * 10**9, 3.35e12,
                   "nvlink4", LINKS["nvlink4"], _H100),
        DeviceSpec("h200", 989.5e12, 989.5e12, 67e12, 141 * 10**9, 4.8e12,
                   "nvlink4", LINKS["nvlink4"], _H200),
        DeviceSpec("l4", 121e12, 121e12, 30.3e12, 24 * 10**9, 300e9,
                   "pcie4-x16", LINKS["pcie4-x16"], _L4),
        DeviceSpec("rtx-4090", 165.2e12, 165.2e12, 82.6e12, 24 * 10**9, 1008e9,
                   "pcie4-x16", LINKS["pcie4-x16"], _RTX4090),
        DeviceSpec("cpu-core", 460.8e9, 230.4e9, 230.4e9, 24 * 2**30, 30e9,
                   "loopback", LINKS["loopback"], _CPU, kind="cpu"),
    )
}
"""The devices known by name; ``get_spec(name)`` returns one."""


def known_names() -> list[str]:
    """Names of the known devices, in table order."""
    return list(KNOWN_DEVICES)


def get_spec(name: str) -> DeviceSpec:
    """The known device called ``name`` (case and ``_``/``-`` do not matter).

    Raises:
        ArgumentTypeError: ``name`` is not a string.
        InvalidInputError: unknown name; the message lists the known ones.
    """
    key = checks.text("name", name).strip().lower().replace("_", "-")
    try:
        return KNOWN_DEVICES[key]
    except KeyError:
        raise InvalidInputError(
            f"unknown device {name!r}: known devices are {', '.join(KNOWN_DEVICES)}; "
            "or describe yours in a JSON file (--device-spec FILE)"
        ) from None


INTER_NODE_LINKS: dict[str, str] = {
    # the network between nodes that such devices usually come with (DGX/HGX: one NIC per GPU)
    "a100-40gb": "infiniband-hdr",  # DGX A100: 8 × ConnectX-6 200 Gb/s
    "a100-80gb": "infiniband-hdr",
    "h100-80gb": "infiniband-ndr",  # DGX H100: 8 × ConnectX-7 400 Gb/s
    "h200": "infiniband-ndr",
    "l4": "ethernet-100g",
    "rtx-4090": "ethernet-100g",
    "cpu-core": "ethernet-25g",
}
"""The link between nodes assumed for each named device (a name of :data:`LINKS`)."""


def inter_node_link(spec: DeviceSpec) -> tuple[str, float]:
    """The link between nodes of ``spec``'s devices, and its bandwidth per device (bytes/s,
    one direction): :data:`INTER_NODE_LINKS` for a named device, else NDR InfiniBand for a
    GPU and 25 Gb/s Ethernet for a CPU."""
    name = INTER_NODE_LINKS.get(spec.name, "infiniband-ndr" if spec.kind == "cuda"
                                else "ethernet-25g")
    return name, LINKS[name]
