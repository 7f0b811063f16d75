"""SWARM parallelism's placement (Ryabinin et al., 2023), the baseline of Helix §6.

The model is cut into equal pipeline stages, as few as possible such that the weakest node can hold one
stage (Helix §6.2: "the minimum that allows the weakest GPU to hold one stage with half its VRAM"), and
the nodes are spread over the stages to balance compute per stage: strongest first, each to the stage
with the least throughput so far (longest-processing-time first). If there are fewer nodes than stages,
the weakest nodes are left out until every stage can get a node.
"""

from __future__ import annotations

import math

from .cluster import Cluster
from .cost_model import CostModel
from .errors import CannotPlaceError
from .placement import Placement

__all__ = ["swarm", "swarm_stages"]


def swarm_stages(num_blocks: int, stage_size: int) -> list[tuple[int, int]]:
    """``ceil(L / stage_size)`` stages whose sizes differ by at most one block."""
    count = math.ceil(num_blocks / stage_size)
    base, extra = divmod(num_blocks, count)
    stages = []
    start = 0
    for i in range(count):
        size = base + (1 if i < extra else 0)
        stages.append((start, start + size))
        start += size
    return stages


def swarm(cluster: Cluster, *, cost: CostModel | None = None) -> Placement:
    """Equal stages sized for the weakest node, nodes balanced over the stages by throughput."""
    cost = cost or CostModel(cluster)
    num_blocks = cluster.model.num_blocks
    capacity = {n: max(cost.feasible_sizes(n), default=0) for n in cluster.node_ids}
    usable = [n for n in cluster.node_ids if capacity[n] > 0]
    for weakest in sorted({capacity[n] for n in usable}):
        members = [n for n in usable if capacity[n] >= weakest]
        stages = swarm_stages(num_blocks, min(weakest, num_blocks))
        if len(members) >= len(stages):
            break
    else:
        raise CannotPlaceError(
            "swarm: too few nodes for equal stages: no stage size lets every stage get a node; add nodes"
        )
    size_of = [e - s for s, e in stages]
    members.sort(key=lambda n: (-cost.throughput(n, size_of[0]), cluster.node_ids.index(n)))
    load = [0.0] * len(stages)
    ranges: dict[str, tuple[int, int]] = {}
    for node_id in members:
        k = min(range(len(stages)), key=lambda i: (load[i], i))
        load[k] += cost.throughput(node_id, size_of[k])
        ranges[node_id] = stages[k]
    return Placement({n: ranges[n] for n in cluster.node_ids if n in ranges})
