"""Signed records and trust on a real hivemind DHT: owner-marked subkeys, unsigned and untrusted records,
trusted-key loading, and the coordinator lease.

Three DHT peers run on 127.0.0.1 for the whole module: `a` and `a2` sign with the same key (two
coordinators sharing one key file), `b` with its own. Every test uses its own DHT prefix, so the tests
do not see each other's records. The peers are shut down when the module ends, whether it passed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import time
from dataclasses import dataclass

import hivemind
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from hivemind.utils.crypto import RSAPrivateKey

from swarmnode.coordinator.lease import Lease
from swarmnode.dht import start_dht
from swarmnode.identity import (
    KeyFileError,
    load_or_create_private_key,
    load_private_key,
    load_trusted_keys,
    owner_marker,
    owner_of,
    peer_id_of_key,
    public_key_text,
)
from swarmnode.naming import short_id
from swarmnode.records import NodeRecord, PlacementRecord, nodes_key, placement_key
from swarmnode.swarm_state import Rejected, read_leases, read_nodes, read_placement, store_owned

TTL = 60.0  # lifetime of the records the tests store; longer than the module runs


@dataclass(frozen=True)
class Peers:
    a: hivemind.DHT
    b: hivemind.DHT
    a2: hivemind.DHT  # signs with key_a, like `a`
    key_a: RSAPrivateKey
    key_b: RSAPrivateKey

    @property
    def pub_a(self) -> str:
        return public_key_text(self.key_a)

    @property
    def pub_b(self) -> str:
        return public_key_text(self.key_b)

    def pid(self, dht: hivemind.DHT) -> str:
        return dht.peer_id.to_base58()


def _identity_file(key: RSAPrivateKey, path) -> str:
    """A libp2p identity file holding `key` (as nodes do, a peer's records are signed with its identity key)."""
    from hivemind.proto import crypto_pb2

    path.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=key.to_bytes()).SerializeToString())
    return str(path)


@pytest.fixture(scope="module")
def peers(tmp_path_factory):
    key_a, key_b = RSAPrivateKey(), RSAPrivateKey()
    folder = tmp_path_factory.mktemp("identities")
    started: list[hivemind.DHT] = []
    try:
        started.append(start_dht(key=key_a, identity_path=_identity_file(key_a, folder / "a.key")))
        initial = [str(addr) for addr in started[0].get_visible_maddrs()]
        started.append(start_dht(initial, key=key_b, identity_path=_identity_file(key_b, folder / "b.key")))
        started.append(start_dht(initial, key=key_a))  # a second peer signing with a's key, under its own id
        yield Peers(*started, key_a=key_a, key_b=key_b)
    finally:
        for dht in reversed(started):
            with contextlib.suppress(Exception):
                dht.shutdown()


def run(coro):
    return asyncio.run(coro)


async def _items(dht, key: str) -> dict:
    """subkey -> value of everything stored under `key`, as `dht` reads it from the network."""
    found = await dht.get(key, latest=True, return_future=True)
    if found is None:
        return {}
    return {subkey: item.value for subkey, item in found.value.items()}


def _node(peer_id: str, **fields) -> dict:
    record = dict(peer_id=peer_id, state="waiting", device="cpu", dtype="float32", memory_bytes=2 << 30,
                  num_threads=2, block_bytes=1 << 20, overhead_bytes=1 << 20, max_blocks=8,
                  block_throughput=100.0)
    record.update(fields)
    return NodeRecord(**record).to_dict()


def _placement(version: int, term: int, coordinator: str, peers: Peers, **fields) -> dict:
    record = dict(version=version, term=term, coordinator=coordinator, algorithm="greedy", reason="test",
                  created=time.time(), num_blocks=4,
                  assignments={peers.pid(peers.a): (0, 2), peers.pid(peers.b): (2, 4)})
    record.update(fields)
    return PlacementRecord(**record).to_dict()


# 1. owner-marked subkeys ----------------------------------------------------------------------------------


def test_peer_cannot_overwrite_another_peers_record(peers):
    prefix = "trust-overwrite"
    key = nodes_key(prefix)
    marker_a, marker_b = owner_marker(peers.key_a), owner_marker(peers.key_b)
    pid_a, pid_b = peers.pid(peers.a), peers.pid(peers.b)
    original = _node(pid_a, memory_bytes=1 << 30, note="a's own record")
    forged = _node(pid_a, memory_bytes=1 << 40, note="forged by b")

    async def scenario():
        assert await store_owned(peers.a, key, marker_a, original, TTL)
        # b's validator cannot sign under a's marker, so every peer (b included) refuses the value,
        # even with a later expiration than a's record
        assert not await store_owned(peers.b, key, marker_a, forged, TTL * 2)
        for reader in (peers.a, peers.b):
            items = await _items(reader, key)
            assert items == {marker_a: original}
            assert owner_of(marker_a) == peers.pub_a
            assert await read_nodes(reader, prefix) == {pid_a: NodeRecord(**original)}
        # b may write its own subkey
        own = _node(pid_b, note="b's own record")
        assert await store_owned(peers.b, key, marker_b, own, TTL)
        for reader in (peers.a, peers.b):
            rejected: list[Rejected] = []
            nodes = await read_nodes(reader, prefix, rejected)
            assert nodes == {pid_a: NodeRecord(**original), pid_b: NodeRecord(**own)}
            assert rejected == []

    run(scenario())


@pytest.fixture
def rogue(peers):
    """A peer that runs no signature validator: it keeps whatever it is asked to store."""
    started: list[hivemind.DHT] = []
    try:
        started.append(hivemind.DHT(initial_peers=[str(addr) for addr in peers.a.get_visible_maddrs()],
                                    start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], num_workers=2))
        yield started[0]
    finally:
        for dht in started:
            with contextlib.suppress(Exception):
                dht.shutdown()


def test_forged_record_held_by_a_rogue_peer_is_refused_by_readers(peers, rogue):
    prefix = "trust-rogue"
    key = nodes_key(prefix)
    marker_a = owner_marker(peers.key_a)
    pid_a = peers.pid(peers.a)
    original = _node(pid_a, note="a's own record")
    forged = _node(pid_a, note="forged by a rogue", memory_bytes=1 << 40)

    async def scenario():
        assert await store_owned(peers.a, key, marker_a, original, TTL)
        # the honest peers refuse the unsigned value; the rogue keeps it in its own storage
        assert not await store_owned(rogue, key, marker_a, forged, TTL * 2)
        assert await _items(rogue, key) == {marker_a: forged}
        # honest readers validate what other peers send them, so they still read a's record
        for reader in (peers.a, peers.b, peers.a2):
            assert await _items(reader, key) == {marker_a: original}
            assert await read_nodes(reader, prefix) == {pid_a: NodeRecord(**original)}

    run(scenario())


def test_a_record_naming_another_peer_than_its_signer_is_refused(peers):
    """b signs a node record with its own key, validly, but names a's peer id in it: the DHT stores it (b may
    write its own subkey), and every reader refuses it, because a node's records must be signed by the identity
    key its peer id is derived from. a's own record is read as before."""
    prefix = "trust-claim"
    pid_a, pid_b = peers.pid(peers.a), peers.pid(peers.b)
    assert peer_id_of_key(peers.pub_a) == pid_a and peer_id_of_key(peers.pub_b) == pid_b
    original = _node(pid_a, note="a's own record")
    claimed = _node(pid_a, note="b posing as a", memory_bytes=1 << 40)

    async def scenario():
        assert await store_owned(peers.a, nodes_key(prefix), owner_marker(peers.key_a), original, TTL)
        assert await store_owned(peers.b, nodes_key(prefix), owner_marker(peers.key_b), claimed, TTL * 2)
        for reader in (peers.a, peers.b, peers.a2):
            rejected: list[Rejected] = []
            assert await read_nodes(reader, prefix, rejected) == {pid_a: NodeRecord(**original)}
            assert [r.owner for r in rejected] == [peers.pub_b]
            assert rejected[0].why == (f"node record claims peer {short_id(pid_a)} but is signed by the key of "
                                       f"peer {short_id(pid_b)}")

    run(scenario())


# 2. unsigned records ----------------------------------------------------------------------------------------


def test_unsigned_records_are_ignored_and_reported(peers):
    prefix = "trust-unsigned"
    pid_a, pid_b = peers.pid(peers.a), peers.pid(peers.b)
    trusted = frozenset({peers.pub_a, peers.pub_b})
    signed_node = _node(pid_a, note="signed")
    signed_placement = _placement(1, 1, pid_a, peers)

    async def scenario():
        assert await store_owned(peers.a, nodes_key(prefix), owner_marker(peers.key_a), signed_node, TTL)
        assert await store_owned(peers.a, placement_key(prefix), owner_marker(peers.key_a), signed_placement, TTL)
        # no owner marker: the DHT accepts these (they are not protected), the readers must not
        assert await store_owned(peers.b, nodes_key(prefix), "rogue", _node(pid_b, note="unsigned"), TTL)
        assert await store_owned(peers.b, nodes_key(prefix), b"rogue-bytes", _node(pid_a, note="hijack"), TTL * 2)
        assert await store_owned(peers.b, placement_key(prefix), "rogue",
                                 _placement(99, 9, pid_b, peers, reason="unsigned"), TTL)

        for reader in (peers.a, peers.b):
            rejected: list[Rejected] = []
            assert await read_nodes(reader, prefix, rejected) == {pid_a: NodeRecord(**signed_node)}
            assert {r.why for r in rejected} == {
                "unsigned node record under subkey 'rogue'",
                "unsigned node record under subkey \"b'rogue-bytes'\"",
            }
            assert len(rejected) == 2
            assert all(r.owner is None for r in rejected)

            rejected = []
            assert await read_placement(reader, prefix, trusted, rejected) == PlacementRecord(**signed_placement)
            assert [(r.owner, r.why) for r in rejected] == [(None, "unsigned placement under subkey 'rogue'")]

    run(scenario())


# 3. placements and trusted keys -------------------------------------------------------------------------


def test_read_placement_follows_only_trusted_keys(peers):
    prefix = "trust-placement"
    pid_a, pid_b = peers.pid(peers.a), peers.pid(peers.b)
    by_a = _placement(2, 1, pid_a, peers)
    by_b = _placement(9, 4, pid_b, peers)  # newer, but signed by b

    async def scenario():
        assert await store_owned(peers.a, placement_key(prefix), owner_marker(peers.key_a), by_a, TTL)
        assert await store_owned(peers.b, placement_key(prefix), owner_marker(peers.key_b), by_b, TTL)
        for reader in (peers.a, peers.b):
            rejected: list[Rejected] = []
            assert await read_placement(reader, prefix, frozenset({peers.pub_a}), rejected) == PlacementRecord(**by_a)
            assert len(rejected) == 1
            assert rejected[0].owner == peers.pub_b
            assert "untrusted key" in rejected[0].why and "v9" in rejected[0].why
            assert rejected[0].record == PlacementRecord(**by_b)

            rejected = []
            assert await read_placement(reader, prefix, frozenset({peers.pub_b}), rejected) == PlacementRecord(**by_b)
            assert [r.owner for r in rejected] == [peers.pub_a]

            rejected = []
            assert await read_placement(reader, prefix, frozenset(), rejected) is None
            assert sorted(r.owner for r in rejected) == sorted([peers.pub_a, peers.pub_b])
            assert all("untrusted key" in r.why for r in rejected)

            both = frozenset({peers.pub_a, peers.pub_b})
            rejected = []
            assert await read_placement(reader, prefix, both, rejected) == PlacementRecord(**by_b)
            assert rejected == []

    run(scenario())


@pytest.mark.parametrize(("order_a", "order_b", "winner"), [
    ((5, 1, "a"), (4, 9, "b"), "a"),  # the version decides, whatever the term
    ((5, 2, "a"), (5, 3, "b"), "b"),  # same version: the term decides
    ((5, 2, "z"), (5, 2, "y"), "a"),  # same version and term: the coordinator id decides
], ids=["version", "term", "coordinator"])
def test_newest_trusted_placement_wins(peers, order_a, order_b, winner):
    prefix = f"trust-order-{order_a[0]}-{order_a[1]}-{order_a[2]}"
    coordinator_id = {"a": peers.pid(peers.a), "b": peers.pid(peers.b), "y": "1" * 45 + "y", "z": "1" * 45 + "z"}
    by_a = _placement(order_a[0], order_a[1], coordinator_id[order_a[2]], peers)
    by_b = _placement(order_b[0], order_b[1], coordinator_id[order_b[2]], peers)
    expected = PlacementRecord(**(by_a if winner == "a" else by_b))
    both = frozenset({peers.pub_a, peers.pub_b})

    async def scenario():
        # b is stored first: the winner is stored last in two cases and first in one, so order does not matter
        assert await store_owned(peers.b, placement_key(prefix), owner_marker(peers.key_b), by_b, TTL)
        assert await store_owned(peers.a, placement_key(prefix), owner_marker(peers.key_a), by_a, TTL)
        for reader in (peers.a, peers.b):
            rejected: list[Rejected] = []
            assert await read_placement(reader, prefix, both, rejected) == expected
            assert rejected == []

    run(scenario())


def test_malformed_placement_from_trusted_key_is_ignored(peers):
    pid_a, pid_b = peers.pid(peers.a), peers.pid(peers.b)
    both = frozenset({peers.pub_a, peers.pub_b})
    valid_b = _placement(1, 1, pid_b, peers)
    valid_a = _placement(1, 1, pid_a, peers)
    uncovered = dict(_placement(7, 1, pid_a, peers), assignments={pid_a: [0, 2]})  # blocks 2 and 3 unserved
    negative = dict(_placement(8, 1, pid_b, peers), version=-1)
    past_the_end = dict(_placement(6, 1, pid_a, peers), assignments={pid_a: [0, 5]})
    cases = [
        ("trust-malformed-uncovered", (peers.a, peers.key_a, uncovered), (peers.b, peers.key_b, valid_b)),
        ("trust-malformed-negative", (peers.b, peers.key_b, negative), (peers.a, peers.key_a, valid_a)),
        ("trust-malformed-past-end", (peers.a, peers.key_a, past_the_end), (peers.b, peers.key_b, valid_b)),
        ("trust-malformed-not-a-dict", (peers.a, peers.key_a, ["not", "a", "placement"]),
         (peers.b, peers.key_b, valid_b)),
    ]

    async def scenario():
        for prefix, (bad_dht, bad_key, bad), (good_dht, good_key, good) in cases:
            assert await store_owned(bad_dht, placement_key(prefix), owner_marker(bad_key), bad, TTL)
            assert await store_owned(good_dht, placement_key(prefix), owner_marker(good_key), good, TTL)
            for reader in (peers.a, peers.b):
                rejected: list[Rejected] = []
                assert await read_placement(reader, prefix, both, rejected) == PlacementRecord(**good), prefix
                assert [(r.owner, r.why) for r in rejected] == [
                    (public_key_text(bad_key), "malformed placement")
                ], prefix
                # alone, the malformed record gives no placement at all
                rejected = []
                assert await read_placement(reader, prefix, frozenset({public_key_text(bad_key)}), rejected) is None
                whys = {r.owner: r.why for r in rejected}
                assert whys[public_key_text(bad_key)] == "malformed placement", prefix
                assert "untrusted key" in whys[public_key_text(good_key)], prefix

    run(scenario())


# 4. load_trusted_keys -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rsa_keys():
    return RSAPrivateKey(), RSAPrivateKey()


def test_trusted_key_from_ssh_rsa_string(rsa_keys):
    key = rsa_keys[0]
    text = public_key_text(key)
    assert text.startswith("ssh-rsa AAAA") and len(text.split()) == 2
    assert load_trusted_keys([text]) == frozenset({text})
    # a trailing comment and surrounding whitespace are dropped: the result matches the owner marker
    assert load_trusted_keys([f"  {text} operator@host \n"]) == frozenset({text})
    assert owner_of(owner_marker(key)) == text
    assert load_trusted_keys([text, public_key_text(rsa_keys[1])]) == {text, public_key_text(rsa_keys[1])}


def test_trusted_keys_from_pub_file(tmp_path, rsa_keys):
    first, second = (public_key_text(k) for k in rsa_keys)
    path = tmp_path / "coordinators.pub"
    path.write_text(f"# the coordinators of this swarm\n{first} alice@one\n\n   {second}\n")
    assert load_trusted_keys([str(path)]) == frozenset({first, second})


def test_trusted_key_from_private_key_file(tmp_path, rsa_keys):
    path = tmp_path / "keys" / "coordinator.pem"
    key = load_or_create_private_key(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert load_trusted_keys([str(path)]) == frozenset({public_key_text(key)})
    # the file is reused, not replaced
    assert public_key_text(load_or_create_private_key(path)) == public_key_text(key)
    assert public_key_text(load_private_key(path)) == public_key_text(key)
    # mixed specs add up
    other = public_key_text(rsa_keys[0])
    assert load_trusted_keys([str(path), other]) == frozenset({public_key_text(key), other})


def test_garbage_trusted_key_specs_are_refused(tmp_path):
    with pytest.raises(KeyFileError, match=r"'not-a-key' is neither an `ssh-rsa \.\.\.` public key nor a readable file"):
        load_trusted_keys(["not-a-key"])
    with pytest.raises(KeyFileError, match="--trusted-coordinator: not an OpenSSH RSA public key"):
        load_trusted_keys(["ssh-rsa AAAAgarbage"])
    with pytest.raises(KeyFileError, match="neither an `ssh-rsa"):
        load_trusted_keys([str(tmp_path)])  # a directory is not a key file
    with pytest.raises(KeyFileError, match="neither an `ssh-rsa"):
        load_trusted_keys([str(tmp_path / "missing.pub")])


def test_key_files_with_garbage_are_refused(tmp_path, rsa_keys):
    good = public_key_text(rsa_keys[0])
    garbage = tmp_path / "garbage.pub"
    garbage.write_text(f"# comment\n{good}\nthis is not a key\n")
    with pytest.raises(KeyFileError, match=rf"{garbage}:3: not an OpenSSH RSA public key"):
        load_trusted_keys([str(garbage)])

    ed25519_line = ed25519.Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()
    not_rsa = tmp_path / "ed25519.pub"
    not_rsa.write_text(ed25519_line + "\n")
    with pytest.raises(KeyFileError, match=rf"{not_rsa}:1: not an OpenSSH RSA public key"):
        load_trusted_keys([str(not_rsa)])

    empty = tmp_path / "empty.pub"
    empty.write_text("# nobody yet\n\n")
    with pytest.raises(KeyFileError, match=rf"{empty} holds no public key"):
        load_trusted_keys([str(empty)])

    broken_pem = tmp_path / "broken.pem"
    broken_pem.write_text("-----BEGIN PRIVATE KEY-----\nnot base64 at all\n-----END PRIVATE KEY-----\n")
    with pytest.raises(KeyFileError, match=rf"{broken_pem} is not an unencrypted PEM private key"):
        load_trusted_keys([str(broken_pem)])

    ed_pem = tmp_path / "ed25519.pem"
    ed_pem.write_bytes(ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    with pytest.raises(KeyFileError, match=rf"{ed_pem} holds a \w*Ed25519PrivateKey\w*, not an RSA key"):
        load_trusted_keys([str(ed_pem)])


def test_key_file_without_keys_is_refused_after_other_specs(tmp_path, rsa_keys):
    empty = tmp_path / "empty.pub"
    empty.write_text("# nobody yet\n")
    with pytest.raises(KeyFileError, match="holds no public key"):
        load_trusted_keys([public_key_text(rsa_keys[0]), str(empty)])


def test_default_trusted_key_is_this_machines_swarm_key(tmp_path, monkeypatch):
    monkeypatch.setenv("SWARMNODE_KEY_DIR", str(tmp_path))
    path = tmp_path / "swarm_key.pem"
    assert load_trusted_keys(None, create=False) == frozenset()
    assert load_trusted_keys([], create=False) == frozenset()
    assert not path.exists()

    trusted = load_trusted_keys(None)
    assert path.is_file() and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert trusted == frozenset({public_key_text(load_private_key(path))})
    # once it exists, the same key is trusted with or without `create`
    assert load_trusted_keys([]) == trusted
    assert load_trusted_keys(None, create=False) == trusted
    assert load_trusted_keys([str(path)]) == trusted


# 5. the coordinator lease ---------------------------------------------------------------------------------

LEASE_TTL, LEASE_SETTLE = 3.0, 0.5


def _holders(*leases: Lease) -> list[Lease]:
    return [lease for lease in leases if lease.held]


def test_lease_shared_key_one_holder_and_takeover(peers):
    prefix = "trust-lease-shared"
    subkey = owner_marker(peers.key_a)  # both coordinators sign with key_a: one subkey
    trusted = frozenset({peers.pub_a})
    first = Lease(peers.a, prefix, subkey, peers.pid(peers.a), trusted, settle=LEASE_SETTLE, ttl=LEASE_TTL)
    second = Lease(peers.a2, prefix, subkey, peers.pid(peers.a2), trusted, settle=LEASE_SETTLE, ttl=LEASE_TTL)

    async def scenario():
        await asyncio.gather(first.poll(), second.poll())
        for lease in (first, second):
            await lease.poll()
        assert len(_holders(first, second)) == 1, [(x.held, x.term, x.holder) for x in (first, second)]
        holder, standby = _holders(first, second)[0], next(x for x in (first, second) if not x.held)
        assert holder.term >= 1 and holder.holder == holder.peer_id
        assert standby.holder == holder.peer_id
        leases = await read_leases(peers.b, prefix, trusted)
        assert [(s.lease.holder, s.lease.term) for s in leases] == [(holder.peer_id, holder.term)]

        # the holder stops renewing: the standby takes over once the lease lapses, with a higher term
        stopped = time.monotonic()
        deadline = stopped + LEASE_TTL + LEASE_SETTLE + 10.0
        while not await standby.poll():
            assert time.monotonic() < deadline, "the standby never took over the lapsed lease"
            await asyncio.sleep(0.25)
        took = time.monotonic() - stopped
        assert standby.held and standby.term > holder.term
        assert took < LEASE_TTL + LEASE_SETTLE + 10.0

        # the old holder, polling again, sees the newer term and steps down
        assert not await holder.poll()
        assert not holder.held and holder.holder == standby.peer_id
        assert len(_holders(first, second)) == 1

    run(scenario())


def test_lease_different_keys_exactly_one_holder(peers):
    prefix = "trust-lease-keys"
    trusted = frozenset({peers.pub_a, peers.pub_b})
    lease_a = Lease(peers.a, prefix, owner_marker(peers.key_a), peers.pid(peers.a), trusted,
                    settle=LEASE_SETTLE, ttl=LEASE_TTL)
    lease_b = Lease(peers.b, prefix, owner_marker(peers.key_b), peers.pid(peers.b), trusted,
                    settle=LEASE_SETTLE, ttl=LEASE_TTL)

    async def scenario():
        await asyncio.gather(lease_a.poll(), lease_b.poll())
        for lease in (lease_a, lease_b):
            await lease.poll()
        assert len(_holders(lease_a, lease_b)) == 1, [(x.held, x.term, x.holder) for x in (lease_a, lease_b)]
        holder = _holders(lease_a, lease_b)[0]
        other = lease_b if holder is lease_a else lease_a
        assert holder.holder == holder.peer_id
        assert other.holder == holder.peer_id  # the standby reports who holds it

        # a reader trusting only one key rejects the other key's lease
        rejected: list[Rejected] = []
        only_a = await read_leases(peers.a2, prefix, frozenset({peers.pub_a}), rejected)
        assert all(s.owner == peers.pub_a for s in only_a)
        assert {r.owner for r in rejected} <= {peers.pub_b}
        assert all("untrusted key" in r.why for r in rejected)
        if holder is lease_b:
            assert rejected, "b holds the lease, so a reader trusting only a must reject b's lease"

    run(scenario())


def test_the_caching_validator_agrees_with_hivemind_s_on_signed_changed_and_foreign_records():
    """`CachingSignatureValidator` gives hivemind's verdict for each record, the first time and from its cache:
    a signed record passes, any changed byte (value, expiration, another owner's subkey) fails, and records
    without an owner marker pass unchecked."""
    import dataclasses

    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.validation import DHTRecord

    from swarmnode.identity import CachingSignatureValidator

    key, other = RSAPrivateKey(), RSAPrivateKey()
    ours, theirs = CachingSignatureValidator(key, cache_size=4), RSASignatureValidator(key)
    mine = owner_marker(key)
    signed = DHTRecord(b"swarm.nodes", b"peer" + mine, b"value", 1e10)
    signed = dataclasses.replace(signed, value=ours.sign_value(signed))
    records = {
        "signed": signed,
        "value changed": dataclasses.replace(signed, value=signed.value.replace(b"value", b"vaLue", 1)),
        "expiration changed": dataclasses.replace(signed, expiration_time=2e10),
        "another owner's subkey": dataclasses.replace(signed, subkey=b"peer" + owner_marker(other)),
        "unsigned": DHTRecord(b"swarm.nodes", b"peer" + mine, b"value", 1e10),
        "no owner": DHTRecord(b"open", b"subkey", b"anything", 1e10),
    }
    expected = {"signed": True, "no owner": True}
    for _ in range(3):  # the second and third rounds are answered from the cache (and evict: it holds 4)
        for name, record in records.items():
            assert ours.validate(record) is expected.get(name, False), name
            assert theirs.validate(record) is expected.get(name, False), name
    assert len(ours._outcomes) == 4
