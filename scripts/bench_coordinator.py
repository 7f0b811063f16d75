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

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--algorithm", default="milp", choices=["milp", "ahp", "gma", "petals", "swarm"])
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    if not 2 <= args.nodes <= 8:
        parser.error("--nodes must be 2..8 on one machine")

    import torch
    from swarmnode.client import ClientConfig, DistributedModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarmnode.dht import start_dht
    from swarmnode.local_swarm import LocalSwarm
    from swarmnode.model_prep import prepare_smollm2
    from swarmnode.records import TAKEOVER_BOUND, model_prefix
    from swarmnode.runtime.checkpoint import Checkpoint
    from swarmnode.swarm_state import read_state

    model_dir = prepare_smollm2()
    checkpoint = Checkpoint(model_dir)
    prefix, num_blocks = model_prefix(checkpoint.name), checkpoint.num_blocks
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = local.generate(ids, max_new_tokens=args.tokens, do_sample=False)

    with LocalSwarm(model_dir) as swarm:
        swarm.start_bootstrap()
        holder = swarm.start_coordinator(extra=["--algorithm", args.algorithm, "--time-limit", "5"])
        swarm.wait_for(holder, r"holding the coordinator lease", 60)
        standby = swarm.start_coordinator(extra=["--algorithm", args.algorithm, "--time-limit", "5"])
        trusted = swarm.trusted_coordinators()
        watcher = start_dht(swarm.initial_peers, client_mode=True)
        loop = asyncio.new_event_loop()

        def state():
            return loop.run_until_complete(read_state(watcher, prefix, num_blocks, trusted))

        def wait(check, timeout: float = 300.0) -> float:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if check(state()):
                    return time.monotonic()
                time.sleep(0.25)
            raise TimeoutError("the swarm did not reach the expected state")

        def placed(s, peers) -> bool:
            return s.placement is not None and set(s.placement.assignments) <= peers

        def serving(s, peers) -> bool:
            if not placed(s, peers) or min(s.replicas(num_blocks)) == 0:
                return False
            return all(p in s.nodes and s.nodes[p].serving == [s.placement.assignments[p]]
                       for p in s.placement.assignments)

        try:
            offers = [f"{600 + 60 * i}M" for i in range(args.nodes)]
            nodes = []
            for offer in offers:
                nodes.append(swarm.start_node(leftover_mem=offer, wait=False))
            last_join = time.monotonic()
            for node in nodes:
                node.peer_id = swarm.wait_for(node, r"^WAITING (\S+)", 120).group(1)
            peers = {n.peer_id for n in nodes}
            t_placement = wait(lambda s: placed(s, peers))
            t_serving = wait(lambda s: serving(s, peers))
            with DistributedModelForCausalLM.from_pretrained(
                    model_dir, initial_peers=swarm.initial_peers,
                    config=ClientConfig(trusted_coordinators=trusted)) as remote:
                first = remote.generate(ids, max_new_tokens=1, do_sample=False)
                t_first = time.monotonic()
                exact_before = bool(torch.equal(remote.generate(ids, max_new_tokens=args.tokens, do_sample=False),
                                                expected))
                version = state().placement.version
                victim = nodes[len(nodes) // 2]
                swarm.kill(victim, signal.SIGKILL)
                died = time.monotonic()
                peers.discard(victim.peer_id)
                t_new = wait(lambda s: s.placement is not None and s.placement.version > version
                             and victim.peer_id not in s.placement.assignments)
                t_healed = wait(lambda s: serving(s, peers))
                exact_after = bool(torch.equal(remote.generate(ids, max_new_tokens=args.tokens, do_sample=False),
                                               expected))
                coordinator_log = holder.log()
                swarm.kill(holder, signal.SIGKILL)
                lost = time.monotonic()
                swarm.wait_for(standby, r"holding the coordinator lease", 120)
                takeover = time.monotonic() - lost
                exact_takeover = bool(torch.equal(remote.generate(ids, max_new_tokens=args.tokens, do_sample=False),
                                                  expected))
            final = state()
        finally:
            watcher.shutdown()
            loop.close()
    result = {
        "nodes": args.nodes,
        "algorithm": args.algorithm,
        "join_to_placement_s": round(t_placement - last_join, 2),
        "join_to_serving_s": round(t_serving - last_join, 2),
        "join_to_first_token_s": round(t_first - last_join, 2),
        "death_to_placement_s": round(t_new - died, 2),
        "death_to_serving_s": round(t_healed - died, 2),
        "death_noticed_by": "pings" if "does not answer pings" in coordinator_log else "record expiry",
        "takeover_s": round(takeover, 2),
        "takeover_bound_s": TAKEOVER_BOUND,
        "placement_version": final.placement.version if final.placement else None,
        "first_token_ok": bool(torch.equal(first, expected[:, : ids.shape[1] + 1])),
        "exact_before": exact_before,
        "exact_after": exact_after,
        "exact_during_takeover": exact_takeover,
    }
    print(json.dumps(result))
    return 0 if result["exact_before"] and result["exact_after"] and result["exact_during_takeover"] else 1


if __name__ == "__main__":
    sys.exit(main())
