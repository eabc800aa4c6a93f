"""The network a step's collectives run on: a node's NVLink and its NICs, each collective a ring
at NCCL's bus bandwidth plus NCCL's latency model (or a fixed latency, the uncalibrated model).
Bandwidths come from hardware.py's rows or the planner's flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_gpt.hardware import GB

NCCL_BASE_LATENCY_S = 8.4e-6
NCCL_NVLINK_HOP_S = 3.4e-6
NCCL_NET_HOP_S = 14e-6
"""NCCL's latency model of a ring collective in its Simple protocol, the one large messages use
(src/graph/tuning.cc, `baseLatencies` and `hwLatencies` for Ring/Simple): a base cost, then one
hop per step of the ring, an NVLink hop inside a node and a network hop between nodes. An
all-gather or reduce-scatter over N ranks on n nodes takes N - 1 steps, n - 1 of them between
nodes; an all-reduce twice as many."""


@dataclass(frozen=True)
class Network:
    gpus_per_node: int
    intra_node_gbps: float
    """NCCL bus bandwidth inside a node, GB/s."""
    inter_node_gbps: float
    """NCCL bus bandwidth between nodes: the node's aggregate NIC bandwidth, GB/s."""
    nccl_latency: bool = True
    """Cost each collective by NCCL's ring latency model (it grows with the ranks); False: a
    fixed `latency_s` each (the uncalibrated model)."""
    latency_s: float = 20e-6
    """The uncalibrated model's fixed cost per collective (launch + ring latency), seconds."""

    def nodes(self, n_gpus: int) -> int:
        return -(-n_gpus // self.gpus_per_node)

    def bus_gbps(self, n_gpus: int) -> float:
        """A ring spanning nodes moves every byte through each node's NICs: the slower link
        bounds it, so across nodes the inter-node bandwidth is the bottleneck."""
        if self.nodes(n_gpus) == 1:
            return self.intra_node_gbps
        return min(self.intra_node_gbps, self.inter_node_gbps)

    def ring_latency_s(self, ranks: int, per_node: int | None = None, *,
                       all_reduce: bool = False) -> float:
        """A ring collective's fixed cost over `ranks` ranks, `per_node` of them in each node
        (default: they fill nodes): `latency_s`, or with `nccl_latency` NCCL's model."""
        if ranks <= 1:
            return 0.0
        if not self.nccl_latency:
            return self.latency_s
        nodes = -(-ranks // (per_node or self.gpus_per_node))
        steps, net_steps = ranks - 1, nodes - 1
        if all_reduce:
            steps, net_steps = 2 * steps, 2 * net_steps
        return (NCCL_BASE_LATENCY_S + (steps - net_steps) * NCCL_NVLINK_HOP_S
                + net_steps * NCCL_NET_HOP_S)

    def send_latency_s(self, across_nodes: bool) -> float:
        """A point-to-point transfer's fixed cost: one ring step of NCCL's model (a network or an
        NVLink hop), or `latency_s`."""
        if not self.nccl_latency:
            return self.latency_s
        return NCCL_NET_HOP_S if across_nodes else NCCL_NVLINK_HOP_S

    def collective_s(self, full_bytes: float, n_gpus: int) -> float:
        """All-gather or reduce-scatter of a `full_bytes` tensor: each rank sends and receives
        (N-1)/N of it (ring algorithm)."""
        if n_gpus <= 1:
            return 0.0
        return (ring_bytes(full_bytes, n_gpus) / (self.bus_gbps(n_gpus) * GB)
                + self.ring_latency_s(n_gpus))

    def ring_s(self, bytes_per_gpu: float, *, ranks: int, per_node: int,
               nic_sharing: int = 1, all_reduce: bool = False) -> float:
        """A ring collective over `ranks` ranks, `per_node` of them in each node, in which each
        member sends `bytes_per_gpu`.

        Inside a node every GPU has its own NVLink/PCIe bandwidth. A ring across nodes pushes
        each member's bytes through every node's NICs once, and the NICs are the node's: when
        `nic_sharing` such rings run at once with members on the same nodes (one per tensor-
        parallel rank for FSDP's data-parallel groups, one per GPU for HSDP's replicate groups),
        they share them. With nic_sharing=1 this is `collective_s`."""
        if bytes_per_gpu <= 0 or ranks <= 1:
            return 0.0
        t = bytes_per_gpu / (self.intra_node_gbps * GB)
        if ranks > per_node:
            t = max(t, nic_sharing * bytes_per_gpu / (self.inter_node_gbps * GB))
        return t + self.ring_latency_s(ranks, per_node, all_reduce=all_reduce)


def ring_bytes(full_bytes: float, n_gpus: int) -> float:
    return (n_gpus - 1) / n_gpus * full_bytes
