"""The swarm side's exceptions: one base class, :class:`SwarmError`, with a machine-readable ``code``.

Nodes, clients, the coordinator and the API raise subclasses of :class:`SwarmError` for every error they
mean to raise, so callers can catch the project's errors without catching bugs. ``code`` is the same
string an RPC error reply carries (``ErrorReply.code`` in :mod:`swarmnode.messages`) where the error
crosses the wire; the message says what was wrong and what to do, for people.
"""

from __future__ import annotations

__all__ = ["SwarmError"]


class SwarmError(Exception):
    """Base of every exception the swarm side raises on purpose; ``code`` is for programs."""

    code = "error"

    def __init__(self, message: str = "", *, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
