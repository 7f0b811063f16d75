"""GMA, the greedy memory algorithm of LLaMPS (ICPE 2024), Algorithm 2.

Step 2: leftover memory ``LM(S_i) = AM(S_i) - P_o`` (here ``memory_bytes x weight_memory_fraction -
overhead_bytes``). Step 4: sort servers by ``LM`` in descending order (ties keep the spec's order).
Step 5: give each server in turn ``Nb(S_i) = floor(LM(S_i) / TB)`` blocks (capped by ``max_blocks``),
contiguously, until every block is placed.
"""

from __future__ import annotations

from ..cluster.spec import Cluster
from ..costs.roofline import block_capacity
from ..placement import Placement, contiguous_fill

__all__ = ["gma", "leftover_memory"]


def leftover_memory(cluster: Cluster, node_id: str) -> float:
    """LLaMPS' ``LM(S_i) = AM(S_i) - P_o``: bytes a node can give to blocks."""
    node = cluster.node(node_id)
    return node.memory_bytes * cluster.weight_memory_fraction - cluster.overhead_bytes


def gma(cluster: Cluster) -> Placement:
    """Place the model greedily by leftover memory (LLaMPS Alg. 2)."""
    order = sorted(cluster.node_ids, key=lambda n: -leftover_memory(cluster, n))
    sizes = {n.id: block_capacity(cluster, n) for n in cluster.nodes}
    return contiguous_fill(order, sizes, cluster.model.num_blocks)
