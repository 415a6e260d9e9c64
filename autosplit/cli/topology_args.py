"""``--gpus``, ``--nodes`` and ``--gpus-per-node`` of ``autosplit plan``: the device count and
the :class:`~autosplit.topology.Topology` they describe."""

from __future__ import annotations

import argparse
from typing import Any

from autosplit.errors import InvalidInputError
from autosplit.topology import Topology

__all__ = ["add_topology_arguments", "resolve_device_count", "topology_for"]


def add_topology_arguments(p: argparse.ArgumentParser, positive_int: Any, byte_size: Any) -> None:
    """``--nodes``, ``--gpus-per-node`` and ``--inter-node-bandwidth`` on the parser ``p``."""
    p.add_argument("--nodes", type=positive_int, metavar="K",
                   help="the devices sit in K nodes (machines); with --gpus-per-node G, "
                        "--gpus defaults to K × G")
    p.add_argument("--gpus-per-node", type=positive_int, metavar="G",
                   help="devices per node; stages and replicas are placed so that the heavier "
                        "traffic stays inside a node")
    p.add_argument("--max-stages", type=positive_int, metavar="P",
                   help="consider layouts of at most P stages (default: the model's blocks); "
                        "the exact 1F1B search takes minutes for tens of stages")
    p.add_argument("--inter-node-bandwidth", type=byte_size, metavar="BYTES_PER_S",
                   help="bandwidth per device between nodes, e.g. 50GB (per second; default: "
                        "the device's usual network, see autosplit.specs.INTER_NODE_LINKS); "
                        "--bandwidth is the link inside a node")


def resolve_device_count(args: argparse.Namespace) -> tuple[int, int] | None:
    """Check ``--gpus`` against ``--nodes`` × ``--gpus-per-node``, set ``args.gpus`` and return
    (K, G), or ``None`` when no node option was given.

    Raises:
        InvalidInputError: neither ``--gpus`` nor both node options; counts that disagree or
            do not divide; ``--inter-node-bandwidth`` without nodes.
    """
    gpus, nodes, per_node = args.gpus, args.nodes, args.gpus_per_node
    if nodes is None and per_node is None:
        if args.inter_node_bandwidth is not None:
            raise InvalidInputError("--inter-node-bandwidth needs --nodes or --gpus-per-node: "
                                    "without them all devices are on one node")
        if gpus is None:
            raise InvalidInputError("give the device count: --gpus N, or --nodes K "
                                    "--gpus-per-node G")
        return None
    if nodes is not None and per_node is not None:
        if gpus is not None and gpus != nodes * per_node:
            raise InvalidInputError(f"--gpus {gpus} differs from --nodes {nodes} × "
                                    f"--gpus-per-node {per_node} = {nodes * per_node}: give "
                                    "consistent counts, or leave out --gpus")
    elif gpus is None:
        given = f"--nodes {nodes}" if nodes is not None else f"--gpus-per-node {per_node}"
        raise InvalidInputError(f"{given} alone does not say how many devices: add --gpus N "
                                "or both --nodes and --gpus-per-node")
    elif nodes is not None:
        if gpus % nodes:
            raise InvalidInputError(f"--nodes {nodes} does not divide --gpus {gpus}: every "
                                    "node holds the same number of devices")
        per_node = gpus // nodes
    else:
        if gpus % per_node:
            raise InvalidInputError(f"--gpus-per-node {per_node} does not divide --gpus {gpus}:"
                                    " every node holds the same number of devices")
        nodes = gpus // per_node
    args.gpus = nodes * per_node
    return nodes, per_node


def topology_for(counts: tuple[int, int], spec: Any, kind: str, intra: float | None,
                 inter: float | None) -> Topology:
    """The :class:`Topology` of K × G devices (``counts``) of the device ``spec`` (or, without
    one, of ``kind``, ``"cpu"`` or ``"cuda"``): ``intra`` (--bandwidth) defaults to the spec's
    link or :data:`autosplit.cost.DEFAULT_LINK_BYTES_PER_S`, ``inter`` to its usual network
    between nodes (:func:`autosplit.specs.inter_node_link`)."""
    from autosplit.cost import DEFAULT_LINK_BYTES_PER_S
    from autosplit.specs import LINKS, inter_node_link

    if spec is not None:
        inside = spec.link_bandwidth_bytes_per_s
        between = inter_node_link(spec)[1]
    else:
        inside = DEFAULT_LINK_BYTES_PER_S.get(kind, 5e9)
        between = LINKS["infiniband-ndr" if kind == "cuda" else "ethernet-25g"]
    return Topology(counts[0], counts[1], intra or inside, inter or between)
