"""How fast the planned swarm forms and heals: time from the last `join` to serving, and from a node's death
to a new placement being served. Prints one JSON line.

A bootstrap peer, a coordinator and `--nodes` nodes offering different memory (no `--blocks`) start as real
processes on 127.0.0.1. Measured:
- `join_to_placement_s`: last `join` started -> a placement covering every block is published;
- `join_to_serving_s`: ... -> every node serves exactly its assignment (ONLINE records);
- `join_to_first_token_s`: ... -> a client got its first generated token through the swarm;
- `death_to_placement_s`: one node SIGKILLed -> a placement without it is published;
- `death_to_serving_s`: ... -> every remaining node serves its new assignment and no block is uncovered;
- `takeover_s`: the lease-holding coordinator SIGKILLed -> the standby holds the lease (bound: `takeover_bound_s`).
Also how the death was noticed (pings vs record expiry) and whether outputs matched local transformers.

    .venv/bin/python scripts/bench_coordinator.py [--nodes 3] [--algorithm milp]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swarmnode.planner.registry import PLACEMENT_ALGORITHMS, REGISTRY

if TYPE_CHECKING:
    from swarmnode.swarm_state import SwarmState
    from swarmnode.testing.local_swarm import LocalSwarm, Process

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--algorithm", default="milp", choices=PLACEMENT_ALGORITHMS)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    if not 2 <= args.nodes <= 8:
        parser.error("--nodes must be 2..8 on one machine")
    return args


@dataclass
class _Reference:
    """The prompt and what local transformers generates from it greedily: what the swarm must reproduce."""

    ids: Any
    expected: Any
    tokens: int


@dataclass
class _Measurements:
    """What the phases record: ``time.monotonic()`` instants, the takeover's duration, and whether the swarm's
    outputs matched the reference at each point."""

    last_join: float = 0.0
    placed_at: float = 0.0
    serving_at: float = 0.0
    first: Any = None
    first_token_at: float = 0.0
    exact_before: bool = False
    died_at: float = 0.0
    replaced_at: float = 0.0
    healed_at: float = 0.0
    exact_after: bool = False
    coordinator_log: str = ""
    takeover: float = 0.0
    exact_takeover: bool = False
    placement_version: int | None = None


def _reference(model_dir: Any, tokens: int) -> _Reference:
    """Tokenise the benchmark's chat prompt and generate ``tokens`` tokens from it with the local model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = local.generate(ids, max_new_tokens=tokens, do_sample=False)
    return _Reference(ids, expected, tokens)


def _matches(output: Any, expected: Any) -> bool:
    import torch

    return bool(torch.equal(output, expected))


def _exact(remote: Any, ref: _Reference) -> bool:
    """Whether a full greedy generation through the swarm equals the local one."""
    return _matches(remote.generate(ref.ids, max_new_tokens=ref.tokens, do_sample=False), ref.expected)


class _SwarmWatch:
    """Reads the swarm's state from the DHT as a client peer of its own and waits for conditions on it."""

    def __init__(self, dht: Any, prefix: str, num_blocks: int, trusted: frozenset[str]) -> None:
        from swarmnode.swarm_state import read_state

        self._read_state = read_state
        self.dht = dht
        self.prefix = prefix
        self.num_blocks = num_blocks
        self.trusted = trusted
        self.loop = asyncio.new_event_loop()

    def state(self) -> SwarmState:
        reading = self._read_state(self.dht, self.prefix, self.num_blocks, self.trusted)
        return self.loop.run_until_complete(reading)

    def wait(self, check: Callable[[SwarmState], bool], timeout: float = 300.0) -> float:
        """Poll the state every 0.25 s until ``check`` holds; returns the instant it did."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check(self.state()):
                return time.monotonic()
            time.sleep(0.25)
        raise TimeoutError("the swarm did not reach the expected state")

    @staticmethod
    def placed(s: SwarmState, peers: set[str]) -> bool:
        """A placement is published and assigns blocks to none but ``peers``."""
        return s.placement is not None and set(s.placement.assignments) <= peers

    def serving(self, s: SwarmState, peers: set[str]) -> bool:
        """:meth:`placed`, every block is served, and every assigned node serves exactly its assignment."""
        if not self.placed(s, peers) or min(s.replicas(self.num_blocks)) == 0:
            return False
        return all(p in s.nodes and s.nodes[p].serving == [s.placement.assignments[p]]
                   for p in s.placement.assignments)

    def close(self) -> None:
        self.dht.shutdown()
        self.loop.close()


def _start_swarm(swarm: LocalSwarm, algorithm: str) -> tuple[Process, Process]:
    """The bootstrap peer, the coordinator that takes the lease, then a standby; returns both coordinators."""
    swarm.start_bootstrap()
    # a 5 s solve for the algorithms that take a time limit (the others refuse the flag)
    extra = ["--algorithm", algorithm, *(["--time-limit", "5"] if "time_limit" in REGISTRY[algorithm].accepts else [])]
    holder = swarm.start_coordinator(extra=extra)
    swarm.wait_lease(holder, 60)
    standby = swarm.start_coordinator(extra=extra)
    return holder, standby


def _time_join(swarm: LocalSwarm, watch: _SwarmWatch, count: int,
               m: _Measurements) -> tuple[list[Process], set[str]]:
    """Start ``count`` nodes offering different memory side by side; record the last join, the first placement
    of only them, and the moment all serve it. Returns the nodes and their peer ids."""
    offers = [f"{600 + 60 * i}M" for i in range(count)]
    nodes = [swarm.start_node(leftover_mem=offer, wait=False) for offer in offers]
    m.last_join = time.monotonic()
    peers = {n.peer_id for n in nodes}
    m.placed_at = watch.wait(lambda s: watch.placed(s, peers))
    m.serving_at = watch.wait(lambda s: watch.serving(s, peers))
    return nodes, peers


def _time_first_token(remote: Any, ref: _Reference, m: _Measurements) -> None:
    """One token through the swarm (recorded with its instant), then a full generation compared with the
    reference."""
    m.first = remote.generate(ref.ids, max_new_tokens=1, do_sample=False)
    m.first_token_at = time.monotonic()
    m.exact_before = _exact(remote, ref)


def _time_node_death(swarm: LocalSwarm, watch: _SwarmWatch, remote: Any, ref: _Reference, holder: Process,
                     nodes: list[Process], peers: set[str], m: _Measurements) -> None:
    """SIGKILL the middle node; record when a newer placement without it is published and when the remaining
    nodes serve it, check the outputs again, and keep the coordinator's log (how it noticed the death)."""
    version = watch.state().placement.version
    victim = nodes[len(nodes) // 2]
    swarm.kill(victim, signal.SIGKILL)
    m.died_at = time.monotonic()
    peers.discard(victim.peer_id)
    m.replaced_at = watch.wait(lambda s: s.placement is not None and s.placement.version > version
                               and victim.peer_id not in s.placement.assignments)
    m.healed_at = watch.wait(lambda s: watch.serving(s, peers))
    m.exact_after = _exact(remote, ref)
    m.coordinator_log = holder.log()


def _time_takeover(swarm: LocalSwarm, holder: Process, standby: Process, remote: Any, ref: _Reference,
                   m: _Measurements) -> None:
    """SIGKILL the lease holder; record how long until the standby holds the lease, then check the outputs."""
    swarm.kill(holder, signal.SIGKILL)
    lost = time.monotonic()
    swarm.wait_lease(standby, 120)
    m.takeover = time.monotonic() - lost
    m.exact_takeover = _exact(remote, ref)


def _report(args: argparse.Namespace, m: _Measurements, ref: _Reference) -> dict[str, Any]:
    from swarmnode.records import TAKEOVER_BOUND

    return {
        "nodes": args.nodes,
        "algorithm": args.algorithm,
        "join_to_placement_s": round(m.placed_at - m.last_join, 2),
        "join_to_serving_s": round(m.serving_at - m.last_join, 2),
        "join_to_first_token_s": round(m.first_token_at - m.last_join, 2),
        "death_to_placement_s": round(m.replaced_at - m.died_at, 2),
        "death_to_serving_s": round(m.healed_at - m.died_at, 2),
        "death_noticed_by": "pings" if "does not answer pings" in m.coordinator_log else "record expiry",
        "takeover_s": round(m.takeover, 2),
        "takeover_bound_s": TAKEOVER_BOUND,
        "placement_version": m.placement_version,
        "first_token_ok": _matches(m.first, ref.expected[:, : ref.ids.shape[1] + 1]),
        "exact_before": m.exact_before,
        "exact_after": m.exact_after,
        "exact_during_takeover": m.exact_takeover,
    }


def main() -> int:
    args = _parse_args()

    from swarmnode.client import ClientConfig, DistributedModelForCausalLM
    from swarmnode.dht import start_dht
    from swarmnode.model_prep import prepare_smollm2
    from swarmnode.records import model_prefix
    from swarmnode.runtime.checkpoint import Checkpoint
    from swarmnode.testing.local_swarm import LocalSwarm

    model_dir = prepare_smollm2()
    checkpoint = Checkpoint(model_dir)
    prefix, num_blocks = model_prefix(checkpoint.name), checkpoint.num_blocks
    ref = _reference(model_dir, args.tokens)
    m = _Measurements()

    with LocalSwarm(model_dir) as swarm:
        holder, standby = _start_swarm(swarm, args.algorithm)
        trusted = swarm.trusted_coordinators()
        watch = _SwarmWatch(start_dht(swarm.initial_peers, client_mode=True), prefix, num_blocks, trusted)
        try:
            nodes, peers = _time_join(swarm, watch, args.nodes, m)
            with DistributedModelForCausalLM.from_pretrained(
                    model_dir, initial_peers=swarm.initial_peers,
                    config=ClientConfig(trusted_coordinators=trusted)) as remote:
                _time_first_token(remote, ref, m)
                _time_node_death(swarm, watch, remote, ref, holder, nodes, peers, m)
                _time_takeover(swarm, holder, standby, remote, ref, m)
            final = watch.state()
            m.placement_version = final.placement.version if final.placement else None
        finally:
            watch.close()
    result = _report(args, m, ref)
    print(json.dumps(result))
    return 0 if result["exact_before"] and result["exact_after"] and result["exact_during_takeover"] else 1


if __name__ == "__main__":
    sys.exit(main())
