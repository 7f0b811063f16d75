"""Invitations to a private swarm and the checks built on them, with real keys and hivemind's real authorizer
code path (`swarmnode.admission`, `swarmnode.membership.SwarmAuthorizer`); the swarm itself is
tests/test_private_swarm.py."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from hivemind.proto import dht_pb2
from hivemind.utils.crypto import RSAPrivateKey

from swarmnode.admission import (
    ALL_ROLES,
    Admission,
    AdmissionError,
    Invitation,
    Role,
)
from swarmnode.identity import PeerIdentity, public_key_text
from swarmnode.membership import SwarmAuthorizer
from swarmnode.rpc import NODE_RPCS, RELAY_RPCS, RPC_INFERENCE, RPC_KV_HANDOVER


@pytest.fixture(scope="module")
def owner():
    return RSAPrivateKey()


@pytest.fixture
def peer(tmp_path):
    return PeerIdentity.load_or_create(str(tmp_path / "peer.id"))


def invite(owner, peer, roles=(Role.NODE,), seconds=3600.0, now=None):
    now = time.time() if now is None else now
    return Invitation.issue(owner, public_key_text(peer.key), roles, now + seconds, now=now)


def test_an_invitation_travels_as_text_and_admits_its_peer(owner, peer, tmp_path):
    invitation = invite(owner, peer, (Role.NODE, Role.CLIENT))
    text = invitation.text()
    assert text.startswith("swarmnode-invitation:1:") and "\n" not in text
    again = Invitation.from_text(text)
    assert again.peer_id == peer.peer_id and again.roles == {Role.NODE, Role.CLIENT}
    assert again.problem(public_key_text(owner)) is None
    (tmp_path / "inv.txt").write_text(text + "\n")
    assert Invitation.from_text(str(tmp_path / "inv.txt")).peer_id == peer.peer_id
    assert json.dumps(again.describe())  # what `invite --json` prints


def test_a_changed_invitation_is_refused_as_forged(owner, peer):
    invitation = invite(owner, peer)
    token = type(invitation.token)()
    token.CopyFrom(invitation.token)
    fields = json.loads(token.username)
    fields["roles"] = ["client", "coordinator", "node"]  # a node granting itself more roles
    token.username = json.dumps(fields)
    assert "forged or changed" in Invitation.from_token(token).problem(public_key_text(owner))
    token.CopyFrom(invitation.token)
    token.expiration_time = repr(time.time() + 10 * 365 * 86400)  # or a longer life
    assert "forged or changed" in Invitation.from_token(token).problem(public_key_text(owner))


def test_an_invitation_signed_by_another_key_in_the_owners_name_is_forged(owner, peer):
    stranger = RSAPrivateKey()
    forged = invite(stranger, peer)
    token = type(forged.token)()
    token.CopyFrom(forged.token)
    fields = json.loads(token.username)
    fields["owner"] = public_key_text(owner)
    token.username = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    assert "forged" in Invitation.from_token(token).problem(public_key_text(owner))
    # and a stranger's honest invitation is for another swarm
    assert "another swarm" in forged.problem(public_key_text(owner))


def test_expired_revoked_and_future_invitations_are_refused_with_why(owner, peer):
    now = time.time()
    invitation = invite(owner, peer, seconds=60, now=now)
    key = public_key_text(owner)
    assert invitation.problem(key, now=now + 30) is None
    assert "expired on" in invitation.problem(key, now=now + 61)
    assert "revoked" in invitation.problem(key, now=now, revoked=frozenset({peer.peer_id}))
    assert "in the future" in invitation.problem(key, now=now - 3600)


def test_an_invitation_must_name_a_role_a_real_key_and_a_sane_expiry(owner, peer):
    with pytest.raises(AdmissionError, match="at least one role"):
        invite(owner, peer, roles=())
    with pytest.raises(AdmissionError, match="must expire after now"):
        invite(owner, peer, seconds=-1)
    with pytest.raises(AdmissionError, match="not an OpenSSH RSA public key"):
        Invitation.issue(owner, "ssh-rsa bm90IGEga2V5", [Role.NODE], time.time() + 60)
    with pytest.raises(ValueError):
        invite(owner, peer, roles=("admin",))


def test_text_that_is_no_invitation_says_so():
    with pytest.raises(AdmissionError, match="neither an invitation"):
        Invitation.from_text("hello")
    with pytest.raises(AdmissionError, match="cut or changed"):
        Invitation.from_text("swarmnode-invitation:1:@@@")
    with pytest.raises(AdmissionError, match="not a swarmnode invitation"):
        Invitation.from_text("swarmnode-invitation:1:")


def test_loading_an_admission_checks_identity_role_and_validity(owner, peer, tmp_path):
    text = invite(owner, peer, (Role.NODE,)).text()
    admission = Admission.load(Role.NODE, invitation=text, identity=peer.path)
    assert admission is not None and admission.peer_id == peer.peer_id and admission.owner_key is None
    assert Admission.load(Role.NODE) is None  # a public swarm
    with pytest.raises(AdmissionError, match="start with --identity FILE"):
        Admission.load(Role.NODE, invitation=text)
    other = PeerIdentity.load_or_create(str(tmp_path / "other.id"))
    with pytest.raises(AdmissionError, match=f"is for peer {peer.peer_id}, but --identity .* holds peer "
                                             f"{other.peer_id}"):
        Admission.load(Role.NODE, invitation=text, identity=other.path)
    with pytest.raises(AdmissionError, match="does not exist"):
        Admission.load(Role.NODE, invitation=text, identity=str(tmp_path / "missing.id"))
    with pytest.raises(AdmissionError, match="as node, not as client"):
        Admission.load(Role.CLIENT, invitation=text, identity=peer.path)
    assert Admission.load(None, invitation=text, identity=peer.path) is not None  # a reader takes any role
    expired = invite(owner, peer, seconds=60, now=time.time() - 120).text()
    with pytest.raises(AdmissionError, match="expired on"):
        Admission.load(Role.NODE, invitation=expired, identity=peer.path)
    with pytest.raises(AdmissionError, match="not both"):
        Admission.load(Role.NODE, invitation=text, identity=peer.path, owner_key="owner.pem")


def test_the_owner_key_admits_its_holder_in_every_role(tmp_path):
    from swarmnode.identity import load_or_create_private_key

    load_or_create_private_key(tmp_path / "owner.pem")
    admission = Admission.load(Role.COORDINATOR, owner_key=str(tmp_path / "owner.pem"))
    assert admission is not None and admission.roles == ALL_ROLES and admission.owner_key is not None
    assert admission.invitation.problem(admission.owner) is None
    with pytest.raises(AdmissionError, match="--owner-key"):
        Admission.load(Role.NODE, owner_key=str(tmp_path / "missing.pem"))


def test_dht_messages_are_signed_with_invitations_and_checked_by_the_receiver(owner, tmp_path):
    """hivemind's `TokenAuthorizerBase` protocol with invitations: a member's request passes another member's
    check once (a replay is refused), a stranger's and a revoked member's do not."""
    def member(name: str, roles=(Role.NODE,), signer=owner) -> Admission:
        identity = PeerIdentity.load_or_create(str(tmp_path / f"{name}.id"))
        invitation = Invitation.issue(signer, public_key_text(identity.key), roles, time.time() + 600)
        return Admission(public_key_text(signer), invitation, identity)

    bob_admission = member("bob", (Role.CLIENT,))
    alice, bob = SwarmAuthorizer(member("alice")), SwarmAuthorizer(bob_admission)
    eve = SwarmAuthorizer(member("eve", signer=RSAPrivateKey()))  # a member of another owner's swarm

    async def exchange():
        request = dht_pb2.PingRequest()
        await bob.sign_request(request, None)
        sent = request.SerializeToString()  # validation clears the signature it checked: replay the bytes sent
        first = await alice.validate_request(dht_pb2.PingRequest.FromString(sent))
        replay = await alice.validate_request(dht_pb2.PingRequest.FromString(sent))
        response = dht_pb2.PingResponse()
        await alice.sign_response(response, request)
        answer = await bob.validate_response(response, request)
        foreign = dht_pb2.PingRequest()
        await eve.sign_request(foreign, None)
        stranger = await alice.validate_request(foreign)
        alice.revoked = frozenset({bob_admission.peer_id})
        late = dht_pb2.PingRequest()
        await bob.sign_request(late, None)
        revoked = await alice.validate_request(late)
        return first, replay, answer, stranger, revoked

    assert asyncio.run(exchange()) == (True, False, True, False, False)
    unsigned = dht_pb2.PingRequest()  # a public peer's request carries no invitation at all
    assert asyncio.run(alice.validate_request(unsigned)) is False


def test_every_rpc_names_the_roles_that_may_call_it():
    from swarmnode.rpc import ROLES_BY_NAME, RPC_OUTPUTS, RPC_REACH_CHECK, RPC_RELAY, RPC_RELAY_RESERVE

    by_name = {rpc.name: rpc for rpc in (*NODE_RPCS, *RELAY_RPCS)}
    assert by_name[RPC_INFERENCE].roles == by_name[RPC_OUTPUTS].roles == {Role.CLIENT}
    assert by_name[RPC_KV_HANDOVER].roles == by_name[RPC_RELAY_RESERVE].roles == {Role.NODE}
    assert by_name[RPC_RELAY].roles == ALL_ROLES  # a relay checks the roles of the RPC it forwards instead:
    assert {rpc.name: rpc.roles for rpc in NODE_RPCS} == ROLES_BY_NAME
    # only a starting node's reachability check is answered without an invitation (it dials the caller back)
    assert [rpc.name for rpc in by_name.values() if rpc.open_to_all] == [RPC_REACH_CHECK]
