"""HexGen-2's two phases served by a real swarm: prompts on prefill nodes, generation on decode nodes.

Four `join --blocks ... --phase` nodes on loopback, ranges that do not align: prefill P1 [0, 20) and
P2 [20, 30), decode D1 [0, 10) and D2 [10, 30), plus a full node F (both phases) that the client leaves out
until a test lets it in. A session's prompt runs on P1 then P2, which hand the KV cache of their blocks over
to D1 and D2 (P1 feeds both; D2 is fed by both); generation continues on D1 and D2 without recomputing the
prompt. Greedy output equals local `transformers` for 3 prompts and a padded batch; a decode node SIGKILLed
after the handover and a prefill node SIGKILLed mid-prompt change nothing in the tokens (the client replays
on the decode route: see docs/architecture.md, step 7). A prefill-only node refuses other sessions with
`wrong_phase`, which the client routes around without counting a failure.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from swarmnode.client import ClientConfig, DistributedModelForCausalLM
from swarmnode.testing.local_swarm import LocalSwarm
from swarmnode.testing.workload import passage_inputs

pytestmark = pytest.mark.swarm

NODES = {"P1": (0, 20, "prefill"), "P2": (20, 30, "prefill"), "D1": (0, 10, "decode"), "D2": (10, 30, "decode"),
         "F": (0, 30, "both")}


@pytest.fixture(scope="module")
def split_swarm(model_dir, tmp_path_factory):
    with LocalSwarm(model_dir, log_dir=tmp_path_factory.mktemp("split-swarm")) as swarm:
        swarm.start_bootstrap()
        nodes = {name: swarm.launch_node(a, b, name=name, extra=["--phase", phase])
                 for name, (a, b, phase) in NODES.items()}
        for node in nodes.values():
            swarm.wait_serving(node)
        yield swarm, nodes


def _dead(swarm) -> frozenset[str]:
    """The nodes an earlier test killed: their records live on for a while, and a test that does not kill
    them itself must not count on clients routing around them."""
    return frozenset(p.peer_id for p in swarm.node_processes() if not p.alive())


def _client(swarm, model_dir, exclude):
    """A client that splits every session (`disaggregate=True`), leaving out the processes `exclude` and the
    nodes killed before."""
    return DistributedModelForCausalLM.from_pretrained(
        model_dir, initial_peers=swarm.initial_peers,
        config=ClientConfig(disaggregate=True, exclude_peers=frozenset(p.peer_id for p in exclude) | _dead(swarm)))


def test_prompts_on_prefill_nodes_generation_on_decode_nodes_exact(split_swarm, model_dir, local_model,
                                                                   chat_prompts, tokenizer):
    swarm, nodes = split_swarm
    status = swarm.status()
    assert {nodes[n].peer_id: p for n, (_, _, p) in NODES.items()} == {
        peer: status["nodes"][peer]["phase"] for peer in (nodes[n].peer_id for n in NODES)}
    with _client(swarm, model_dir, [nodes["F"]]) as model:
        for ids in chat_prompts:
            with model.inference_session(max_length=ids.shape[1] + 16) as session:
                ours = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
                hops = [(h.hop.peer_id, h.hop.start, h.hop.end) for h in session.hops]
                assert session.prefills == 1 and session.retries == 0
            truth = local_model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
            assert torch.equal(ours, truth)
            assert hops == [(nodes["D1"].peer_id, 0, 10), (nodes["D2"].peer_id, 10, 30)]
        tokenizer.padding_side = "left"
        batch = tokenizer(["The capital of France is", "Once upon a time, in a small village by the sea,",
                           "def fibonacci(n):"], return_tensors="pt", padding=True)
        ours = model.generate(**batch, max_new_tokens=16, do_sample=False)
        assert torch.equal(ours, local_model.generate(**batch, max_new_tokens=16, do_sample=False))
        # speculative decoding on the decode route: the drafts of a handed-over session verified and taken back
        ids = passage_inputs(tokenizer, 1)[0]
        with model.inference_session(max_length=ids.shape[1] + 32) as session:
            ours = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                  prompt_lookup_num_tokens=10)
            assert session.prefills == 1 and session.steps - 1 < 24, session.steps
        assert torch.equal(ours, local_model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False))
    for name in ("P1", "P2"):
        assert "handed blocks" in nodes[name].log(), nodes[name].log_tail()
    for name in ("D1", "D2"):
        assert "by handover" in nodes[name].log() and "its cache is complete" in nodes[name].log()


def test_a_prefill_node_refuses_other_sessions_with_wrong_phase(split_swarm, model_dir):
    """A session that is not a prefill session, opened on a prefill-only node, is refused with the code
    `wrong_phase`, which the client treats as a stale view (routed around, not a failure); a client that
    reads the records never routes generation there."""
    swarm, nodes = split_swarm
    from swarmnode.client.errors import RemoteError
    from swarmnode.client.hops import Chunk, HopStream, has_moved, hidden_states
    from swarmnode.client.routing import Hop

    with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers) as model:
        hop = HopStream(Hop(nodes["P1"].peer_id, 0, 20), "wrong-phase", 8, 1)
        chunk = Chunk(torch.zeros(1, 2, 576), torch.arange(2)[None], torch.ones(1, 2, dtype=torch.int64))

        async def attempt():
            await hop.send(model.swarm.p2p, chunk, 0, model.swarm.config)
            try:
                response = await hop.receive(model.swarm.p2p, model.swarm.config)
                hidden_states(hop.hop.peer_id, response, (1, 2, 576), torch.float32)
            finally:
                await hop.close()

        with pytest.raises(RemoteError) as refused:
            model.swarm.loop.run(attempt(), 30)
        with model.inference_session(max_length=8) as session:
            model(torch.tensor([[1, 2, 3, 4]]))
            used = {h.hop.peer_id for h in session.hops}
    assert refused.value.code == "wrong_phase" and has_moved(refused.value)
    assert "serves the prefill phase only" in str(refused.value)
    assert not used & {nodes["P1"].peer_id, nodes["P2"].peer_id}


def test_decode_node_gone_between_prefill_and_handover_same_tokens(split_swarm, model_dir, local_model, tokenizer):
    """A decode node D3 (all blocks) whose session the client opened is SIGKILLed before the prefill nodes hand
    the prompt's KV cache over to it: the handover fails, the client runs the prompt on a decode route without
    D3 (D1 and D2), and the tokens are the same."""
    swarm, nodes = split_swarm
    d3 = swarm.start_node(0, 30, name="D3", extra=["--phase", "decode"])
    text = " ".join(["It was the best of times, it was the worst of times."] * 40)
    ids = tokenizer(text, return_tensors="pt").input_ids
    truth = local_model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    seen = d3.log().count("opened by")
    everyone_else = frozenset(nodes[n].peer_id for n in ("F", "D1", "D2"))

    with _client(swarm, model_dir, []) as model:
        model.swarm.config.exclude_peers = everyone_else  # the decode route is D3 alone

        def kill_when_the_decode_session_opens():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and d3.log().count("opened by") == seen:
                time.sleep(0.002)
            swarm.kill(d3, signal.SIGKILL)
            model.swarm.config.exclude_peers = frozenset({nodes["F"].peer_id})  # D1 and D2 may take over

        killer = threading.Thread(target=kill_when_the_decode_session_opens, daemon=True)
        killer.start()
        with model.inference_session(max_length=ids.shape[1] + 8) as session:
            ours = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
            prefills, hops = session.prefills, [(h.hop.peer_id, h.hop.start, h.hop.end) for h in session.hops]
        killer.join(5)
    assert not d3.alive()
    assert prefills == 0, "the handover to the dead node failed: the prompt ran on the decode route"
    assert hops == [(nodes["D1"].peer_id, 0, 10), (nodes["D2"].peer_id, 10, 30)]
    assert torch.equal(ours, truth)
    assert "could not hand the KV cache over" in nodes["P1"].log() + nodes["P2"].log(), nodes["P1"].log_tail()


def test_decode_node_killed_after_the_handover_same_tokens(split_swarm, model_dir, local_model, chat_prompts):
    swarm, nodes = split_swarm
    ids = chat_prompts[1]
    truth = local_model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    with _client(swarm, model_dir, [nodes["F"]]) as model:
        killed = threading.Event()

        class Striker:
            seen = -1

            def put(self, value):
                self.seen += 1
                if self.seen == 6:  # the prompt and 5 tokens are through: D2 holds the handed-over cache
                    swarm.kill(nodes["D2"], signal.SIGKILL)
                    model.swarm.config.exclude_peers = _dead(swarm) - {nodes["D2"].peer_id}
                    killed.set()

            def end(self):
                pass

        with model.inference_session(max_length=ids.shape[1] + 20) as session:
            ours = model.generate(ids, max_new_tokens=20, min_new_tokens=20, do_sample=False, streamer=Striker())
            assert session.prefills == 1 and session.retries >= 1
    assert killed.is_set() and torch.equal(ours, truth)


def test_prefill_node_killed_mid_prompt_same_tokens(split_swarm, model_dir, local_model, tokenizer):
    swarm, nodes = split_swarm
    text = " ".join(["It was the best of times, it was the worst of times."] * 40)
    ids = tokenizer(text, return_tensors="pt").input_ids
    truth = local_model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    p1 = nodes["P1"]
    seen = p1.log().count("opened by")

    def kill_when_the_prompt_arrives():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and p1.log().count("opened by") == seen:
            time.sleep(0.005)
        swarm.kill(p1, signal.SIGKILL)

    with _client(swarm, model_dir, [nodes["D2"]]) as model:  # D2 was killed by the test before
        killer = threading.Thread(target=kill_when_the_prompt_arrives, daemon=True)
        killer.start()
        with model.inference_session(max_length=ids.shape[1] + 8) as session:
            ours = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
            prefills = session.prefills
        killer.join(5)
    assert not p1.alive()
    assert prefills == 0  # the prompt ran on the decode route instead
    assert torch.equal(ours, truth)
