"""A node's settings check themselves part by part, and the placement follower works through its two
collaborators (a `NodeStatus` and a `FollowerHost`) alone: no `Node`, no DHT, no model."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from swarmnode.records import NodeState, Phase, PlacementRecord, ServerRecord
from swarmnode.server.config import (
    MemoryConfig,
    ModelConfig,
    NetworkConfig,
    NodeConfig,
    NodeConfigError,
    ServingConfig,
)
from swarmnode.server.follower import FollowerHost, PlacementFollower
from swarmnode.server.node_status import NodeStatus

ME = "12D3KooWF4wEr5XtqQayPrXS8NnvDGNZqpszHir9fBj4b7KJ3i9j"
OTHER = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
PEER = f"/ip4/127.0.0.1/tcp/31337/p2p/{ME}"


@pytest.mark.parametrize("build,message", [
    (lambda: ModelConfig(model=""), "--model is empty"),
    (lambda: ModelConfig(model="m", blocks=(3, 3)), "--blocks 3:3 is empty or negative"),
    (lambda: ModelConfig(model="m", dtype="int3"), "--dtype int3 is not one of"),  # type: ignore[arg-type]
    (lambda: ModelConfig(model="m", quantization="int3"), "--quantize int3 is not one of"),  # type: ignore[arg-type]
    (lambda: MemoryConfig(leftover_mem=-1), "--leftover-mem -1 is negative"),
    (lambda: MemoryConfig(cache_tokens=0), "--cache-tokens 0 is below 1"),
    (lambda: NetworkConfig(port=70000), "--port 70000 is not a TCP port"),
    (lambda: NetworkConfig(metrics_port=-2), "--metrics-port -2 is not a TCP port"),
    (lambda: NetworkConfig(reachability="maybe"), "--reachability maybe is not one of"),
    (lambda: NetworkConfig(reachability="relay"), "--reachability relay needs --initial-peers"),
    (lambda: NetworkConfig(reachability="relay", initial_peers=[PEER], port=31400), "do not apply"),
    (lambda: ServingConfig(phase="sideways"), "--phase sideways is not one of"),  # type: ignore[arg-type]
    (lambda: ServingConfig(prefill_chunk=-1), "--prefill-chunk -1 is negative"),
    (lambda: ServingConfig(num_threads=0), "--num-threads 0 is below 1"),
    (lambda: ServingConfig(cores=0), "--leftover-cores 0 is below 1"),
    (lambda: ServingConfig(shutdown_grace=-1.0), "--shutdown-grace -1.0 is negative"),
])
def test_each_part_refuses_its_own_bad_fields(build, message):
    with pytest.raises(NodeConfigError, match=message.replace("-1.0", r"-1\.0")) as caught:
        build()
    assert caught.value.code == "node_config"


def test_a_node_config_is_composed_of_its_parts():
    config = NodeConfig(model=ModelConfig(model="m", blocks=(0, 2)), serving=ServingConfig(phase="decode"))
    assert config.model.start == 0 and config.model.end == 2
    assert config.serving.phase is Phase.DECODE  # a phase's name becomes the member
    assert config.memory == MemoryConfig() and config.network == NetworkConfig()


@dataclass
class FakeUnit:
    span: tuple[int, int]
    live: bool = True
    closed: bool = False


@dataclass
class FakeHost:
    """A `FollowerHost` that loads instantly and reads a fixed placement."""

    placement: PlacementRecord | None
    peer_id: str = ME
    memory: object = None
    loaded: list[tuple[int, int]] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)

    async def aload_unit(self, start, end, *, cache_tokens=None, reuse=None):
        self.loaded.append((start, end))
        return FakeUnit((start, end))

    def set_phase(self, phase, why):
        self.phases.append(Phase(phase).value)

    async def read_placement(self, trusted, rejected):
        return self.placement

    async def read_block_servers(self) -> dict[int, list[ServerRecord]]:
        return {}

    async def answering(self, peers, timeout):
        return set(peers)


def _placement(assignments, **extra) -> PlacementRecord:
    return PlacementRecord(version=3, term=1, coordinator=OTHER, algorithm="milp", reason="r", created=0.0,
                           num_blocks=4, assignments=assignments, **extra)


def _follower(host: FakeHost, *, phase=Phase.BOTH, pinned=False) -> tuple[PlacementFollower, NodeStatus, list]:
    wakes: list[int] = []
    status = NodeStatus(assigned=None, on_change=lambda: wakes.append(1))
    typed: FollowerHost = host  # type: ignore[assignment]  # the fake's attributes stand for the protocol's
    return PlacementFollower(typed, status, frozenset({"key"}), phase=phase, phase_pinned=pinned), status, wakes


def test_the_follower_loads_its_assignment_through_the_host_and_records_it_in_the_status():
    host = FakeHost(_placement({ME: (1, 3), OTHER: (0, 4)}, phases={ME: "prefill", OTHER: "decode"}))
    follower, status, wakes = _follower(host)
    asyncio.run(follower.step())
    assert host.loaded == [(1, 3)] and [u.span for u in status.units] == [(1, 3)]
    assert status.state is NodeState.ONLINE and status.note == "serving blocks [1, 3] (placement v3)"
    assert status.assigned == (1, 3) and status.placement_version == 3 and wakes
    assert host.phases == ["prefill"]
    asyncio.run(follower.step())  # already serving it: nothing more is loaded
    assert host.loaded == [(1, 3)]


def test_the_follower_waits_when_unused_and_keeps_a_pinned_phase():
    host = FakeHost(_placement({OTHER: (0, 4)}, unused={ME: "too slow"}, phases={OTHER: "decode"}))
    follower, status, _ = _follower(host, phase=Phase.PREFILL, pinned=True)
    asyncio.run(follower.step())
    assert status.state is NodeState.WAITING and status.note == "not used by placement v3: too slow"
    assert status.assigned is None and host.loaded == [] and host.phases == []
