"""Exceptions of the test helpers: a process of a local swarm died, or the swarm did not reach a state in
time. Both derive from :class:`swarmnode.errors.SwarmError`; the timeout is also a :class:`TimeoutError`
and the death a :class:`RuntimeError`, which is what callers catch."""

from __future__ import annotations

from swarmnode.errors import SwarmError

__all__ = ["NodeInfoError", "ProcessExitedError", "SwarmTimeoutError"]


class ProcessExitedError(SwarmError, RuntimeError):
    """A process of a local swarm exited while the caller waited for it; the message ends with its log."""

    code = "process_exited"


class SwarmTimeoutError(SwarmError, TimeoutError):
    """A local swarm (or one of its processes) did not reach the expected state within the time given; the
    message says which state and shows the last one read, or the process's log."""

    code = "swarm_timeout"


class NodeInfoError(SwarmError, RuntimeError):
    """A node answered its `info` RPC with an error reply."""

    code = "info_failed"
