"""Private swarms: invitations the swarm's owner signs, and what a peer brings to join one.

A swarm is private when it has an owner: an RSA key (`swarmnode invite` uses this machine's swarm key unless
given `--owner-key`). The owner admits a peer by signing an `Invitation` for the peer's identity key (the key
its libp2p peer id is derived from), with the roles it may take (`Role`: node, client, coordinator) and an
expiry. A peer starts with its invitation and that identity (`Admission`), or with the owner's key itself,
which admits it in every role. What checks an invitation:

- the DHT: every DHT request and reply in a private swarm carries the sender's invitation and is signed by the
  invited key (hivemind's token authorizer, `membership.SwarmAuthorizer`), so a peer without a valid one can
  neither read nor write the swarm's records;
- every swarmnode RPC (`rpc.register` with a gate, `membership.Membership`): refused before any work unless
  the caller's peer id (authenticated by libp2p) holds a valid invitation with a role the RPC is for;
- readers of records (`swarm_state`): node and serving records of peers not admitted as nodes are ignored,
  so coordinators never plan them and clients never route to them.

Revocation: the owner publishes the revoked peer ids (`swarmnode revoke`, a `RevocationRecord` only the
owner's key can write); every peer reads it each heartbeat, and from then on refuses the revoked peer's DHT
requests and RPCs, and clients move open sessions off it.

The invitation is hivemind's `AccessToken` (`hivemind.proto.auth_pb2`): `username` holds the swarm's owner,
the peer id, the roles and when it was issued (JSON), `public_key` the invited key, `expiration_time` the
expiry, and `signature` the owner's signature over the three. Its text form, `swarmnode-invitation:1:` and
the token in URL-safe base64, is what `swarmnode invite` prints and `--invitation` takes (or a file holding it).
"""

from __future__ import annotations

import base64
import enum
import functools
import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from swarmnode.errors import SwarmError
from swarmnode.identity import KeyFileError, PeerIdentity, load_private_key, peer_id_of_key, public_key_text
from swarmnode.naming import short_id

TEXT_PREFIX = "swarmnode-invitation:1:"
#: The longest an invitation may last: an owner who needs longer re-invites.
MAX_INVITATION_S = 5 * 365 * 24 * 3600.0
#: How long the invitation a process holding the owner's key gives itself lasts (it signs a new one each start).
OWNER_SELF_INVITATION_S = MAX_INVITATION_S
#: Clocks may differ this much between an owner and its peers: an invitation issued "in the future" by up to this
#: is accepted, one past its expiry by even a second is not.
CLOCK_SKEW_S = 300.0


class Role(str, enum.Enum):
    """What an invitation lets a peer do: serve blocks (node), open sessions and generate (client), plan and
    publish placements (coordinator). A process holding the owner's key has every role."""

    NODE = "node"
    CLIENT = "client"
    COORDINATOR = "coordinator"

    def __str__(self) -> str:
        return self.value


ALL_ROLES: frozenset[Role] = frozenset(Role)


class AdmissionError(SwarmError, ValueError):
    """An invitation that cannot be used, or a peer a private swarm does not admit; the message says which and
    what to do."""

    code = "not_admitted"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)


def _signed_bytes(username: str, public_key: bytes, expiration_time: str) -> bytes:
    return b"\0".join([b"swarmnode-invitation", username.encode(), public_key, expiration_time.encode()])


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclass(frozen=True)
class Invitation:
    """An owner's signed admission of one key (`public_key`, whose peer id is `peer_id`) in `roles`, valid from
    `issued` until `expires` (Unix seconds). `token` is the signed form that travels."""

    owner: str
    peer_id: str
    public_key: str
    roles: frozenset[Role]
    issued: float
    expires: float
    token: AccessToken

    # --- making and reading ------------------------------------------------------------------------
    @classmethod
    def issue(cls, owner_key: RSAPrivateKey, public_key: str, roles, expires: float,
              now: float | None = None) -> Invitation:
        """The owner's invitation for `public_key` (an `ssh-rsa ...` line) in `roles`, until `expires`."""
        now = time.time() if now is None else now
        roles = frozenset(Role(r) for r in roles)
        if not roles:
            raise AdmissionError("an invitation needs at least one role: node, client or coordinator")
        if not now < expires <= now + MAX_INVITATION_S:
            raise AdmissionError(f"an invitation must expire after now and within {MAX_INVITATION_S / 86400:.0f} "
                                 f"days; asked for {_when(expires)}")
        peer_id = peer_id_of_key(public_key)
        if peer_id is None:
            raise AdmissionError(f"{public_key[:40]!r}... is not an OpenSSH RSA public key: give the key line that "
                                 f"`swarmnode identity FILE` prints, or the identity file itself")
        key_bytes = " ".join(public_key.split()[:2]).encode()
        username = json.dumps({"owner": public_key_text(owner_key), "peer_id": peer_id,
                               "roles": sorted(r.value for r in roles), "issued": round(now, 3)},
                              sort_keys=True, separators=(",", ":"))
        expiration_time = repr(float(expires))
        token = AccessToken(username=username, public_key=key_bytes, expiration_time=expiration_time)
        token.signature = owner_key.sign(_signed_bytes(username, key_bytes, expiration_time))
        return cls.from_token(token)

    @classmethod
    def from_token(cls, token: AccessToken) -> Invitation:
        """Read a token's fields (their signature is checked by `problem`); AdmissionError if they are not an
        invitation's."""
        try:
            fields = json.loads(token.username)
            owner, peer_id = str(fields["owner"]), str(fields["peer_id"])
            roles = frozenset(Role(r) for r in fields["roles"])
            issued, expires = float(fields["issued"]), float(token.expiration_time)
            public_key = token.public_key.decode()
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise AdmissionError(f"not a swarmnode invitation (its fields do not read: {exc})") from None
        copy = AccessToken()
        copy.CopyFrom(token)
        return cls(owner, peer_id, public_key, roles, issued, expires, copy)

    @classmethod
    def from_text(cls, text: str) -> Invitation:
        """An invitation from its text form, or from a file holding it."""
        text = text.strip()
        if not text.startswith(TEXT_PREFIX):
            path = Path(text)
            if len(text) < 4096 and path.is_file():
                return cls.from_text(path.read_text())
            raise AdmissionError(f"{text[:60]!r} is neither an invitation (`{TEXT_PREFIX}...`, as `swarmnode invite` "
                                 f"prints it) nor a file holding one")
        try:
            token = AccessToken.FromString(_unb64(text[len(TEXT_PREFIX):]))
        except Exception:  # safe: any decoding failure means the text was cut or changed
            raise AdmissionError("the invitation's text does not decode: it was cut or changed on the way; copy it "
                                 "whole, or ask the owner for it again") from None
        return cls.from_token(token)

    def text(self) -> str:
        return TEXT_PREFIX + _b64(self.token.SerializeToString())

    # --- checking ----------------------------------------------------------------------------------
    def signed_by_owner(self) -> bool:
        """Whether the owner's key signed this invitation as it is (any changed field fails)."""
        return _verify(self.owner, _signed_bytes(self.token.username, self.token.public_key,
                                                 self.token.expiration_time), self.token.signature)

    def problem(self, owner: str, *, now: float | None = None, revoked: frozenset[str] = frozenset()) -> str | None:
        """Why this invitation does not admit its peer to the swarm of `owner` now, or None when it does."""
        now = time.time() if now is None else now
        if " ".join(self.owner.split()[:2]) != " ".join(owner.split()[:2]):
            return f"it is for another swarm (owner key {short_id(self.owner)}, not {short_id(owner)})"
        if peer_id_of_key(self.public_key) != self.peer_id:
            return "its peer id is not the one of the key it names"
        if not self.signed_by_owner():
            return "its signature does not verify against the owner's key: it was forged or changed"
        if self.issued > now + CLOCK_SKEW_S:
            return f"it was issued in the future ({_when(self.issued)}): check this machine's clock"
        if self.expires <= now:
            return f"it expired on {_when(self.expires)}: ask the swarm's owner for a new one"
        if self.peer_id in revoked:
            return "the swarm's owner revoked it"
        return None

    def describe(self) -> dict:
        """The invitation's fields for people and `--json` (no secret in it: the token proves nothing alone)."""
        return {"peer_id": self.peer_id, "roles": sorted(r.value for r in self.roles), "owner": self.owner,
                "issued": _when(self.issued), "expires": _when(self.expires)}


@functools.lru_cache(maxsize=4096)
def _verify(owner: str, data: bytes, signature: bytes) -> bool:
    try:
        return RSAPublicKey.from_bytes(" ".join(owner.split()[:2]).encode()).verify(data, signature)
    except (ValueError, UnsupportedAlgorithm):
        return False


@dataclass(frozen=True)
class Admission:
    """What a process brings to a private swarm: the swarm's `owner` key, its own `invitation`, the
    `identity` it was issued for (the libp2p identity the process's DHT peer starts with), and the owner's
    private key when the process holds it (`owner_key`: it may then sign revocations, and keeps its local copy
    of them in `revocations_file`, beside the key)."""

    owner: str
    invitation: Invitation
    identity: PeerIdentity
    owner_key: RSAPrivateKey | None = None
    revocations_file: Path | None = None

    @property
    def peer_id(self) -> str:
        return self.invitation.peer_id

    @property
    def roles(self) -> frozenset[Role]:
        return self.invitation.roles

    @classmethod
    def load(cls, role: Role | None, *, invitation: str | None = None, identity: str | None = None,
             owner_key: str | None = None) -> Admission | None:
        """The admission of a process that takes `role` (None: any role, for a reader such as `status`): from `--owner-key` (it invites itself, in every role,
        with the identity in `identity` or a fresh one), from `--invitation` (which must be for the key in
        `identity`, in `role`, valid now), or None for a public swarm (neither given)."""
        if invitation and owner_key:
            raise AdmissionError("give --invitation or --owner-key, not both: the owner's key admits its holder")
        if owner_key:
            try:
                key = load_private_key(owner_key)
            except (OSError, KeyFileError) as exc:
                raise AdmissionError(f"--owner-key {owner_key}: {exc}") from None
            peer = PeerIdentity.load_or_create(identity)
            own = Invitation.issue(key, public_key_text(peer.key), ALL_ROLES,
                                   time.time() + OWNER_SELF_INVITATION_S - CLOCK_SKEW_S)
            return cls(own.owner, own, peer, key, Path(f"{owner_key}.revoked.json"))
        if not invitation:
            return None
        own = Invitation.from_text(invitation)
        if not identity:
            raise AdmissionError(f"the invitation is for peer {own.peer_id}: start with --identity FILE, the identity "
                                 f"file whose key it was issued for (`swarmnode identity FILE` made and printed it)")
        if not Path(identity).is_file():
            raise AdmissionError(f"--identity {identity} does not exist: the invitation is for the key in the identity "
                                 f"file it was issued for (peer {own.peer_id})")
        peer = PeerIdentity.load_or_create(identity)
        if peer.peer_id != own.peer_id:
            raise AdmissionError(f"the invitation is for peer {own.peer_id}, but --identity {identity} holds peer "
                                 f"{peer.peer_id}: give the identity it was issued for, or ask the owner to invite "
                                 f"this one")
        problem = own.problem(own.owner)
        if problem is not None:
            raise AdmissionError(f"the invitation for peer {short_id(own.peer_id)} cannot be used: {problem}")
        if role is not None and role not in own.roles:
            raise AdmissionError(f"the invitation admits peer {short_id(own.peer_id)} as "
                                 f"{', '.join(sorted(r.value for r in own.roles))}, not as {role.value}: ask the "
                                 f"swarm's owner for an invitation with role {role.value}")
        return cls(own.owner, own, peer)
