"""Helix's flow graph of a placed cluster, its max flow, and the latency of the best pipeline.

Helix (ASPLOS 2025) §4.3: each compute node ``c_i`` becomes two vertices ``c_i^in -> c_i^out`` joined by
an edge of capacity ``T_j`` (its throughput holding ``j`` layers); the coordinator becomes a source and a
sink. Only *valid* connections become edges: source -> ``c_j`` when ``c_j`` holds the first layer,
``c_i`` -> sink when ``c_i`` holds the last one, and ``c_i`` -> ``c_j`` when ``c_j`` holds the layers
needed right after ``c_i``. With partial inference (Helix §4.4, "requests coming from c_i will only infer
layers [e_i, e_j) on c_j") that means ``s_j <= e_i < e_j``; without it, ``e_i == s_j``. Link edges have
the capacity of :meth:`planner.costs.roofline.CostModel.link_capacity`. Every capacity is in output tokens per
second of the cost model's workload (a link's counts the prompt's activations per output token, a node's
``T_j`` the prompt's compute), so the max flow from source to sink (computed with the preflow-push
algorithm, as Helix does) is the cluster's serving throughput in output tokens per second, what the
simulator measures.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import networkx as nx
from networkx.algorithms.flow import preflow_push

from .cluster.spec import COORDINATOR, Cluster
from .costs.roofline import CostModel
from .placement import PlacementError

__all__ = ["SINK", "SOURCE", "Evaluation", "Stage", "build_flow_graph", "evaluate", "valid_edges"]

#: Vertex names of the coordinator in flow dictionaries: tokens leave it as SOURCE and return as SINK.
SOURCE = "source"
SINK = "sink"

_FLOW_EPS = 1e-9


@dataclass(frozen=True)
class Stage:
    """One hop of a pipeline: ``node`` runs blocks ``[start, end)`` for the request."""

    node: str
    start: int
    end: int


@dataclass(frozen=True)
class Evaluation:
    """Max-flow throughput of a placement, with the flows that achieve it.

    ``flows[u][v]`` is the flow (tokens/s) from ``u`` to ``v`` where ``u`` is :data:`SOURCE` or a node and
    ``v`` a node or :data:`SINK` (positive flows only); ``node_flows[n]`` the flow through node ``n``.
    ``latency`` is the per-token latency (seconds) of the fastest pipeline among those that carry flow
    (link latencies plus each node's batch-1 decode step over the blocks it runs), ``pipeline`` its stages.
    """

    throughput: float
    flows: dict[str, dict[str, float]]
    node_flows: dict[str, float]
    latency: float | None = None
    pipeline: tuple[Stage, ...] = ()
    node_capacity: dict[str, float] = field(default_factory=dict)


def _check(cluster: Cluster, placement: Mapping[str, tuple[int, int]], cost: CostModel) -> None:
    num_blocks = cluster.model.num_blocks
    for node_id, (start, end) in placement.items():
        if not cluster.has_node(node_id):
            raise PlacementError(f"node {node_id!r} is not in cluster {cluster.name!r}")
        if not 0 <= start < end <= num_blocks:
            raise PlacementError(f"node {node_id!r}: range [{start}, {end}) is not inside [0, {num_blocks})")
        if end - start > cost.capacity[node_id]:
            raise PlacementError(
                f"node {node_id!r}: holds {end - start} blocks but its memory allows {cost.capacity[node_id]}"
            )


def valid_edges(
    placement: Mapping[str, tuple[int, int]], num_blocks: int, *, partial_inference: bool = True
) -> list[tuple[str, str]]:
    """Helix §4.3's valid connections as ``(u, v)`` pairs (``SOURCE``/``SINK`` for the coordinator)."""
    edges = []
    items = list(placement.items())
    for v, (s_v, _e_v) in items:
        if s_v == 0:
            edges.append((SOURCE, v))
    for u, (_s_u, e_u) in items:
        if e_u == num_blocks:
            edges.append((u, SINK))
        for v, (s_v, e_v) in items:
            if u == v:
                continue
            if (partial_inference and s_v <= e_u < e_v) or (not partial_inference and s_v == e_u):
                edges.append((u, v))
    return edges


def build_flow_graph(
    cluster: Cluster,
    placement: Mapping[str, tuple[int, int]],
    *,
    cost: CostModel | None = None,
    partial_inference: bool = True,
) -> nx.DiGraph:
    """The directed graph of Helix §4.3 with ``capacity`` on every edge.

    Vertices: :data:`SOURCE`, :data:`SINK`, and ``(node_id, "in")`` / ``(node_id, "out")`` per node."""
    cost = cost or CostModel(cluster)
    _check(cluster, placement, cost)
    graph = nx.DiGraph()
    graph.add_node(SOURCE)
    graph.add_node(SINK)
    for node_id, (start, end) in placement.items():
        graph.add_edge((node_id, "in"), (node_id, "out"), capacity=cost.throughput(node_id, end - start))
    for u, v in valid_edges(placement, cluster.model.num_blocks, partial_inference=partial_inference):
        if u == SOURCE:
            graph.add_edge(SOURCE, (v, "in"), capacity=cost.link_capacity(COORDINATOR, v))
        elif v == SINK:
            graph.add_edge((u, "out"), SINK, capacity=cost.link_capacity(u, COORDINATOR))
        else:
            graph.add_edge((u, "out"), (v, "in"), capacity=cost.link_capacity(u, v))
    return graph


def evaluate(
    cluster: Cluster,
    placement: Mapping[str, tuple[int, int]],
    *,
    cost: CostModel | None = None,
    partial_inference: bool = True,
    with_latency: bool = True,
) -> Evaluation:
    """Max-flow throughput (tokens/s) of ``placement`` on Helix's flow graph, its per-edge and per-node
    flows, and the latency of the best flow-carrying pipeline."""
    cost = cost or CostModel(cluster)
    graph = build_flow_graph(cluster, placement, cost=cost, partial_inference=partial_inference)
    value, flow = nx.maximum_flow(graph, SOURCE, SINK, flow_func=preflow_push)
    flows: dict[str, dict[str, float]] = {}
    node_flows: dict[str, float] = {}
    for u, targets in flow.items():
        for v, f in targets.items():
            if f <= _FLOW_EPS:
                continue
            if u == SOURCE:
                flows.setdefault(SOURCE, {})[v[0]] = f
            elif v == SINK:
                flows.setdefault(u[0], {})[SINK] = f
            elif u[1] == "in":
                node_flows[u[0]] = f
            else:
                flows.setdefault(u[0], {})[v[0]] = f
    capacity = {n: cost.throughput(n, e - s) for n, (s, e) in placement.items()}
    latency = None
    pipeline: tuple[Stage, ...] = ()
    if with_latency and value > _FLOW_EPS:
        latency, pipeline = _best_pipeline(cluster, placement, flows, cost)
    return Evaluation(
        throughput=float(value),
        flows=flows,
        node_flows=node_flows,
        latency=latency,
        pipeline=pipeline,
        node_capacity=capacity,
    )


def _best_pipeline(
    cluster: Cluster,
    placement: Mapping[str, tuple[int, int]],
    flows: dict[str, dict[str, float]],
    cost: CostModel,
) -> tuple[float | None, tuple[Stage, ...]]:
    """Shortest source->sink path over flow-carrying edges; an edge ``u -> v`` costs the link latency
    plus ``v``'s time for the blocks it runs after ``u`` (``[e_u, e_v)``)."""
    graph = nx.DiGraph()
    for u, targets in flows.items():
        for v in targets:
            if v == SINK:
                weight = cost.link_latency(u, COORDINATOR)
            else:
                entry = 0 if u == SOURCE else placement[u][1]
                end = placement[v][1]
                link = cost.link_latency(COORDINATOR if u == SOURCE else u, v)
                weight = link + cost.token_latency(v, end - entry)
            graph.add_edge(u, v, weight=weight)
    try:
        length, path = nx.single_source_dijkstra(graph, SOURCE, SINK, weight="weight")
    except (nx.NetworkXNoPath, nx.NodeNotFound):
        return None, ()
    stages = []
    position = 0
    for node_id in path[1:-1]:
        end = placement[node_id][1]
        stages.append(Stage(node=node_id, start=position, end=end))
        position = end
    return float(length), tuple(stages)
