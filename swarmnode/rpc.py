"""The RPC contract: every RPC by name, its shape, the servicer method that answers it, and how it is called.

What the RPCs carry (message schemas, the metadata and tensor codec, error replies) is `swarmnode.messages`;
this module holds the RPCs themselves:

- `Rpc`: a name on the wire, its shape (unary, or streams in and out), the servicer method that answers it
  (`rpc_<x>` beside the servicer's other handlers, as in hivemind's `ServicerBase`) and whether a relay
  forwards it to a node behind NAT. `NODE_RPCS` are what a serving node answers (`server.handler`),
  `RELAY_RPCS` what a relay answers (`relay.service`); `register` installs a servicer's table in one loop.
- The call side: `timed_call` (unary, timed), `call_streamed` (one message each way over a stream),
  `call_sized` (unary when small, else streamed), `answering` (who answers a ping), `read_to_end` (how a
  failing stream handler lets its error reply through), and the push timeout.

RPCs (hivemind P2P protobuf handlers):
- `INFO` (unary): the node's span, cache budget and version.
- `FORWARD` (unary): stateless run of blocks `[start, end)` on tensors `[hidden, position_ids, attention_mask]`.
- `PING` (unary): echoes its metadata (bounded); timed for round trips.
- `PROBE` (unary): one uint8 tensor of up to `MAX_PROBE_BYTES`, answered with its size; timed by peers to
  measure bandwidth; its metadata (`ProbeRequest`) may reserve (`hold`) or release the node's probe slot
  (`server.probe`), so one caller measures at a time; rate-limited per caller so probes never flood a link.
- `INFERENCE` (stream): the first message opens a session (`OpenSession`) and may carry a first step;
  every later message carries one step (`StepMeta` + the three tensors). Each step is answered with the
  output hidden states. An error reply ends the stream.
  With a `StepMeta.push_to`, the node sends the step's output straight to the next hop's session (`PUSH`)
  and answers with a `StepReply` alone; a step with `pushed` set carries no tensors: its input comes by
  `PUSH` (from the previous hop, a replacement of it, or the client).
- `PUSH` (unary; `PUSH_STREAM` for payloads past `UNARY_LIMIT`, one message each way over a stream): one step's input for an open session (`PushRequest` + the three tensors), from whoever
  holds the session's id; answered once it is queued (or known to be a step already run).
- `OUTPUTS` (one message each way, over a stream): a session's kept outputs for tokens `[start, end)` (`OutputsRequest`), for the session's
  own client only: what a replacement of the next hop must replay, without every step's output having
  crossed the client's link.

- `KV_HANDOVER` (stream in, one reply): a session's KV cache for some of its blocks, from the node that ran
  the prompt (prefill) to a session the client opened on the node that goes on decoding (HexGen-2's split of
  the two phases). The first message is a `KvHandover` header with the `valid` mask of the cached tokens;
  then one message per block carries its keys and values. The receiving session was opened (its cache
  reserved) by its client; a step continuing from the handed-over length waits for the handover.

Relays (`swarmnode.relay`), offered by peers others can dial (the bootstrap, reachable nodes) to nodes that
nobody can dial (behind NAT):
- `RELAY_RESERVE` (unary, `RelayReserve` -> `RelayReply`): a node behind NAT asks to be reached through this
  peer for `ttl` seconds, over the connection it opened; it renews the reservation well before it lapses.
- `RELAY` (unary) and `RELAY_STREAM` (stream): a call for a reserved node. The request (the stream's first
  message) names the node and the RPC in its `uid` (`relay_address`); the relay replaces the `uid` with the
  caller's peer id (which the node trusts from its own relay only, `relayed_caller`) and forwards the call.
- `REACH_CHECK` (unary, `ReachCheck` -> `ReachReply`): "can you open a TCP connection to these addresses of
  mine?": how a starting node learns whether it is behind NAT (`relay.reachability`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from hivemind.proto import runtime_pb2

from swarmnode.admission import ALL_ROLES, AdmissionError, Role
from swarmnode.messages import ReplyError, error_response, response_error, response_error_code
from swarmnode.naming import short_id

RPC_INFO = "swarmnode.info"
RPC_FORWARD = "swarmnode.forward"
RPC_INFERENCE = "swarmnode.inference"
RPC_PING = "swarmnode.ping"
RPC_PROBE = "swarmnode.probe"
RPC_PUSH = "swarmnode.push"
RPC_PUSH_STREAM = "swarmnode.push_stream"
RPC_OUTPUTS = "swarmnode.outputs"
RPC_KV_HANDOVER = "swarmnode.kv_handover"
RPC_RELAY_RESERVE = "swarmnode.relay_reserve"
RPC_RELAY = "swarmnode.relay"
RPC_RELAY_STREAM = "swarmnode.relay_stream"
RPC_REACH_CHECK = "swarmnode.reach_check"


logger = logging.getLogger(__name__)

_NODES, _CLIENTS = frozenset({Role.NODE}), frozenset({Role.CLIENT})


@dataclass(frozen=True)
class Rpc:
    """One RPC: its `name` on the wire, the servicer `method` that answers it, its shape, whether a relay
    forwards it to a node behind NAT (`relayed`; a relay's own RPCs never are), and in a private swarm the
    roles a caller's invitation must hold (`roles`; `swarmnode.admission`)."""

    name: str
    method: str
    stream_input: bool = False
    stream_output: bool = False
    relayed: bool = False
    roles: frozenset[Role] = ALL_ROLES
    # answered without an invitation even in a private swarm (a starting node's reachability check, made from a
    # temporary peer before it has joined: it only dials back the caller's own addresses)
    open_to_all: bool = False

    @property
    def streamed(self) -> bool:
        return self.stream_input or self.stream_output


#: What a serving node answers (`server.handler.BlockHandler`). Pushes go unary when small, else over a
#: stream (`call_sized`; the same method); outputs always over a stream, one message each way (a unary call's
#: payload is capped at 2 MiB).
#: In a private swarm, sessions and forwards are for clients, pushes come from clients and the nodes before a hop,
#: handovers and probes from nodes; anyone admitted may ask for a node's info or ping it.
NODE_RPCS: tuple[Rpc, ...] = (
    Rpc(RPC_INFO, "rpc_info", relayed=True),
    Rpc(RPC_PING, "rpc_ping", relayed=True),
    Rpc(RPC_PROBE, "rpc_probe", relayed=True, roles=_NODES | {Role.COORDINATOR}),
    Rpc(RPC_FORWARD, "rpc_forward", relayed=True, roles=_CLIENTS),
    Rpc(RPC_PUSH, "rpc_push", relayed=True, roles=_CLIENTS | _NODES),
    Rpc(RPC_PUSH_STREAM, "rpc_push", stream_output=True, relayed=True, roles=_CLIENTS | _NODES),
    Rpc(RPC_OUTPUTS, "rpc_outputs", stream_output=True, relayed=True, roles=_CLIENTS),
    Rpc(RPC_KV_HANDOVER, "rpc_kv_handover", stream_input=True, stream_output=True, relayed=True, roles=_NODES),
    Rpc(RPC_INFERENCE, "rpc_inference", stream_input=True, stream_output=True, relayed=True, roles=_CLIENTS),
)
#: What a relay answers (`relay.service.RelayService`: the bootstrap, reachable nodes).
RELAY_RPCS: tuple[Rpc, ...] = (
    Rpc(RPC_RELAY_RESERVE, "rpc_reserve", roles=_NODES),
    Rpc(RPC_RELAY, "rpc_relay"),
    Rpc(RPC_RELAY_STREAM, "rpc_relay_stream", stream_input=True, stream_output=True),
    Rpc(RPC_REACH_CHECK, "rpc_reach_check", open_to_all=True),
)
#: the roles a caller needs for each node RPC: a relay checks them for the RPC it forwards (`relay.service`)
ROLES_BY_NAME: dict[str, frozenset[Role]] = {r.name: r.roles for r in NODE_RPCS}
#: the node RPCs a relay forwards, by how they are called
RELAYED_UNARY = frozenset(r.name for r in NODE_RPCS if r.relayed and not r.streamed)
RELAYED_STREAM = frozenset(r.name for r in NODE_RPCS if r.relayed and r.streamed)


class Gate(Protocol):
    """Who may call: `membership.Membership` in a private swarm."""

    async def refusal(self, peer_id: str, roles: frozenset[Role]) -> str | None:
        """Why `peer_id` may not call an RPC for `roles`, or None when it may."""
        ...


async def register(p2p, servicer: object, rpcs: tuple[Rpc, ...], gate: Gate | None = None) -> None:
    """Install `servicer`'s handler of each of `rpcs` on `p2p` (a hivemind `P2P`): one table per servicer
    instead of a hand-written line per RPC. With a `gate` (a private swarm), a call from a peer it refuses is
    answered with an `AdmissionError` reply before the handler sees it."""
    for rpc in rpcs:
        handler = getattr(servicer, rpc.method)
        if gate is not None and not rpc.open_to_all:
            handler = _gated(handler, rpc, gate)
        await p2p.add_protobuf_handler(rpc.name, handler, runtime_pb2.ExpertRequest,
                                       stream_input=rpc.stream_input, stream_output=rpc.stream_output)


def _gated(handler, rpc: Rpc, gate: Gate):
    """`handler` behind `gate`: the caller is the peer libp2p authenticated (`context.remote_id`). A call a
    node's relay forwards comes from the relay, which gated the caller itself."""

    def refused(reason: str, context) -> runtime_pb2.ExpertResponse:
        logger.info("refused %s from %s: %s", rpc.name, short_id(str(context.remote_id)), reason)
        return error_response(reason, code=AdmissionError.code)

    if rpc.stream_output:
        @functools.wraps(handler)
        async def gated_stream(requests, context):
            reason = await gate.refusal(str(context.remote_id), rpc.roles)
            if reason is not None:
                yield refused(reason, context)
                if rpc.stream_input:
                    await read_to_end(requests)
                return
            output = handler(requests, context)
            if inspect.isawaitable(output):  # one reply over a stream (`PUSH_STREAM`, `OUTPUTS`), as hivemind allows
                yield await output
                return
            async for reply in output:
                yield reply

        return gated_stream

    @functools.wraps(handler)
    async def gated(request, context):
        reason = await gate.refusal(str(context.remote_id), rpc.roles)
        if reason is not None:
            return refused(reason, context)
        return await handler(request, context)

    return gated


async def timed_call(p2p, peer_id: str, name: str, request: runtime_pb2.ExpertRequest | None = None, *,
                     timeout: float) -> float:
    """Call unary RPC `name` on a peer and return the seconds it took; raises on an error reply or timeout.
    With no request it is an empty `PING`-style message (peers and clients time it for round trips)."""
    from hivemind.p2p import PeerID

    began = time.perf_counter()
    response = await asyncio.wait_for(
        p2p.call_protobuf_handler(PeerID.from_base58(peer_id), name, request or runtime_pb2.ExpertRequest(),
                                  runtime_pb2.ExpertResponse),
        timeout=timeout,
    )
    elapsed = time.perf_counter() - began
    error = response_error(response)
    if error is not None:
        raise ReplyError(error, code=response_error_code(response))
    return elapsed


# Requests up to this size go as unary calls (over the daemon's persistent connection: no stream to set up,
# which a decode step's push would pay for on every hop); larger ones over a stream (hivemind caps a unary
# call's payload at 2 MiB, serialization included).
UNARY_LIMIT = 3 << 19


# A push is given PUSH_BASE_TIMEOUT s plus its payload's time at 1 Mbit/s, the slowest link it allows for: a
# large prefill over a slow link is not cut off, while a dead next hop is given up on within seconds.
PUSH_BASE_TIMEOUT = 5.0
PUSH_FLOOR_BYTES_PER_S = 125_000


def push_timeout(payload_bytes: int) -> float:
    return PUSH_BASE_TIMEOUT + payload_bytes / PUSH_FLOOR_BYTES_PER_S


async def _one(message):
    yield message


async def call_single(p2p, peer_id, name: str, requests, output_type):
    """The one reply to a stream RPC call (`requests`: an async iterable of messages), as hivemind's
    `call_protobuf_handler` returns it, except that a stream which ends without exactly one reply (the peer
    died or dropped the call half-way) raises `EOFError`: a transport error that callers fail over on, where
    hivemind raises a bare `ValueError` from `asingle`. `p2p` is a hivemind P2P or a `RelayDialer`."""
    stream = await p2p.iterate_protobuf_handler(peer_id, name, requests, output_type)
    replies = []
    try:
        async for reply in stream:
            replies.append(reply)
            if len(replies) > 1:  # as asingle: no need to read on
                break
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()
    if len(replies) != 1:
        raise EOFError(f"{name} to peer {short_id(str(peer_id))} ended with {len(replies)} replies where one was due: "
                       f"the peer stopped or dropped the call")
    return replies[0]


async def call_streamed(p2p, peer_id: str, name: str, request: runtime_pb2.ExpertRequest) -> runtime_pb2.ExpertResponse:
    """One request and one response over a stream RPC (`PUSH`, `OUTPUTS`): hidden states of a long prompt
    exceed what hivemind's unary calls carry."""
    from hivemind.p2p import PeerID

    return await call_single(p2p, PeerID.from_base58(peer_id), name, _one(request), runtime_pb2.ExpertResponse)


async def call_sized(p2p, peer_id: str, unary: str, streamed: str,
                     request: runtime_pb2.ExpertRequest) -> runtime_pb2.ExpertResponse:
    """`request` to RPC `unary` when it is small enough for a unary call, else to `streamed` (the same handler
    registered as a stream RPC)."""
    from hivemind.p2p import PeerID

    if request.ByteSize() <= UNARY_LIMIT:
        return await p2p.call_protobuf_handler(PeerID.from_base58(peer_id), unary, request,
                                               runtime_pb2.ExpertResponse)
    return await call_streamed(p2p, peer_id, streamed, request)


MAX_DRAINED_MESSAGES = 256  # messages read after a failure before a stream closes (a handover's blocks, at most)
FAILURE_LINGER_S = 5.0  # how long a failed stream waits for the caller to end its side


async def read_to_end(requests, limit: int = MAX_DRAINED_MESSAGES, timeout: float = FAILURE_LINGER_S) -> None:
    """Read a stream RPC's incoming side until the caller ends it (at most `limit` messages, each waited for at
    most `timeout` s). A handler that fails calls this around its error reply: a stream closed while the caller
    still writes (its end-of-stream, a step sent before it read the error) is reset, and the reset can drop the
    reply that says why before the caller reads it."""
    iterator = aiter(requests)
    try:
        for _ in range(limit):
            await asyncio.wait_for(anext(iterator), timeout)
    except Exception:  # safe: StopAsyncIteration is the end; a caller gone or stalled leaves nothing to wait for
        pass


async def answering(p2p, peers, timeout: float) -> set[str]:
    """The peers of `peers` that answer a `PING` within `timeout` s, pinged side by side. Any failure (no
    route, a timeout, an error reply) counts as no answer: callers decide what silence means."""

    async def ping(peer: str) -> bool:
        try:
            await timed_call(p2p, peer, RPC_PING, timeout=timeout)
            return True
        except asyncio.CancelledError:
            raise
        except Exception:  # whatever the cause, the peer did not answer
            return False

    peers = list(peers)
    return {p for p, ok in zip(peers, await asyncio.gather(*(ping(p) for p in peers))) if ok}
