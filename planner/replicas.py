"""Plans made of model replicas: pipelines of tensor-parallel stages (HexGen) and prefill/decode groups (HexGen-2).

HexGen (000_7037da9499fcd439.txt) §4.1 writes an assignment as ``D -> {(d_ij, l_ij)}``: the ``i``-th
replica is a pipeline whose ``j``-th stage is a set of GPUs ``d_ij`` that runs ``l_ij`` layers with tensor
parallelism over ``|d_ij|`` GPUs. HexGen-2 (002_ac42bb48b964a3e9.txt) §3.1 adds a type per replica
(prefill or decode) and the KV-cache routing between them. :class:`StagePlan` and :class:`ReplicaPlan`
hold exactly that, with the concrete GPUs.

JSON: a stage is ``{"id", "gpus", "nodes": {node: gpu count}, "tp", "layers": [start, end]}`` and a
replica ``{"role", "stages", "capacity"}``. The plan-wide ``placement`` maps each stage id to its layer
range; a stage id is the node id when the stage uses every GPU of one node, ``node#a-b`` for GPUs ``a..b``
of a node, and the ``+``-joined ids when it spans several single-GPU nodes of a machine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .costs.hexgen_gpus import Gpu

__all__ = ["ReplicaPlan", "StagePlan", "build_stages", "placement_of", "stage_id", "take_gpus"]


def stage_id(gpus: Sequence[Gpu], node_gpus: Mapping[str, int]) -> str:
    """Readable, unique id of a GPU set (see the module docstring)."""
    nodes = sorted({g.node for g in gpus})
    if len(nodes) == 1:
        node = nodes[0]
        idx = sorted(g.index for g in gpus)
        if len(idx) == node_gpus.get(node, len(idx)):
            return node
        if idx == list(range(idx[0], idx[-1] + 1)):
            return f"{node}#{idx[0]}" if len(idx) == 1 else f"{node}#{idx[0]}-{idx[-1]}"
        return f"{node}#" + ",".join(str(i) for i in idx)
    return "+".join(sorted(g.id for g in gpus))


def take_gpus(pool: list[Gpu], t: int) -> list[Gpu]:
    """Remove ``t`` GPUs from ``pool`` (the free GPUs of one class) and return them: ``t`` GPUs of one node
    when a node still has that many, so that a tensor-parallel group stays inside a node where it can
    (HexGen §4.2), else the first ``t`` of the pool."""
    by_node: dict[str, list[Gpu]] = {}
    for g in pool:
        by_node.setdefault(g.node, []).append(g)
    node = next((nid for nid, gs in by_node.items() if len(gs) >= t), None)
    chosen = by_node[node][:t] if node is not None else pool[:t]
    if len(chosen) < t:
        raise ValueError(f"a stage needs {t} GPUs but only {len(chosen)} of its class are free")
    for g in chosen:
        pool.remove(g)
    return chosen


def build_stages(
    pools: Sequence[list[Gpu]], layout: Iterable[tuple[int, int, int]], node_gpus: Mapping[str, int]
) -> tuple[StagePlan, ...]:
    """Concrete stages of one replica from its layout, ``(class index, TP degree, layers)`` per stage in
    pipeline order: each stage takes its GPUs from ``pools[class]`` (:func:`take_gpus`) and the next
    ``layers`` layers, starting at layer 0. ``node_gpus`` maps every node to its GPU count (for
    :func:`stage_id`)."""
    stages = []
    position = 0
    for k, t, layers in layout:
        chosen = take_gpus(pools[k], t)
        stages.append(StagePlan(stage_id(chosen, node_gpus), tuple(chosen), position, position + layers))
        position += layers
    return tuple(stages)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: ``gpus`` run layers ``[start, end)`` tensor-parallel (TP degree ``len(gpus)``)."""

    id: str
    gpus: tuple[Gpu, ...]
    start: int
    end: int

    def __post_init__(self) -> None:
        if not self.gpus:
            raise ValueError(f"stage {self.id!r} has no GPUs")
        if not 0 <= self.start < self.end:
            raise ValueError(f"stage {self.id!r}: layer range [{self.start}, {self.end}) is empty")

    @property
    def tp(self) -> int:
        return len(self.gpus)

    @property
    def layers(self) -> int:
        return self.end - self.start

    @property
    def nodes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for g in self.gpus:
            out[g.node] = out.get(g.node, 0) + 1
        return out

    @property
    def machines(self) -> set[str]:
        return {g.machine for g in self.gpus}

    @property
    def regions(self) -> set[str]:
        return {g.region for g in self.gpus}

    @property
    def gpu_types(self) -> set[str]:
        return {g.gpu_type for g in self.gpus}

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "gpus": [g.id for g in self.gpus],
            "nodes": self.nodes,
            "tp": self.tp,
            "layers": [self.start, self.end],
        }


@dataclass(frozen=True)
class ReplicaPlan:
    """A model replica: stages in pipeline order covering ``[0, L)``; ``role`` is ``replica`` (prefill and
    decode together, HexGen), ``prefill`` or ``decode`` (HexGen-2). ``capacity`` is what the planner's cost
    model gives it (output tokens/s for ``replica`` and ``decode``, prompts/s for ``prefill``)."""

    stages: tuple[StagePlan, ...]
    role: str = "replica"
    capacity: float = 0.0

    def __post_init__(self) -> None:
        if self.role not in ("replica", "prefill", "decode"):
            raise ValueError(f"unknown replica role {self.role!r}")
        if not self.stages:
            raise ValueError("a replica needs at least one stage")
        position = 0
        for stage in self.stages:
            if stage.start != position:
                raise ValueError(
                    f"stage {stage.id!r} starts at layer {stage.start}, expected {position}: stages must be contiguous"
                )
            position = stage.end

    @property
    def num_layers(self) -> int:
        return self.stages[-1].end

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        return tuple(g for s in self.stages for g in s.gpus)

    @property
    def strategy(self) -> list[int]:
        """HexGen Table 4's notation: the TP degree of each stage."""
        return [s.tp for s in self.stages]

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "strategy": self.strategy,
            "capacity": self.capacity,
            "stages": [s.to_json() for s in self.stages],
        }


def placement_of(replicas: Iterable[ReplicaPlan]) -> dict[str, list[int]]:
    """The plan JSON's ``placement``: stage id -> ``[start, end]``."""
    out: dict[str, list[int]] = {}
    for replica in replicas:
        for stage in replica.stages:
            if stage.id in out:
                raise ValueError(f"stage id {stage.id!r} appears twice; a GPU serves one stage")
            out[stage.id] = [stage.start, stage.end]
    return out
