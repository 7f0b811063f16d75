"""Upper bounds on the throughput of every placement of a cluster, each with its proof.

:func:`planner.algorithms.milp.milp` reports its best placement's gap to the lowest of these (``upper_bound``) and to
Helix's bound alone (``helix_bound``). Every bound holds for *every* placement (contiguous ranges, any
subset of the nodes used, with or without partial inference), because each is the capacity of a cut of
Helix's flow graph (§4.3) maximised over placements, or a relaxation of that maximum; max flow = min cut.

* :func:`helix_bound` — Helix §4.5: ``sum_i max_j (j T_ij) / L``. Every token passes ``L`` layers, and node
  ``i`` processes at most ``max_j j T_ij`` layer-tokens per second. Compute only.
* :func:`coordinator_bound` — the cut of the coordinator's own links. Every token leaves the coordinator
  on an edge ``source -> c_j`` (``c_j`` holds block 0) and returns on ``c_i -> sink`` (``c_i`` holds the
  last block); such an edge carries at most its link capacity and at most ``T_j`` of the node it enters
  or leaves. So the flow is at most ``sum_j max_k min(T_j(k), c(coordinator, j))``, and likewise for the
  links back. Binds when the coordinator's links are slow.
* :func:`coverage_bound` — the best *minimum block coverage* over all placements, links ignored. With or
  without partial inference every token processes block ``b`` in exactly one node holding ``b``, so the
  nodes holding ``b`` are a vertex cut and the flow is at most their summed ``T_j`` (coverage theorem,
  :mod:`planner.search.coverage`); the covering MILP maximises the smallest such cut over all placements, and
  HiGHS' dual bound is at least its optimum. Nodes with the same ``T_j`` table are one type here (their
  links do not matter to this cut), so the model is small. Tighter than Helix's bound whenever nodes
  must hold many blocks (``T_j`` falls faster than ``1/j``) or block counts do not divide evenly, but
  still blind to the network: it is the optimum of the cluster with infinitely fast links.

Network-aware bounds come from the MILP itself: the ``typed`` relaxation of :mod:`planner.algorithms.milp` bounds the
flow between node types across every block boundary by ``C x senders x receivers`` exactly (a node
pair is one link), so its dual bound is valid and sees slow links. On small clusters HiGHS solves it in
seconds, and there it equals the brute-force optimum (``tests/test_planner_milp.py``). On
``helix-geo-24`` (24k variables) its LP relaxation is exactly Helix's bound — fractional node counts
spread over many boundaries get link pairs for free — and HiGHS needs minutes for that root LP alone, so
no network-aware bound is proven there within the time limits.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from ..cluster.spec import COORDINATOR, Cluster
from ..costs.roofline import CostModel
from .coverage import solve_coverage

__all__ = [
    "CoverageBound",
    "coordinator_bound",
    "coverage_bound",
    "helix_bound",
    "throughput_types",
    "tightest",
]


def helix_bound(cost: CostModel) -> float:
    """Helix §4.5: ``sum_i max_j (j T_ij) / L`` (tokens/s)."""
    return cost.upper_bound()


def coordinator_bound(cluster: Cluster, cost: CostModel) -> float:
    """The smaller of the two coordinator cuts (module docstring): ``sum_j max_k min(T_j(k), c)`` over the
    links from the coordinator, and over the links back to it (tokens/s)."""
    out_cut = back_cut = 0.0
    for n in cluster.node_ids:
        rates = [cost.throughput(n, k) for k in cost.feasible_sizes(n)]
        if not rates:
            continue
        out_cut += max(min(r, cost.link_capacity(COORDINATOR, n)) for r in rates)
        back_cut += max(min(r, cost.link_capacity(n, COORDINATOR)) for r in rates)
    return min(out_cut, back_cut)


def throughput_types(cluster: Cluster, cost: CostModel) -> list[list[str]]:
    """Nodes grouped by their ``T_j`` table alone (interchangeable for every cut made of node edges)."""
    by_table: dict[tuple[float, ...], list[str]] = {}
    for n in cluster.node_ids:
        if cost.feasible_sizes(n):
            by_table.setdefault(tuple(cost.table[n]), []).append(n)
    return list(by_table.values())


@dataclass(frozen=True)
class CoverageBound:
    """``bound``: HiGHS' proven upper bound on the best minimum coverage (None if it proved none);
    ``value``: the best minimum coverage found (a lower bound on that optimum, not a placement's flow);
    ``status``: HiGHS' status."""

    bound: float | None
    value: float
    status: str
    seconds: float


def coverage_bound(
    cluster: Cluster,
    cost: CostModel,
    *,
    time_limit: float,
    start: dict[str, tuple[int, int]] | None = None,
    mip_rel_gap: float = 1e-4,
    seed: int = 0,
) -> CoverageBound:
    """The coverage bound (module docstring) by the covering MILP over :func:`throughput_types`, warm-started
    from ``start`` (any placement), for at most ``time_limit`` seconds."""
    t0 = time.monotonic()
    groups = throughput_types(cluster, cost)
    length = cluster.model.num_blocks
    members = {n for g in groups for n in g}
    ranges = {n: r for n, r in (start or {}).items() if n in members}
    result = solve_coverage(
        cost, groups, length, ranges, time_limit=time_limit, lns_share=0.0, mip_rel_gap=mip_rel_gap, seed=seed
    )
    bound = result.bound if result.bound is not None and math.isfinite(result.bound) else None
    return CoverageBound(bound=bound, value=result.value, status=result.status, seconds=time.monotonic() - t0)


def tightest(bounds: Mapping[str, float | None]) -> tuple[str, float]:
    """The lowest finite bound of ``bounds`` and its name."""
    finite = [(v, k) for k, v in bounds.items() if v is not None and math.isfinite(v)]
    if not finite:
        raise ValueError("no finite upper bound to compare with; pass at least Helix's bound")
    value, name = min(finite)
    return name, value
