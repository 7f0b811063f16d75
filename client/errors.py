"""The client's exceptions, and what a failing call to a peer may raise.

Every error the client raises on purpose derives from :class:`swarmnode.errors.SwarmError`: ``code`` for
programs (for a peer's refusal, the ``ErrorReply.code`` it sent), the message for people. A call to a peer
that fails in transport (``TRANSPORT_ERRORS``) or answers wrongly becomes a :class:`RemoteError` naming
the peer, so the session's failover handles one exception type.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError

from swarmnode.errors import SwarmError
from swarmnode.naming import short_id

__all__ = ["TRANSPORT_ERRORS", "ClientConfigError", "PeerDiverged", "PeerNotAdmitted", "PeerSilent", "RemoteError",
           "SessionError"]

# What a call to a peer raises when the peer or the path to it fails: the daemon refuses (no route to the
# peer, a dead connection), the peer's handler sent an error frame, the stream broke (OSError, EOFError
# from a short read; TimeoutError is an OSError) or a frame was garbled (TypeError: an unknown frame
# marker; DecodeError: a protobuf that does not parse).
TRANSPORT_ERRORS = (P2PDaemonError, P2PHandlerError, OSError, EOFError, TypeError, DecodeError)


class ClientConfigError(SwarmError, ValueError):
    """A client setting (`ClientConfig`, `from_pretrained`'s arguments) that cannot be used."""

    code = "bad_config"


class RemoteError(SwarmError, RuntimeError):
    """A peer answered with an error or did not answer in time; `code` is the reply's
    `messages.ErrorReply.code` when the peer sent one."""

    code = "remote_error"

    def __init__(self, peer_id: str, message: str, code: str | None = None):
        super().__init__(f"peer {short_id(peer_id)}: {message}", code=code)
        self.peer_id = peer_id


class PeerDiverged(RemoteError):
    """A verifying client found the peer's outputs wrong (`client.verify`): it is banned for good."""

    code = "diverged"


class PeerNotAdmitted(RemoteError):
    """A private swarm no longer admits the peer (its owner revoked it, or its invitation expired): the client
    moves its sessions off it."""

    code = "not_admitted"


class PeerSilent(RemoteError):
    """A peer answered neither a step nor the keep-alive pings sent while waiting for it, for
    `ClientConfig.peer_silence` s: killed, frozen or cut off. `silence` is how long it had been quiet."""

    code = "peer_silent"

    def __init__(self, peer_id: str, message: str, silence: float):
        super().__init__(peer_id, message)
        self.silence = silence


class SessionError(SwarmError, RuntimeError):
    """The session cannot go on: retries ran out or the request itself is invalid."""

    code = "session_failed"
