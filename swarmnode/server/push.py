"""Sending a step's output straight to the next hop's node (`PUSH`), instead of back to the client.

A node whose step names a `PushTarget` sends the output from the target's `prefix_length` on, with the
matching position ids and mask, to the target's session. The push has `rpc.push_timeout` for its
payload in all (a dead next hop is given up on within seconds) and is tried again within that time after a
quick failure. What happened goes back to the client in the step's `StepReply` (`pushed`, `push_error`): the
client then pushes the output itself, or replaces the next hop. A target behind NAT is pushed to through
the relay the target names (`PushTarget.via`, `relay.dialer`).
"""

from __future__ import annotations

import asyncio
import logging

import torch

from swarmnode import messages, rpc
from swarmnode.messages import PushReply, PushTarget, unpack_metadata
from swarmnode.naming import short_id
from swarmnode.relay.dialer import RelayDialer

logger = logging.getLogger(__name__)

PUSH_ATTEMPTS = 2


async def push_step(p2p: RelayDialer, target: PushTarget, hidden: torch.Tensor, positions: torch.Tensor,
                    mask: torch.Tensor) -> tuple[bool, str | None]:
    """Send one step's input to `target`'s session; returns (queued or already run, error or None).
    Raises nothing: a failure is reported for the caller to pass on."""
    p2p = p2p.through(target.peer_id, target.via)  # reached where the client said: directly or via its relay
    request = messages.push_request(target.session_id, target.step_id, target.prefix_length, hidden, positions, mask)
    deadline = asyncio.get_running_loop().time() + rpc.push_timeout(sum(len(t.buffer) for t in request.tensors))
    error = None
    for attempt in range(PUSH_ATTEMPTS):
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            break
        try:
            response = await asyncio.wait_for(
                rpc.call_sized(p2p, target.peer_id, rpc.RPC_PUSH, rpc.RPC_PUSH_STREAM, request), left)
            refused = messages.response_error(response)
            if refused is not None:  # the next hop answered and said no: trying again will not change it
                return False, f"{short_id(target.peer_id)} refused the push: {refused}"
            unpack_metadata(response.metadata, PushReply)
            return True, None
        except asyncio.CancelledError:
            raise
        except asyncio.TimeoutError:
            error = f"no answer from {short_id(target.peer_id)} in {left:.0f} s"
        except Exception as exc:  # a transport failure or a malformed reply: the push did not land
            error = f"pushing to {short_id(target.peer_id)} failed: {type(exc).__name__}: {exc}"
        logger.info("push of step %d to %s, attempt %d of %d: %s", target.step_id, short_id(target.peer_id),
                    attempt + 1, PUSH_ATTEMPTS, error)
    return False, error
