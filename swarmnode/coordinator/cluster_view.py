"""The planner's view of a live swarm: a :class:`~swarmnode.planner.cluster.spec.Cluster` built from the
nodes' capacity records (:class:`~swarmnode.records.NodeRecord`).

Helix (ASPLOS 2025) §4 plans over a cluster whose nodes have a per-node throughput ``T_j`` and whose links
have a bandwidth and a latency. In a swarm these are measured, not guessed: every node measures its own
tokens/s through one block (``block_throughput``; the cost model then uses ``T_j = block_throughput / j``),
computes how many blocks fit its memory offer with room for KV cache (``max_blocks``), and measures its
links to other peers (round trip and bandwidth; a node whose own connection limits all its links gets that
as its NIC, :func:`access_links`). This module only translates those records into the
planner's spec format (``planner/clusters/README.md``) and validates it with
:func:`~swarmnode.planner.cluster.spec.cluster_from_dict`: plain data in, plain data out, no network.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any

from swarmnode.coordinator.events import LinkChanged
from swarmnode.planner.cluster.spec import Cluster, ModelSpec, cluster_from_dict
from swarmnode.planner.costs.roofline import CostModel
from swarmnode.planner.errors import CannotPlaceError, PlannerError
from swarmnode.records import NodeRecord, NodeState

__all__ = [
    "DEFAULT_BANDWIDTH_MBPS",
    "DEFAULT_LATENCY_MS",
    "REGION",
    "access_links",
    "cluster_from_records",
    "device_kind",
    "link_changes",
    "measured_links",
    "plannable_records",
]

#: Every swarm node sits in one region: links between them are the measured ones or the swarm's median.
REGION = "swarm"
#: The intra-region link when no link was measured at all (a LAN).
DEFAULT_BANDWIDTH_MBPS = 1000.0
DEFAULT_LATENCY_MS = 1.0
#: A measured link whose bandwidth moved by this factor (either way) since the last plan is a change to plan
#: for, when it can limit the swarm (:func:`link_changes`).
LINK_CHANGE_FACTOR = 2.0
#: A node's own connection is taken to limit its fastest measured link when the peer at the other end of that
#: link reaches another node at least this many times faster (:func:`access_links`).
BOTTLENECK_FACTOR = 1.5

# A GPU node that has not measured its block throughput yet needs hardware figures for the cost model
# (the parser demands tflops and memory_bandwidth_gbs). These are deliberately modest (about a T4) so an
# unmeasured GPU is never trusted with more than a small GPU would carry; they are used only until the
# node publishes a measurement.
_UNMEASURED_GPU_TFLOPS = 65.0
_UNMEASURED_GPU_BANDWIDTH_GBS = 300.0


def model_section(model: ModelSpec) -> dict[str, Any]:
    """The ``model`` section of a cluster spec (None fields left out)."""
    return {k: v for k, v in vars(model).items() if v is not None}


def device_kind(device: str) -> str:
    """The planner's device class of a torch device string: ``cuda``, ``cuda:1`` -> ``gpu``; else ``cpu``."""
    return "gpu" if device.strip().lower().startswith("cuda") else "cpu"


def plannable_records(nodes: Mapping[str, NodeRecord]) -> dict[str, NodeRecord]:
    """The records the coordinator may place, keyed by peer id in a stable (sorted) order: every node
    that did not pick its own range (``manual``), is not leaving (``OFFLINE``) or still measuring itself
    (``MEASURING``), and can hold at least one block."""
    return {
        r.peer_id: r
        for _, r in sorted(nodes.items())
        if not r.manual and r.state not in (NodeState.OFFLINE, NodeState.MEASURING) and r.max_blocks > 0
    }


def measured_links(records: Iterable[NodeRecord]) -> dict[tuple[str, str], tuple[float | None, float]]:
    """Node-pair links from the records' measurements: ``(a, b)`` (sorted) -> ``(bandwidth_mbps or None,
    latency_ms)``, with one-way latency = rtt / 2. A pair measured from both ends keeps the lower
    bandwidth and the higher rtt (the pessimistic view of a link that may be asymmetric). Links to peers
    without a record here, and a peer's link to itself, are ignored."""
    records = list(records)
    ids = {r.peer_id for r in records}
    pairs: dict[tuple[str, str], tuple[float | None, float]] = {}
    for record in records:
        for other, link in record.links.items():
            if other == record.peer_id or other not in ids:
                continue
            key = (min(record.peer_id, other), max(record.peer_id, other))
            latency = link.rtt_ms / 2.0
            bandwidth = link.bandwidth_mbps
            if key in pairs:
                old_bandwidth, old_latency = pairs[key]
                latency = max(latency, old_latency)
                if old_bandwidth is not None:
                    bandwidth = old_bandwidth if bandwidth is None else min(bandwidth, old_bandwidth)
            pairs[key] = (bandwidth, latency)
    return pairs


def access_links(pairs: Mapping[tuple[str, str], tuple[float | None, float]]) -> dict[str, float]:
    """The nodes whose own connection is known to limit what they move, with its bandwidth (Mbps), from the
    node-pair links (:func:`measured_links`). A link reads the slower of its two ends' connections, so a
    node's connection is at least as fast as its fastest link; it is that link's limit when the peer at the
    link's other end reaches someone else :data:`BOTTLENECK_FACTOR` times faster. All of a node's links share
    its connection: the planner caps the node's traffic there (``nic_mbps``), or a node behind one slow line
    would count as carrying that line's rate to each of its peers at once. A node whose fastest link is as
    fast as its peer's (a fast node among slow peers, or any node of a uniform swarm) gets no cap."""
    fastest: dict[str, tuple[float, str]] = {}
    for (a, b), (bandwidth, _latency) in pairs.items():
        if bandwidth is None:
            continue
        for node, other in ((a, b), (b, a)):
            if node not in fastest or bandwidth > fastest[node][0]:
                fastest[node] = (bandwidth, other)
    return {node: bandwidth for node, (bandwidth, other) in fastest.items()
            if fastest[other][0] >= BOTTLENECK_FACTOR * bandwidth}


def _default_link(pairs: Mapping[tuple[str, str], tuple[float | None, float]]) -> dict[str, float]:
    """The swarm's intra-region link: the median of the measured links (bandwidth and latency each over
    the pairs that measured it), else :data:`DEFAULT_BANDWIDTH_MBPS` / :data:`DEFAULT_LATENCY_MS`."""
    bandwidths = [b for b, _ in pairs.values() if b is not None]
    latencies = [lat for _, lat in pairs.values()]
    return {
        "bandwidth_mbps": float(statistics.median(bandwidths)) if bandwidths else DEFAULT_BANDWIDTH_MBPS,
        "latency_ms": float(statistics.median(latencies)) if latencies else DEFAULT_LATENCY_MS,
    }


def _node_spec(record: NodeRecord, model: ModelSpec, overhead_bytes: int) -> dict[str, Any]:
    """One ``nodes[]`` entry. The node's own ``max_blocks`` is authoritative: it was computed with the
    node's dtype, overhead and KV-cache room. The planner derives capacity from ``memory_bytes`` too, with
    one ``block_bytes`` and the swarm's largest overhead, so when that would allow fewer blocks than the
    node reported (a node running a smaller dtype than ``model.block_bytes`` assumes, or with less
    overhead than the largest) the memory passed is raised just enough to hold ``max_blocks``."""
    kind = device_kind(record.device)
    needed = overhead_bytes + record.max_blocks * model.block_bytes
    spec: dict[str, Any] = {
        "id": record.peer_id,
        "region": REGION,
        "device": kind,
        "memory_bytes": max(record.memory_bytes, needed),
        "max_blocks": record.max_blocks,
    }
    cores = record.cores if record.cores is not None else record.num_threads
    if kind == "cpu" or record.cores is not None:
        spec["cores"] = cores
    if record.block_throughput > 0:
        spec["block_throughput"] = float(record.block_throughput)
        if record.prefill_throughput > 0:  # a prefill rate counts only beside the decode rate it came with
            spec["prefill_throughput"] = float(record.prefill_throughput)
    elif kind == "gpu":  # no measurement yet: see _UNMEASURED_GPU_*
        spec["tflops"] = _UNMEASURED_GPU_TFLOPS
        spec["memory_bandwidth_gbs"] = _UNMEASURED_GPU_BANDWIDTH_GBS
    return spec


def _capacity_error(held: int, model: ModelSpec) -> CannotPlaceError:
    return CannotPlaceError(
        f"the swarm's nodes hold at most {held} of {model.num_blocks} blocks of {model.name}: "
        "more nodes or larger --leftover-mem are needed"
    )


def cluster_from_records(
    model: ModelSpec,
    nodes: Mapping[str, NodeRecord],
    *,
    workload: tuple[float, float] | None = None,
) -> Cluster:
    """The planner's cluster of the swarm's plannable nodes (:func:`plannable_records`), from their records.

    Nodes: id = peer id, region :data:`REGION`, ``device`` ``gpu`` for ``cuda*`` devices else ``cpu``,
    the offered memory, cores, ``max_blocks`` and the measured ``block_throughput``. ``overhead_bytes`` is
    the largest any node reports, and ``nic_mbps`` where a node's own connection is known to limit it
    (:func:`access_links`). Network: measured node-pair links (:func:`measured_links`), the median of them as
    the default link (:func:`_default_link`), the coordinator in :data:`REGION`. ``workload`` is ``(avg_input_tokens,
    avg_output_tokens)``; None keeps the planner's default (Helix's trace).

    Raises :class:`~swarmnode.planner.errors.CannotPlaceError` when no node can be planned or when the
    offers together hold fewer blocks than the model has (the coordinator waits for more offers); the
    message says what to do.
    """
    records = plannable_records(nodes)
    if not records:
        raise CannotPlaceError(
            f"no plannable nodes for {model.name}: none has joined, every node is manual (--blocks), "
            "leaving, still measuring itself or holds no block; start a node without --blocks so the "
            "coordinator can place it"
        )
    held = sum(min(r.max_blocks, model.num_blocks) for r in records.values())
    if held < model.num_blocks:
        raise _capacity_error(held, model)
    overhead = max(r.overhead_bytes for r in records.values())
    pairs = measured_links(records.values())
    default = _default_link(pairs)
    access = access_links(pairs)
    links = [
        {
            "a": a,
            "b": b,
            "bandwidth_mbps": default["bandwidth_mbps"] if bandwidth is None else float(bandwidth),
            "latency_ms": float(latency),
        }
        for (a, b), (bandwidth, latency) in sorted(pairs.items())
    ]
    data: dict[str, Any] = {
        "name": f"swarm-{model.name}",
        "source": "live node records",
        "model": model_section(model),
        "overhead_bytes": overhead,
        "nodes": [{**_node_spec(r, model, overhead), **({"nic_mbps": access[p]} if p in access else {})}
                  for p, r in records.items()],
        "network": {"intra_region": default, "coordinator_region": REGION, "links": links},
    }
    if workload is not None:
        data["workload"] = {"avg_input_tokens": float(workload[0]), "avg_output_tokens": float(workload[1])}
    return cluster_from_dict(data)


def link_changes(model: ModelSpec, before: Mapping[str, NodeRecord], now: Mapping[str, NodeRecord], *,
                 workload: tuple[float, float] | None = None) -> list[LinkChanged]:
    """The measured links between the plannable nodes of ``now`` that changed since the records ``before``
    (those the last plan was made from) in a way that can change a plan, one event each: a pair measured
    for the first time, or whose bandwidth (:func:`measured_links`) moved by :data:`LINK_CHANGE_FACTOR` or
    more, where the lower of its two readings carries fewer output tokens per second in the planner's cost
    model (:meth:`~swarmnode.planner.costs.roofline.CostModel.link_capacity`) than the whole swarm can serve
    (Helix's upper bound, §4.5), both for requests of ``workload`` (as :func:`cluster_from_records`). A link
    faster than that cannot bind any plan, so the noise of fast links never causes a re-plan. Empty when the
    nodes of ``now`` cannot be planned at all."""
    old = measured_links(before.values())
    moved = []
    for pair, (bandwidth, _latency) in measured_links(plannable_records(now).values()).items():
        if bandwidth is None:
            continue
        was = old.get(pair, (None, 0.0))[0]
        if was is not None and max(bandwidth, was) < LINK_CHANGE_FACTOR * min(bandwidth, was):
            continue
        moved.append((pair, was, bandwidth))
    if not moved:
        return []
    try:
        cost = CostModel(cluster_from_records(model, now, workload=workload))
    except PlannerError:
        return []
    bound = cost.upper_bound()
    changes = []
    for (a, b), was, bandwidth in moved:
        capacity = min(cost.link_capacity(a, b), cost.link_capacity(b, a))  # at `bandwidth`, linear in it
        if capacity * min(bandwidth, was or bandwidth) / bandwidth >= bound:
            continue
        changes.append(LinkChanged(a, b, bandwidth, was))
    return changes
