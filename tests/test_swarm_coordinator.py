"""Leftover capacity in, planned placement out: nodes without --blocks, the coordinator, re-plans, the
lease, and trust. Real processes over real hivemind P2P on 127.0.0.1; the truth is local transformers.
"""

from __future__ import annotations

import re
import signal
import threading
import time

import pytest
import torch

from swarmnode.cli.status import status_text
from swarmnode.client import ClientConfig, DistributedModelForCausalLM
from swarmnode.identity import load_or_create_private_key, load_trusted_keys
from swarmnode.naming import short_id
from swarmnode.records import TAKEOVER_BOUND
from swarmnode.server.memory_plan import MIN_CACHE_TOKENS
from swarmnode.testing.swarm_reader import settled

pytestmark = pytest.mark.swarm


class _TokenCount:
    """A `generate(streamer=...)` streamer that sets `reached` once `count` tokens came (the prompt counts
    as the first `put`)."""

    def __init__(self, count: int):
        self.count, self.seen, self.reached = count, 0, threading.Event()

    def put(self, value) -> None:
        self.seen += 1
        if self.seen > self.count:
            self.reached.set()

    def end(self) -> None:
        self.reached.set()


def _logged(process, pattern: str, timeout: float) -> bool:
    """Whether `process` tells its operator `pattern` (a regex) within `timeout` s: what it logs, not its
    state, is what is checked."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, process.log(), re.MULTILINE):
            return True
        time.sleep(0.2)
    return False


def _client(swarm, model_dir):
    trusted = load_trusted_keys([str(swarm.log_dir / "keys" / "swarm_key.pem")])
    return DistributedModelForCausalLM.from_pretrained(
        model_dir, initial_peers=swarm.initial_peers, config=ClientConfig(trusted_coordinators=trusted))


def _fits(status: dict) -> None:
    placement = status["placement"]
    covered = [0] * status["num_blocks"]
    for peer, (start, end) in placement["assignments"].items():
        assert end - start <= status["nodes"][peer]["max_blocks"], f"{peer} was given more than it offered"
        # each placed range leaves its node the KV cache its offer was counted with
        assert status["nodes"][peer]["cache_tokens"] >= MIN_CACHE_TOKENS, (peer, status["nodes"][peer])
        for block in range(start, end):
            covered[block] += 1
    assert all(covered), f"placement leaves blocks uncovered: {covered}"


def _redundancy(status: dict) -> list[tuple[int, int]]:
    """Check that the placement names exactly the block ranges it holds on fewer than `min_replicas` (2 by
    default) nodes, and that `status` shows them; return them."""
    placement, floor = status["placement"], status["min_replicas"]
    assert floor == placement["min_replicas"] == 2
    counts = [0] * status["num_blocks"]
    for start, end in placement["assignments"].values():
        for block in range(start, end):
            counts[block] += 1
    short: list[tuple[int, int]] = []
    for block, count in enumerate(counts):
        if count < floor:
            if short and short[-1][1] == block:
                short[-1] = (short[-1][0], block + 1)
            else:
                short.append((block, block + 1))
    assert [tuple(r) for r in status["single_points"]] == short
    text = status_text(status)
    if short:
        assert "SINGLE POINTS OF FAILURE" in text
    else:
        assert "every block planned on at least 2 nodes" in text
    assert all(peer not in placement["assignments"] for peer in status["unused"])
    return short


def _planned_because(coordinator, words: str) -> bool:
    """Whether the coordinator logged a plan whose reason says `words`. Not the newest placement's reason alone:
    another change (a node's offer settling once it serves) may be planned before the status is read."""
    return any("planned in" in line and words in line for line in coordinator.log().splitlines())


def test_planned_placement_serves_replans_and_keeps_generating(swarm_factory, model_dir, local_model, chat_prompts):
    swarm = swarm_factory()
    swarm.start_bootstrap()
    coordinator = swarm.start_coordinator(extra=["--time-limit", "5"])
    offers = ["850M", "900M", "950M"]
    nodes = [swarm.start_node(leftover_mem=m, wait=False, name=f"node-{m}") for m in offers]
    for node in nodes:
        swarm.wait_serving(node, 240)
    peers = {n.peer_id for n in nodes}
    status = swarm.wait_status(lambda s: settled(s, peers))
    _fits(status)
    _redundancy(status)
    max_blocks = {p: status["nodes"][p]["max_blocks"] for p in peers}
    assert len(set(max_blocks.values())) == 3, "different offers must give different capacities"
    assert all(status["nodes"][p]["block_throughput"] > 0 for p in peers)
    assert status["coordinators"] and status["coordinators"][0]["holder"] == coordinator.peer_id
    first_version = status["placement"]["version"]

    ids = chat_prompts[0]
    expected = local_model.generate(ids, max_new_tokens=40, do_sample=False)
    with _client(swarm, model_dir) as remote:
        ours = remote.generate(ids, max_new_tokens=24, do_sample=False)
        assert torch.equal(ours, expected[:, : ids.shape[1] + 24])
        assert remote.swarm.plan_routes > 0, "routes should follow the placement's flows"

        # a fourth node joins: a new placement uses it
        fourth = swarm.start_node(leftover_mem="1050M", wait=False, name="node-1050M")
        swarm.wait_serving(fourth, 240)
        peers.add(fourth.peer_id)
        status = swarm.wait_status(lambda s: settled(s, peers) and s["placement"]["version"] > first_version)
        _fits(status)
        assert fourth.peer_id in status["placement"]["assignments"]
        assert _planned_because(coordinator, f"node {short_id(fourth.peer_id)} joined")
        four_nodes_short = _redundancy(status)

        # a node is stopped while a generation runs: the swarm re-plans and the text is unchanged
        result: dict = {}
        underway = _TokenCount(3)

        def generate() -> None:
            try:
                result["tokens"] = remote.generate(ids, max_new_tokens=40, do_sample=False, streamer=underway)
            except Exception as exc:  # reported below
                result["error"] = exc

        worker = threading.Thread(target=generate)
        worker.start()
        assert underway.reached.wait(120), "the generation did not start"
        victim = nodes[1]
        version_before = status["placement"]["version"]
        assert swarm.stop(victim) == 0
        peers.discard(victim.peer_id)
        worker.join(300)
        assert not worker.is_alive()
        assert "error" not in result, result.get("error")
        assert torch.equal(result["tokens"], expected)
        status = swarm.wait_status(lambda s: settled(s, peers) and s["placement"]["version"] > version_before)
        _fits(status)
        assert victim.peer_id not in status["placement"]["assignments"]
        assert _planned_because(coordinator, f"node {short_id(victim.peer_id)} left")
        again = remote.generate(chat_prompts[1], max_new_tokens=24, do_sample=False)
        assert torch.equal(again, local_model.generate(chat_prompts[1], max_new_tokens=24, do_sample=False))

        # a node is SIGKILLed and its service manager restarts it at once with the same identity (peer id),
        # while the killed process's record still lives: the coordinator drops it, then plans it again
        version_before = status["placement"]["version"]
        swarm.kill(fourth, signal.SIGKILL)
        fourth.popen.wait(10)
        peers.discard(fourth.peer_id)
        status = swarm.wait_status(lambda s: s["placement"]["version"] > version_before
                                   and fourth.peer_id not in s["placement"]["assignments"])
        assert _planned_because(coordinator, f"node {short_id(fourth.peer_id)} left")
        restarted = swarm.spawn(f"{fourth.name}~1", fourth.args)
        assert restarted.peer_id == fourth.peer_id
        swarm.wait_serving(restarted, 240)  # serving means placed: an unplanned node serves nothing
        peers.add(fourth.peer_id)
        status = swarm.wait_status(lambda s: settled(s, peers))
        _fits(status)
        # the node came back: the floor is restored as far as the three nodes plus it allow
        assert len(_redundancy(status)) <= len(four_nodes_short) + 1
        # planned again either as the node it was (it answered pings while the killed process's record lived)
        # or, when its restart outlasted that record (a loaded machine), as a node that joined
        assert _logged(coordinator, rf"answers pings again|node {re.escape(short_id(fourth.peer_id))} joined", 5)
        last = remote.generate(chat_prompts[2], max_new_tokens=24, do_sample=False)
        assert torch.equal(last, local_model.generate(chat_prompts[2], max_new_tokens=24, do_sample=False))
    assert coordinator.alive() and all(n.alive() for n in [*nodes, restarted] if n is not victim)
    assert swarm.placement_version() >= first_version + 4  # the first, a join, a departure, a kill, a return


def test_standby_takes_over_and_forged_placements_are_ignored(swarm_factory, model_dir, local_model, chat_prompts,
                                                               tmp_path):
    swarm = swarm_factory()
    swarm.start_bootstrap()
    first = swarm.start_coordinator(name="coordinator-a", extra=["--algorithm", "petals"])
    swarm.wait_lease(first, 60)
    standby = swarm.start_coordinator(name="coordinator-b", extra=["--algorithm", "petals"])
    nodes = [swarm.start_node(leftover_mem="950M", wait=False, name=f"node-{i}") for i in range(2)]
    for node in nodes:
        swarm.wait_serving(node, 240)
    peers = {n.peer_id for n in nodes}
    status = swarm.wait_status(lambda s: settled(s, peers))
    assert [c["holder"] for c in status["coordinators"]] == [first.peer_id]  # the standby holds no lease
    assert standby.alive()

    ids = chat_prompts[2]
    expected = local_model.generate(ids, max_new_tokens=20, do_sample=False)
    with _client(swarm, model_dir) as remote:
        # the lease holder dies: the standby takes over within the documented bound; nodes keep serving
        swarm.kill(first, signal.SIGKILL)
        killed_at = time.monotonic()
        assert torch.equal(remote.generate(ids, max_new_tokens=20, do_sample=False), expected)
        swarm.wait_lease(standby, TAKEOVER_BOUND + 30)
        took = time.monotonic() - killed_at
        assert took <= TAKEOVER_BOUND + 5, f"takeover took {took:.1f} s, bound {TAKEOVER_BOUND:.0f} s"
        # the third node also runs a coordinator in its process: it stands by while the lease is held
        third = swarm.start_node(leftover_mem="950M", wait=False, name="node-2", extra=["--coordinator"])
        swarm.wait_serving(third, 240)
        peers.add(third.peer_id)
        status = swarm.wait_status(lambda s: settled(s, peers) and s["placement"]["coordinator"] == standby.peer_id)
        assert [c["holder"] for c in status["coordinators"]] == [standby.peer_id]  # the third stands by
        assert third.peer_id in status["placement"]["assignments"]
        trusted_version = status["placement"]["version"]
        assignments = status["placement"]["assignments"]

        # a coordinator with a key nobody trusts publishes a placement: every node ignores it and says why
        rogue_key = tmp_path / "rogue.pem"
        load_or_create_private_key(rogue_key)
        rogue = swarm.start_coordinator(name="rogue", extra=["--key", str(rogue_key), "--algorithm", "gma"])
        rogue_trust = load_trusted_keys([str(rogue_key)])
        forged = swarm.wait_until(lambda: swarm.reader.placement(trusted=rogue_trust), 60,
                                  "placement signed by the rogue key", rogue)
        assert forged.coordinator == rogue.peer_id
        for node in [*nodes, third]:  # each node has read the forged placement and refused it
            assert _logged(node, rf"ignoring placement v{forged.version} .* signed by untrusted key", 30), node.name
        status = swarm.wait_status(lambda s: settled(s, set(assignments)), timeout=60)
        assert status["placement"]["version"] == trusted_version
        assert status["placement"]["assignments"] == assignments
        assert any("untrusted key" in r["why"] for r in status["rejected"])
        assert torch.equal(remote.generate(ids, max_new_tokens=20, do_sample=False), expected)
    assert all(n.alive() for n in [*nodes, third, standby])
