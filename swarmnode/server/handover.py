"""Handing a session's KV cache over to another node (`KV_HANDOVER`): HexGen-2's split of the two phases.

A prefill node runs a session's prompt; a step naming `handover_to` targets then sends, to each target, the
keys and values of the blocks both sides hold (`[max(starts), min(ends))`: ranges need not align, so one
prefill node may feed two decode nodes and the reverse) for the tokens computed so far, and the mask of the
tokens that hold real keys. The decode node's session was opened by the client, so its cache is reserved (or
the session refused) before anything moves; it checks every message against that session
(`ServerSession.check_handover`) and fills its cache, and its decode steps continue from the handed-over
length without recomputing the prompt. The sender reports per target whether the handover landed and, if
not, why; the client then replays the prompt into that decode node itself.

The receiving side's limits: one message per block, each with keys and values of exactly the announced
shape and dtype; a transfer has `rpc.push_timeout` for its bytes, like a push.
"""

from __future__ import annotations

import asyncio
import logging

import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from swarmnode import messages, rpc
from swarmnode.messages import KvHandover, KvHandoverReply, KvTarget, pack_metadata, unpack_metadata
from swarmnode.naming import short_id
from swarmnode.relay.dialer import RelayDialer
from swarmnode.runtime.dtypes import dtype_name
from swarmnode.runtime.kv_cache import SessionCache

logger = logging.getLogger(__name__)


def shared_blocks(target: KvTarget, cache: SessionCache) -> tuple[int, int] | None:
    """The blocks of `target` that `cache` holds, or None when it holds none of them."""
    start, end = max(target.start, cache.start), min(target.end, cache.end)
    return (start, end) if start < end else None


def handover_messages(cache: SessionCache, session_id: str, start: int, end: int, length: int):
    """The messages of one `KV_HANDOVER` of blocks [start, end), `length` tokens, of `cache`."""
    header = KvHandover(session_id=session_id, start=start, end=end, length=length, batch_size=cache.batch_size,
                        dtype=dtype_name(cache.keys[start].dtype))
    yield runtime_pb2.ExpertRequest(metadata=pack_metadata(header),
                                    tensors=messages.serialize_tensors([cache.valid[:, :length].to(torch.int64)]))
    for index in range(start, end):
        yield runtime_pb2.ExpertRequest(tensors=messages.serialize_tensors(
            [cache.keys[index][:, :, :length], cache.values[index][:, :, :length]]))


async def hand_over(p2p: RelayDialer, cache: SessionCache, target: KvTarget, length: int) -> tuple[bool, str | None]:
    """Send `cache`'s keys and values of the blocks it shares with `target` to the target's session; returns
    (taken, error or None). Raises nothing: a failure is reported for the client to act on."""
    blocks = shared_blocks(target, cache)
    if blocks is None:
        return False, (f"this node holds blocks [{cache.start}, {cache.end}) of the session, none of "
                       f"[{target.start}, {target.end})")
    start, end = blocks
    size = 2 * sum(cache.keys[i][:, :, :length].numel() * cache.keys[i].element_size() for i in range(start, end))

    async def requests():
        for message in handover_messages(cache, target.session_id, start, end, length):
            yield message

    try:
        response = await asyncio.wait_for(p2p.through(target.peer_id, target.via).call_protobuf_handler(
            PeerID.from_base58(target.peer_id), rpc.RPC_KV_HANDOVER, requests(), runtime_pb2.ExpertResponse),
            rpc.push_timeout(size))
    except asyncio.CancelledError:
        raise
    except asyncio.TimeoutError:
        return False, f"no answer from {short_id(target.peer_id)} in {rpc.push_timeout(size):.0f} s"
    except Exception as exc:  # a transport failure: the handover did not land
        return False, f"handing over to {short_id(target.peer_id)} failed: {type(exc).__name__}: {exc}"
    refused = messages.response_error(response)
    if refused is not None:
        return False, f"{short_id(target.peer_id)} refused the handover: {refused}"
    try:
        unpack_metadata(response.metadata, KvHandoverReply)
    except messages.ProtocolError as exc:
        return False, f"{short_id(target.peer_id)} answered the handover with {exc}"
    logger.info("handed blocks [%d, %d) of %d tokens (%.1f MB) over to %s", start, end, length, size / 1e6,
                short_id(target.peer_id))
    return True, None
