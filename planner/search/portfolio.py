"""The search one :func:`planner.algorithms.milp.milp` run performs: a portfolio of heuristics, coverage beams,
large-neighbourhood search, the flow beam and the MILP models, each phase improving the best placement
found so far and proving upper bounds, until the best is within ``gap`` of the lowest bound or the time
runs out (Helix §4.4-4.5; the phases and their time shares are described in :mod:`planner.algorithms.milp`'s
docstring).

:class:`_Search` holds one run's state (the incumbent, the bounds of :mod:`planner.search.bounds`, the phases run,
the clock), with one method per phase: the heuristics as warm starts (Helix §4.5), the exact coverage
search (:mod:`planner.search.coverage`) where links never bind, each region alone and the flow beam
(:mod:`planner.search.flow_beam`, Helix §4.3) where slow links separate regions, and the ``typed`` and
``per-node`` models of :mod:`planner.algorithms.milp_formulations` (Helix Tables 5-6). Every candidate is scored by
the exact max flow (:func:`planner.flow_graph.evaluate`). What a run reports, :class:`Progress` while it
runs and :class:`MilpResult` at the end, is defined here too; both are public as ``planner.algorithms.milp.Progress``
and ``planner.algorithms.milp.MilpResult``.

This is not the MILP itself: :mod:`planner.algorithms.milp` is the entry point (options, the formulation chosen,
model sizes) and :mod:`planner.algorithms.milp_formulations` builds the models this search solves.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..algorithms.milp_formulations import (
    _complete,
    _floor_cover,
    _ordered,
    _per_node_decode,
    _per_node_model,
    _per_node_start,
    _Typed,
    _typed_decode,
    _typed_model,
    _typed_start,
    interchangeable_groups,
)
from ..cluster.spec import Cluster
from ..costs.roofline import CostModel
from ..errors import PlannerError
from ..flow_graph import evaluate
from ..placement import Placement, PlacementError
from .bounds import coordinator_bound, coverage_bound
from .coverage import _lns_key, _lns_neighbourhood, _lns_step, beam_coverage, coverage_profile, solve_coverage
from .flow_beam import link_regions, search_flows
from .milp_model import ModelSize, SparseModel, recording
from .redundancy import Floor, floor_layout, repair_floor, replica_counts

#: The typed relaxation (slow links) runs under ``auto`` only up to this many variables: larger, HiGHS
#: does not finish its root LP within a minute on two cores (``helix-geo-24``: 24k variables), and the
#: LP bound equals Helix's anyway (fractional nodes spread over many boundaries get link pairs for free).
TYPED_RELAXATION_VARS = 10_000


@dataclass(frozen=True)
class Progress:
    """A report while the MILP runs: ``phase`` (``heuristics``, ``beam``, ``lns``, ``coverage``,
    ``flow beam``, ``bound``, ``typed``, ``per-node``, ``done``), seconds since the start, the best max
    flow so far and the best proven upper bound (tokens/s)."""

    phase: str
    elapsed: float
    best: float
    bound: float
    message: str = ""


ProgressCallback = Callable[[Progress], None]


@dataclass(frozen=True)
class MilpResult:
    """``upper_bound`` is the lowest proven bound of ``bounds`` (named: ``helix``, ``coordinator``,
    ``coverage``, ``solver``; :mod:`planner.search.bounds`), ``bound_name`` its name, ``gap`` is
    ``1 - throughput / upper_bound``; ``helix_bound`` is §4.5's bound alone, ``solver_bound`` the best
    MILP dual bound (None if none). ``floor`` is the redundancy floor the placement meets
    (:class:`planner.search.redundancy.Floor`: ``min_replicas`` and how many blocks the offers let reach it)."""

    placement: Placement
    throughput: float
    upper_bound: float
    helix_bound: float
    solver_bound: float | None
    gap: float
    solve_seconds: float
    formulation: str
    status: str
    start_algorithm: str
    phases: tuple[dict, ...] = field(default_factory=tuple)
    bounds: dict[str, float] = field(default_factory=dict)
    bound_name: str = "helix"
    floor: Floor | None = None


def _heuristic_starts(cluster: Cluster, cost: CostModel, min_replicas: int = 1) -> dict[str, Placement]:
    from ..algorithms.ahp import ahp
    from ..algorithms.gma import gma
    from ..algorithms.petals import petals
    from ..algorithms.swarm_baseline import swarm

    replicas = min_replicas if min_replicas > 1 else 1  # both heuristics' default: no floor
    starts = {}
    for name, fn in (
        ("petals", lambda: petals(cluster, cost=cost, min_replicas=replicas)),
        ("swarm", lambda: swarm(cluster, cost=cost, min_replicas=replicas)),
        ("gma", lambda: gma(cluster)),
        ("ahp", lambda: ahp(cluster, cost=cost)),
    ):
        try:
            starts[name] = fn()
        except PlannerError:  # PlacementError, AHPError: the heuristic does not apply to this cluster
            continue
    return starts


# ---------------------------------------------------------------------------------------------------
# Orchestration
# ---------------------------------------------------------------------------------------------------


class _Search:
    """One :func:`planner.algorithms.milp.milp` run: the best placement so far, the proven upper bounds, the phases
    run and the clock, with one method per phase of the search (:mod:`planner.algorithms.milp`'s docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        cost: CostModel,
        *,
        t0: float,
        time_limit: float,
        gap: float,
        mip_rel_gap: float,
        partial_inference: bool,
        link_degree: int | None,
        progress: ProgressCallback | None,
        seed: int,
        floor: Floor | None = None,
    ) -> None:
        self.cluster = cluster
        self.cost = cost
        self.floor_used = floor
        self.floor = floor if floor is not None and floor.active else None
        self.capacities = {
            n: min(max(cost.feasible_sizes(n)), cluster.model.num_blocks)
            for n in cluster.node_ids
            if cost.feasible_sizes(n)
        }
        self.floor_repairs = 0
        self.floor_rejects = 0
        self.t0 = t0
        self.deadline = t0 + time_limit
        self.gap = gap
        self.mip_rel_gap = mip_rel_gap
        self.partial = partial_inference
        self.link_degree = link_degree
        self.progress = progress
        self.seed = seed
        self.num_blocks = cluster.model.num_blocks
        self.helix = cost.upper_bound()
        self.groups = interchangeable_groups(cluster, cost)
        self.bounds: dict[str, float] = {"helix": self.helix, "coordinator": coordinator_bound(cluster, cost)}
        self.bound = min(self.bounds.values())
        self.solver_bound: float | None = None
        self.best: Placement | None = None
        self.best_value = -1.0
        self.best_name = ""
        self.start_name = ""
        self.phases: list[dict] = []
        self.used: list[str] = []
        self.status = "heuristics only"
        self.eval_seconds = 0.0

    # --- bookkeeping ---------------------------------------------------------------------------------

    def score(self, placement: Mapping[str, tuple[int, int]]) -> float:
        t1 = time.monotonic()
        value = evaluate(
            self.cluster, placement, cost=self.cost, partial_inference=self.partial, with_latency=False
        ).throughput
        self.eval_seconds = max(self.eval_seconds, time.monotonic() - t1)
        return value

    def margin(self) -> float:
        """Seconds a phase leaves before the deadline: scoring its last placements (two max flows, at
        the slowest seen) takes that long after the phase stops, and the time limit must hold."""
        return 0.05 + 2 * self.eval_seconds

    def report(self, phase: str, message: str = "") -> None:
        if self.progress is not None:
            elapsed = time.monotonic() - self.t0
            self.progress(Progress(phase, elapsed, max(self.best_value, 0.0), self.bound, message))

    def consider(self, name: str, placement: Placement, phase: str) -> None:
        """Keep ``placement`` if its exact max flow beats the best so far. Under a redundancy floor a
        placement below it is first repaired (:func:`planner.search.redundancy.repair_floor`, moves of whole
        nodes) and dropped when the repair falls short."""
        if self.floor is not None and not self.floor.met_by(placement):
            ranges, _ = repair_floor(placement, self.capacities, self.floor, all_sizes=False, rates=self.cost.table)
            if not self.floor.met_by(ranges):
                self.floor_rejects += 1
                return
            self.floor_repairs += 1
            placement = _ordered(self.cluster, ranges)
        value = self.score(placement)
        if value > self.best_value * (1 + 1e-9) + 1e-12:
            self.best, self.best_value, self.best_name = placement, value, name
            self.report(phase, f"{name}: {value:.1f} tokens/s")

    def prove(self, bound: float | None, name: str = "solver") -> None:
        """Record a proven upper bound on the max flow."""
        if bound is not None and math.isfinite(bound):
            self.bounds[name] = min(self.bounds.get(name, math.inf), bound)
            if name == "solver":
                self.solver_bound = self.bounds[name]
            self.bound = min(self.bound, bound)

    def good_enough(self) -> bool:
        return self.best_value >= (1 - max(self.gap, self.mip_rel_gap)) * self.bound - 1e-9

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def stop_at(self) -> float:
        """The flow at which a solver may stop: within ``gap`` of the best bound."""
        return (1 - self.gap) * self.bound

    def completed(self, ranges: Mapping[str, tuple[int, int]]) -> Placement:
        """``ranges`` with the nodes it leaves out placed as Petals would."""
        unused = [n for n in self.cluster.node_ids if n not in ranges]
        return _ordered(self.cluster, _complete(self.cluster, self.cost, dict(ranges), unused))

    @property
    def incumbent(self) -> Placement:
        """The best placement so far: :meth:`start_from_heuristics` finds one before any other phase runs."""
        assert self.best is not None, "start_from_heuristics runs first"
        return self.best

    def as_given(self, ranges: Mapping[str, tuple[int, int]]) -> Placement:
        """``ranges`` as a placement in the cluster's node order (coverage solutions place every node
        they use; the others stay idle)."""
        return _ordered(self.cluster, ranges)

    # --- phases --------------------------------------------------------------------------------------

    def start_from_heuristics(self, warm_start: Placement | None) -> None:
        """Score the heuristics (and ``warm_start``): the incumbent every later phase must beat."""
        replicas = self.floor.min_replicas if self.floor is not None else 1
        candidates = _heuristic_starts(self.cluster, self.cost, replicas)
        if warm_start is not None:
            candidates = {"given": warm_start, **candidates}
        if self.floor is not None:  # a placement meeting the floor exists: start from one
            layout = floor_layout(self.capacities, self.num_blocks, self.floor.min_replicas)
            candidates["floor layout"] = self.completed(layout)
            regions = {n: self.cluster.node(n).region for n in self.cluster.node_ids}
            by_region = floor_layout(self.capacities, self.num_blocks, self.floor.min_replicas, regions)
            candidates["floor layout by region"] = self.completed(by_region)
        for name, placement in candidates.items():
            self.consider(name, placement, "heuristics")
        if self.best is None:
            raise PlacementError("no heuristic found a placement to start the MILP from")
        self.start_name = self.best_name
        self.report("heuristics", f"best heuristic: {self.start_name}")

    def coverage_search(self) -> None:
        """The exact-coverage path: beam search, a short covering MILP for a proven bound, wider beams,
        then LNS and the covering MILP from the best placement until the time runs out. Under a
        redundancy floor: beams (their placements repaired to the floor), then the covering MILP with the
        floor's rows (:meth:`floor_cover`) for the time left."""
        total = self.remaining()
        if self.floor is not None:
            self.coverage_beam(16, 0.1, total)
            self.coverage_beam(64, 0.1, total)
            self.floor_lns(0.4, total)
            self.floor_cover(total)
            return
        self.coverage_beam(16, 0.1, total)
        self.cover(0.1, 0.0, total)  # a short covering MILP: a proven bound, maybe a better placement
        for width in (64, 256, 1024):
            self.coverage_beam(width, 0.5, total)
            if self.remaining() < 0.5 * total:
                break
        self.cover(1.0, 0.3, total)
        self.status = next(
            (p["status"] for p in reversed(self.phases) if "status" in p), "heuristics and beam search"
        )

    def coverage_beam(self, width: int, share: float, total: float) -> None:
        """A coverage beam of ``width`` for ``share`` of the ``total`` time."""
        if self.good_enough() or self.remaining() <= 0.1:
            return
        t1 = time.monotonic()
        found, _value = beam_coverage(
            self.cost,
            self.groups,
            self.num_blocks,
            low=max(self.best_value, 0.0),
            high=self.bound,
            time_limit=max(0.1, min(share * total, self.remaining() - self.margin())),
            width=width,
        )
        if found is not None:
            self.consider(f"beam {width}", self.as_given(found), "beam")
        self.phases.append(
            {"formulation": f"beam {width}", "seconds": time.monotonic() - t1, "best": self.best_value}
        )
        if "beam" not in self.used:
            self.used.append("beam")

    def cover(self, share: float, lns_share: float, total: float) -> None:
        """LNS and the covering MILP (:func:`planner.search.coverage.solve_coverage`) from the best placement, for
        ``share`` of the ``total`` time."""
        phase = "coverage"
        if self.good_enough() or self.remaining() <= 0.2:
            return
        t1 = time.monotonic()
        with recording() as solved:
            result = solve_coverage(
                self.cost,
                self.groups,
                self.num_blocks,
                dict(self.incumbent.items()),
                time_limit=max(0.2, min(share * total, self.remaining() - self.margin())),
                stop_at=self.stop_at(),
                lns_share=lns_share,
                mip_rel_gap=max(self.gap, self.mip_rel_gap),  # exact model: HiGHS' own gap is the early stop
                seed=self.seed,
                on_improve=lambda v, b: self.report(phase, f"incumbent {v:.1f}"),
            )
        self.consider(phase, self.as_given(result.ranges), phase)
        self.prove(result.bound)
        self.phases.append(
            {
                "formulation": phase,
                "status": result.status,
                "objective": result.value,
                "bound": result.bound,
                "lns_seconds": result.lns_seconds,
                "lns_iterations": result.lns_iterations,
                "milp_seconds": result.milp_seconds,
                "seconds": time.monotonic() - t1,
                **_solved_sizes(solved),
            }
        )
        if phase not in self.used:
            self.used.append(phase)

    def network_search(self) -> None:
        """Links may bind. When slow links separate regions, each region alone first (:meth:`region_share`);
        else a coverage beam with links ignored. Then the coverage bound (links ignored) and the flow
        beam."""
        total = self.remaining()
        regions = link_regions(self.cost, self.groups) if self.partial else []
        if len(regions) > 1:
            self.regions_alone(regions, total)
        else:
            self.coverage_beam_ignoring_links(total)
        if not self.good_enough() and self.remaining() > 0.2:
            self.coverage_bound(total)
        if not self.good_enough() and self.remaining() > 0.2:
            self.flow_beam(total)

    def region_groups(self, regions: list[set[str]]) -> tuple[list[list[str]], list[int]]:
        """The interchangeable groups split by region (a group's nodes share every link, so they share a
        region unless links inside and between regions are equal), with each one's region index."""
        groups: list[list[str]] = []
        region_of: list[int] = []
        for members in self.groups:
            for r, region in enumerate(regions):
                inside = [n for n in members if n in region]
                if inside:
                    groups.append(inside)
                    region_of.append(r)
        return groups, region_of

    def region_share(self) -> float:
        """The share of the time the regions alone get: 65% from 50 nodes up, where the flow beam found
        nothing better than their union in 84 s (100 nodes); 30% below, where the flow beam needs its time
        (on helix-geo-24 it reaches 1424.6 tokens/s in about 35 s, pipelines crossing regions, which no
        region alone has)."""
        return 0.65 if len(self.cost.cluster.nodes) >= 50 else 0.3

    def regions_alone(self, regions: list[set[str]], total: float) -> None:
        """Each region on its own, for up to :meth:`region_share` of the time shared by the regions'
        sizes. Links inside a region never bind, so there the max flow is the minimum block coverage and the coverage search
        is exact: per region a coverage beam (widths 16 and 64), then LNS and the covering MILP from the
        best. The union of the regions' placements (pipelines that never cross a slow link; the exact
        max flow adds whatever the slow links carry between them) is a candidate."""
        t1 = time.monotonic()
        budget = max(0.2, min(self.region_share() * total, self.remaining()))
        groups, region_of = self.region_groups(regions)
        ranges: dict[str, tuple[int, int]] = {}
        values: list[float] = []
        bounds: list[float | None] = []
        size = sum(len(region) for region in regions)
        with recording() as solved:
            for r, region in enumerate(regions):
                if self.remaining() <= 0.2:
                    break
                t2 = time.monotonic()
                share = min(budget * len(region) / size, self.remaining() - self.margin())
                sub = [g for g, rr in zip(groups, region_of, strict=True) if rr == r]
                found, value, bound = self.region_alone(sub, share, t2)
                ranges.update(found)
                values.append(value)
                bounds.append(bound)
        self.consider("regions alone", self.completed(ranges), "regions")
        self.phases.append(
            {
                "formulation": "regions alone",
                "regions": len(regions),
                "coverage": values,
                "region_bounds": bounds,
                "seconds": time.monotonic() - t1,
                "best": self.best_value,
                **_solved_sizes(solved),
            }
        )
        self.used.append("regions")

    def region_alone(
        self, groups: list[list[str]], share: float, t0: float
    ) -> tuple[dict[str, tuple[int, int]], float, float | None]:
        """One region's best coverage placement within ``share`` seconds from ``t0``: beams of width 16
        and 64 (each up to 15% of the share, bisecting up to the region's own Helix bound), then LNS and
        the covering MILP from the best (:func:`planner.search.coverage.solve_coverage`). Returns the placement,
        its minimum coverage and the covering MILP's bound on it (None when it did not run)."""
        L = self.num_blocks
        area = sum(
            len(g) * max(k * self.cost.throughput(g[0], k) for k in self.cost.feasible_sizes(g[0]))
            for g in groups
        )
        members = {n for g in groups for n in g}
        best = {n: rg for n, rg in self.incumbent.items() if n in members}
        best_value = min(coverage_profile(self.cost, best, L)) if best else 0.0
        for width in (16, 64):
            left = share - (time.monotonic() - t0)
            found, value = beam_coverage(
                self.cost,
                groups,
                L,
                low=best_value,
                high=area / L,
                time_limit=max(0.05, min(0.15 * share, left)),
                width=width,
            )
            if found is not None and value > best_value:
                best, best_value = found, value
        left = share - (time.monotonic() - t0)
        if left <= 0.2:
            return best, best_value, None
        result = solve_coverage(
            self.cost,
            groups,
            L,
            best,
            time_limit=left,
            lns_share=0.5,
            mip_rel_gap=max(self.mip_rel_gap, 0.01),
            seed=self.seed,
        )
        return result.ranges, result.value, result.bound

    def floor_lns(self, share: float, total: float) -> None:
        """The large-neighbourhood search of :mod:`planner.search.coverage` under the redundancy floor
        (:func:`_floor_lns_step`) from the best placement for ``share`` of the ``total`` time: windows around
        the bottleneck re-placed exactly, every block keeping ``min_replicas`` holders where it has them
        (one elsewhere), so every step meets the floor."""
        floor = self.floor
        assert floor is not None  # coverage_search runs it under a floor only
        if self.good_enough() or self.remaining() <= 0.5:
            return
        t1 = time.monotonic()
        budget = max(0.2, min(share * total, self.remaining() - self.margin()))
        rng = random.Random(self.seed)
        L = self.num_blocks
        ranges = dict(self.incumbent.items())
        cov = coverage_profile(self.cost, ranges, L)
        widths = sorted({min(L, w) for w in (8, 12, 16, 24, 32, 48)})
        iterations = 0
        while time.monotonic() - t1 < budget and min(cov) < self.stop_at():
            iterations += 1
            lo, hi, free = _lns_neighbourhood(self.cost, ranges, cov, L, widths, rng)
            if not free:
                continue
            r = floor.min_replicas
            targets = [r if c >= r else 1 for c in replica_counts(ranges, L)]
            near = min(cov) * 1.02
            step = min(2.0, max(0.2, budget - (time.monotonic() - t1)))
            new = _lns_step(self.cost, self.groups, ranges, free, lo, hi, L, near, step, targets)
            if new is None:
                continue
            new_cov = coverage_profile(self.cost, new, L)
            if _lns_key(new_cov, near) > _lns_key(cov, near):
                ranges, cov = new, new_cov
        self.consider("floor lns", self.as_given(ranges), "lns")
        self.used.append("floor lns")
        self.phases.append(
            {"formulation": "floor lns", "iterations": iterations, "seconds": time.monotonic() - t1, "best": self.best_value}
        )

    def floor_cover(self, total: float) -> None:
        """The covering MILP with the redundancy floor (:func:`planner.algorithms.milp_formulations._floor_cover`)
        from the best placement for the time left; exact here (links never bind), so its bound is proven."""
        assert self.floor is not None  # coverage_search runs it under a floor only
        if self.good_enough() or self.remaining() <= 0.2:
            return
        phase = "floor cover"
        found, bound, model, outcome = _floor_cover(
            self.cost,
            self.groups,
            self.num_blocks,
            self.floor,
            dict(self.incumbent.items()),
            time_limit=max(0.2, self.remaining() - self.margin()),
            stop_at=self.stop_at(),
            on_improve=lambda v, b: self.report(phase, f"incumbent {v:.1f}"),
            mip_rel_gap=max(self.gap, self.mip_rel_gap),
            seed=self.seed,
        )
        if found is not None:
            self.consider(phase, self.as_given(found), phase)
        self.prove(bound)
        self.status = outcome.status
        self.used.append(phase)
        self.phases.append(_phase(phase, model, outcome))

    def coverage_beam_ignoring_links(self, total: float) -> None:
        t1 = time.monotonic()
        found, _ = beam_coverage(
            self.cost,
            self.groups,
            self.num_blocks,
            low=0.0,
            high=self.helix,
            time_limit=max(0.1, 0.05 * total),
            width=16,
        )
        if found is not None:
            self.consider("coverage beam", self.completed(found), "beam")
        self.phases.append(
            {"formulation": "coverage beam", "seconds": time.monotonic() - t1, "best": self.best_value}
        )

    def coverage_bound(self, total: float) -> None:
        """Prove the coverage bound (:func:`planner.search.bounds.coverage_bound`) for up to 10% of the time."""
        t1 = time.monotonic()
        with recording() as solved:
            relaxed = coverage_bound(
                self.cluster,
                self.cost,
                time_limit=max(0.1, min(0.1 * total, self.remaining() - self.margin())),
                start=dict(self.incumbent.items()),
                mip_rel_gap=self.mip_rel_gap,
                seed=self.seed,
            )
        self.prove(relaxed.bound, "coverage")
        if relaxed.bound is not None:
            self.report("bound", f"coverage bound (links ignored): {relaxed.bound:.1f} tokens/s")
        self.phases.append(
            {
                "formulation": "coverage bound",
                "status": relaxed.status,
                "bound": relaxed.bound,
                "objective": relaxed.value,
                "seconds": time.monotonic() - t1,
                **_solved_sizes(solved),
            }
        )

    def flow_beam(self, total: float) -> None:
        """The flow beam (:func:`planner.search.flow_beam.search_flows`) for up to 70% of the time."""
        t1 = time.monotonic()
        search_flows(
            self.cluster,
            self.cost,
            self.groups,
            low=self.best_value,
            high=self.bound,
            time_limit=max(0.1, min(0.7 * total, self.remaining() - self.margin())),
            score=lambda ranges: self.score(self.completed(ranges)),
            partial_inference=self.partial,
            stop_at=self.stop_at(),
            on_found=lambda name, ranges, _value: self.consider(name, self.completed(ranges), "flow beam"),
        )
        self.phases.append(
            {"formulation": "flow beam", "seconds": time.monotonic() - t1, "best": self.best_value}
        )
        self.used.append("flow beam")

    def milp_models(self, formulation: str) -> None:
        """The typed model (first when nodes repeat) and then the per-node model, as ``formulation``
        asks; a typed model that is exact makes the per-node one unnecessary under ``auto``."""
        repeated = len(self.groups) < len(self.cluster.nodes)
        typed_first = formulation == "typed" or (formulation == "auto" and repeated)
        typed_exact = False
        if typed_first and not self.good_enough() and self.remaining() > 0.2:
            typed = _typed_model(self.cluster, self.cost, self.groups, self.partial, self.floor)
            typed_exact = typed.exact
            if typed.exact or formulation == "typed" or typed.model.num_vars <= TYPED_RELAXATION_VARS:
                self.solve_typed(typed, formulation)
            else:
                self.phases.append({"formulation": "typed", "skipped": f"{typed.model.num_vars} variables"})
        run_per_node = formulation == "per-node" or (formulation == "auto" and not typed_exact)
        if run_per_node and not self.good_enough() and self.remaining() > 0.2:
            self.solve_per_node()

    def solve_typed(self, typed: _Typed, formulation: str) -> None:
        """Solve the typed model from the best placement: all the time left when it is exact (or asked
        for), else 40% of it, as a relaxation whose dual bound still holds."""
        start = _typed_start(typed, self.cluster, self.cost, self.incumbent, self.partial)
        budget = (
            self.remaining() - self.margin()
            if (typed.exact or formulation == "typed")
            else 0.4 * self.remaining()
        )
        outcome = typed.model.solve(
            time_limit=budget,
            start=start,
            stop_at=self.stop_at(),
            on_improve=lambda v, b: self.report("typed", f"incumbent {v:.1f}"),
            mip_rel_gap=max(self.gap, self.mip_rel_gap) if typed.exact else self.mip_rel_gap,
            seed=self.seed,
        )
        if outcome.values is not None:
            placement = _typed_decode(typed, self.cluster, self.cost, outcome.values)
            self.consider("typed MILP", placement, "typed")
        self.prove(outcome.bound)  # exact or a relaxation: a valid bound either way
        self.status = outcome.status
        self.used.append("typed")
        self.phases.append(_phase("typed", typed.model, outcome, exact=typed.exact))

    def solve_per_node(self) -> None:
        """Helix Tables 5-6 from the best placement for the time left; a pruned model's bound is not
        proven for the whole problem."""
        pn = _per_node_model(self.cluster, self.cost, self.groups, self.partial, self.link_degree, self.floor)
        start, _ = _per_node_start(pn, self.cluster, self.cost, self.incumbent, self.groups, self.partial)
        outcome = pn.model.solve(
            time_limit=max(0.1, self.remaining() - self.margin()),
            start=start,
            stop_at=self.stop_at(),
            on_improve=lambda v, b: self.report("per-node", f"incumbent {v:.1f}"),
            mip_rel_gap=self.mip_rel_gap,
            seed=self.seed,
        )
        if outcome.values is not None:
            self.consider("per-node MILP", _per_node_decode(pn, self.cluster, outcome.values), "per-node")
        complete = len(pn.flow) == 2 * len(pn.nodes) + len(pn.nodes) * (len(pn.nodes) - 1)
        if complete:  # a pruned model's bound only holds for the pruned problem
            self.prove(outcome.bound)
        self.status = outcome.status
        self.used.append("per-node")
        self.phases.append(_phase("per-node", pn.model, outcome, pruned=not complete))

    def result(self) -> MilpResult:
        elapsed = time.monotonic() - self.t0
        value = self.best_value
        bound = max(self.bound, value)  # tolerances can leave a solver bound a hair below the incumbent
        self.report("done", f"{'+'.join(self.used) or 'heuristics'} in {elapsed:.1f}s")
        if self.floor is not None:
            self.phases.append(
                {"formulation": "floor", "repaired": self.floor_repairs, "rejected": self.floor_rejects}
            )
        return MilpResult(
            placement=self.incumbent,
            throughput=value,
            upper_bound=bound,
            helix_bound=self.helix,
            solver_bound=self.solver_bound,
            gap=0.0 if bound <= 0 else max(0.0, 1.0 - value / bound),
            solve_seconds=elapsed,
            formulation="+".join(self.used) or "heuristics",
            status=self.status,
            start_algorithm=self.start_name,
            phases=tuple(self.phases),
            bounds=dict(self.bounds),
            bound_name=min(self.bounds.items(), key=lambda item: item[1])[0],
            floor=self.floor_used,
        )


def _phase(name: str, model: SparseModel, outcome, **extra) -> dict:
    return {
        "formulation": name,
        **_solved_sizes([model.size]),
        "status": outcome.status,
        "objective": outcome.objective,
        "bound": outcome.bound,
        "seconds": outcome.seconds,
        **extra,
    }


def _solved_sizes(solved: list[ModelSize]) -> dict:
    """What a phase solved: how many models, and the columns and rows of the largest (none: ``{}``)."""
    if not solved:
        return {}
    largest = max(solved, key=lambda size: (size.columns, size.rows))
    return {"models": len(solved), "columns": largest.columns, "rows": largest.rows}

