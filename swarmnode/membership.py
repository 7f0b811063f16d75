"""Who is in a private swarm right now: the live view every peer of one keeps, and the gates built on it.

- `SwarmAuthorizer` runs in the DHT process (hivemind's `TokenAuthorizerBase`): every DHT request and reply
  carries the sender's invitation and is signed by the invited key; a request or reply without a valid one
  (wrong owner, forged, expired, revoked) is dropped, so peers outside the swarm cannot read or write its
  records.
- `Membership` runs in the process's own loop: it publishes the process's invitation (`{swarm}.members`),
  reads the others' and the owner's revocation list every heartbeat, hands the revoked ids to the DHT
  process's authorizer, and answers two questions: may this peer call this RPC (`refusal`, the gate that
  `rpc.register` puts before every handler) and is this peer admitted as a node (`admits`, which readers of
  node and serving records use). A caller not yet in the view (a client that just published its invitation)
  makes it read the members again before it is refused (callers that arrive while a read is under way share
  the next one), and records naming peers not known yet make readers read again at most every `MISS_REFRESH_S`.

Revocation takes effect at the next read, within `HEARTBEAT_INTERVAL` s: the revoked peer's RPCs are refused,
its records ignored, and clients move open sessions off it (`client.session`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path

from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase

from swarmnode.admission import Admission, AdmissionError, Invitation, Role
from swarmnode.identity import owner_marker, owner_of, public_key_text
from swarmnode.naming import short_id
from swarmnode.records import (
    HEARTBEAT_INTERVAL,
    MEMBER_RECORD_TTL,
    REVOCATION_TTL,
    MemberRecord,
    RevocationRecord,
    members_key,
    parse_record,
    private_swarm_prefix,
    revoked_key,
)
from swarmnode.swarm_state import read_items

logger = logging.getLogger(__name__)

MISS_REFRESH_S = 1.0  # records naming unknown peers make the view re-read the members at most this often
PUBLISH_ATTEMPTS = 5  # tries of the first publication of this process's invitation, PUBLISH_RETRY_S apart
PUBLISH_RETRY_S = 1.0
DHT_READ_TIMEOUT = 10.0


def read_revocations(path) -> dict | None:
    """The revocation list the owner's `swarmnode revoke` keeps beside the owner key (a `RevocationRecord` as
    JSON), or None when there is none or it does not read."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


class SwarmAuthorizer(TokenAuthorizerBase):
    """hivemind's token authorizer with invitations as tokens: built in the owner process and carried into the
    DHT process, where `revoked` is replaced each heartbeat (`set_revoked`)."""

    def __init__(self, admission: Admission):
        super().__init__(admission.identity.key)
        self.owner = admission.owner
        self._token = admission.invitation.token
        self.revoked: frozenset[str] = frozenset()

    async def get_token(self) -> AccessToken:
        return self._token

    def is_token_valid(self, access_token: AccessToken) -> bool:
        invitation = _read_token(access_token.SerializeToString())
        return invitation is not None and invitation.problem(self.owner, revoked=self.revoked) is None

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return False


@functools.lru_cache(maxsize=4096)
def _read_token(data: bytes) -> Invitation | None:
    try:
        return Invitation.from_token(AccessToken.FromString(data))
    except Exception:  # safe: a token that does not read admits nobody
        return None


async def set_revoked(peers: frozenset[str], _dht, node) -> None:
    """Run in the DHT process (`DHT.run_coroutine`): the revoked peer ids its authorizer refuses."""
    authorizer = node.protocol.authorizer
    if isinstance(authorizer, SwarmAuthorizer):
        authorizer.revoked = peers


class Membership:
    """The members of the private swarm `admission` is for, as the DHT shows them (see the module's docstring).
    `dht`: the process's hivemind DHT (started with `admission`); its validator signs with `record_key`, which
    names the subkey this process publishes its invitation under."""

    def __init__(self, dht, admission: Admission, record_key):
        self.dht, self.admission = dht, admission
        self.owner = admission.owner
        self.swarm = private_swarm_prefix(admission.owner)
        # records are signed with `record_key` (its owner marker in the subkey); one member record per identity, so
        # processes that share a records key (the owner's) do not replace each other's invitations
        self._marker = owner_marker(record_key)
        self._subkey = self._marker + b" member " + admission.peer_id.encode()
        self._members: dict[str, Invitation] = {admission.peer_id: admission.invitation}
        self.revoked: frozenset[str] = frozenset()
        self.revoked_updated = 0.0  # when the owner wrote the revocation list known here (0: none known)
        # the process signs its records with the owner's key: it keeps the revocation list stored
        self._owns_records = admission.owner_key is not None and public_key_text(record_key) == admission.owner
        local = read_revocations(admission.revocations_file) if admission.revocations_file is not None else None
        if local is not None:  # the owner's own copy (`swarmnode revoke` keeps it beside the key)
            self._take(parse_record(RevocationRecord, local, what=f"revocation list {admission.revocations_file}"))
        self._known_revoked: frozenset[str] = frozenset()  # revocations already logged
        self._pushed: frozenset[str] | None = None
        self._read_at = 0.0
        self._lock = asyncio.Lock()
        self.refused = 0  # RPCs refused by the gate

    # --- the view ------------------------------------------------------------------------------------
    def roles_of(self, peer_id: str) -> frozenset[Role]:
        """The roles `peer_id` holds now. Every invitation in the view was checked in full when it entered it
        (owner, signature, key), so what can change since is only its expiry and revocation: this runs for every
        call a member takes and every record it reads, and verifies no signature."""
        invitation = self._members.get(peer_id)
        if invitation is None or invitation.expires <= time.time() or peer_id in self.revoked:
            return frozenset()
        return invitation.roles

    def admits(self, peer_id: str, role: Role = Role.NODE) -> bool:
        """Whether `peer_id` is admitted in `role` now, as far as the last read shows."""
        return role in self.roles_of(peer_id)

    def why_not(self, peer_id: str, roles: Iterable[Role]) -> str:
        """Why `peer_id` is not admitted in any of `roles`, for people."""
        names = sorted(r.value for r in roles)
        invitation = self._members.get(peer_id)
        if invitation is None:
            return f"peer {short_id(peer_id)} holds no invitation to this private swarm"
        problem = invitation.problem(self.owner, revoked=self.revoked)
        if problem is not None:
            return f"peer {short_id(peer_id)}'s invitation is not valid: {problem}"
        return (f"peer {short_id(peer_id)} is admitted as {', '.join(sorted(r.value for r in invitation.roles))}, "
                f"not as {' or '.join(names)}")

    async def refusal(self, peer_id: str, roles: frozenset[Role]) -> str | None:
        """Why `peer_id` may not call an RPC for `roles`, or None when it may (the gate of `rpc.register`). A
        caller the view does not know yet (a peer that just published its invitation) makes it read the members
        once more, a read that begins after the call came, before it is refused."""
        if self.roles_of(peer_id) & roles:
            return None
        if peer_id not in self._members:
            await self.refresh(since=time.monotonic())
            if self.roles_of(peer_id) & roles:
                return None
        self.refused += 1
        return f"this swarm is private and {self.why_not(peer_id, roles)}"

    async def learn(self, peer_ids: Iterable[str]) -> None:
        """Read the members again when some of `peer_ids` are not known yet (at most every `MISS_REFRESH_S`):
        a node that just joined is admitted before its records are next read."""
        if any(p not in self._members for p in peer_ids) and time.monotonic() - self._read_at > MISS_REFRESH_S:
            await self.refresh()

    # --- reading and publishing ---------------------------------------------------------------------------
    async def publish(self) -> bool:
        """Store this process's invitation under `{swarm}.members` (until its next heartbeat's store)."""
        from hivemind.utils import get_dht_time

        expires = min(get_dht_time() + MEMBER_RECORD_TTL, self.admission.invitation.expires)
        record = MemberRecord(invitation=self.admission.invitation.text())
        try:
            return bool(await self.dht.store(members_key(self.swarm), subkey=self._subkey, value=record.to_dict(),
                                             expiration_time=expires, return_future=True))
        except Exception as exc:  # safe: published again at the next heartbeat
            logger.warning("could not publish this peer's invitation: %s", exc)
            return False

    async def refresh(self, since: float | None = None) -> None:
        """Read the members and the owner's revocation list (one read at a time; callers that come while one
        is under way wait for it). A read that finds nothing, or fails, changes nothing: invitations already
        checked stay known (they lapse by expiry or revocation, not by a record's absence), and so does the
        revocation list."""
        began = time.monotonic() if since is None else since
        async with self._lock:
            if self._read_at >= began:
                return  # a read that began after this caller asked has finished meanwhile
            started = time.monotonic()
            members, revoked = await asyncio.gather(read_items(self.dht, members_key(self.swarm), DHT_READ_TIMEOUT),
                                                    read_items(self.dht, revoked_key(self.swarm), DHT_READ_TIMEOUT))
            self._revocations(revoked)
            found = dict(self._members)
            for subkey, item in members.items():
                record = parse_record(MemberRecord, getattr(item, "value", None), what="member record")
                if not isinstance(record, MemberRecord):
                    continue
                try:
                    invitation = Invitation.from_text(record.invitation)
                except AdmissionError as exc:
                    logger.debug("ignoring a member record under %r: %s", str(subkey)[:40], exc)
                    continue
                if invitation.problem(self.owner) is not None:
                    continue
                known = found.get(invitation.peer_id)
                if known is None or known.expires < invitation.expires:
                    found[invitation.peer_id] = invitation
            for peer in sorted(self.revoked - self._known_revoked):
                logger.warning("peer %s was revoked by the swarm's owner: refusing its calls and records",
                               short_id(peer))
            self._known_revoked = frozenset(self.revoked)
            self._members = found
            self._read_at = started
        await self._push_revoked()

    def _revocations(self, items: dict) -> None:
        """Take the newest revocation list the owner's key signed among `items` (a DHT read's)."""
        for subkey, item in items.items():
            owner = owner_of(subkey)
            if owner is None or " ".join(owner.split()[:2]) != " ".join(self.owner.split()[:2]):
                continue  # only the owner's key may revoke
            self._take(parse_record(RevocationRecord, getattr(item, "value", None), what="revocation list"))

    def _take(self, record) -> None:
        """Keep `record` (a `RevocationRecord`, or None when one did not parse) if it is newer than the list known."""
        if isinstance(record, RevocationRecord) and record.updated > self.revoked_updated:
            self.revoked, self.revoked_updated = frozenset(record.peers), record.updated

    async def republish_revocations(self) -> bool:
        """Store the revocation list again, as the owner signs it: done each heartbeat by a process holding the
        owner's key as its records' key (the bootstrap started with `--owner-key`), so the list outlives the
        peers that stored it and the `revoke` command that wrote it."""
        if not self._owns_records or not self.revoked_updated:
            return False
        from hivemind.utils import get_dht_time

        record = RevocationRecord(peers=sorted(self.revoked), updated=self.revoked_updated)
        try:
            return bool(await self.dht.store(revoked_key(self.swarm), subkey=self._marker, value=record.to_dict(),
                                             expiration_time=get_dht_time() + REVOCATION_TTL, return_future=True))
        except Exception as exc:  # safe: stored again at the next heartbeat
            logger.warning("could not store the revocation list again: %s", exc)
            return False

    async def _push_revoked(self) -> None:
        if self.revoked == self._pushed:
            return
        try:
            await self.dht.run_coroutine(functools.partial(set_revoked, self.revoked), return_future=True)
            self._pushed = self.revoked
        except Exception as exc:  # safe: pushed again after the next read
            logger.warning("could not hand the revocation list to the DHT process: %s", exc)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Publish and read every heartbeat until `stop` is set (or the task is cancelled)."""
        while stop is None or not stop.is_set():
            await self.publish()
            await self.refresh()
            await self.republish_revocations()
            problem = self.admission.invitation.problem(self.owner, revoked=self.revoked)
            if problem is not None:
                logger.error("this peer's own invitation no longer admits it (%s): other peers refuse its calls",
                             problem)
            try:
                if stop is None:
                    await asyncio.sleep(HEARTBEAT_INTERVAL)
                else:
                    await asyncio.wait_for(stop.wait(), HEARTBEAT_INTERVAL)
            except asyncio.TimeoutError:
                pass

    async def start(self) -> None:
        """Publish this process's invitation (tried again for a few seconds if no peer stores it: the DHT may be
        starting too) and read the others' once, before the process calls anyone."""
        for attempt in range(PUBLISH_ATTEMPTS):
            if await self.publish():
                break
            if attempt + 1 < PUBLISH_ATTEMPTS:
                await asyncio.sleep(PUBLISH_RETRY_S)
        else:
            logger.warning("no peer stored this peer's invitation yet: members refuse its calls until one does "
                           "(tried again every heartbeat)")
        await self.refresh()
