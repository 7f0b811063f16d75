"""Measured links across hosts: four planned nodes, each on a host of its own (`swarmnode.testing.netns`), one of
them behind a link shaped to 20 Mbit/s. The links the nodes measure and announce must read within 0.6x-1.5x
of 20 Mbit/s where they cross the shaped link and faster elsewhere; the coordinator must not route every
request through the shaped node, and its own cost model, evaluated here from the same records, must say
that plans which do are clearly worse, because of that link.

The workload the coordinator plans for. Its model (`planner.costs.roofline`) charges a link, per output token,
the prompt's share of activations, (prompt + output - 1) / output of them, 576 x 4 bytes each for
SmolLM2-135M in float32. With Helix's default lengths (763:232) a 20 Mbit/s link carries about 250 output
tokens/s, while these CPU nodes (about 200 tokens/s through one block with one thread, 500 with two; 13-20
blocks each) serve at most about 40 between the four of them: no plan can be limited by the link, so it
could not change a placement (`test_link_changes` pins these numbers). Shaping the link down to where it
would bind (under about 1 Mbit/s) is no way out: between probes, the swarm's other traffic (DHT records
stored and read, pings) crosses each node's link at about 0.4 Mbit/s each way here, so such a link is mostly
taken and its node misses the coordinator's pings. So the coordinator plans for long prompts and short
answers (`--workload 4096:32`): each output token then costs 129 activations per link, and 20 Mbit/s
carries about 8 output tokens/s, less than one node serves. Note that for nodes with a measured speed the
model does not charge the prompt's compute (a node holding j blocks serves `block_throughput / j`), so with
this workload it counts links for more, relative to compute, than these CPU nodes would see.

The shaped node computes with two threads, so it is the fastest node: without its link measured, the best
plans route every request through it (the coordinator's first placement, made before any link is measured,
usually does); with it, they serve a fraction of what the others do.
The coordinator plans with `--min-replicas 1` (throughput alone, as Helix does): with its floor of two
replicas, no block has a single holder wherever the offers hold the model twice, and no plan would route
every request through any one node.

The bed is the session's (`netns_bed`); this module's hosts are named `links-*` and no other module uses them.
Every process is ended when the test ends, passed or failed.
"""

from __future__ import annotations

import itertools
import time

import pytest

from swarmnode.coordinator.cluster_view import cluster_from_records
from swarmnode.coordinator.service import model_info_from_checkpoint
from swarmnode.planner.flow_graph import evaluate
from swarmnode.runtime.checkpoint import Checkpoint
from swarmnode.swarm_state import read_nodes
from swarmnode.testing.netns import NetnsSwarm

pytestmark = pytest.mark.swarm

SHAPED_MBPS, SHAPED_RATE = 20.0, "20mbit"
LOW, HIGH = 0.6, 1.5  # how close a reading must be to the shaped rate
WORKLOAD = "4096:32"
OFFER = "840M"  # 13-20 blocks each, as the nodes' measured overheads leave
NAMES = ("shaped", "a", "b", "c")


class LinksSwarm(NetnsSwarm):
    """A NetnsSwarm whose hosts are this module's own (`links-<process>`)."""

    def host_of(self, name: str):
        return self.bed.host(f"links-{name.replace('~', '-')}")


def single_holders(placement: dict[str, tuple[int, int]], num_blocks: int) -> dict[int, str]:
    """Block -> the node that alone holds it."""
    holders = {b: [p for p, (s, e) in placement.items() if s <= b < e] for b in range(num_blocks)}
    return {b: h[0] for b, h in holders.items() if len(h) == 1}


def through(node: str, others: list[str], capacity: dict[str, int], speed: dict[str, float],
            num_blocks: int, count: int) -> list[dict[str, tuple[int, int]]]:
    """Placements that route every request through `node`: it alone holds a window of blocks, and every other
    node holds, whole, the part before the window or the part after it. The `count` best by the throughput
    bound that ignores links (the smallest, over the three parts, of its holders' `speed / blocks held`)."""
    scored = []
    for width in range(1, min(capacity[node], num_blocks) + 1):
        for start in range(num_blocks - width + 1):
            end = start + width
            for sides in itertools.product((0, 1), repeat=len(others)):
                before = [n for n, side in zip(others, sides) if side == 0]
                after = [n for n, side in zip(others, sides) if side == 1]
                if bool(before) != (start > 0) or bool(after) != (end < num_blocks) or \
                        any(capacity[n] < start for n in before) or any(capacity[n] < num_blocks - end for n in after):
                    continue
                parts = [speed[node] / width]
                parts += [sum(speed[n] / start for n in before)] if before else []
                parts += [sum(speed[n] / (num_blocks - end) for n in after)] if after else []
                plan = {node: (start, end), **{n: (0, start) for n in before}, **{n: (end, num_blocks) for n in after}}
                scored.append((min(parts), plan))
    scored.sort(key=lambda item: -item[0])
    return [plan for _, plan in scored[:count]]


def test_measured_links_and_a_placement_around_the_shaped_link(netns_bed, model_dir, tmp_path_factory):
    began = time.monotonic()
    swarm = LinksSwarm(model_dir, log_dir=tmp_path_factory.mktemp("netns-links"), bed=netns_bed)
    hosts = {name: swarm.host_of(f"node-{name}") for name in NAMES}
    with swarm:
        netns_bed.shape(hosts["shaped"], SHAPED_RATE)
        swarm.start_bootstrap()
        coordinator = swarm.start_coordinator(name="coordinator", wait=False, extra=[
            "--time-limit", "5", "--min-replicas", "1", "--workload", WORKLOAD])
        nodes = {name: swarm.launch_node(leftover_mem=OFFER, name=f"node-{name}",
                                         extra=["--num-threads", "2"] if name == "shaped" else [])
                 for name in NAMES}
        peer = {name: process.peer_id for name, process in nodes.items()}
        name_of = {p: name for name, p in peer.items()}
        swarm.wait_lease(coordinator, 120)

        # --- the readings: every node's link to every other, as announced in its record ------------------------
        def expected(a: str, b: str) -> tuple[float, float]:
            if "shaped" in (a, b):
                return LOW * SHAPED_MBPS, HIGH * SHAPED_MBPS
            return HIGH * SHAPED_MBPS, float("inf")  # unshaped: faster than the shaped link could read

        def node_records() -> dict:
            reader = swarm.reader
            return reader.loop.run(read_nodes(reader.dht, reader.prefix), 30)

        def readings() -> dict[tuple[str, str], float | None]:
            records = node_records()
            links = {a: records[peer[a]].links if peer[a] in records else {} for a in NAMES}
            return {(a, b): links[a][peer[b]].bandwidth_mbps if peer[b] in links[a] else None
                    for a in NAMES for b in NAMES if a != b}

        deadline = time.monotonic() + 120
        while True:
            last = readings()
            if all(v is not None and expected(*pair)[0] <= v <= expected(*pair)[1] for pair, v in last.items()):
                break
            assert time.monotonic() < deadline and all(p.alive() for p in nodes.values()), \
                f"links not read as shaped within 120 s: {last}"
            time.sleep(2.0)
        measured_after = time.monotonic() - began

        # --- the placement: no block that only the shaped node holds -------------------------------------------
        num_blocks = Checkpoint(model_dir).num_blocks

        def placed_around_shaped():
            """The placement with the records it is judged by, read together: a node that measured its overhead
            again once serving may announce fewer blocks than it was placed with, and the coordinator then
            re-plans (`coordinator.events.RangeTooLarge`); only a placement that fits the records stands."""
            placement = swarm.reader.placement()
            if placement is None or not set(placement.assignments) <= set(name_of):
                return None
            ranges = {p: tuple(r) for p, r in placement.assignments.items()}
            records = {p: r for p, r in node_records().items() if p in name_of}
            if any(p not in records or end - start > records[p].max_blocks for p, (start, end) in ranges.items()):
                return None
            return (ranges, records) if peer["shaped"] not in single_holders(ranges, num_blocks).values() else None

        placed, records = swarm.wait_until(placed_around_shaped, 90, "a placement that fits the nodes' records and "
                                           "does not route every request through the shaped node",
                                           coordinator, period=1.0)

        # --- by the coordinator's own model, plans that route every request through it are clearly worse -----
        model = model_info_from_checkpoint(Checkpoint(model_dir))
        workload = tuple(float(x) for x in WORKLOAD.split(":"))
        cluster = cluster_from_records(model, records, workload=workload)
        # the same records with the shaped node's links unmeasured: as fast as the swarm's median link
        blind = cluster_from_records(model, {
            p: r.model_copy(update={"links": {o: m for o, m in r.links.items() if peer["shaped"] not in (p, o)}})
            for p, r in records.items()}, workload=workload)
        capacity = {n.id: n.max_blocks for n in cluster.nodes}
        speed = {p: r.block_throughput for p, r in records.items()}
        others = [peer[n] for n in NAMES if n != "shaped"]
        candidates = through(peer["shaped"], others, capacity, speed, num_blocks, count=10)
        assert candidates, capacity
        chosen = evaluate(cluster, placed).throughput
        alternatives = [(evaluate(blind, plan).throughput, evaluate(cluster, plan).throughput, plan)
                        for plan in candidates]
        best_blind, best_measured, best = max(alternatives, key=lambda item: item[0])
        figures = {"readings": last, "measured_after_s": round(measured_after, 1),
                   "placement": {name_of[p]: r for p, r in placed.items()},
                   "chosen_flow": chosen, "chosen_flow_blind": evaluate(blind, placed).throughput,
                   "through_shaped": {name_of[p]: r for p, r in best.items()},
                   "through_shaped_flow": best_measured, "through_shaped_flow_blind": best_blind}
        print(figures)
        # every such plan is worse by more than the 20% a fresh plan must gain before the coordinator moves blocks
        assert max(measured for _, measured, _ in alternatives) < 0.8 * chosen, figures
        # because of the shaped link: with it unmeasured, the best of them would serve far more
        assert best_blind > 1.25 * best_measured, figures
        assert all(p.alive() for p in [coordinator, *nodes.values()])
