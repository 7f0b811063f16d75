"""A private swarm of real processes: a bootstrap holding the owner's key, two invited nodes serving the whole
SmolLM2 model, invited clients, and peers that were never invited or were revoked (`swarmnode.admission`).

What is checked, against local `transformers` where text comes out: an invited client generates exactly; a
peer without an invitation cannot join the DHT, and its RPCs to members are refused before any work; a member
admitted as a client cannot call what nodes call, and its node records are ignored (never routed to or
planned); bad invitations end `join` with the reason; a node the owner revokes (`swarmnode revoke`, the real
command) is left by an open session within a heartbeat, the output still exact, and its own calls are refused.
The revocation comes last: it changes the swarm for good.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
import torch

from swarmnode.admission import Admission, Role
from swarmnode.records import HEARTBEAT_INTERVAL

pytestmark = pytest.mark.swarm

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def private(model_dir, tmp_path_factory):
    from swarmnode.testing.local_swarm import LocalSwarm

    with LocalSwarm(model_dir, log_dir=tmp_path_factory.mktemp("private-swarm"), private=True) as swarm:
        swarm.start_bootstrap()
        nodes = [swarm.launch_node(0, 30, name=name) for name in ("node-a", "node-b")]
        for node in nodes:
            swarm.wait_serving(node)
        yield swarm, nodes


def client_admission(swarm, name: str, roles=("client",)) -> Admission:
    identity = swarm.identity_path(name)
    invitation = swarm.invite(identity, list(roles), name=name)
    admission = Admission.load(Role.CLIENT if "client" in roles else None, invitation=str(invitation),
                               identity=str(identity))
    assert admission is not None
    return admission


def open_client(swarm, model_dir, admission):
    from swarmnode.client import DistributedModelForCausalLM

    return DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                       dtype=torch.float32, admission=admission)


async def call_unary(identity: str | None, maddr: str, peer_id: str, name: str, request=None, *,
                     streamed: bool = False):
    """Call RPC `name` of `peer_id` from a bare libp2p peer (no DHT) with `identity` (None: a fresh one): unary,
    or `streamed` (one message each way over a stream, as `rpc.call_streamed` does)."""
    from hivemind.p2p import P2P, PeerID
    from hivemind.proto import runtime_pb2

    from swarmnode.rpc import call_streamed

    # an identity a running peer holds too (a revoked node's) is used as it is: the caller is that peer id
    p2p = await P2P.create(initial_peers=[maddr], identity_path=identity, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                           check_if_identity_free=False)
    request = request if request is not None else runtime_pb2.ExpertRequest()
    try:
        if streamed:
            return await asyncio.wait_for(call_streamed(p2p, peer_id, name, request), 30)
        return await asyncio.wait_for(p2p.call_protobuf_handler(PeerID.from_base58(peer_id), name, request,
                                                                 runtime_pb2.ExpertResponse), 30)
    finally:
        await p2p.shutdown()


def refusal(response) -> tuple[str | None, str | None]:
    from swarmnode.messages import response_error, response_error_code

    return response_error_code(response), response_error(response)


def test_an_invited_client_generates_what_local_transformers_does(private, model_dir, local_model, chat_prompts):
    swarm, _ = private
    prompt = chat_prompts[0]
    with open_client(swarm, model_dir, client_admission(swarm, "client-exact")) as remote:
        got = remote.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = local_model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                                    attention_mask=torch.ones_like(prompt))
    assert torch.equal(got, expected)


def test_an_invited_api_server_answers_what_local_transformers_does(private, model_dir, local_model, tokenizer):
    """`swarmnode api` with a client invitation (the swarm starts it with one, as an operator would)."""
    from pathlib import Path

    from openai import OpenAI

    swarm, _ = private
    question = [{"role": "user", "content": "Name a colour."}]
    ids = tokenizer.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    out = local_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    truth = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    api, url = swarm.start_api(name="api-private")
    assert "--invitation" in api.args
    with OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300) as client:
        reply = client.chat.completions.create(model=Path(model_dir).resolve().name, messages=question,
                                               max_tokens=NEW_TOKENS, temperature=0)
    assert reply.choices[0].message.content == truth
    swarm.stop(api)


def test_a_peer_without_an_invitation_cannot_join_and_its_calls_are_refused(private, model_dir):
    from swarmnode.rpc import RPC_INFO

    swarm, nodes = private
    stranger_identity = swarm.identity_path("stranger")
    stranger = swarm.spawn("stranger", ["join", "--model", str(model_dir), "--blocks", "0:30", "--host", "127.0.0.1",
                                        "--num-threads", "1", *swarm._peer_args(), "--identity",
                                        str(stranger_identity)])
    # its RPC to a member, over a direct libp2p connection, is refused before any work
    maddr = swarm.maddr_of(nodes[0])
    code, message = refusal(asyncio.run(call_unary(None, maddr, nodes[0].peer_id, RPC_INFO)))
    assert code == "not_admitted" and "holds no invitation to this private swarm" in message
    # and the uninvited node never gets into the DHT: it exits saying why
    assert stranger.popen.wait(120) != 0
    assert "if the swarm is private, its peers answer only peers with an invitation" in stranger.log()
    assert stranger.peer_id not in json.dumps(swarm.status())


def test_a_member_admitted_as_client_cannot_act_as_a_node(private, model_dir):
    from hivemind.proto import runtime_pb2

    from swarmnode.messages import OutputsRequest, pack_metadata
    from swarmnode.records import NodeRecord, NodeState, ServerRecord, ServerState, block_key, nodes_key
    from swarmnode.rpc import RPC_INFO, RPC_OUTPUTS, RPC_PROBE
    from swarmnode.swarm_state import read_block_servers, read_nodes, store_owned

    swarm, nodes = private
    admission = client_admission(swarm, "client-posing")
    maddr = swarm.maddr_of(nodes[0])
    with open_client(swarm, model_dir, admission) as remote:  # which publishes its invitation
        info = asyncio.run(call_unary(admission.identity.path, maddr, nodes[0].peer_id, RPC_INFO))
        assert refusal(info)[0] is None
        code, message = refusal(asyncio.run(call_unary(admission.identity.path, maddr, nodes[0].peer_id, RPC_PROBE)))
        assert code == "not_admitted" and "admitted as client, not as coordinator or node" in message
        # a stream RPC with one reply, which clients may call, reaches its handler (which finds no session of
        # this client's under another's id)
        outputs = runtime_pb2.ExpertRequest(metadata=pack_metadata(OutputsRequest(session_id="someone-else", start=0,
                                                                                  end=4)))
        code, message = refusal(asyncio.run(call_unary(admission.identity.path, maddr, nodes[0].peer_id, RPC_OUTPUTS,
                                                       outputs, streamed=True)))
        assert code != "not_admitted" and "no session someone-... of yours is open on this node" in message
        view = remote.swarm
        fake = ServerRecord(state=ServerState.ONLINE, peer_id=admission.peer_id, start=0, end=30, throughput=1e9,
                            free_cache_tokens=10**6, cache_tokens=10**6)
        from swarmnode.identity import owner_marker

        offer = NodeRecord(peer_id=admission.peer_id, state=NodeState.WAITING, device="cpu", dtype="float32",
                           memory_bytes=1 << 34, num_threads=2, block_bytes=1 << 20, overhead_bytes=0, max_blocks=30,
                           block_throughput=1e9)  # an offer a coordinator would plan first

        async def announce_fake() -> list[bool]:
            marker = owner_marker(admission.identity.key)
            return await asyncio.gather(store_owned(view.dht, nodes_key(view.prefix), marker, offer.to_dict(), 60),
                                        *(store_owned(view.dht, block_key(view.prefix, b), marker, fake.to_dict(), 60)
                                          for b in range(30)))

        stored = view.loop.run(announce_fake(), 60)
        assert all(stored)  # the DHT takes it (a member signed it), and a reader that does not filter sees it ...
        unfiltered = view.loop.run(read_block_servers(view.dht, view.prefix, 30), 60)
        assert admission.peer_id in {r.peer_id for r in unfiltered[0]}
        assert admission.peer_id in view.loop.run(read_nodes(view.dht, view.prefix), 60)
        view.loop.run(view.refresh(force=True), 60)
        assert {span.peer_id for span in view.spans.values()} == {n.peer_id for n in nodes}  # ... no one routes to it
    # nor is it planned: a coordinator reads offers through the same filter (`read_nodes` with its members)
    state = swarm.reader.state()
    assert all(admission.peer_id not in {r.peer_id for r in records} for records in state.blocks.values())
    assert set(state.nodes) == {n.peer_id for n in nodes}
    assert any("admitted as client, not as node" in r.why for r in state.rejected)


@pytest.mark.parametrize("case", ["expired", "another-peer", "forged"])
def test_join_with_a_bad_invitation_ends_with_the_reason(private, model_dir, case):
    from swarmnode.admission import Invitation
    from swarmnode.identity import load_identity_key, load_or_create_private_key, public_key_text
    from swarmnode.testing.local_swarm import make_identity

    swarm, _ = private
    identity = swarm.identity_path(f"bad-{case}")
    make_identity(identity)
    if case == "expired":
        owner = load_or_create_private_key(swarm._swarm_key_path())
        text = Invitation.issue(owner, public_key_text(load_identity_key(str(identity))), [Role.NODE],
                                time.time() + 1, now=time.time() - 10).text()
        time.sleep(1.5)
        expected = "expired on"
    elif case == "another-peer":
        text = swarm.invite(swarm.identity_path("someone-else"), ["node"]).read_text()
        expected = "is for peer"
    else:  # signed by a key of its own in the owner's name
        stranger = load_or_create_private_key(swarm.log_dir / "stranger-owner.pem")
        honest = Invitation.issue(stranger, public_key_text(load_identity_key(str(identity))), [Role.NODE],
                                  time.time() + 600)
        token = type(honest.token)()
        token.CopyFrom(honest.token)
        fields = json.loads(token.username)
        fields["owner"] = public_key_text(load_or_create_private_key(swarm._swarm_key_path()))
        token.username = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        text = Invitation.from_token(token).text()
        expected = "forged or changed"
    result = subprocess.run([sys.executable, "-m", "swarmnode", "join", "--model", str(model_dir), "--blocks", "0:30",
                             *swarm._peer_args(), "--identity", str(identity), "--invitation", text],
                            capture_output=True, text=True, timeout=120, env=_env(swarm))
    assert result.returncode != 0 and expected in result.stderr, result.stderr[-2000:]


def _env(swarm) -> dict[str, str]:
    import os

    return {**os.environ, **swarm.env, "HF_HUB_OFFLINE": "1"}


def test_a_revoked_node_is_left_within_a_heartbeat_with_exact_output(private, model_dir, local_model, chat_prompts):
    from transformers.generation.streamers import BaseStreamer

    from swarmnode.rpc import RPC_INFO

    swarm, nodes = private
    prompt = chat_prompts[1]
    tokens = 160
    seen: dict[str, object] = {}

    with open_client(swarm, model_dir, client_admission(swarm, "client-revoke")) as remote:

        class RevokeMidway(BaseStreamer):
            """After the fifth new token, revoke the node serving the session (with the real command) and wait
            until this client's view of the members says so."""

            def __init__(self):
                self.count = 0

            def put(self, value):
                self.count += 1
                if "victim" in seen:
                    seen["route"] = [h.hop.peer_id for h in remote.active_session.hops or []]
                if self.count != 6:  # the prompt, then five new tokens
                    return
                victim = remote.active_session.hops[0].hop.peer_id
                done = subprocess.run([sys.executable, "-m", "swarmnode", "revoke", victim, *swarm._peer_args(),
                                       "--owner-key", str(swarm._swarm_key_path()), "--json"],
                                      capture_output=True, text=True, timeout=120, env=_env(swarm))
                assert done.returncode == 0, done.stderr[-2000:]
                assert victim in json.loads(done.stdout)["revoked"]
                began = time.monotonic()
                while remote.swarm.not_admitted(victim) is None:
                    assert time.monotonic() - began < HEARTBEAT_INTERVAL + 10, "the client never saw the revocation"
                    time.sleep(0.2)
                seen.update(victim=victim, noticed_after=time.monotonic() - began)

            def end(self):
                pass

        got = remote.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              streamer=RevokeMidway())
    expected = local_model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                    attention_mask=torch.ones_like(prompt))
    assert torch.equal(got, expected)
    victim = seen["victim"]
    assert seen["noticed_after"] <= HEARTBEAT_INTERVAL + 10
    survivor = next(n for n in nodes if n.peer_id != victim)
    assert seen["route"] == [survivor.peer_id]  # the session's last steps went through the other node
    # the revoked node's own calls to members are refused, and its records are no longer read
    revoked = next(n for n in nodes if n.peer_id == victim)
    code, message = refusal(asyncio.run(call_unary(str(swarm.identity_path(revoked.name)),
                                                   swarm.maddr_of(survivor), survivor.peer_id, RPC_INFO)))
    assert code == "not_admitted" and "revoked" in message
    swarm.wait_until(lambda: victim not in {r.peer_id for rs in swarm.reader.state().blocks.values() for r in rs},
                     HEARTBEAT_INTERVAL + 10, "the revoked node's records ignored")
