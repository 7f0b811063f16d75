"""The swarm outlives its bootstrap peer: once formed, nodes, the coordinator and new clients and nodes that
know any live peer keep working. Real processes on 127.0.0.1; the truth is local transformers."""

from __future__ import annotations

import signal

import pytest
import torch

from swarmnode.client import ClientConfig, DistributedModelForCausalLM
from swarmnode.testing.local_swarm import group_members

pytestmark = pytest.mark.swarm


def test_swarm_survives_the_loss_of_its_bootstrap_peer(swarm_factory, model_dir, local_model, chat_prompts):
    swarm = swarm_factory()
    swarm.start_bootstrap()
    coordinator = swarm.start_coordinator(extra=["--algorithm", "petals"])
    nodes = [swarm.start_node(leftover_mem="950M", wait=False, name=f"node-{i}") for i in range(2)]
    for node in nodes:
        swarm.wait_serving(node, 240)
    bootstrap = swarm.processes[0]
    config = ClientConfig(trusted_coordinators=swarm.trusted_coordinators())
    ids = chat_prompts[0]
    expected = local_model.generate(ids, max_new_tokens=16, do_sample=False)
    with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                     config=config) as before:
        swarm.kill(bootstrap, signal.SIGKILL)
        bootstrap.popen.wait(10)
        swarm.wait_until(lambda: not group_members(bootstrap.pid), 30, "end of the bootstrap's p2pd")
        # a client that joined through the bootstrap keeps generating
        assert torch.equal(before.generate(ids, max_new_tokens=16, do_sample=False), expected)

    # new clients and nodes join through any live peer
    swarm.initial_peers = [swarm.maddr_of(nodes[0])]
    with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                     config=config) as after:
        assert torch.equal(after.generate(ids, max_new_tokens=16, do_sample=False), expected)
        third = swarm.start_node(leftover_mem="950M", wait=False, name="node-late")
        swarm.wait_serving(third, 240)  # only a placement from the coordinator, still up, makes it serve
        assert torch.equal(after.generate(chat_prompts[1], max_new_tokens=16, do_sample=False),
                           local_model.generate(chat_prompts[1], max_new_tokens=16, do_sample=False))
    assert coordinator.alive() and all(n.alive() for n in [*nodes, third])
