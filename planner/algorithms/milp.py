"""Helix's MILP placement (ASPLOS 2025, §4.4, Tables 5-6), solved with HiGHS.

The problem: choose each node's contiguous block range so that the max flow of Helix's flow graph
(:mod:`planner.flow_graph`) is largest. Three formulations are built here:

``per-node`` — Helix Tables 5-6 as written: per node ``c_i`` an integer first layer ``s_i`` and binaries
``b_i^k`` (holds ``k`` layers; ``sum_k b_i^k = 1``; ``e_i = s_i + sum_k k b_i^k <= L``); per connection a
flow ``f_ij`` and a validity binary ``d_ij`` (with partial inference also the auxiliaries ``aux1``,
``aux2``); flow conservation; node capacity ``sum_in f <= sum_k b_i^k T_ik``; link capacity
``f_ij <= d_ij C_ij``; the big-M validity constraints of §4.4 (source ``s_j <= L (1 - d)``, sink
``L d <= e_i``; without partial inference ``L d <= L + e_i - s_j`` and ``L d <= L - e_i + s_j``; with it
``s_j <= e_i < e_j`` through the auxiliaries). §4.5's speed-ups: link pruning (each node keeps its
``link_degree`` fastest links, ties kept) and a warm start from the best heuristic. Interchangeable nodes
(same hardware, same coordinator link, same link to every other node) get ``s_i <= s_i'``, which removes
their symmetric copies without losing any placement.

``typed`` — the same flows aggregated over node types: an integer ``x[t, s, k]`` counts the type-``t``
nodes on ``[s, s + k)``, a continuous ``g`` carries their flow (``g <= T_t(k) x``; with partial inference
one ``g`` per entry block), and flow is conserved at every block boundary. Between types whose links can
bind, the flow across boundary ``b`` is split per type pair and bounded by ``C X Y``: the ``X`` type-``a``
nodes ending at ``b`` and the ``Y`` type-``c`` nodes taking tokens at ``b`` are ``X Y`` distinct node
pairs, one link of capacity ``C`` each (Helix §4.3). The product is exact: ``X = z_1 + ... + z_n`` with
binaries ``z_m`` ("at least ``m`` senders"), ``w_m = z_m Y`` by ``w_m <= Y`` and ``w_m <= n_c z_m``. The
model is still a relaxation (flows of one type are pooled, so one node may carry another's share), so its
dual bound is a valid, network-aware upper bound; its placements are scored exactly.

``coverage`` — with partial inference and links that never bind, the max flow equals the minimum block
coverage (:mod:`planner.search.coverage`), so the MILP becomes a covering problem over node types, solved after
a beam search and a large-neighbourhood search have found a strong incumbent.

``formulation="auto"`` picks ``coverage`` when it is exact. Otherwise it scores the heuristics; when slow
links separate regions (:func:`planner.search.flow_beam.link_regions`) it places each region alone with the exact
coverage search (links inside a region never bind; up to 65% of the time, 30% below 50 nodes) and scores the union of the
regions' placements, else it scores the coverage beam's placement; it proves the coverage bound (:mod:`planner.search.bounds`, links ignored; 10% of the
time), runs the flow beam (:mod:`planner.search.flow_beam`: placements built together with a feasible flow, over
orders of the regions that slow links separate; up to 70%), and spends the rest improving the best
placement with the ``typed`` model (nodes repeat; as a relaxation only up to
:data:`planner.search.portfolio.TYPED_RELAXATION_VARS` variables) and the ``per-node`` model. Every
search stops early once the best placement is within ``gap`` of the lowest proven upper bound — Helix's
``sum_i max_j (j T_ij) / L`` (§4.5), the coordinator cut, the coverage bound or a MILP dual bound
(:mod:`planner.search.bounds`) — or at the time limit. Solutions map back to concrete nodes type by type;
nodes left unused are placed as Petals would (window of least throughput), which can only add flow.
Every candidate is scored by :func:`planner.flow_graph.evaluate`, and the heuristics are candidates too,
so the result is never worse than the best heuristic.

Sizes (Helix Table 8). :func:`per_node_size` builds the per-node model as Tables 5-6 write it (no
symmetry-breaking rows) and counts its columns and rows; without partial inference, over the complete
graph of ``helix-single-24``, that is Table 8's 1376 variables and 1848 constraints (Helix's own run, whose
Gurobi log ``artifact_evaluation/model_placement/layout_single/ilp/trace.txt`` reads "1848 rows, 1376
columns", set ``allow_partial_inference = False``), and 4004 / 5502 for ``helix-hetero-42``.
:func:`model_size` reports that size unpruned and after link pruning, with the size of every model each
phase of a search actually solved (its ``phases`` carry ``models``, ``columns`` and ``rows``).

Where it lives: this module is the entry point (:func:`milp`: options, which formulation applies, the
search run; and the model sizes above). The search and what it reports (:class:`Progress`,
:class:`MilpResult`) are in :mod:`planner.search.portfolio`; the ``typed``, ``per-node`` and floor-covering
models, their warm starts and decoders, and :func:`interchangeable_groups` in
:mod:`planner.algorithms.milp_formulations`; the covering MILP and its beam and LNS in :mod:`planner.search.coverage`; the
HiGHS model builder in :mod:`planner.search.milp_model`.
"""

from __future__ import annotations

import time

from ..cluster.spec import COORDINATOR, Cluster
from ..costs.factory import make_cost_model
from ..costs.roofline import CostModel
from ..errors import CannotPlaceError, PlannerError
from ..placement import Placement
from ..search.milp_model import ModelSize
from ..search.portfolio import MilpResult, Progress, ProgressCallback, _Search
from ..search.redundancy import achievable_floor, check_min_replicas
from .milp_formulations import _per_node_model, interchangeable_groups

__all__ = [
    "DEFAULT_LINK_DEGREE",
    "FORMULATIONS",
    "MilpResult",
    "Progress",
    "coverage_is_exact",
    "interchangeable_groups",
    "milp",
    "model_size",
    "per_node_size",
]

FORMULATIONS = ("auto", "coverage", "typed", "per-node")

#: Links each node keeps in the per-node model (Helix §4.5 pruning; Helix's runs keep 12).
DEFAULT_LINK_DEGREE = 12

# ---------------------------------------------------------------------------------------------------
# When the coverage formulation is exact
# ---------------------------------------------------------------------------------------------------


def coverage_is_exact(cluster: Cluster, cost: CostModel, partial_inference: bool = True) -> bool:
    """True when the max flow of every placement equals its minimum block coverage: partial inference is
    allowed and no link can carry less than the nodes at its ends can process."""
    if not partial_inference:
        return False
    rate = {
        n: max((cost.throughput(n, k) for k in cost.feasible_sizes(n)), default=0.0) for n in cluster.node_ids
    }
    ids = [n for n in cluster.node_ids if rate[n] > 0]
    for i, a in enumerate(ids):
        if min(cost.link_capacity(COORDINATOR, a), cost.link_capacity(a, COORDINATOR)) < rate[a]:
            return False
        for b in ids[i + 1 :]:
            if min(cost.link_capacity(a, b), cost.link_capacity(b, a)) < min(rate[a], rate[b]):
                return False
    return True

def milp(
    cluster: Cluster,
    *,
    time_limit: float = 60.0,
    gap: float = 0.05,
    partial_inference: bool = True,
    formulation: str = "auto",
    link_degree: int | None = DEFAULT_LINK_DEGREE,
    mip_rel_gap: float = 1e-4,
    cost: CostModel | None = None,
    warm_start: Placement | None = None,
    progress: ProgressCallback | None = None,
    seed: int = 0,
    min_replicas: int = 1,
) -> MilpResult:
    """Search the placement with the largest max flow (Helix §4.4).

    ``time_limit`` bounds the whole search (seconds); it stops early once the best placement is within
    ``gap`` (a fraction) of the best proven upper bound. ``partial_inference`` selects Helix's connection
    rule for the search and for scoring. ``formulation``: ``auto``, ``coverage``, ``typed`` or
    ``per-node`` (module docstring); ``link_degree`` prunes the per-node model to each node's fastest
    links (None: keep all). ``progress`` receives :class:`Progress` reports. ``cost`` defaults to the
    spec's cost model (:func:`planner.costs.factory.make_cost_model`).

    ``min_replicas``: the redundancy floor (:mod:`planner.search.redundancy`): every block on at least that many
    nodes where the offers allow it (else as many blocks as they allow, every block once), throughput
    maximised subject to it; both formulations carry the floor's rows and candidates below it are repaired
    or dropped. 1 (the default) is Helix's problem as published.
    """
    _check_options(formulation, time_limit, gap, link_degree)
    min_replicas = check_min_replicas(min_replicas)
    t0 = time.monotonic()
    cost = cost or make_cost_model(cluster)
    held = sum(max(cost.feasible_sizes(n), default=0) for n in cluster.node_ids)
    if held < cluster.model.num_blocks:
        raise CannotPlaceError(
            f"cluster {cluster.name!r} cannot hold the model: its nodes hold {held} of "
            f"{cluster.model.num_blocks} blocks; add nodes or memory"
        )
    floor = achievable_floor(
        (max(cost.feasible_sizes(n), default=0) for n in cluster.node_ids), cluster.model.num_blocks, min_replicas
    )
    exact_cover = coverage_is_exact(cluster, cost, partial_inference)
    if formulation == "coverage" and not exact_cover:
        raise PlannerError(
            "the coverage formulation needs partial inference and links that never bind; "
            "use formulation='auto', 'typed' or 'per-node' for this cluster",
            code="bad_option",
        )
    search = _Search(
        cluster,
        cost,
        t0=t0,
        time_limit=time_limit,
        gap=gap,
        mip_rel_gap=mip_rel_gap,
        partial_inference=partial_inference,
        link_degree=link_degree,
        progress=progress,
        seed=seed,
        floor=floor,
    )
    search.start_from_heuristics(warm_start)
    if formulation in ("auto", "coverage") and exact_cover:
        search.coverage_search()
    else:
        if formulation == "auto" and not search.good_enough():
            search.network_search()
        search.milp_models(formulation)
    return search.result()


def _check_options(formulation: str, time_limit: float, gap: float, link_degree: int | None) -> None:
    if formulation not in FORMULATIONS:
        raise PlannerError(
            f"formulation must be one of {', '.join(FORMULATIONS)}, got {formulation!r}", code="bad_option"
        )
    if not time_limit > 0:
        raise PlannerError(f"time_limit must be positive, got {time_limit}", code="bad_option")
    if not 0 <= gap < 1:
        raise PlannerError(f"gap must be in [0, 1), got {gap}", code="bad_option")
    if link_degree is not None and link_degree < 1:
        raise PlannerError(f"link_degree must be at least 1 (or None), got {link_degree}", code="bad_option")


# ---------------------------------------------------------------------------------------------------
# Model sizes (Helix Table 8)
# ---------------------------------------------------------------------------------------------------


def per_node_size(
    cluster: Cluster,
    cost: CostModel | None = None,
    *,
    partial_inference: bool = False,
    link_degree: int | None = None,
) -> ModelSize:
    """Columns and rows of Helix Tables 5-6 as written for ``cluster``: per node ``s_i`` and one ``b_i^k``
    per size it can hold; per connection ``f_ij`` and ``d_ij`` (and ``aux1``, ``aux2`` with
    ``partial_inference``); the rows of one size, ``e_i <= L``, conservation and node capacity per node,
    ``f <= d C`` and the validity rows per connection. Connections are those of the complete graph, or the
    links each node keeps under §4.5 pruning with ``link_degree`` (:func:`_kept_links`; the source and
    sink links are never pruned). The symmetry-breaking rows the solver adds are not Helix's and are not
    counted. ``helix-single-24`` without partial inference: 1376 columns, 1848 rows (Table 8)."""
    cost = cost or make_cost_model(cluster)
    singletons = [[n] for n in cluster.node_ids]  # no interchangeable nodes: no symmetry rows
    return _per_node_model(cluster, cost, singletons, partial_inference, link_degree).model.size


def model_size(
    cluster: Cluster,
    cost: CostModel | None = None,
    *,
    partial_inference: bool = True,
    link_degree: int | None = DEFAULT_LINK_DEGREE,
    phases: tuple[dict, ...] | list[dict] = (),
) -> dict:
    """The JSON ``model_size`` of a MILP plan: Helix's per-node model (:func:`per_node_size`) for this
    cluster, cost model and ``partial_inference``, unpruned (the complete graph: Helix Table 8's "without
    pruning") and pruned to ``link_degree`` links per node (Table 8's "with pruning"), built whatever
    formulation the search then solved; and, from ``phases`` (:attr:`MilpResult.phases`), what was solved:
    per phase that ran HiGHS its formulation, the number of models and the columns and rows of the
    largest.

    ``{"formulation": "per-node", "partial_inference": bool, "link_degree": int | None,
    "unpruned": {"columns", "rows"}, "pruned": {"columns", "rows"},
    "solved": [{"formulation", "models", "columns", "rows"}, ...]}``"""
    cost = cost or make_cost_model(cluster)
    unpruned = per_node_size(cluster, cost, partial_inference=partial_inference)
    pruned = per_node_size(cluster, cost, partial_inference=partial_inference, link_degree=link_degree)
    solved = [
        {k: p[k] for k in ("formulation", "models", "columns", "rows")} for p in phases if p.get("models")
    ]
    return {
        "formulation": "per-node",
        "partial_inference": partial_inference,
        "link_degree": link_degree,
        "unpruned": unpruned.to_dict(),
        "pruned": pruned.to_dict(),
        "solved": solved,
    }
