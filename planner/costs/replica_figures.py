"""HexGen's cost model applied to one planned replica: its request latency (Eq. 2) and memory (Eq. 7).

A replica (:class:`~planner.replicas.ReplicaPlan`) is a pipeline of tensor-parallel stages. HexGen §3.2
prices one request on it as the sum over stages of compute (Eq. 4) and tensor-parallel communication
(Eq. 5), plus the hops between stages (Eq. 6): Eq. 2. Eq. 7 says whether every GPU holds its layers'
weights and the request's KV cache. ``swarmnode plan`` prints both for every group of a HexGen or
HexGen-2 plan.
"""

from __future__ import annotations

import itertools

from ..algorithms.hexgen import memory_problems
from ..cluster.spec import Cluster
from ..replicas import ReplicaPlan
from .hexgen_gpus import StageCost, Task, gpu_classes, link_between

__all__ = ["memory_verdict", "request_latency"]


def memory_verdict(cluster: Cluster, replica: ReplicaPlan, task: Task) -> tuple[str, list[str]]:
    """``("fits", [])`` when HexGen Eq. 7 holds on every GPU of ``replica`` for one request of ``task``,
    else ``("OUT OF MEMORY", problems)`` with one sentence per GPU over its memory."""
    stages = [([g.id for g in s.gpus], s.layers) for s in replica.stages]
    problems = memory_problems(cluster, stages, task=task)
    return ("fits" if not problems else "OUT OF MEMORY"), problems


def request_latency(cluster: Cluster, replica: ReplicaPlan, task: Task) -> float:
    """HexGen Eq. 2 for ``replica``: compute (Eq. 4) and tensor-parallel (Eq. 5) time of every stage plus
    the pipeline hops (Eq. 6), in seconds for one request of ``task`` (prefill and every decode step)."""
    cls_of = {g.id: c for c in gpu_classes(cluster) for g in c.gpus}
    sc = StageCost(cluster, task)
    seconds = 0.0
    for stage in replica.stages:
        cls = cls_of[stage.gpus[0].id]
        seconds += sc.compute(cls, stage.tp, stage.layers) + sc.tensor_parallel(cls, stage.tp, stage.layers)
    for a, b in itertools.pairwise(replica.stages):
        seconds += sc.pipeline_hop(link_between(cluster, a.gpus, b.gpus))
    return seconds
