"""SWARM parallelism's placement (Ryabinin et al., 2023) as Helix ran it for its baseline (Helix §6).

Helix's ``simulator/initial_layout/heterogeneous_layout/swarm_layout.py`` (``SwarmLayout.synthesize``,
Thesys-lab/Helix-ASPLOS25 at 148b733):

* the model is cut into ``num_stages`` stages of ``L / num_stages`` consecutive layers each; ``L`` must
  be a multiple of ``num_stages`` and every node must hold one stage. Helix's scripts
  (``artifact_evaluation/*/step2_gen_layout.py``) pass the fewest such stages, "the minimum that allows
  the weakest GPU to hold one stage with half its VRAM" (Helix §6.2): 20 stages of 4 layers for
  LLaMA-2 70B (80 layers, a T4 holds 4), 10 of 6 for LLaMA 30B (60 layers, a T4 holds 8). Here the stage
  size is the largest divisor of ``L`` that the weakest node holds (:func:`swarm_stage_size`);
* a node's strength is its throughput holding one stage (``layer_count_2_throughput[stage size]``,
  here ``cost.throughput(node, stage size)``); the nodes are sorted strongest first, equal ones the
  later node first (Helix sorts ``(throughput, node index)`` pairs in reverse);
* each node in turn joins the stage with the least summed throughput so far, the first such stage on
  ties (``stage_throughput.index(min(stage_throughput))``): strongest node first into the weakest stage.

Beyond Helix's code, which asserts instead: nodes the cost model gives no block count are left out; if
there are fewer nodes than stages, the weakest nodes are left out (a stronger weakest node allows
larger stages) until every stage can get a node; if no divisor works, stages of near-equal size
(:func:`swarm_stages`) are tried the same way.

Beyond SWARM: ``min_replicas`` (default 1, the algorithm as Helix ran it) asks for a redundancy floor
(:mod:`planner.search.redundancy`): the stages are the largest the weakest node taking part holds such that every
stage can get ``min_replicas`` nodes (else, as above, one), and each node in turn joins a stage with the
fewest nodes below the floor, the one of least summed throughput among those.
"""

from __future__ import annotations

import math

from ..cluster.spec import Cluster
from ..costs.roofline import CostModel
from ..errors import CannotPlaceError
from ..placement import Placement
from ..search.redundancy import check_min_replicas

__all__ = ["swarm", "swarm_stage_size", "swarm_stages"]


def swarm_stage_size(num_blocks: int, weakest: int) -> int:
    """The largest divisor of ``num_blocks`` no larger than ``weakest`` (Helix's ``num_layers %
    num_stages == 0`` and ``num_layer_per_stage <= node.max_num_layers`` for every node), i.e. the
    fewest equal stages the weakest node can hold."""
    return max(d for d in range(1, min(weakest, num_blocks) + 1) if num_blocks % d == 0)


def swarm_stages(num_blocks: int, stage_size: int) -> list[tuple[int, int]]:
    """``ceil(L / stage_size)`` stages whose sizes differ by at most one block (all ``stage_size``
    blocks when it divides ``L``)."""
    count = math.ceil(num_blocks / stage_size)
    base, extra = divmod(num_blocks, count)
    stages = []
    start = 0
    for i in range(count):
        size = base + (1 if i < extra else 0)
        stages.append((start, start + size))
        start += size
    return stages


def _layout(
    cluster: Cluster, capacity: dict[str, int], min_replicas: int = 1
) -> tuple[list[str], list[tuple[int, int]]]:
    """The nodes that take part and the stages: Helix's equal stages for the weakest node if there are
    nodes enough (``min_replicas`` per stage when they allow it, else one), else without the weakest
    nodes, else near-equal stages."""
    num_blocks = cluster.model.num_blocks
    usable = [n for n in cluster.node_ids if capacity[n] > 0]
    weakest_first = sorted({capacity[n] for n in usable})
    for per_stage in sorted({min_replicas, 1}, reverse=True):
        for equal in (True, False):
            for weakest in weakest_first:
                members = [n for n in usable if capacity[n] >= weakest]
                size = swarm_stage_size(num_blocks, weakest) if equal else min(weakest, num_blocks)
                stages = swarm_stages(num_blocks, size)
                if len(members) >= per_stage * len(stages):
                    return members, stages
    raise CannotPlaceError(
        f"swarm: {len(usable)} nodes cannot give every stage a node: the stages the nodes can hold "
        f"need more nodes than there are; add nodes or memory"
    )


def swarm(cluster: Cluster, *, cost: CostModel | None = None, min_replicas: int = 1) -> Placement:
    """Helix's SWARM baseline: equal stages as large as the weakest node holds, nodes strongest first
    each into the stage of least summed throughput; with ``min_replicas`` > 1, into a stage still below
    the floor first (module docstring)."""
    min_replicas = check_min_replicas(min_replicas)
    cost = cost or CostModel(cluster)
    capacity = {n: max(cost.feasible_sizes(n), default=0) for n in cluster.node_ids}
    members, stages = _layout(cluster, capacity, min_replicas)
    position = {n: i for i, n in enumerate(cluster.node_ids)}
    strength = {n: cost.throughput(n, stages[0][1] - stages[0][0]) for n in members}
    members.sort(key=lambda n: (strength[n], position[n]), reverse=True)
    load = [0.0] * len(stages)
    holders = [0] * len(stages)
    ranges: dict[str, tuple[int, int]] = {}
    for node_id in members:
        if min_replicas > 1:
            k = min(range(len(stages)), key=lambda i: (min(holders[i], min_replicas), load[i], i))
        else:
            k = load.index(min(load))
        holders[k] += 1
        start, end = stages[k]
        load[k] += cost.throughput(node_id, end - start)
        ranges[node_id] = stages[k]
    return Placement({n: ranges[n] for n in cluster.node_ids if n in ranges})
