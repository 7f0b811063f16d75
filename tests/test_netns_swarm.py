"""A swarm across hosts: every peer in its own network namespace (`swarmnode.testing.netns`), on one bridge,
started with no address options at all. Nodes on another "machine" must be dialled at the addresses they
announce, so this checks the defaults (listen on all interfaces, announce non-loopback addresses) end to end:
a client on its own host generates exactly what local `transformers` does.

The bed (`netns_bed`) and the running swarm (`netns_swarm`) are module fixtures, for more tests across hosts
(link shaping, peer-to-peer transfers) to share. Without root or `ip netns` the fixture fails with the reason.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from swarmnode.dht import maddr_host
from swarmnode.testing.netns import NetnsBed, NetnsSwarm, announced_maddrs
from swarmnode.testing.swarm_reader import settled

pytestmark = pytest.mark.swarm

OFFERS = ["900M", "950M", "1000M"]
# what a node and a coordinator log once their DHT peer is up: its peer id and the addresses it announces
_ANNOUNCED_RE = re.compile(r"joined the DHT as (\S+), listening on (.+)$", re.MULTILINE)

# the client: a separate Python process on its own host; prints the generated token ids as JSON
CLIENT = """
import json, sys
import torch
from swarmnode.client import ClientConfig, DistributedModelForCausalLM
from swarmnode.identity import load_trusted_keys

model_dir, key_path, ids, new_tokens, *peers = sys.argv[1:]
config = ClientConfig(trusted_coordinators=load_trusted_keys([key_path]))
with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=peers, config=config) as model:
    output = model.generate(torch.tensor(json.loads(ids)), max_new_tokens=int(new_tokens), do_sample=False)
print("TOKENS " + json.dumps(output.tolist()), flush=True)
"""


@pytest.fixture(scope="module")
def netns_bed():
    """A bed of network namespaces for this module's tests; deleted when they end, passed or failed."""
    with NetnsBed() as bed:
        yield bed


@pytest.fixture(scope="module")
def netns_swarm(netns_bed, model_dir, tmp_path_factory):
    """A bootstrap, a coordinator and three planned nodes, each on its own host, serving the model."""
    swarm = NetnsSwarm(model_dir, log_dir=tmp_path_factory.mktemp("netns-swarm"), bed=netns_bed)
    with swarm:
        swarm.start_bootstrap()
        coordinator = swarm.start_coordinator(extra=["--time-limit", "5"], wait=False)
        nodes = [swarm.launch_node(leftover_mem=offer, name=f"node-{i}") for i, offer in enumerate(OFFERS)]
        swarm.wait_lease(coordinator, 120)
        for node in nodes:
            swarm.wait_serving(node, 240)
        swarm.wait_status(lambda s: settled(s, {n.peer_id for n in nodes}), timeout=120)
        yield swarm


def test_swarm_across_hosts_with_default_addresses(netns_swarm, netns_bed, model_dir, local_model, chat_prompts):
    swarm = netns_swarm
    bootstrap = next(p for p in swarm.processes if p.args[0] == "bootstrap")
    nodes = swarm.node_processes()
    coordinator = next(p for p in swarm.processes if p.args[0] == "coordinate")
    for process in swarm.processes:  # nobody was told an address; only the bootstrap a port (0: any free one)
        told = {"--host", "--announce-host"} if process is bootstrap else {"--host", "--announce-host", "--port"}
        assert not told & set(process.args), process.args

    # the bootstrap printed a multiaddr per address of its host: its bed address, then loopback
    printed = [line.split()[1] for line in bootstrap.log().splitlines() if line.startswith("--initial-peers ")]
    assert [maddr_host(m) for m in printed] == [swarm.host_of(bootstrap.name).address, "127.0.0.1"], printed
    assert swarm.initial_peers == printed[:1]

    # every peer announces its host's bed address and nothing else, never loopback to a swarm off loopback:
    # as each logs it (its daemon's own list), and as the swarm's libp2p peer store has it
    for process in [coordinator, *nodes]:
        logged = _ANNOUNCED_RE.findall(process.log())
        assert logged and logged[-1][0] == process.peer_id, process.log_tail()
        assert {maddr_host(m) for m in logged[-1][1].split(", ")} == {swarm.host_of(process.name).address}, logged
    for process in [bootstrap, coordinator, *nodes]:
        announced = swarm.wait_until(lambda p=process: announced_maddrs(swarm.reader, p.peer_id), 30,
                                     f"the addresses {process.name} announces")
        assert {maddr_host(m) for m in announced} == {swarm.host_of(process.name).address}, \
            (process.name, announced)

    # a client on a host of its own generates what local transformers does
    ids = chat_prompts[0]
    new_tokens = 16
    expected = local_model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    key_path = swarm.log_dir / "keys" / "swarm_key.pem"
    result = swarm.run_python(netns_bed.host("client"), CLIENT,
                              [str(model_dir), str(key_path), json.dumps(ids.tolist()), str(new_tokens),
                               *swarm.initial_peers], timeout=120, name="client")
    assert result.returncode == 0, result.stderr[-4000:]
    tokens = next(line[len("TOKENS "):] for line in result.stdout.splitlines() if line.startswith("TOKENS "))
    assert torch.equal(torch.tensor(json.loads(tokens)), expected)
    assert all(process.alive() for process in [bootstrap, coordinator, *nodes])
