"""A session larger than a node's KV-cache budget is refused up front; the node keeps serving."""

from __future__ import annotations

import time

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from swarmnode import messages, rpc
from swarmnode.client import DistributedModelForCausalLM, SessionError
from swarmnode.messages import InferenceRequest, OpenSession, StepMeta

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def small_node(model_dir, tmp_path_factory):
    from swarmnode.testing.local_swarm import LocalSwarm

    with LocalSwarm(model_dir, log_dir=tmp_path_factory.mktemp("small-cache")) as swarm:
        swarm.start_bootstrap()
        node = swarm.start_node(0, 30, extra=["--cache-tokens", "64"])
        yield swarm, node


async def _open_raw(remote, peer_id: str, max_length: int, hidden_size: int):
    meta = InferenceRequest(session=OpenSession(session_id="raw", start=0, end=30, max_length=max_length,
                                                batch_size=1),
                            step=StepMeta(step_id=0, prefix_length=0))
    hidden = torch.zeros(1, 1, hidden_size)
    request = runtime_pb2.ExpertRequest(metadata=messages.pack_metadata(meta),
                                        tensors=messages.step_tensors(hidden, torch.zeros(1, 1), torch.ones(1, 1)))

    async def one():
        yield request

    stream = await remote.swarm.p2p.iterate_protobuf_handler(
        PeerID.from_base58(peer_id), rpc.RPC_INFERENCE, one(), runtime_pb2.ExpertResponse)
    return [response async for response in stream]


def test_oversized_session_is_refused_and_node_keeps_serving(small_node, model_dir, local_model, tokenizer):
    swarm, node = small_node
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers) as remote:
        # the node itself refuses, with a message that names the budget; it reads the stream to its end before
        # closing it, so the reply is never lost to a reset (a hundred raw opens in a row all get it)
        for _ in range(100):
            responses = remote.swarm.loop.run(_open_raw(remote, node.peer_id, 1000, 576), timeout=60)
            assert len(responses) == 1
        error = messages.response_error(responses[0])
        assert error is not None and "cache" in error and "64" in error
        # the client does not even try a peer whose announced free cache is too small
        with pytest.raises(SessionError, match=r"can never hold this session's \d+ cache tokens .*64 tokens"):
            remote.generate(ids, max_new_tokens=200, do_sample=False)
        # and the node still serves a session that fits
        ours = remote.generate(ids, max_new_tokens=20, do_sample=False)
        assert torch.equal(ours, local_model.generate(ids, max_new_tokens=20, do_sample=False))
        # refused and finished sessions leave no reservation behind (closing is asynchronous: allow 10 s)
        deadline = time.monotonic() + 10
        while True:
            info = remote.swarm.loop.run(remote.swarm.p2p.call_protobuf_handler(
                PeerID.from_base58(node.peer_id), rpc.RPC_INFO, runtime_pb2.ExpertRequest(),
                runtime_pb2.ExpertResponse), timeout=30)
            reply = messages.MSGPackSerializer.loads(info.metadata)
            if reply["free_cache_tokens"] == 64 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert reply["free_cache_tokens"] == reply["cache_tokens"] == 64
    assert node.alive()
