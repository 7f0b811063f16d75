"""A swarm across hosts: every peer in its own network namespace (`swarmnode.testing.netns`), on one bridge,
started with no address options at all. Nodes on another "machine" must be dialled at the addresses they
announce, so this checks the defaults (listen on all interfaces, announce non-loopback addresses) end to end:
a client on its own host generates exactly what local `transformers` does. Then hidden states go from host
to host (push): through a chain of three nodes on three hosts the tokens are exact and the client's link
carries each step once, and a node of the chain SIGKILLed mid-generation changes nothing in the output.
Last, a node behind NAT (its host behind a masquerading router: it can dial out, nobody can dial in) joins
with no address options, finds out it cannot be dialled, and serves through a relay (`swarmnode.relay`) in the
middle of the chain, exactly; when its relay is SIGKILLed mid-session the output is still exact and the node
reserves with the next relay.

The bed (`netns_bed`, in conftest) is shared by the run's tests across hosts; the running swarm (`netns_swarm`)
is this module's, for its tests to share. Without root or `ip netns` the fixture fails with the reason.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from swarmnode.dht import maddr_host
from swarmnode.testing.netns import NetnsSwarm, announced_maddrs, error_tail
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
    assert result.returncode == 0, error_tail(result.stderr)
    tokens = next(line[len("TOKENS "):] for line in result.stdout.splitlines() if line.startswith("TOKENS "))
    assert torch.equal(torch.tensor(json.loads(tokens)), expected)
    assert all(process.alive() for process in [bootstrap, coordinator, *nodes])


# the client for the chain: excludes the planned nodes (so the route is the three chain nodes); after `after`
# tokens it strikes (`strike`: "kill:PID" SIGKILLs that process group; "cut:NAMESPACE" takes that host's link
# down for `CUT_SECONDS` s; "none") and then lets the planned nodes in, to replace the node struck
CUT_SECONDS = 20
CHAIN_CLIENT = """
import json, os, signal, subprocess, sys
import torch
from transformers.generation.streamers import BaseStreamer
from swarmnode.client import ClientConfig, DistributedModelForCausalLM
from swarmnode.identity import load_trusted_keys

model_dir, key_path, ids, new_tokens, exclude, strike, after, *peers = sys.argv[1:]
config = ClientConfig(trusted_coordinators=load_trusted_keys([key_path]), exclude_peers=frozenset(json.loads(exclude)))
cut = None

class Striker(BaseStreamer):
    seen = -1
    def put(self, value):
        global cut
        self.seen += 1
        if strike != "none" and self.seen == int(after):
            print("HOPS_BEFORE " + json.dumps([h.hop.peer_id for h in model.active_session.hops]), flush=True)
            kind, target = strike.split(":")
            if kind == "kill":
                os.killpg(int(target), signal.SIGKILL)
            else:
                link = ["ip", "netns", "exec", target, "ip", "link", "set", "eth0"]
                subprocess.run([*link, "down"], check=True)
                cut = subprocess.Popen(["sh", "-c", f"sleep {CUT_SECONDS}; {' '.join(link)} up"])
            model.swarm.config.exclude_peers = frozenset()
    def end(self):
        pass
""".replace("{CUT_SECONDS}", str(CUT_SECONDS)) + """

ids = torch.tensor(json.loads(ids))
with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=peers, config=config) as model:
    with model.inference_session(max_length=ids.shape[1] + int(new_tokens)) as session:
        output = model.generate(ids, max_new_tokens=int(new_tokens), min_new_tokens=int(new_tokens),
                                do_sample=False, streamer=Striker())
        report = {"push": session.push, "hops": [[h.hop.peer_id, h.hop.start, h.hop.end] for h in session.hops],
                  "traffic": session.traffic, "retries": session.retries, "restarts": session.restarts,
                  "silent": [p for p, _ in session.silent_peers]}
print("TOKENS " + json.dumps(output.tolist()), flush=True)
print("REPORT " + json.dumps(report), flush=True)
if cut is not None:
    cut.wait()
"""
CHAIN = [(0, 10), (10, 20), (20, 30)]


@pytest.fixture(scope="module")
def chain(netns_swarm):
    """Three nodes on three more hosts, each serving a third of the blocks (`--blocks`, not planned)."""
    nodes = [netns_swarm.launch_node(a, b, name=f"chain-{a}") for a, b in CHAIN]
    for node in nodes:
        netns_swarm.wait_serving(node, 240)
    return nodes


def _run_chain_client(swarm, bed, model_dir, ids, new_tokens, *, strike="none", after=0, exclude=()):
    planned = [p.peer_id for p in swarm.node_processes() if "--blocks" not in p.args] + list(exclude)
    key_path = swarm.log_dir / "keys" / "swarm_key.pem"
    result = swarm.run_python(bed.host("client"), CHAIN_CLIENT,
                              [str(model_dir), str(key_path), json.dumps(ids.tolist()), str(new_tokens),
                               json.dumps(planned), strike, str(after), *swarm.initial_peers], timeout=180,
                              name="chain client")
    assert result.returncode == 0, error_tail(result.stderr)
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines()
             if line.split(" ", 1)[0] in ("TOKENS", "REPORT", "HOPS_BEFORE")}
    return torch.tensor(lines["TOKENS"]), lines["REPORT"], lines.get("HOPS_BEFORE")


def test_hidden_states_pushed_host_to_host_exact(netns_swarm, netns_bed, chain, model_dir, local_model,
                                                 chat_prompts):
    ids = chat_prompts[1]
    new_tokens = 12
    tokens, report, _ = _run_chain_client(netns_swarm, netns_bed, model_dir, ids, new_tokens)
    assert torch.equal(tokens, local_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                    do_sample=False))
    assert report["push"] is True
    assert report["hops"] == [[n.peer_id, a, b] for n, (a, b) in zip(chain, CHAIN)]
    # the client's link carried every token's hidden state up once, not once per hop, and down only the
    # last token's of each step
    once = (ids.shape[1] + new_tokens - 1) * 576 * 4
    assert report["traffic"]["up"] < 1.2 * once, report
    assert report["traffic"]["down"] == new_tokens * 576 * 4, report


def test_chain_link_cut_for_20_s_mid_generation_exact(netns_swarm, netns_bed, chain, model_dir, local_model,
                                                      chat_prompts):
    """The middle node's link goes down (`ip link set eth0 down` on its host) for 20 s after 5 tokens: the first
    node cannot push to it, the client finds it silent and fails over to a planned node, and the tokens are
    local transformers'. The link comes back and the node serves again."""
    ids = chat_prompts[0]
    new_tokens = 14
    host = netns_swarm.host_of(chain[1].name)
    try:
        tokens, report, before = _run_chain_client(netns_swarm, netns_bed, model_dir, ids, new_tokens,
                                                   strike=f"cut:{host.namespace}", after=5)
    finally:
        host.run("ip", "link", "set", "eth0", "up")
    assert before == [n.peer_id for n in chain]
    assert torch.equal(tokens, local_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                    do_sample=False))
    assert report["retries"] >= 1 and chain[1].peer_id not in {p for p, _, _ in report["hops"]}, report
    assert chain[1].alive()
    netns_swarm.wait_serving(chain[1], 60)  # reachable again, for the next test


def test_chain_node_killed_mid_generation_with_push_exact(netns_swarm, netns_bed, chain, model_dir, local_model,
                                                          chat_prompts):
    """The middle node of the chain is SIGKILLed after 6 tokens; a planned node replaces it, fed from the first
    node's kept outputs, and pushes on to the last: the tokens are local transformers'."""
    ids = chat_prompts[2]
    new_tokens = 16
    tokens, report, before = _run_chain_client(netns_swarm, netns_bed, model_dir, ids, new_tokens,
                                               strike=f"kill:{chain[1].pid}", after=6)
    assert before == [n.peer_id for n in chain]
    assert torch.equal(tokens, local_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                    do_sample=False))
    assert report["retries"] >= 1 and report["restarts"] == 0, report
    hops = report["hops"]
    assert hops[0] == [chain[0].peer_id, 0, 10] and hops[-1] == [chain[2].peer_id, 20, 30], hops
    assert chain[1].peer_id not in {p for p, _, _ in hops}
    assert not chain[1].alive()


@pytest.fixture(scope="module")
def nat(netns_swarm, netns_bed):
    """A relay (a second bootstrap peer, on its own host) and a node behind NAT serving blocks 10:20, started
    with no address options; its initial peers are the relay, then the swarm's bootstrap."""
    swarm = netns_swarm
    identities = swarm.log_dir / "identities"
    relay = swarm.spawn("relay", ["bootstrap", "--port", "0", "--initial-peers", swarm.initial_peers[0],
                                  "--identity", str(identities / "relay.key")])
    relay_maddr = swarm.wait_until(lambda: swarm.bootstrap_maddr(relay), 60, "the relay printing its address", relay)
    netns_bed.behind_nat("home")
    home = swarm.spawn("home", ["join", "--model", str(swarm.model), "--blocks", "10:20", "--num-threads", "1",
                                "--initial-peers", relay_maddr, "--initial-peers", swarm.initial_peers[0],
                                "--identity", str(identities / "home.key")])
    swarm.wait_serving(home, 240)
    return relay, home


def test_node_behind_nat_serves_through_a_relay_exact(netns_swarm, netns_bed, chain, nat, model_dir, local_model,
                                                      chat_prompts):
    """The node behind NAT learned it cannot be dialled, reserved with its first initial peer, and `status`
    says so; a client on another host generates through chain-0 -> home -> chain-20 exactly, with push (chain-0
    pushes to the node through its relay, the node pushes out directly)."""
    relay, home = nat
    swarm = netns_swarm
    assert "other peers cannot dial this node" in home.log(), home.log_tail()
    record = swarm.wait_status(lambda s: (s["nodes"].get(home.peer_id) or {}).get("relay") is not None,
                               timeout=60)["nodes"][home.peer_id]
    assert record["relayed"] is True and record["relay"] == relay.peer_id, record
    from swarmnode.cli.status import status_text
    from swarmnode.naming import short_id

    assert f"[relayed via {short_id(relay.peer_id)}]" in status_text(swarm.status())
    # nobody dials the node directly: a TCP connection to it from the bed fails (the router drops it)
    home_host = netns_bed.hosts["home"]
    probe = swarm.host_of("client").run("python3", "-c", (
        "import socket,sys; s=socket.socket(); s.settimeout(2); print(s.connect_ex((sys.argv[1], 9)))"),
        home_host.address, check=False)
    assert probe.stdout.strip() not in ("0", ""), probe

    ids = chat_prompts[0]
    new_tokens = 10
    tokens, report, _ = _run_chain_client(swarm, netns_bed, model_dir, ids, new_tokens, exclude=[chain[1].peer_id])
    assert torch.equal(tokens, local_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                    do_sample=False))
    assert report["push"] is True
    assert report["hops"] == [[chain[0].peer_id, 0, 10], [home.peer_id, 10, 20], [chain[2].peer_id, 20, 30]], report
    assert "relaying for" in relay.log(), relay.log_tail()


def test_relay_killed_mid_session_exact_and_node_moves_to_next_relay(netns_swarm, netns_bed, chain, nat, model_dir,
                                                                    local_model, chat_prompts):
    """The node's relay is SIGKILLed after 5 tokens: the session fails over (the tokens are local
    transformers'), nothing waits past a step timeout, and the node reserves with its next initial peer (the
    bootstrap), announcing it, so it can be reached again."""
    relay, home = nat
    swarm = netns_swarm
    bootstrap = next(p for p in swarm.processes if p.args[0] == "bootstrap" and p is not relay)
    ids = chat_prompts[1]
    new_tokens = 12
    tokens, report, before = _run_chain_client(swarm, netns_bed, model_dir, ids, new_tokens,
                                               exclude=[chain[1].peer_id], strike=f"kill:{relay.pid}", after=5)
    assert before == [chain[0].peer_id, home.peer_id, chain[2].peer_id]
    assert torch.equal(tokens, local_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                    do_sample=False))
    assert report["retries"] >= 1, report
    assert not relay.alive()
    record = swarm.wait_status(lambda s: (s["nodes"].get(home.peer_id) or {}).get("relay") == bootstrap.peer_id,
                               timeout=60)["nodes"][home.peer_id]
    assert record["relayed"] is True
    assert "stopped relaying for this node" in home.log(), home.log_tail()
    assert swarm.reader.info(home.peer_id)["spans"] == [
        {"start": 10, "end": 20, "cache_tokens": record["cache_tokens"], "free_cache_tokens": record["cache_tokens"]}]
