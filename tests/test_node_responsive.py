"""A node keeps answering while one of its ranges is retired: closing a unit never blocks the event loop.

Retiring a range stops its compute thread, which first finishes the step it is running (a step cannot be
interrupted); that wait can last seconds. A real node serving blocks [0, 30) gets a long prefill step
(2048 tokens through 30 blocks run whole, `--prefill-chunk 0`: seconds of compute on one thread), then SIGTERM with no grace for open
sessions, so it goes offline and closes the unit while the step is still running. Meanwhile the test pings
the node every 0.2 s: every ping must be answered within `PING_BOUND`, while the node's log shows that
the close itself waited longer than that for the compute thread.
"""

from __future__ import annotations

import asyncio
import re

import pytest
import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from swarmnode import messages, rpc
from swarmnode.messages import InferenceRequest, OpenSession, StepMeta

pytestmark = pytest.mark.swarm

PREFILL = 2048  # tokens of the long step in flight when the unit closes
PING_BOUND = 2.0  # seconds: every ping during the retirement is answered within this
HIDDEN = 576
_CLOSED_RE = re.compile(r"blocks \[0, 30\) closed after ([\d.]+) s")


async def _long_step(p2p, peer: PeerID) -> None:
    """Open a session whose first step is a `PREFILL`-token prefill; wait for whatever comes back."""
    meta = InferenceRequest(session=OpenSession(session_id="long", start=0, end=30, max_length=PREFILL,
                                                batch_size=1),
                            step=StepMeta(step_id=0, prefix_length=0))
    tensors = messages.step_tensors(torch.randn(1, PREFILL, HIDDEN), torch.arange(PREFILL)[None],
                                    torch.ones(1, PREFILL))

    async def one():
        yield runtime_pb2.ExpertRequest(metadata=messages.pack_metadata(meta), tensors=tensors)
        await asyncio.sleep(3600)  # keep the stream open: the session stays open while its step runs

    stream = await p2p.iterate_protobuf_handler(peer, rpc.RPC_INFERENCE, one(), runtime_pb2.ExpertResponse)
    async for _response in stream:
        pass


def test_node_answers_pings_while_a_unit_closes_under_a_running_step(model_dir, tmp_path):
    from swarmnode.testing.local_swarm import LocalSwarm

    with LocalSwarm(model_dir, log_dir=tmp_path / "logs") as swarm:
        swarm.start_bootstrap()
        node = swarm.start_node(0, 30, wait=False, extra=["--shutdown-grace", "0", "--cache-tokens", str(PREFILL),
                                                             "--prefill-chunk", "0"])
        swarm.wait_serving(node, 120)
        p2p, peer = swarm.reader.p2p, PeerID.from_base58(node.peer_id)

        def ping():
            return rpc.timed_call(p2p, node.peer_id, rpc.RPC_PING, timeout=PING_BOUND)

        async def scenario() -> tuple[list[float], str]:
            assert await ping() < PING_BOUND  # answers before anything happens
            step = asyncio.create_task(_long_step(p2p, peer))
            try:
                while "session long opened" not in node.log():  # the step is queued right after this line
                    if step.done():
                        step.result()
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)  # the compute thread has taken the step
                swarm.signal(node)  # SIGTERM: offline, no grace for the session, close the unit
                latencies: list[float] = []
                while (match := _CLOSED_RE.search(node.log())) is None:
                    try:
                        latencies.append(await ping())
                    except asyncio.TimeoutError:
                        latencies.append(float("inf"))
                    except Exception:  # the node may exit right after logging the close: only then is this fine
                        if _CLOSED_RE.search(node.log()) is None:
                            raise
                    await asyncio.sleep(0.2)
                return latencies, match.group(1)
            finally:
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)

        latencies, close_seconds = swarm.reader.loop.run(scenario(), timeout=120)
        assert float(close_seconds) > PING_BOUND, (
            f"the close took {close_seconds} s: the step was not running, so this test proves nothing")
        assert len(latencies) >= 3, f"too few pings during the retirement: {latencies}"
        assert max(latencies) < PING_BOUND, (
            f"pings stalled while the unit closed (close took {close_seconds} s): {latencies}")
