"""`coordinate --algorithm hexgen2` on a live swarm: the coordinator splits `join --leftover-mem` nodes into
prefill and decode nodes from their measured speeds and memory (HexGen-2 adapted to swarm nodes,
`planner.algorithms.hexgen2_swarm`), the nodes take the phases and ranges it publishes, and a client's sessions run their
prompts on the prefill nodes and their generation on the decode nodes, exact against local `transformers`.
When a node is lost and the rest cannot hold both phases, the coordinator falls back to a placement without
phases and the swarm keeps generating the same text."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from swarmnode.client import DistributedModelForCausalLM

pytestmark = pytest.mark.swarm

# Each offer holds 15-29 blocks of SmolLM2's 30 with room for KV cache (a tighter one leaves a node a few hundred
# tokens of cache once its blocks are loaded): two nodes make one copy of the model, four a prefill and a decode group.
OFFER = "900M"


def _settled(status: dict, peers: set[str]) -> bool:
    placement = status["placement"]
    if placement is None or placement["algorithm"] != "hexgen2" or set(placement["assignments"]) != peers:
        return False
    nodes = status["nodes"]
    return all(p in nodes and nodes[p]["phase"] == placement["phases"][p]
               and nodes[p]["serving"] == [list(placement["assignments"][p])] for p in peers)


def test_coordinator_plans_phases_nodes_follow_and_sessions_split(swarm_factory, model_dir, local_model,
                                                                  chat_prompts):
    swarm = swarm_factory()
    swarm.start_bootstrap()
    swarm.start_coordinator(extra=["--algorithm", "hexgen2", "--time-limit", "5", "--workload", "512:32"])
    nodes = [swarm.launch_node(leftover_mem=OFFER, name=f"node-{i}") for i in range(3)]
    pinned = swarm.launch_node(leftover_mem=OFFER, name="node-pinned-decode", extra=["--phase", "decode"])
    nodes.append(pinned)
    for node in nodes:
        swarm.wait_serving(node, 240)
    peers = {n.peer_id for n in nodes}
    status = swarm.wait_status(lambda s: _settled(s, peers), timeout=180)
    placement = status["placement"]
    for peer in peers:
        assert 15 <= status["nodes"][peer]["max_blocks"] < 30, status["nodes"][peer]
        assert status["nodes"][peer]["prefill_throughput"] > status["nodes"][peer]["block_throughput"] > 0
    phases = placement["phases"]
    assert sorted(phases.values()) == ["decode", "decode", "prefill", "prefill"], placement
    assert phases[pinned.peer_id] == "decode" and status["nodes"][pinned.peer_id]["phase_pinned"]
    for phase in ("prefill", "decode"):  # each phase's nodes hold the whole model once
        spans = sorted(tuple(placement["assignments"][p]) for p in peers if phases[p] == phase)
        assert spans[0][0] == 0 and spans[-1][1] == 30 and spans[0][1] == spans[1][0], spans
    assert placement["kv_links"] and all(phases[s] == "prefill" and all(phases[d] == "decode" for d in t)
                                         for s, t in placement["kv_links"].items())
    assert "hexgen2" in placement["reason"] and "prefill" in placement["reason"]
    text = subprocess.run([sys.executable, "-m", "swarmnode", "status", "--initial-peers", *swarm.initial_peers,
                           "--model", str(model_dir)], capture_output=True, text=True, timeout=120, env=swarm.env)
    assert "phases (HexGen-2)" in text.stdout and "KV cache" in text.stdout, text.stdout + text.stderr
    assert text.stdout.count("[prefill]") == 2 and text.stdout.count("[decode]") == 2, text.stdout

    decode_nodes = {p for p in peers if phases[p] == "decode"}
    with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers) as model:
        for ids in chat_prompts[:2]:
            with model.inference_session(max_length=ids.shape[1] + 12) as session:
                ours = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
                assert session.prefills == 1, "a swarm with prefill nodes serving every block splits sessions"
                assert {h.hop.peer_id for h in session.hops} <= decode_nodes
            truth = local_model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
            assert torch.equal(ours, truth)
    for node in nodes:
        if phases[node.peer_id] == "prefill":
            assert "serving the prefill phase" in node.log() and "handed blocks" in node.log(), node.log_tail()

    # a decode node dies: three nodes cannot hold two copies, so the coordinator falls back to a placement without
    # phases (prefill-only nodes would refuse generation); every node serves both phases and the text is the same
    gone = next(n for n in nodes if phases[n.peer_id] == "decode" and n is not pinned)
    swarm.kill(gone)
    left = peers - {gone.peer_id}

    def colocated(s: dict) -> bool:
        placement = s["placement"]
        return (placement["version"] > status["placement"]["version"] and not placement["phases"]
                and set(placement["assignments"]) == left
                and all(s["nodes"][p]["phase"] == ("decode" if p == pinned.peer_id else "both")
                        and s["nodes"][p]["serving"] == [list(placement["assignments"][p])] for p in left))

    after = swarm.wait_status(colocated, timeout=180)
    assert "no two-phase plan" in after["placement"]["reason"], after["placement"]["reason"]
    with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers) as model:
        ids = chat_prompts[0]
        with model.inference_session(max_length=ids.shape[1] + 12) as session:
            ours = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
            assert session.prefills == 0
        assert torch.equal(ours, local_model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False))
