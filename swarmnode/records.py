"""DHT keys and record schemas: defined once here, imported by nodes, coordinators and clients.

Every value read from the DHT is validated with these models; a record that does not validate is logged
and ignored, never trusted. Values travel as plain dicts (msgpack through hivemind's DHT).

| key                      | subkey                    | value                                   |
|--------------------------|---------------------------|-----------------------------------------|
| `{prefix}.block.{i}`     | node's owner marker       | `ServerRecord`: a node serving block i  |
| `{prefix}.nodes`         | node's owner marker       | `NodeRecord`: offer, measurements, state |
| `{prefix}.placement`     | coordinator's owner marker| `PlacementRecord`: the versioned plan   |
| `{prefix}.coordinator`   | coordinator's owner marker| `LeaseRecord`: who coordinates, until   |
| `{prefix}.reports`       | reporter's marker + peer  | `ReportRecord`: a client saw a peer's outputs diverge |
| `{swarm}.members`        | publisher's owner marker  | `MemberRecord`: a peer's invitation to a private swarm |
| `{swarm}.revoked`        | the swarm owner's marker  | `RevocationRecord`: peers the owner revoked       |

A private swarm's keys (`swarm` = `private_swarm_prefix(owner)`) belong to its owner's key rather than to a
model: one invitation admits a peer to every model the swarm serves (`swarmnode.admission`).

Owner markers (`[owner:ssh-rsa ...]`, `swarmnode.identity`) make a subkey writable only by the holder
of that RSA key: every peer runs hivemind's `RSASignatureValidator`, which refuses unsigned or
mis-signed values under a marked subkey, so no peer can overwrite another's records. A node signs with its
libp2p identity's key, and readers take a `NodeRecord` or `ServerRecord` only when its `peer_id` is the one
derived from that key (`swarm_state`), so no peer can announce itself as another either. Placements and
leases are trusted only when the marker's key is one the reader trusts (`swarmnode.identity`).
A report's subkey is the reporter's owner marker followed by the accused peer id, so one reporter keeps
one report per peer (a newer one replaces it) and no one can write or erase a report in another's name.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import re
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

logger = logging.getLogger(__name__)

# How long a serving record lives without a refresh, and how often nodes refresh it.
SERVER_RECORD_TTL = 30.0
HEARTBEAT_INTERVAL = 10.0
# A capacity record lives as long as a serving record; a placement outlives its coordinator for a while,
# so nodes and clients keep following it while a standby takes over.
NODE_RECORD_TTL = SERVER_RECORD_TTL
PLACEMENT_TTL = 600.0
# The coordinator lease: renewed every LEASE_RENEW s, it lapses LEASE_TTL s after the last renewal; a
# standby polls every LEASE_POLL s and, having stored its claim, waits LEASE_SETTLE s and reads back
# before acting. Takeover bound after the holder dies: LEASE_TTL + LEASE_POLL + LEASE_SETTLE.
LEASE_TTL = 12.0
LEASE_RENEW = 3.0
LEASE_POLL = 2.0
LEASE_SETTLE = 2.0
TAKEOVER_BOUND = LEASE_TTL + LEASE_POLL + LEASE_SETTLE
# A report of diverging outputs outlives the client that made it, so operators see it in `swarmnode status`.
REPORT_TTL = 3600.0
# Longest `PlacementRecord.reason` a peer accepts; writers shorten to it.
MAX_REASON_CHARS = 500

MAX_LINKS = 256
MAX_PLACEMENT_NODES = 1024
# The largest redundancy floor a placement may ask for (`PlacementRecord.min_replicas`), and the longest
# reason it may give for one node it leaves out (`PlacementRecord.unused`).
MAX_MIN_REPLICAS = 16
MAX_UNUSED_REASON_CHARS = 240
# The dtypes a node may compute in and hidden states may travel in (torch's names; `runtime.dtypes` maps them).
DtypeName = Literal["float32", "bfloat16", "float16"]
DTYPE_NAMES: tuple[DtypeName, ...] = get_args(DtypeName)
# How a node's weights are stored: "none" (in the node's dtype), a weight-only quantization it applies as it loads
# (`runtime.quantize`: int8, int4, q8_0, q4_0, q4_1, bf16), or "gguf": as a GGUF file stores them, in ggml's block
# formats (`runtime.ggml`).
QuantizationName = Literal["none", "int8", "int4", "q8_0", "q4_0", "q4_1", "bf16", "gguf"]
QUANTIZATION_NAMES: tuple[QuantizationName, ...] = get_args(QuantizationName)
#: What `join --quantize` may ask for: the quantizations applied on load (a GGUF file brings its own): int8 and
#: int4 through PyTorch's kernels; q8_0, q4_0, q4_1 and bf16 (16-bit rows) into ggml's formats and kernels.
QUANTIZE_CHOICES: tuple[QuantizationName, ...] = ("none", "int8", "int4", "q8_0", "q4_0", "q4_1", "bf16")
#: The quantization of a node serving a GGUF file.
GGUF_QUANTIZATION: QuantizationName = "gguf"


class Phase(str, enum.Enum):
    """HexGen-2's phases (§3.1): a node may serve a request's prompt only (prefill), its generation only
    (decode, and replays into it), or both, as every node did before the split. Sessions carry one too: a
    prefill session runs a prompt and hands its KV cache over; the others generate.

    Records and messages carry the value (`PhaseName`); code compares members, and the two rules below are
    the only places that say which sessions meet which nodes."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"

    def __str__(self) -> str:
        return self.value

    def takes(self, session: Phase) -> bool:
        """Whether a node serving this phase accepts a session of phase `session` (the node's rule,
        `server.session`): a prefill node only prefill sessions, a decode node every session but those."""
        if self is Phase.PREFILL:
            return session is Phase.PREFILL
        if self is Phase.DECODE:
            return session is not Phase.PREFILL
        return True

    def routed_to(self, node: Phase) -> bool:
        """Whether a client routes a session of this phase through a node serving `node` (the client's rule,
        `client.swarm`): prefill sessions only through prefill nodes, which exist for them, and every other
        session through any node but those. Never a pair that `node.takes(self)` refuses."""
        return node is Phase.PREFILL if self is Phase.PREFILL else node is not Phase.PREFILL


PhaseName = Literal["both", "prefill", "decode"]
PHASE_NAMES: tuple[PhaseName, ...] = get_args(PhaseName)
if tuple(phase.value for phase in Phase) != PHASE_NAMES:  # the wire's names and the enum are one list
    raise ImportError(f"records.PhaseName {PHASE_NAMES} and records.Phase disagree")
# What a node computes in, as one label: its dtype, plus its quantization when it has one ("bfloat16+int8").
FULL_PRECISION = "float32"


def served_kind(dtype: str, quantization: str = "none") -> str:
    """The label of what a node serves: "float32", "bfloat16", "bfloat16+int8", ..."""
    return dtype if quantization == "none" else f"{dtype}+{quantization}"

_PEER_ID_RE = r"^[1-9A-HJ-NP-Za-km-z]{20,128}$"

_PREFIX_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")


def model_prefix(name: str) -> str:
    """The DHT prefix of a model: its name lower-cased, with characters outside [a-z0-9._-] as '-'."""
    prefix = re.sub(r"[^a-z0-9._-]+", "-", name.strip().lower()).strip("-.")
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"cannot derive a DHT prefix from model name {name!r}; pass --dht-prefix explicitly")
    return prefix


def block_key(prefix: str, block: int) -> str:
    return f"{prefix}.block.{block}"


def nodes_key(prefix: str) -> str:
    return f"{prefix}.nodes"


def placement_key(prefix: str) -> str:
    return f"{prefix}.placement"


def coordinator_key(prefix: str) -> str:
    return f"{prefix}.coordinator"


def reports_key(prefix: str) -> str:
    return f"{prefix}.reports"


def private_swarm_prefix(owner: str) -> str:
    """The DHT prefix of the private swarm owned by the key `owner` (`ssh-rsa AAAA...`)."""
    return "private-" + hashlib.sha256(" ".join(owner.split()[:2]).encode()).hexdigest()[:20]


def members_key(swarm: str) -> str:
    return f"{swarm}.members"


def revoked_key(swarm: str) -> str:
    return f"{swarm}.revoked"


# A member's invitation is published for as long as a serving record lives, and refreshed as often; a
# revocation list is stored for as long as an invitation may last, and stored again every heartbeat by a peer
# holding the owner's key (`membership.Membership.republish_revocations`).
MEMBER_RECORD_TTL = SERVER_RECORD_TTL
REVOCATION_TTL = 5 * 365 * 24 * 3600.0
MAX_INVITATION_CHARS = 4096
MAX_REVOKED = 10_000


REPORT_SUBKEY_SEPARATOR = b" accuses "


def report_subkey(owner_marker: bytes, peer_id: str) -> bytes:
    """The subkey of a report about `peer_id` by the holder of `owner_marker`: one report per (reporter, peer)."""
    return owner_marker + REPORT_SUBKEY_SEPARATOR + peer_id.encode()


def reported_peer(subkey: object) -> str | None:
    """The peer id a report's subkey names (what `report_subkey` appended), None when it names none."""
    if isinstance(subkey, str):
        subkey = subkey.encode()
    if not isinstance(subkey, bytes) or REPORT_SUBKEY_SEPARATOR not in subkey:
        return None
    return subkey.rsplit(REPORT_SUBKEY_SEPARATOR, 1)[1].decode(errors="replace")


class ServerState(str, enum.Enum):
    """What a node is doing with a block: clients route only through ONLINE ones."""

    OFFLINE = "offline"
    JOINING = "joining"
    ONLINE = "online"


class ServerRecord(BaseModel):
    """A node's announcement for each block of its span (`{prefix}.block.{i}`, subkey = peer id)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    state: ServerState
    peer_id: str = Field(pattern=_PEER_ID_RE)
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    throughput: float = Field(ge=0, description="tokens/s the node sustains through one block")
    free_cache_tokens: int = Field(ge=0)
    cache_tokens: int = Field(ge=0, description="the node's whole KV-cache budget, in tokens")
    public_name: str | None = Field(default=None, max_length=128)
    version: str = Field(default="", max_length=32)
    device: str = Field(default="cpu", max_length=32)
    dtype: DtypeName = "float32"
    quantization: QuantizationName = "none"
    relay: str | None = Field(default=None, pattern=_PEER_ID_RE,
                              description="the peer that relays calls to this node (behind NAT); None: dial it")
    phase: PhaseName = "both"

    @model_validator(mode="after")
    def _span_is_ordered(self) -> ServerRecord:
        if self.end <= self.start:
            raise ValueError(f"span [{self.start}, {self.end}) is empty")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _check_range(value: tuple[int, int] | None, what: str) -> None:
    if value is not None and not 0 <= value[0] < value[1]:
        raise ValueError(f"{what} {list(value)} is not a range [start, end) with 0 <= start < end")


class NodeState(str, enum.Enum):
    """Where a node is in its life: measuring itself, waiting for a placement, loading, serving, gone."""

    MEASURING = "measuring"
    WAITING = "waiting"
    LOADING = "loading"
    ONLINE = "online"
    OFFLINE = "offline"


class LinkMeasurement(BaseModel):
    """A node's measurement of its link to another peer: round trip (ms) and bandwidth (Mbps, 1e6 bit/s)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    rtt_ms: float = Field(ge=0, le=600_000)
    bandwidth_mbps: float | None = Field(default=None, gt=0, le=1e7)


class NodeRecord(BaseModel):
    """A node's capacity record (`{prefix}.nodes`): what it offers, what it measured, what it serves.

    The coordinator plans from these; `swarmnode status` prints them. `assigned` is the range the node
    was given by placement `placement_version`; `serving` are the ranges it serves now (two while it
    moves to a new range); `loading` with `progress` (0..1) tells clients and operators it is not ready.
    `manual` nodes chose their range with `--blocks` and are not planned.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    peer_id: str = Field(pattern=_PEER_ID_RE)
    state: NodeState
    device: str = Field(max_length=32)
    dtype: DtypeName
    quantization: QuantizationName = "none"
    memory_bytes: int = Field(ge=0, description="memory offered for weights and KV cache")
    cores: int | None = Field(default=None, ge=1, le=100_000)
    num_threads: int = Field(ge=1, le=100_000)
    block_bytes: int = Field(gt=0, description="weight bytes of one block at this node's dtype")
    overhead_bytes: int = Field(ge=0)
    max_blocks: int = Field(ge=0, description="blocks that fit in the offer with room for some KV cache")
    block_throughput: float = Field(ge=0, description="measured tokens/s through one block")
    links: dict[str, LinkMeasurement] = Field(default_factory=dict, max_length=MAX_LINKS)
    manual: bool = False
    assigned: tuple[int, int] | None = None
    placement_version: int | None = Field(default=None, ge=1)
    serving: list[tuple[int, int]] = Field(default_factory=list, max_length=4)
    loading: tuple[int, int] | None = None
    progress: float = Field(default=0.0, ge=0.0, le=1.0)
    cache_tokens: int = Field(default=0, ge=0)
    free_cache_tokens: int = Field(default=0, ge=0)
    note: str = Field(default="", max_length=300, description="what the node is doing and why")
    public_name: str | None = Field(default=None, max_length=128)
    version: str = Field(default="", max_length=32)
    relayed: bool = Field(default=False, description="behind NAT: reached through a relay only")
    relay: str | None = Field(default=None, pattern=_PEER_ID_RE, description="its relay now")
    relay_service: bool = Field(default=False, description="relays calls for nodes behind NAT")
    phase: PhaseName = "both"
    # the operator chose the phase (`join --phase prefill|decode`): a two-phase plan keeps it
    phase_pinned: bool = False
    prefill_throughput: float = Field(default=0.0, ge=0, description="measured prompt tokens/s through one block")

    @model_validator(mode="after")
    def _ranges_are_ordered(self) -> NodeRecord:
        _check_range(self.assigned, "assigned")
        _check_range(self.loading, "loading")
        for span in self.serving:
            _check_range(span, "serving")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class PlacementRecord(BaseModel):
    """A coordinator's placement (`{prefix}.placement`): node -> blocks, with the max-flow edge flows.

    `version` grows by one with every placement any coordinator publishes; `(version, term, coordinator)`
    orders placements, so a reader always agrees on the newest. `flows[u][v]` are tokens/s on the flow
    graph (`u` = "source" or a peer id, `v` = a peer id or "sink", Helix §5.1) and become the clients'
    routing weights. `reason` says why this placement replaced the previous one.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    version: int = Field(ge=1)
    term: int = Field(ge=1)
    coordinator: str = Field(pattern=_PEER_ID_RE)
    algorithm: str = Field(max_length=32)
    reason: str = Field(max_length=MAX_REASON_CHARS)
    created: float = Field(ge=0)
    num_blocks: int = Field(ge=1, le=100_000)
    assignments: dict[str, tuple[int, int]] = Field(max_length=MAX_PLACEMENT_NODES)
    flows: dict[str, dict[str, float]] = Field(default_factory=dict, max_length=MAX_PLACEMENT_NODES + 1)
    throughput: float = Field(default=0.0, ge=0)
    moved_blocks: int = Field(default=0, ge=0)
    # The redundancy floor the placement was planned with (every block on at least this many nodes where
    # the offers allow it), the block ranges [start, end) it could not raise to the floor (single points of
    # failure when the floor is 2), and why each node with an offer that it leaves out is left out.
    min_replicas: int = Field(default=1, ge=1, le=MAX_MIN_REPLICAS)
    single_points: tuple[tuple[int, int], ...] = Field(default=(), max_length=MAX_PLACEMENT_NODES)
    unused: dict[str, str] = Field(default_factory=dict, max_length=MAX_PLACEMENT_NODES)
    # A two-phase plan (HexGen-2, `coordinate --algorithm hexgen2`): each assigned node's phase, and the KV
    # links, prefill node -> decode node -> requests/s whose KV cache the plan sends over that pair. Empty:
    # every node serves both phases.
    phases: dict[str, PhaseName] = Field(default_factory=dict, max_length=MAX_PLACEMENT_NODES)
    kv_links: dict[str, dict[str, float]] = Field(default_factory=dict, max_length=MAX_PLACEMENT_NODES)

    @model_validator(mode="after")
    def _covers_the_model(self) -> PlacementRecord:
        covered = [False] * self.num_blocks
        for peer, span in self.assignments.items():
            _check_range(span, f"assignment of {peer}")
            if span[1] > self.num_blocks:
                raise ValueError(f"assignment of {peer} {list(span)} runs past the model's {self.num_blocks} blocks")
            for block in range(*span):
                covered[block] = True
        if not all(covered):
            raise ValueError(f"placement leaves block {covered.index(False)} unserved")
        for span in self.single_points:
            _check_range(span, "single point of failure")
            if span[1] > self.num_blocks:
                raise ValueError(f"single point of failure {list(span)} runs past the model's {self.num_blocks} blocks")
        for peer, why in self.unused.items():
            if not re.match(_PEER_ID_RE, peer) or peer in self.assignments:
                raise ValueError(f"unused node {peer[:64]!r} is not a peer id outside the assignments")
            if len(why) > MAX_UNUSED_REASON_CHARS:
                raise ValueError(f"the reason given for unused node {peer} is over {MAX_UNUSED_REASON_CHARS} chars")
        for peer in self.phases:
            if peer not in self.assignments:
                raise ValueError(f"phase given for {peer[:64]!r}, which has no assignment")
        for sender, targets in self.kv_links.items():
            if self.phases.get(sender) != Phase.PREFILL:
                raise ValueError(f"KV link from {sender[:64]!r}, which is not an assigned prefill node")
            if len(targets) > MAX_PLACEMENT_NODES:
                raise ValueError(f"KV links from {sender} name over {MAX_PLACEMENT_NODES} nodes")
            for target, rate in targets.items():
                if self.phases.get(target) != Phase.DECODE or not 0 <= rate < float("inf"):
                    raise ValueError(f"KV link {sender} -> {target[:64]!r} must reach an assigned decode node "
                                     f"with a finite rate >= 0, got {rate!r}")
        return self

    @property
    def order(self) -> tuple[int, int, str]:
        return (self.version, self.term, self.coordinator)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class LeaseRecord(BaseModel):
    """The coordinator lease (`{prefix}.coordinator`): `holder` coordinates until the record expires.

    `term` grows by one at every takeover; a coordinator publishes placements only while it holds the
    lease, which is what keeps two coordinators from publishing at once.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    holder: str = Field(pattern=_PEER_ID_RE)
    term: int = Field(ge=1)
    renewed: float = Field(ge=0)
    algorithm: str = Field(default="", max_length=32)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class ReportRecord(BaseModel):
    """A client's report that a peer's outputs diverged from other replicas' (`{prefix}.reports`).

    Written by a verifying client (`swarmnode.client.verify`) when at least two independent replicas agreed
    on blocks `[start, end)` and `peer_id`'s hidden states differed from theirs by `max_diff` (the distance of
    the comparison for the peer's kind, `client.agreement`: for float32 the largest difference of one element
    relative to its token's scale), more than that comparison's `tolerance`. `witnesses` are the peers whose
    outputs agreed. A report is evidence for operators, signed by its reporter; readers count distinct
    reporters, and no one bans a peer because of someone else's report (a client could lie).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    peer_id: str = Field(pattern=_PEER_ID_RE)
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    max_diff: float = Field(ge=0, allow_inf_nan=False)
    tolerance: float = Field(gt=0, allow_inf_nan=False)
    reason: str = Field(default="outputs diverged", max_length=200)
    reporter: str = Field(default="", max_length=128)
    witnesses: list[str] = Field(default_factory=list, max_length=8)
    created: float = Field(ge=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _span_is_ordered(self) -> ReportRecord:
        if self.end <= self.start:
            raise ValueError(f"span [{self.start}, {self.end}) is empty")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class MemberRecord(BaseModel):
    """A peer's invitation to a private swarm, as `swarmnode invite` wrote it (`admission.Invitation.text`),
    published under `{swarm}.members` so that peers it calls can check it before they answer. The invitation
    carries its own proof (the owner's signature over the invited key, roles and expiry); who publishes it does
    not matter, since admission is of a key, and every call is authenticated by the caller's key."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    invitation: str = Field(min_length=1, max_length=MAX_INVITATION_CHARS)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class RevocationRecord(BaseModel):
    """Peers the owner of a private swarm has revoked (`swarmnode revoke`), under `{swarm}.revoked` with the
    owner's marker as subkey: only the owner's key can write it. `updated` orders versions."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    peers: list[str] = Field(default_factory=list, max_length=MAX_REVOKED)
    updated: float = Field(ge=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _peer_ids(self) -> RevocationRecord:
        bad = [p for p in self.peers if not re.match(_PEER_ID_RE, p)]
        if bad:
            raise ValueError(f"{len(bad)} entries are not peer ids, e.g. {bad[0][:40]!r}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def parse_record(model: type[BaseModel], value: Any, *, what: str) -> BaseModel | None:
    """Validate a DHT value; log and return None when it does not fit the schema."""
    try:
        return model.model_validate(value)
    except (ValidationError, TypeError, ValueError) as exc:
        logger.warning("ignoring malformed %s: %s", what, str(exc).replace("\n", "; ")[:300])
        return None
