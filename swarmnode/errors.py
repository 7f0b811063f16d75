"""The swarm side's exceptions: one base class, :class:`SwarmError`, with a machine-readable ``code``.

Nodes, clients, the coordinator and the API raise subclasses of :class:`SwarmError` for every error they
mean to raise, so callers can catch the project's errors without catching bugs. ``code`` is the same
string an RPC error reply carries (``ErrorReply.code`` in :mod:`swarmnode.messages`) where the error
crosses the wire; the message says what was wrong and what to do, for people.
"""

from __future__ import annotations

__all__ = ["ERROR_BAD_REQUEST", "ERROR_CACHE_FULL", "ERROR_MOVED", "ERROR_WRONG_PHASE", "SwarmError"]

# `ErrorReply.code` values that clients act on (see `swarmnode.messages`).
# A request that breaks the protocol or the node's limits: the caller must change it.
ERROR_BAD_REQUEST = "bad_request"
# A refusal because the node's KV cache has no room for the session now: the peer did nothing wrong, so
# clients wait or try another peer instead of banning it.
ERROR_CACHE_FULL = "cache_full"
# A refusal because the node does not (or no longer) serve the blocks asked for: its placement changed
# since the client read the swarm's records.
ERROR_MOVED = "moved"
# A refusal because the node serves another phase of a request (HexGen-2: prefill only, or decode only):
# the client routes that phase elsewhere, without counting it as a failure.
ERROR_WRONG_PHASE = "wrong_phase"


class SwarmError(Exception):
    """Base of every exception the swarm side raises on purpose; ``code`` is for programs."""

    code = "error"

    def __init__(self, message: str = "", *, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
