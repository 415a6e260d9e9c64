"""Devices grouped in nodes, and where the stages and replicas of a layout go (no torch import).

Symbols: K nodes of G devices each (N = K · G), p stages, d replicas (p · d devices used),
W_in the link bandwidth between two devices of one node, W_out between nodes (bytes/s, one
direction, per device: a node's InfiniBand is shared by its G devices, one NIC each).

Devices are numbered node by node: device i sits on node ⌊i / G⌋. A layout of p × d devices is a
2-D mesh, and which dimension is the inner one (consecutive device numbers) decides which
traffic stays inside a node:

* ``"pp-inner"``: replica r's stages are devices r·p … r·p + p − 1 (the mesh ("dp", "pp") of
  torchtitan and torch's DeviceMesh in row-major order). Pipeline transfers stay inside a node
  when G is a multiple of p; a stage's replicas all-reduce across nodes once p · d > G.
* ``"dp-inner"``: stage s's replicas are devices s·d … s·d + d − 1 (the mesh ("pp", "dp")).
  The all-reduce stays inside a node when G is a multiple of d; the pipeline crosses nodes.

Costing (:func:`placements`): a transfer or an all-reduce runs at the bandwidth of the slowest
link it crosses: W_in when every device it involves sits on one node, W_out otherwise. All
replicas run at once, so the pipeline's transfers are costed at the slowest link that *any* of
its stage boundaries crosses: a pipeline that spans nodes pays W_out at every cut. That is on
the safe side for the boundaries inside a node (costing each boundary at its own link would
need per-stage transfer times in the exact search, which takes one time per block cut); the
all-reduce of the stage groups is exact (every group spans nodes, or none does, for the two
orders above). Pure data parallelism (p = 1) and pure pipelines (d = 1) have one placement.
"""

from __future__ import annotations

from dataclasses import dataclass

from autosplit import checks
from autosplit.errors import InvalidInputError

__all__ = ["PLACEMENTS", "Placement", "Topology", "device_of", "placement_text", "placements"]

PLACEMENTS = ("pp-inner", "dp-inner")
"""The placement orders, in the order ties are broken."""


@dataclass(frozen=True, slots=True)
class Topology:
    """N = ``nodes`` · ``per_node`` devices and the links between them.

    Attributes:
        nodes: K, the number of nodes (machines).
        per_node: G, devices per node.
        intra_node_bytes_per_s: W_in, link bandwidth between two devices of one node (one
            direction, bytes/s; e.g. NVLink 4: 450e9).
        inter_node_bytes_per_s: W_out, bandwidth per device between nodes (one direction,
            bytes/s; e.g. 400 Gb/s InfiniBand per GPU: 50e9).

    Raises:
        ArgumentTypeError: a count that is not an int, a bandwidth that is not a number.
        InvalidInputError: a count below 1, a bandwidth that is not finite and > 0.
    """

    nodes: int
    per_node: int
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float

    def __post_init__(self) -> None:
        checks.positive_int("nodes", self.nodes)
        checks.positive_int("per_node", self.per_node)
        checks.positive_finite("intra_node_bytes_per_s", self.intra_node_bytes_per_s, "bytes/s")
        checks.positive_finite("inter_node_bytes_per_s", self.inter_node_bytes_per_s, "bytes/s")

    @property
    def devices(self) -> int:
        """N = K · G."""
        return self.nodes * self.per_node

    def node_of(self, device: int) -> int:
        """The node holding device number ``device`` (numbered node by node)."""
        return device // self.per_node

    def bandwidth(self, devices: list[int] | tuple[int, ...]) -> float:
        """Bandwidth (bytes/s) of traffic among ``devices``: W_in on one node, else the
        slower of W_in and W_out."""
        if len({self.node_of(i) for i in devices}) <= 1:
            return self.intra_node_bytes_per_s
        return min(self.intra_node_bytes_per_s, self.inter_node_bytes_per_s)

    def describe(self) -> str:
        """``"8 nodes × 8 devices (450 GB/s inside a node, 50 GB/s between)"``."""
        return (f"{self.nodes} node{'s' if self.nodes != 1 else ''} × {self.per_node} "
                f"device{'s' if self.per_node != 1 else ''} "
                f"({self.intra_node_bytes_per_s / 1e9:g} GB/s inside a node, "
                f"{self.inter_node_bytes_per_s / 1e9:g} GB/s between)")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a layout's stages and replicas go, and the bandwidths that follow.

    Attributes:
        order: ``"pp-inner"`` or ``"dp-inner"`` (see the module docstring).
        link_bytes_per_s: bandwidth of the pipeline's transfers (the slowest boundary).
        allreduce_bytes_per_s: bandwidth of the stages' gradient all-reduce.
    """

    order: str
    link_bytes_per_s: float
    allreduce_bytes_per_s: float


def device_of(order: str, stage: int, replica: int, stages: int, replicas: int) -> int:
    """The device number of ``stage`` of ``replica`` under ``order``."""
    checks.one_of("order", order, PLACEMENTS)
    return replica * stages + stage if order == "pp-inner" else stage * replicas + replica


def placements(topology: Topology, stages: int, replicas: int,
               allreduce_bytes_per_s: float | None = None) -> tuple[Placement, ...]:
    """The placements of p = ``stages`` × d = ``replicas`` worth planning, in
    :data:`PLACEMENTS` order: one when the other's bandwidths are no better in both respects
    (it cannot be faster), else both.

    ``allreduce_bytes_per_s`` (e.g. a measured all-reduce) replaces W_in for an all-reduce
    inside a node; across nodes it is capped by W_out.

    Raises:
        InvalidInputError: p · d is more than the topology's devices.
    """
    p = checks.positive_int("stages", stages)
    d = checks.positive_int("replicas", replicas)
    if p * d > topology.devices:
        raise InvalidInputError(f"{p} stages × {d} replicas need {p * d} devices: the topology "
                                f"has {topology.describe()}, {topology.devices} devices")
    inside = topology.intra_node_bytes_per_s if allreduce_bytes_per_s is None else (
        allreduce_bytes_per_s)
    found: list[Placement] = []
    for order in PLACEMENTS:
        links = [topology.bandwidth((device_of(order, s, r, p, d),
                                     device_of(order, s + 1, r, p, d)))
                 for s in range(p - 1) for r in range(d)]
        groups = [topology.bandwidth(tuple(device_of(order, s, r, p, d) for r in range(d)))
                  for s in range(p)]
        sync = inside if min(groups) >= topology.intra_node_bytes_per_s else min(
            inside, topology.inter_node_bytes_per_s)
        link = min(links, default=topology.intra_node_bytes_per_s)
        found.append(Placement(order, link, sync if d > 1 else inside))
    first, second = found
    if (first.link_bytes_per_s >= second.link_bytes_per_s
            and first.allreduce_bytes_per_s >= second.allreduce_bytes_per_s):
        return (first,)
    if (second.link_bytes_per_s >= first.link_bytes_per_s
            and second.allreduce_bytes_per_s >= first.allreduce_bytes_per_s):
        return (second,)
    return (first, second)


def placement_text(order: str, stages: int, replicas: int, per_node: int) -> str:
    """What stays inside a node of ``per_node`` devices under ``order``, e.g.
    ``"pp-inner: each replica's 4 stages inside a node, replicas across nodes"``."""
    p, d = stages, replicas

    def node(s: int, r: int) -> int:
        return device_of(order, s, r, p, d) // per_node

    pipe_in = all(node(s, r) == node(s + 1, r) for s in range(p - 1) for r in range(d))
    sync_in = all(node(s, r) == node(s, 0) for s in range(p) for r in range(d))
    parts = []
    if p > 1:
        parts.append(f"each pipeline {'inside a node' if pipe_in else 'across nodes'}")
    if d > 1:
        parts.append(f"each stage's all-reduce {'inside a node' if sync_in else 'across nodes'}")
    where = ", ".join(parts) or "one device"
    return f"{order}: {where}" if p > 1 and d > 1 else where  # one order when p or d is 1
