"""Keys and trust: who may write which DHT record, and whose placements a node follows.

Every peer signs its records with an RSA key through hivemind's `RSASignatureValidator`: a record whose
subkey holds an owner marker `[owner:ssh-rsa ...]` is accepted by the DHT only with a valid signature by
that key, so a peer cannot overwrite another peer's records. Nodes sign with their libp2p identity's key
(`PeerIdentity`; a fresh one per process unless `--identity` names a file), so the peer id a node record
names must be the one derived from its signer's key (`peer_id_of_key`): no peer can announce itself as another;
coordinators sign with a key kept in a file, because nodes decide whose placements to follow by that
key: `--trusted-coordinator` names a public key, a `.pub` file with one key per line, or a private key
file. Without it, a node trusts the swarm key of this machine (`swarm_key.pem` in the key directory,
created on first use), which is the key `swarmnode coordinate` signs with by default: a private swarm run
by one operator (one machine, or one shared home directory) works without configuration.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import re
import tempfile
from collections import OrderedDict
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from swarmnode.errors import SwarmError

logger = logging.getLogger(__name__)

KEY_DIR_ENV = "SWARMNODE_KEY_DIR"
SWARM_KEY_NAME = "swarm_key.pem"
_OWNER_RE = re.compile(rb"\[owner:(.+?)\]")


class KeyFileError(SwarmError, ValueError):
    """A key or key file that cannot be used; the message says which and what to do."""

    code = "bad_key"


def key_dir() -> Path:
    return Path(os.environ.get(KEY_DIR_ENV) or Path.home() / ".config" / "swarmnode")


def default_swarm_key_path() -> Path:
    return key_dir() / SWARM_KEY_NAME


def _wrap(private: rsa.RSAPrivateKey) -> RSAPrivateKey:
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key._private_key = private
    return key


def load_private_key(path: str | Path) -> RSAPrivateKey:
    data = Path(path).read_bytes()
    try:
        private = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise KeyFileError(f"{path} is not an unencrypted PEM private key ({exc})") from None
    if not isinstance(private, rsa.RSAPrivateKey):
        raise KeyFileError(f"{path} holds a {type(private).__name__}, not an RSA key")
    return _wrap(private)


def load_or_create_private_key(path: str | Path) -> RSAPrivateKey:
    """The RSA key in `path` (PEM), created with mode 0600 when the file does not exist."""
    path = Path(path)
    if path.exists():
        return load_private_key(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    # written whole to a private temporary file, then linked into place: a process starting at the same
    # time either wins the link or finds the complete key the other one wrote, never a partial file
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(pem)
        os.chmod(temporary, 0o600)
        try:
            os.link(temporary, path)
        except FileExistsError:
            return load_private_key(path)
    finally:
        os.unlink(temporary)
    logger.info("created a new key in %s", path)
    return _wrap(private)


def public_key_text(key: RSAPrivateKey) -> str:
    """The key's public half as one OpenSSH line, `ssh-rsa AAAA...`: the form operators pass around."""
    return key.get_public_key().to_bytes().decode()


def owner_marker(key: RSAPrivateKey) -> bytes:
    """The subkey that only `key` may write (hivemind's `[owner:...]` convention)."""
    return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", key.get_public_key().to_bytes())


def owner_of(subkey: object) -> str | None:
    """The public key named by a subkey's owner marker, or None for an unprotected subkey."""
    if isinstance(subkey, str):
        subkey = subkey.encode()
    if not isinstance(subkey, bytes):
        return None
    found = _OWNER_RE.findall(subkey)
    return found[0].decode(errors="replace") if len(found) == 1 else None


#: Records whose signature check result a validator keeps (a few KiB of digests): every read of a dictionary
#: key validates each of its subkeys again, and a swarm's node list is read by every node every few seconds.
VERIFIED_CACHE_SIZE = 8192


class CachingSignatureValidator(RSASignatureValidator):
    """hivemind's `RSASignatureValidator`, remembering the outcome for records it has checked before.

    A DHT peer validates every subkey of a dictionary in every `find` reply and at every store, so the same
    signed record (same key, subkey, value with its signature, and expiration) is checked many times within a
    heartbeat: in a 12-node swarm on 2 cores, parsing public keys and verifying RSA signatures was the largest
    share of the DHT processes' CPU, and idle nodes kept both cores busy. The check of identical bytes has an
    identical outcome, so it is kept, by a BLAKE2b digest of those bytes, for the last `VERIFIED_CACHE_SIZE`
    records; parsed public keys are kept as well. A changed byte anywhere is a new digest, checked in full."""

    def __init__(self, private_key: RSAPrivateKey | None = None, cache_size: int = VERIFIED_CACHE_SIZE):
        super().__init__(private_key)
        self._cache_size = cache_size
        self._outcomes: OrderedDict[bytes, bool] = OrderedDict()

    def validate(self, record: DHTRecord) -> bool:
        digest = hashlib.blake2b(MSGPackSerializer.dumps(dataclasses.astuple(record)), digest_size=20).digest()
        known = self._outcomes.get(digest)
        if known is not None:
            self._outcomes.move_to_end(digest)
            return known
        outcome = self._check(record)
        self._outcomes[digest] = outcome
        if len(self._outcomes) > self._cache_size:
            self._outcomes.popitem(last=False)
        return outcome

    def _check(self, record: DHTRecord) -> bool:
        """`RSASignatureValidator.validate`'s check (hivemind 1.1), with the owner's parsed key reused."""
        public_keys = self._PUBLIC_KEY_RE.findall(record.key)
        if record.subkey is not None:
            public_keys += self._PUBLIC_KEY_RE.findall(record.subkey)
        if not public_keys:
            return True  # not protected by a public key
        if len(set(public_keys)) > 1:
            return False  # key and subkey name different owners
        signatures = self._SIGNATURE_RE.findall(record.value)
        if len(signatures) != 1:
            return False
        try:
            public_key = _parsed_public_key(public_keys[0])
        except (ValueError, UnsupportedAlgorithm):
            return False
        stripped = dataclasses.replace(record, value=self.strip_value(record))
        return public_key.verify(self._serialize_record(stripped), signatures[0])


@functools.lru_cache(maxsize=1024)
def _parsed_public_key(data: bytes) -> RSAPublicKey:
    return RSAPublicKey.from_bytes(data)


@functools.lru_cache(maxsize=4096)
def peer_id_of_key(public_key: str) -> str | None:
    """The libp2p peer id of an RSA public key (`ssh-rsa AAAA...`): base58 of the SHA-256 multihash of the key's
    protobuf-encoded DER form, as `p2pd` derives it from an identity file (libp2p's peer-id spec); None when
    the text is not an RSA key. A node signs its records with its identity key, so a reader can check that a
    record's peer id is its signer's."""
    try:
        parsed = serialization.load_ssh_public_key(public_key.encode())
    except (ValueError, UnsupportedAlgorithm):
        return None
    if not isinstance(parsed, rsa.RSAPublicKey):
        return None
    der = parsed.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(_SHA2_256_MULTIHASH + hashlib.sha256(encoded).digest()).to_base58()


_SHA2_256_MULTIHASH = bytes([0x12, 0x20])  # multihash code of sha2-256, then its 32-byte length


class PeerIdentity:
    """A peer's libp2p identity (an RSA key in hivemind's identity file format) and its peer id.

    A node signs its DHT records with this key, so its records' owner marker names the key its peer id is
    derived from. `path` is what `p2pd` is started with; `temporary` when it was made for this process alone
    (no `--identity`): `discard` removes it once the daemon has read it."""

    def __init__(self, key: RSAPrivateKey, path: str, *, temporary: bool = False):
        self.key, self.path, self.temporary = key, path, temporary
        self.peer_id = peer_id_of_key(public_key_text(key))

    @classmethod
    def load_or_create(cls, path: str | None) -> PeerIdentity:
        """The identity in `path` (made there first when the file does not exist), or with no path a fresh one
        in a private temporary folder."""
        from hivemind.p2p import P2P

        temporary = path is None
        if path is None:
            path = os.path.join(tempfile.mkdtemp(prefix="swarmnode-identity-"), "identity.key")
        if not os.path.exists(path):
            try:
                P2P.generate_identity(path)
            except OSError as exc:
                raise KeyFileError(f"--identity {path}: cannot write a new identity there ({exc})") from None
        return cls(load_identity_key(path), path, temporary=temporary)

    def discard(self) -> None:
        """Remove a temporary identity file and its folder (the daemon has read it)."""
        if self.temporary:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.path))


def load_identity_key(path: str) -> RSAPrivateKey:
    """The RSA key of a libp2p identity file (hivemind's format: a protobuf `PrivateKey` holding DER)."""
    try:
        proto = crypto_pb2.PrivateKey.FromString(Path(path).read_bytes())
    except OSError as exc:
        raise KeyFileError(f"--identity {path}: cannot read it ({exc})") from None
    except Exception:  # safe: any decoding failure means the file is not an identity
        raise KeyFileError(f"--identity {path}: not a libp2p identity file (write one by giving a path that does "
                           f"not exist yet)") from None
    if proto.key_type != crypto_pb2.RSA:
        kind = crypto_pb2.KeyType.Name(proto.key_type)
        raise KeyFileError(f"--identity {path}: holds a key of type {kind}; a node signs its records with its "
                           f"identity, which must be RSA (give a path that does not exist yet and one is written)")
    try:
        serialization.load_der_private_key(proto.data, password=None)
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise KeyFileError(f"--identity {path}: its RSA key cannot be read ({exc})") from None
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": proto.data})  # hivemind's own unpickling path: DER in, key out
    return key


def make_validator(key: RSAPrivateKey | None = None) -> RSASignatureValidator:
    return CachingSignatureValidator(key or RSAPrivateKey.process_wide())


def _check_public(text: str, where: str) -> str:
    try:
        RSAPublicKey.from_bytes(text.encode())
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise KeyFileError(f"{where}: not an OpenSSH RSA public key ({exc})") from None
    return " ".join(text.split()[:2])


def load_trusted_keys(specs: list[str] | tuple[str, ...] | None, *, create: bool = True) -> frozenset[str]:
    """Public keys to trust for placements: each spec is a key (`ssh-rsa AAAA...`), a file of such keys
    (one per line, `#` comments allowed), or a PEM private key file. No specs: this machine's swarm key
    (created when missing if `create`, else nothing is trusted)."""
    if not specs:
        path = default_swarm_key_path()
        if not create and not path.exists():
            return frozenset()
        return frozenset({public_key_text(load_or_create_private_key(path))})
    keys: set[str] = set()
    for spec in specs:
        spec = spec.strip()
        if spec.startswith("ssh-rsa "):
            keys.add(_check_public(spec, "--trusted-coordinator"))
            continue
        path = Path(spec)
        if not path.is_file():
            raise KeyFileError(
                f"--trusted-coordinator {spec!r} is neither an `ssh-rsa ...` public key nor a readable file"
            )
        data = path.read_bytes()
        if b"PRIVATE KEY" in data:
            keys.add(public_key_text(load_private_key(path)))
            continue
        found = set()
        for number, line in enumerate(data.decode(errors="replace").splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                found.add(_check_public(line, f"{path}:{number}"))
        if not found:
            raise KeyFileError(f"{path} holds no public key")
        keys |= found
    return frozenset(keys)
