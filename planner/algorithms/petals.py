"""Petals' block selection (Borzunov et al., 2023) as Helix ran it for its baseline (Helix §6.6).

Helix's ``simulator/initial_layout/heterogeneous_layout/petals_layout.py`` (``PetalsLayout.synthesize``,
Thesys-lab/Helix-ASPLOS25 at 148b733, "ref: Petals Appendix D"):

1. the servers join in a random order drawn from a seed: ``random.seed(seed)``, then
   ``random.shuffle`` of the list of nodes in node-index order;
2. each takes as many blocks as it can hold (``max_num_layers``) and adds its throughput at that block
   count (``T_j`` with ``j`` the maximum: Helix's ``layer_count_2_throughput[max_num_layers]``) to every
   block of its window;
3. the window is the one Petals' ``choose_best_blocks`` picks (``_choose_best_start`` in
   ``petals/server/block_selection.py``): the window whose per-block throughputs, *sorted*, are
   lexicographically smallest, the earliest of equal ones. This puts a server first on the blocks
   nobody serves yet, then on the least-served ones; it is not the window of least summed throughput.
4. there is no rebalancing: Helix's code places each server once. (Petals' servers move later, when
   ``should_choose_other_blocks`` finds the swarm unbalanced; ``rebalance=True`` runs a pass in that
   spirit, see :func:`petals`.)

What differs from Helix's code: the order is :class:`random.Random` ``(seed).shuffle`` of the spec's
node order, which is the same permutation Helix's global ``random.seed(seed); random.shuffle(...)``
draws for a list of the same length, so the join order is Helix's exactly when the spec lists the
nodes in Helix's node-index order (``helix-geo-24`` does; ``helix-single-24`` groups its nodes by GPU
kind, so pass Helix's order as ``order``, see ``tests/data/helix_layouts/README.md``). The block counts
and throughputs come from the cost model given (Helix's come from its profiled model manager), and
nodes the cost model gives no feasible block count are skipped.

Blocks stay unserved only when the nodes hold too few blocks together (or ``order`` leaves nodes
out): as long as every joining server adds a positive throughput, the unserved blocks always form one
run at the end of the model and each server covers as many of them as it can. Helix's code would
return such a placement anyway (with zero max flow); here it is a
:class:`~planner.errors.CannotPlaceError` unless ``rebalance=True``.

Beyond Petals: ``min_replicas`` (default 1, the algorithm as published) asks for a redundancy floor
(:mod:`planner.search.redundancy`). A joining server then picks among the windows whose blocks have the fewest
holders, counted up to the floor (:func:`choose_floor_start`: the lexicographically smallest sorted
holder counts, each capped at ``min_replicas``), and only among those by Petals' rule; once every block is
at the floor this is Petals' choice again. If the join order still leaves the floor unmet where the
offers allow it, servers move one at a time with the smallest moves until it holds
(:func:`planner.search.redundancy.repair_floor`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..cluster.spec import Cluster
from ..costs.roofline import CostModel
from ..errors import CannotPlaceError, PlannerError
from ..placement import Placement, PlacementError
from ..search.redundancy import achievable_floor, check_min_replicas, repair_floor

__all__ = ["PetalsRun", "choose_best_start", "choose_floor_start", "petals", "petals_order", "petals_orders"]


def choose_best_start(per_block: Sequence[float], size: int) -> int:
    """The start of the ``size``-block window Petals' ``_choose_best_start`` picks: the smallest
    ``(sorted(per_block[i : i + size]), i)``, i.e. the lexicographically smallest sorted throughputs,
    the earliest window among equal ones. ``size`` beyond the model is cut to the model (Helix's
    ``best_end_idx = min(start + max_hold_layers, num_layers)``)."""
    if size <= 0:
        raise PlannerError(f"a window needs at least one block, got {size}; give a positive block count")
    size = min(size, len(per_block))
    return min((sorted(per_block[i : i + size]), i) for i in range(len(per_block) - size + 1))[1]


def choose_floor_start(per_block: Sequence[float], served: Sequence[int], size: int, min_replicas: int) -> int:
    """:func:`choose_best_start` restricted to the windows whose blocks need holders most: the smallest
    ``(sorted(min(served[b], min_replicas) for b in window), sorted(per_block[window]), start)``."""
    if size <= 0:
        raise PlannerError(f"a window needs at least one block, got {size}; give a positive block count")
    size = min(size, len(per_block))
    return min(
        (sorted(min(c, min_replicas) for c in served[i : i + size]), sorted(per_block[i : i + size]), i)
        for i in range(len(per_block) - size + 1)
    )[2]


def petals_order(cluster: Cluster, seed: int) -> list[str]:
    """The join order Helix draws from ``seed``: ``random.seed(seed); random.shuffle(nodes)`` on the
    nodes in the spec's order (Helix: in node-index order)."""
    order = list(cluster.node_ids)
    random.Random(seed).shuffle(order)
    return order


def _window_sums(per_block: list[float], size: int) -> list[float]:
    sums = []
    current = sum(per_block[:size])
    sums.append(current)
    for start in range(1, len(per_block) - size + 1):
        current += per_block[start + size - 1] - per_block[start - 1]
        sums.append(current)
    return sums


def _join_order(cluster: Cluster, seed: int | None, order: Sequence[str] | None) -> list[str]:
    if order is None:
        return list(cluster.node_ids) if seed is None else petals_order(cluster, seed)
    order = list(order)
    unknown = [n for n in order if not cluster.has_node(n)]
    if unknown:
        raise PlannerError(
            f"petals: order names nodes not in cluster {cluster.name!r}: {', '.join(map(repr, unknown))}; "
            "list only the spec's node ids"
        )
    repeated = sorted({n for n in order if order.count(n) > 1})
    if repeated:
        raise PlannerError(f"petals: order lists {', '.join(map(repr, repeated))} twice; list each node once")
    return order


def petals(
    cluster: Cluster,
    *,
    cost: CostModel | None = None,
    seed: int | None = 0,
    order: Sequence[str] | None = None,
    rebalance: bool = False,
    min_replicas: int = 1,
) -> Placement:
    """Place the model as Helix's Petals baseline does: servers join in the order drawn from ``seed``
    (:func:`petals_order`; ``seed=None``: the spec's order), or in ``order`` when given (then ``seed``
    plays no part), each taking its largest block count at the window :func:`choose_best_start` picks.

    ``rebalance=True`` adds a pass Helix's code does not have, kept for coverage whatever the order:
    while blocks are unserved, servers re-choose in turn the window that serves the most unserved
    blocks (then the least summed throughput). Without it, unserved blocks are a
    :class:`~planner.errors.CannotPlaceError`.

    ``min_replicas`` > 1: servers join the windows below the redundancy floor first
    (:func:`choose_floor_start`), then move as little as needed to meet the floor the offers allow
    (module docstring).
    """
    min_replicas = check_min_replicas(min_replicas)
    cost = cost or CostModel(cluster)
    num_blocks = cluster.model.num_blocks
    order = _join_order(cluster, seed, order)
    sizes = {}
    for node_id in order:
        feasible = cost.feasible_sizes(node_id)
        if feasible:
            sizes[node_id] = min(max(feasible), num_blocks)
    if sum(sizes.values()) < num_blocks:
        raise CannotPlaceError(
            f"the nodes hold {sum(sizes.values())} blocks together but the model has {num_blocks}; "
            "add nodes or memory"
        )
    per_block = [0.0] * num_blocks
    served = [0] * num_blocks
    chosen: dict[str, int] = {}

    def add(node_id: str, start: int, sign: int) -> None:
        rate = cost.throughput(node_id, sizes[node_id])
        for b in range(start, start + sizes[node_id]):
            per_block[b] += sign * rate
            served[b] += sign

    for node_id in order:
        if node_id in sizes:
            if min_replicas > 1:
                chosen[node_id] = choose_floor_start(per_block, served, sizes[node_id], min_replicas)
            else:
                chosen[node_id] = choose_best_start(per_block, sizes[node_id])
            add(node_id, chosen[node_id], 1)

    if rebalance:
        _rebalance(order, chosen, sizes, per_block, served, add)
    if min_replicas > 1:
        floor = achievable_floor(sizes.values(), num_blocks, min_replicas)
        ranges = {n: (s, s + sizes[n]) for n, s in chosen.items()}
        if not floor.met_by(ranges):
            ranges, _ = repair_floor(ranges, sizes, floor, all_sizes=False)
            for n, (s, _e) in ranges.items():
                if n in chosen:
                    add(n, chosen[n], -1)
                chosen[n] = s
                add(n, s, 1)
    if not all(served):
        missing = [b for b, n in enumerate(served) if n == 0]
        error = PlacementError if rebalance else CannotPlaceError
        raise error(
            f"petals: blocks {missing[0]}..{missing[-1]} are left unserved ({len(missing)} blocks) by the "
            "join order; join every node, or pass rebalance=True"
        )
    return Placement({n: (s, s + sizes[n]) for n, s in chosen.items()})


def _rebalance(order, chosen, sizes, per_block, served, add) -> None:
    """Servers re-choose in turn, preferring the windows that serve the most unserved blocks, then the
    least summed throughput, until every block is served (at most one round per server and one more)."""
    for _ in range(len(order) + 1):
        if all(served):
            return
        for node_id in order:
            if node_id not in chosen or all(served):
                continue
            add(node_id, chosen[node_id], -1)
            size = sizes[node_id]
            sums = _window_sums(per_block, size)
            uncovered = [sum(1 for b in range(s, s + size) if served[b] == 0) for s in range(len(sums))]
            start = min(range(len(sums)), key=lambda s: (-uncovered[s], sums[s], s))
            chosen[node_id] = start
            add(node_id, start, 1)


@dataclass(frozen=True)
class PetalsRun:
    """One seed of :func:`petals_orders`: the join order, the placement and its max flow (tokens/s)."""

    seed: int
    order: tuple[str, ...]
    placement: Placement
    throughput: float


def petals_orders(
    cluster: Cluster,
    seeds: Iterable[int] = range(20),
    *,
    cost: CostModel | None = None,
    rebalance: bool = False,
    partial_inference: bool = True,
) -> list[PetalsRun]:
    """:func:`petals` for each of ``seeds``, each placement scored by its max flow on Helix's flow graph
    (:func:`planner.flow_graph.evaluate`), in the order of ``seeds``. Helix reports seed 0; the spread
    over seeds shows how much the baseline owes to its join order (e.g. ``statistics.median(r.throughput
    for r in runs)``)."""
    from ..flow_graph import evaluate

    cost = cost or CostModel(cluster)
    runs = []
    for seed in seeds:
        order = petals_order(cluster, seed)
        placement = petals(cluster, cost=cost, order=order, rebalance=rebalance)
        value = evaluate(cluster, placement, cost=cost, partial_inference=partial_inference, with_latency=False)
        runs.append(PetalsRun(seed, tuple(order), placement, value.throughput))
    return runs
