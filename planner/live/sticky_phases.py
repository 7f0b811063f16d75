"""Replanning a two-phase swarm with stickiness: keep the prefill/decode groups unless a fresh plan is clearly better.

The counterpart of :mod:`planner.live.sticky` for HexGen-2 plans (:mod:`planner.algorithms.hexgen2_swarm`). A published
two-phase placement gives every node a phase and a range; each phase's nodes form chains that cover the
model once (a group, HexGen-2 §3.2). When the swarm changes, :func:`decide_phases` re-scores the previous
groups with today's measurements (§3.3's max flow, :func:`planner.algorithms.hexgen2_swarm.score_phase_groups`) and
keeps them unless a node of theirs left or the fresh plan is at least ``improvement`` faster: moving blocks
and switching a node's phase costs loading time and cold caches, as in :mod:`planner.live.sticky`. Plain data in
and out.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import replace

from ..algorithms.hexgen2_swarm import DECODE, PREFILL, SwarmPhasePlan, plan_swarm_phases, score_phase_groups
from ..cluster.spec import Cluster
from .sticky import Decision, moved_blocks

__all__ = ["chains", "decide_phases"]


def chains(assignments: Mapping[str, tuple[int, int]], num_blocks: int) -> list[list[str]] | None:
    """The nodes of one phase as groups: chains of ranges that each cover ``[0, num_blocks)`` once, built
    greedily in (start, node id) order; None when the ranges do not split into such chains."""
    left = sorted(assignments, key=lambda n: (assignments[n][0], n))
    out = []
    while left:
        chain, end = [], 0
        while end < num_blocks:
            nxt = next((n for n in left if assignments[n][0] == end), None)
            if nxt is None:
                return None
            chain.append(nxt)
            left.remove(nxt)
            end = assignments[nxt][1]
        out.append(chain)
    return out


def _previous_groups(previous: Mapping[str, tuple[int, int]], phases: Mapping[str, str],
                     num_blocks: int) -> tuple[list[list[str]], list[str]] | None:
    groups, roles = [], []
    for role in (PREFILL, DECODE):
        of_role = {n: (r[0], r[1]) for n, r in previous.items() if phases.get(n) == role}
        found = chains(of_role, num_blocks)
        if not found:
            return None
        groups += found
        roles += [role] * len(found)
    return groups, roles


def _align(cluster: Cluster, plan: SwarmPhasePlan, previous: Mapping[str, tuple[int, int]] | None,
           previous_phases: Mapping[str, str] | None, pinned: Mapping[str, str] | None = None) -> SwarmPhasePlan:
    """The plan with interchangeable nodes (same hardware figures, memory, speeds and pin; links are the
    swarm's default unless measured) trading places so that as many as possible keep their old range and
    phase: the plan's value does not change, fewer blocks are loaded (as :func:`planner.live.sticky.decide` aligns a
    fresh plan)."""
    if not previous:
        return plan
    pinned = pinned or {}

    def kind(node_id: str) -> tuple:
        n = cluster.node(node_id)
        return (n.device, n.gpus, n.gpu, n.tflops, n.memory_bandwidth_gbs, n.cores, n.max_blocks,
                n.block_throughput, n.prefill_throughput, n.memory_bytes, n.nic_mbps, pinned.get(node_id))

    measured = {x for a, b, _link in cluster.network.links for x in (a, b)}
    slots = [(gi, k) for gi, g in enumerate(plan.groups) for k in range(len(g.ranges))]
    who = {slot: plan.groups[slot[0]].ranges[slot[1]][0] for slot in slots}

    def keeps(node_id: str, slot: tuple[int, int]) -> int:
        group = plan.groups[slot[0]]
        _n, a, b = group.ranges[slot[1]]
        old = previous.get(node_id)
        if old is None or (previous_phases or {}).get(node_id) != group.role:
            return 0
        return max(0, min(b, old[1]) - max(a, old[0]))

    improved = True
    while improved:
        improved = False
        for s1, s2 in itertools.combinations(slots, 2):
            x, y = who[s1], who[s2]
            if x in measured or y in measured or kind(x) != kind(y):
                continue
            if keeps(y, s1) + keeps(x, s2) > keeps(x, s1) + keeps(y, s2):
                who[s1], who[s2] = y, x
                improved = True
    groups = tuple(
        replace(g, ranges=tuple((who[(gi, k)], a, b) for k, (_n, a, b) in enumerate(g.ranges)))
        for gi, g in enumerate(plan.groups))
    return replace(plan, groups=groups)


def _decision(plan: SwarmPhasePlan, previous: Mapping[str, tuple[int, int]] | None,
              previous_phases: Mapping[str, str] | None, reason: str, max_reason_chars: int | None,
              ) -> Decision:
    placement = plan.assignments
    phases = plan.phases
    changed = placement != dict(previous or {}) or phases != dict(previous_phases or {})
    if max_reason_chars is not None and len(reason) > max_reason_chars:
        reason = reason[:max_reason_chars - 1] + "…"
    return Decision(placement, plan.flows(), plan.throughput, "hexgen2", reason,
                    moved_blocks(placement, dict(previous or {})), changed, phases=phases, kv_links=plan.kv_links())


def _describe(plan: SwarmPhasePlan) -> str:
    pre = sum(1 for g in plan.groups if g.role == PREFILL)
    dec = len(plan.groups) - pre
    return (f"{pre} prefill and {dec} decode group{'s' * (dec != 1)}, {plan.throughput:.0f} tok/s "
            f"({plan.value:.3g} requests/s of {plan.s_in:.0f}+{plan.s_out:.0f} tokens)")


def decide_phases(
    cluster: Cluster,
    previous: Mapping[str, tuple[int, int]] | None,
    previous_phases: Mapping[str, str] | None,
    *,
    events: Sequence[str] = (),
    improvement: float = 0.2,
    time_limit: float = 10.0,
    workload: tuple[float, float] | None = None,
    pinned: Mapping[str, str] | None = None,
    max_reason_chars: int | None = None,
) -> Decision:
    """The two-phase placement to publish for ``cluster`` given the previous one (module docstring).

    Raises :class:`~swarmnode.planner.errors.CannotPlaceError` when the nodes cannot form a prefill and a
    decode group (:func:`planner.algorithms.hexgen2_swarm.plan_swarm_phases`)."""
    what = "; ".join(events)
    prefix = f"{what}: " if what else ""
    fresh = plan_swarm_phases(cluster, workload=workload, pinned=pinned, time_limit=time_limit)
    old = None
    if previous and previous_phases and set(previous) <= set(cluster.node_ids):
        groups = _previous_groups(previous, previous_phases, cluster.model.num_blocks)
        if groups is not None:
            old = score_phase_groups(cluster, groups[0], groups[1], workload=workload, pinned=pinned)
    if old is not None and old.value > 0 and fresh.value < (1.0 + improvement) * old.value:
        reason = (f"{prefix}keeps {_describe(old)}; a fresh hexgen2 plan would give {fresh.throughput:.0f} tok/s, "
                  f"below the {improvement * 100:.0f}% threshold for moving blocks")
        return _decision(old, previous, previous_phases, reason, max_reason_chars)
    if not previous:
        why = "first placement"
    elif old is None:
        why = "the old placement cannot serve both phases any more"
    else:
        why = f"{old.throughput:.0f} tok/s for keeping the old one"
    reason = f"{prefix}fresh hexgen2 plan: {_describe(fresh)}; {why}"
    fresh = _align(cluster, fresh, previous, previous_phases, pinned)
    return _decision(fresh, previous, previous_phases, reason, max_reason_chars)
