"""Typed cluster specifications: the model, the nodes, the network and the workload.

The format is the one of ``planner/clusters/README.md`` (JSON or YAML). A cluster is read with
:func:`load_cluster` (from a file) or :func:`cluster_from_dict` (from plain data, e.g. live measurements
gathered by the coordinator); both validate the input and raise :class:`SpecError`, whose message says
what is wrong, where, and how to fix it.

Network resolution follows the README: a ``links[]`` entry for the node pair wins, then ``intra_machine``
for two nodes of the same ``machine``, then ``intra_region`` for two nodes of one region, then a
``region_links[]`` entry for the region pair, then ``inter_region``. The coordinator (Helix §4.1: the
node where requests arrive, the source and sink of the flow graph) sits in ``coordinator_region``; a
``links[]`` entry may name :data:`COORDINATOR` as one end to give a node its own coordinator link.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PlannerError

__all__ = [
    "COORDINATOR",
    "COST_MODEL_NAMES",
    "Cluster",
    "LinkSpec",
    "ModelSpec",
    "NetworkSpec",
    "NodeSpec",
    "SpecError",
    "Workload",
    "cluster_from_dict",
    "cluster_to_dict",
    "load_cluster",
]

#: Name of the coordinator in ``links[]`` entries and in flow graphs.
COORDINATOR = "coordinator"

#: The cost models a spec may name (``cost_model``); :mod:`planner.costs.factory` builds them. ``roofline``
#: (HexGen Eqs. 4-7 on the hardware's specs, :mod:`planner.costs.roofline`) is the default; ``helix`` uses the
#: per-layer GPU profiles Helix measured (:mod:`planner.costs.helix_profiled`).
COST_MODEL_NAMES = ("roofline", "helix")

#: Helix's trace (Azure Conversation, §6.2): the default workload when a spec has none.
DEFAULT_INPUT_TOKENS = 763.0
DEFAULT_OUTPUT_TOKENS = 232.0


class SpecError(PlannerError):
    """A cluster specification that cannot be used; the message says what to change."""

    code = "bad_spec"


@dataclass(frozen=True)
class ModelSpec:
    """The served model: ``num_blocks`` identical transformer blocks of ``block_bytes`` each."""

    name: str
    num_blocks: int
    hidden_size: int
    dtype_bytes: int
    block_bytes: int
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None


@dataclass(frozen=True)
class NodeSpec:
    """One compute node (a machine, or a group of GPUs used tensor-parallel as one logical node)."""

    id: str
    region: str
    device: str  # "cpu" or "gpu"
    memory_bytes: int
    cores: int | None = None
    gpu: str | None = None
    gpus: int = 1
    tflops: float | None = None
    memory_bandwidth_gbs: float | None = None
    nic_mbps: float | None = None
    max_blocks: int | None = None
    block_throughput: float | None = None
    # prompt tokens/s through one block, measured on a long prompt (HexGen-2's prefill phase; planner.algorithms.hexgen2_swarm)
    prefill_throughput: float | None = None
    price_per_hour: float | None = None
    machine: str | None = None


@dataclass(frozen=True)
class LinkSpec:
    """A symmetric network link: bandwidth in Mbps (1e6 bit/s) and one-way latency in ms."""

    bandwidth_mbps: float
    latency_ms: float

    @property
    def bytes_per_second(self) -> float:
        return self.bandwidth_mbps * 1e6 / 8.0

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1000.0


@dataclass(frozen=True)
class NetworkSpec:
    intra_region: LinkSpec
    coordinator_region: str
    inter_region: LinkSpec | None = None
    intra_machine: LinkSpec | None = None
    region_links: tuple[tuple[str, str, LinkSpec], ...] = ()
    links: tuple[tuple[str, str, LinkSpec], ...] = ()


@dataclass(frozen=True)
class Workload:
    """Average request shape used by the cost model (Helix §6.2; HexGen's s_in and s_out)."""

    avg_input_tokens: float = DEFAULT_INPUT_TOKENS
    avg_output_tokens: float = DEFAULT_OUTPUT_TOKENS


@dataclass(frozen=True)
class Cluster:
    """A validated cluster. Build it with :func:`cluster_from_dict` or :func:`load_cluster`."""

    name: str
    model: ModelSpec
    nodes: tuple[NodeSpec, ...]
    network: NetworkSpec
    overhead_bytes: int = 0
    weight_memory_fraction: float = 1.0
    token_bytes: int = 4
    workload: Workload = field(default_factory=Workload)
    #: The cost model that scores this cluster (:data:`planner.costs.factory.COST_MODELS`).
    cost_model: str = "roofline"
    source: str = ""
    expected: Mapping[str, Mapping[str, tuple[int, int]]] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {n.id: n for n in self.nodes})
        object.__setattr__(self, "_pair_links", _index_pairs(self.network.links))
        object.__setattr__(self, "_region_links", _index_pairs(self.network.region_links))

    @property
    def node_ids(self) -> list[str]:
        return [n.id for n in self.nodes]

    @property
    def num_blocks(self) -> int:
        return self.model.num_blocks

    def node(self, node_id: str) -> NodeSpec:
        try:
            return self._by_id[node_id]  # type: ignore[attr-defined]
        except KeyError:
            raise KeyError(f"no node {node_id!r} in cluster {self.name!r}") from None

    def has_node(self, node_id: str) -> bool:
        return node_id in self._by_id  # type: ignore[attr-defined]

    def region_link(self, region_a: str, region_b: str) -> LinkSpec | None:
        """The link between two regions, or None when the spec does not define one."""
        if region_a == region_b:
            return self.network.intra_region
        link = self._region_links.get(frozenset((region_a, region_b)))  # type: ignore[attr-defined]
        if link is not None:
            return link
        return self.network.inter_region

    def link(self, a: str, b: str) -> LinkSpec:
        """The link between two nodes (or a node and :data:`COORDINATOR`)."""
        if a == b:
            raise ValueError(f"no link from node {a!r} to itself")
        pair = self._pair_links.get(frozenset((a, b)))  # type: ignore[attr-defined]
        if pair is not None:
            return pair
        region_a = self.network.coordinator_region if a == COORDINATOR else self.node(a).region
        region_b = self.network.coordinator_region if b == COORDINATOR else self.node(b).region
        if (
            a != COORDINATOR
            and b != COORDINATOR
            and self.network.intra_machine is not None
            and self.node(a).machine is not None
            and self.node(a).machine == self.node(b).machine
        ):
            return self.network.intra_machine
        link = self.region_link(region_a, region_b)
        if link is None:  # validated away when the cluster is built
            raise SpecError(f"no link between regions {region_a!r} and {region_b!r}")
        return link

    def coordinator_link(self, node_id: str) -> LinkSpec:
        return self.link(COORDINATOR, node_id)

    def with_nodes(self, nodes: Iterable[NodeSpec]) -> Cluster:
        """A copy of this cluster with another node list (links to removed nodes are dropped)."""
        nodes = tuple(nodes)
        ids = {n.id for n in nodes} | {COORDINATOR}
        links = tuple(item for item in self.network.links if item[0] in ids and item[1] in ids)
        network = NetworkSpec(
            intra_region=self.network.intra_region,
            coordinator_region=self.network.coordinator_region,
            inter_region=self.network.inter_region,
            intra_machine=self.network.intra_machine,
            region_links=self.network.region_links,
            links=links,
        )
        return Cluster(
            name=self.name,
            model=self.model,
            nodes=nodes,
            network=network,
            overhead_bytes=self.overhead_bytes,
            weight_memory_fraction=self.weight_memory_fraction,
            token_bytes=self.token_bytes,
            workload=self.workload,
            cost_model=self.cost_model,
            source=self.source,
            expected={},
            extra=self.extra,
        )


def _index_pairs(items: Iterable[tuple[str, str, LinkSpec]]) -> dict[frozenset, LinkSpec]:
    return {frozenset((a, b)): link for a, b, link in items}


# ---------------------------------------------------------------------------------------------------
# Loading and validation
# ---------------------------------------------------------------------------------------------------

_MODEL_KEYS = {
    "name",
    "num_blocks",
    "hidden_size",
    "dtype_bytes",
    "block_bytes",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
}
_NODE_KEYS = {
    "id",
    "region",
    "device",
    "memory_bytes",
    "cores",
    "gpu",
    "gpus",
    "tflops",
    "memory_bandwidth_gbs",
    "nic_mbps",
    "max_blocks",
    "block_throughput",
    "prefill_throughput",
    "price_per_hour",
    "machine",
}
_LINK_KEYS = {"bandwidth_mbps", "latency_ms"}
_TOP_KEYS = {
    "name",
    "source",
    "model",
    "overhead_bytes",
    "weight_memory_fraction",
    "nodes",
    "network",
    "token_bytes",
    "workload",
    "cost_model",
    "expected",
}


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster spec from a ``.json``, ``.yaml`` or ``.yml`` file."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"{path}: no such file; give the path of a cluster spec (JSON or YAML)")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise SpecError(f"{path}: not valid YAML: {exc}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecError(
                f"{path}: not valid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
            ) from None
    try:
        return cluster_from_dict(data, default_name=path.stem)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None


def _unknown_keys(where: str, data: Mapping[str, Any], known: set[str]) -> None:
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(known))}"
            raise SpecError(f"{where}: unknown key {key!r}{hint}")


def _require(where: str, data: Mapping[str, Any], key: str) -> Any:
    if key not in data or data[key] is None:
        raise SpecError(f"{where}: missing required key {key!r}")
    return data[key]


def _number(where: str, key: str, value: Any, *, positive: bool = False, allow_zero: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SpecError(f"{where}: {key} must be a finite number, got {value!r}")
    if value < 0:
        raise SpecError(f"{where}: {key} must not be negative, got {value!r}")
    if (positive or not allow_zero) and value == 0:
        raise SpecError(f"{where}: {key} must be greater than 0, got {value!r}")
    return float(value)


def _integer(where: str, key: str, value: Any, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer():
        raise SpecError(f"{where}: {key} must be a whole number, got {value!r}")
    if value < minimum:
        raise SpecError(f"{where}: {key} must be at least {minimum}, got {value!r}")
    return int(value)


def _opt(data: Mapping[str, Any], key: str) -> Any:
    return data.get(key)


def _string(where: str, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise SpecError(f"{where}: {key} must be a non-empty string, got {value!r}")
    return value


def _parse_model(data: Any) -> ModelSpec:
    where = "model"
    if not isinstance(data, Mapping):
        raise SpecError("model: must be an object with num_blocks, hidden_size, dtype_bytes, block_bytes")
    _unknown_keys(where, data, _MODEL_KEYS)
    name = str(data.get("name", "model"))
    num_blocks = _integer(where, "num_blocks", _require(where, data, "num_blocks"), minimum=1)
    hidden = _integer(where, "hidden_size", _require(where, data, "hidden_size"), minimum=1)
    dtype_bytes = _integer(where, "dtype_bytes", _require(where, data, "dtype_bytes"), minimum=1)
    block_bytes = _integer(where, "block_bytes", _require(where, data, "block_bytes"), minimum=1)
    inter = data.get("intermediate_size")
    heads = data.get("num_attention_heads")
    kv_heads = data.get("num_key_value_heads")
    inter = None if inter is None else _integer(where, "intermediate_size", inter, minimum=1)
    heads = None if heads is None else _integer(where, "num_attention_heads", heads, minimum=1)
    kv_heads = None if kv_heads is None else _integer(where, "num_key_value_heads", kv_heads, minimum=1)
    if heads is not None and hidden % heads:
        raise SpecError(f"model: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    if kv_heads is not None and heads is None:
        raise SpecError("model: num_key_value_heads needs num_attention_heads too")
    if kv_heads is not None and heads is not None and heads % kv_heads:
        raise SpecError(
            f"model: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    return ModelSpec(
        name=name,
        num_blocks=num_blocks,
        hidden_size=hidden,
        dtype_bytes=dtype_bytes,
        block_bytes=block_bytes,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )


def _parse_node(index: int, data: Any) -> NodeSpec:
    if not isinstance(data, Mapping):
        raise SpecError(f"nodes[{index}]: must be an object with id, region, device and memory_bytes")
    where = f"nodes[{index}]"
    node_id = data.get("id")
    if node_id is not None:
        where = f"node {node_id!r}"
    _unknown_keys(where, data, _NODE_KEYS)
    node_id = _string(where, "id", _require(where, data, "id"))
    if node_id == COORDINATOR:
        raise SpecError(f"{where}: the id {COORDINATOR!r} is reserved for the coordinator; rename the node")
    region = _string(where, "region", _require(where, data, "region"))
    device = _require(where, data, "device")
    if device not in ("cpu", "gpu"):
        raise SpecError(f"{where}: device must be 'cpu' or 'gpu', got {device!r}")
    memory = _require(where, data, "memory_bytes")
    if isinstance(memory, bool) or not isinstance(memory, (int, float)):
        raise SpecError(f"{where}: memory_bytes must be a number of bytes, got {memory!r}")
    if memory < 0:
        raise SpecError(
            f"{where}: memory_bytes is negative ({memory}); give the node's free memory in bytes (>= 0)"
        )
    memory = _integer(where, "memory_bytes", memory)
    measured = data.get("block_throughput")
    measured = None if measured is None else _number(where, "block_throughput", measured, positive=True)
    prefill = data.get("prefill_throughput")
    prefill = None if prefill is None else _number(where, "prefill_throughput", prefill, positive=True)
    cores = data.get("cores")
    cores = None if cores is None else _integer(where, "cores", cores, minimum=1)
    gpus = _integer(where, "gpus", data.get("gpus", 1), minimum=1)
    tflops = data.get("tflops")
    tflops = None if tflops is None else _number(where, "tflops", tflops, positive=True)
    bandwidth = data.get("memory_bandwidth_gbs")
    bandwidth = (
        None if bandwidth is None else _number(where, "memory_bandwidth_gbs", bandwidth, positive=True)
    )
    nic = data.get("nic_mbps")
    nic = None if nic is None else _number(where, "nic_mbps", nic, positive=True)
    max_blocks = data.get("max_blocks")
    max_blocks = None if max_blocks is None else _integer(where, "max_blocks", max_blocks, minimum=0)
    price = data.get("price_per_hour")
    price = None if price is None else _number(where, "price_per_hour", price)
    machine = data.get("machine")
    machine = None if machine is None else _string(where, "machine", machine)
    gpu = data.get("gpu")
    gpu = None if gpu is None else _string(where, "gpu", gpu)
    if measured is None:
        if device == "gpu" and (tflops is None or bandwidth is None):
            raise SpecError(
                f"{where}: a GPU node needs tflops and memory_bandwidth_gbs for the cost model "
                "(or a measured block_throughput)"
            )
        if device == "cpu" and cores is None:
            raise SpecError(
                f"{where}: a CPU node needs cores for the cost model (or a measured block_throughput)"
            )
    return NodeSpec(
        id=node_id,
        region=region,
        device=device,
        memory_bytes=memory,
        cores=cores,
        gpu=gpu,
        gpus=gpus,
        tflops=tflops,
        memory_bandwidth_gbs=bandwidth,
        nic_mbps=nic,
        max_blocks=max_blocks,
        block_throughput=measured,
        prefill_throughput=prefill,
        price_per_hour=price,
        machine=machine,
    )


def _parse_link(where: str, data: Any) -> LinkSpec:
    if not isinstance(data, Mapping):
        raise SpecError(f"{where}: must be an object with bandwidth_mbps and latency_ms")
    extra = set(data) - _LINK_KEYS - {"a", "b"}
    if extra:
        _unknown_keys(where, {k: None for k in extra}, _LINK_KEYS | {"a", "b"})
    bandwidth = _number(where, "bandwidth_mbps", _require(where, data, "bandwidth_mbps"), positive=True)
    latency = _number(where, "latency_ms", data.get("latency_ms", 0.0))
    return LinkSpec(bandwidth_mbps=bandwidth, latency_ms=latency)


def _parse_network(data: Any, nodes: tuple[NodeSpec, ...]) -> NetworkSpec:
    if not isinstance(data, Mapping):
        raise SpecError("network: must be an object with at least intra_region {bandwidth_mbps, latency_ms}")
    known = {
        "intra_region",
        "inter_region",
        "intra_machine",
        "region_links",
        "links",
        "coordinator_region",
        "note",
    }
    _unknown_keys("network", data, known)
    intra = _parse_link("network.intra_region", _require("network", data, "intra_region"))
    inter = data.get("inter_region")
    inter = None if inter is None else _parse_link("network.inter_region", inter)
    machine = data.get("intra_machine")
    machine = None if machine is None else _parse_link("network.intra_machine", machine)
    regions = sorted({n.region for n in nodes})
    coord = data.get("coordinator_region")
    if coord is None:
        if len(regions) != 1:
            raise SpecError(
                "network: coordinator_region is missing and the nodes span several regions "
                f"({', '.join(regions)}); say where the coordinator sits"
            )
        coord = regions[0]
    coord = _string("network", "coordinator_region", coord)
    ids = {n.id for n in nodes}
    region_links = []
    for i, item in enumerate(data.get("region_links") or []):
        where = f"network.region_links[{i}]"
        if not isinstance(item, Mapping):
            raise SpecError(f"{where}: must be an object with a, b, bandwidth_mbps, latency_ms")
        a = _string(where, "a", _require(where, item, "a"))
        b = _string(where, "b", _require(where, item, "b"))
        if a == b:
            raise SpecError(f"{where}: a and b are both {a!r}; a region's own link is network.intra_region")
        region_links.append((a, b, _parse_link(where, item)))
    links = []
    for i, item in enumerate(data.get("links") or []):
        where = f"network.links[{i}]"
        if not isinstance(item, Mapping):
            raise SpecError(f"{where}: must be an object with a, b, bandwidth_mbps, latency_ms")
        a = _string(where, "a", _require(where, item, "a"))
        b = _string(where, "b", _require(where, item, "b"))
        for end in (a, b):
            if end not in ids and end != COORDINATOR:
                close = difflib.get_close_matches(end, sorted(ids), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise SpecError(
                    f"{where}: unknown node {end!r}{hint} (links join node ids or {COORDINATOR!r})"
                )
        if a == b:
            raise SpecError(f"{where}: a link needs two different ends, got {a!r} twice")
        links.append((a, b, _parse_link(where, item)))
    network = NetworkSpec(
        intra_region=intra,
        coordinator_region=coord,
        inter_region=inter,
        intra_machine=machine,
        region_links=tuple(region_links),
        links=tuple(links),
    )
    # every region pair that can carry traffic needs a link
    pairs = {frozenset((a, b)) for a, b, _ in region_links}
    all_regions = sorted(set(regions) | {coord})
    if inter is None:
        for i, ra in enumerate(all_regions):
            for rb in all_regions[i + 1 :]:
                if frozenset((ra, rb)) not in pairs:
                    raise SpecError(
                        f"network: no link between regions {ra!r} and {rb!r}; add network.inter_region "
                        "or a region_links entry for that pair"
                    )
    return network


def _parse_expected(data: Any, ids: set[str], num_blocks: int) -> dict[str, dict[str, tuple[int, int]]]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise SpecError("expected: must map an algorithm name to {node_id: [start, end]}")
    result: dict[str, dict[str, tuple[int, int]]] = {}
    for algorithm, placement in data.items():
        if not isinstance(placement, Mapping):
            raise SpecError(f"expected.{algorithm}: must map node ids to [start, end]")
        ranges = {}
        for node_id, rng in placement.items():
            where = f"expected.{algorithm}.{node_id}"
            if node_id not in ids:
                raise SpecError(f"{where}: unknown node {node_id!r}")
            if not isinstance(rng, (list, tuple)) or len(rng) != 2:
                raise SpecError(f"{where}: a range is [start, end), got {rng!r}")
            start = _integer(where, "start", rng[0])
            end = _integer(where, "end", rng[1])
            if not start < end <= num_blocks:
                raise SpecError(
                    f"{where}: range [{start}, {end}) must satisfy 0 <= start < end <= {num_blocks}"
                )
            ranges[node_id] = (start, end)
        result[str(algorithm)] = ranges
    return result


def cluster_from_dict(data: Any, *, default_name: str = "cluster") -> Cluster:
    """Validate plain data (parsed JSON/YAML, or built in code) into a :class:`Cluster`."""
    if not isinstance(data, Mapping):
        raise SpecError(f"a cluster spec is an object (mapping) at the top level, got {type(data).__name__}")
    model = _parse_model(_require("cluster", data, "model"))
    raw_nodes = data.get("nodes")
    if not isinstance(raw_nodes, (list, tuple)) or not raw_nodes:
        raise SpecError("nodes: the cluster has no nodes; give a non-empty list under 'nodes'")
    nodes = tuple(_parse_node(i, item) for i, item in enumerate(raw_nodes))
    seen: set[str] = set()
    for node in nodes:
        if node.id in seen:
            raise SpecError(f"nodes: duplicate node id {node.id!r}; every node needs its own id")
        seen.add(node.id)
    network = _parse_network(_require("cluster", data, "network"), nodes)
    overhead = _integer("cluster", "overhead_bytes", data.get("overhead_bytes", 0))
    fraction = _number(
        "cluster", "weight_memory_fraction", data.get("weight_memory_fraction", 1.0), positive=True
    )
    if fraction > 1.0:
        raise SpecError(f"weight_memory_fraction must be in (0, 1], got {fraction}")
    token_bytes = _integer("cluster", "token_bytes", data.get("token_bytes", 4), minimum=1)
    raw_workload = data.get("workload") or {}
    if not isinstance(raw_workload, Mapping):
        raise SpecError("workload: must be an object with avg_input_tokens and avg_output_tokens")
    workload = Workload(
        avg_input_tokens=_number(
            "workload", "avg_input_tokens", raw_workload.get("avg_input_tokens", DEFAULT_INPUT_TOKENS)
        ),
        avg_output_tokens=_number(
            "workload",
            "avg_output_tokens",
            raw_workload.get("avg_output_tokens", DEFAULT_OUTPUT_TOKENS),
            positive=True,
        ),
    )
    cost_model = data.get("cost_model", "roofline")
    if cost_model not in COST_MODEL_NAMES:
        raise SpecError(
            f"cost_model must be one of {', '.join(COST_MODEL_NAMES)}, got {cost_model!r}: 'roofline' models "
            "any hardware from its specs, 'helix' uses Helix's measured GPU profiles"
        )
    expected = _parse_expected(data.get("expected"), seen, model.num_blocks)
    extra = {k: v for k, v in data.items() if k not in _TOP_KEYS}
    return Cluster(
        name=str(data.get("name", default_name)),
        model=model,
        nodes=nodes,
        network=network,
        overhead_bytes=overhead,
        weight_memory_fraction=fraction,
        token_bytes=token_bytes,
        workload=workload,
        cost_model=cost_model,
        source=str(data.get("source", "")),
        expected=expected,
        extra=extra,
    )


def _link_dict(link: LinkSpec) -> dict[str, float]:
    return {"bandwidth_mbps": link.bandwidth_mbps, "latency_ms": link.latency_ms}


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """The plain-data form of a cluster (round-trips through :func:`cluster_from_dict`)."""
    model = {k: v for k, v in vars(cluster.model).items() if v is not None}
    nodes = []
    for node in cluster.nodes:
        item = {k: v for k, v in vars(node).items() if v is not None}
        nodes.append(item)
    net = cluster.network
    network: dict[str, Any] = {
        "intra_region": _link_dict(net.intra_region),
        "coordinator_region": net.coordinator_region,
    }
    if net.inter_region is not None:
        network["inter_region"] = _link_dict(net.inter_region)
    if net.intra_machine is not None:
        network["intra_machine"] = _link_dict(net.intra_machine)
    if net.region_links:
        network["region_links"] = [{"a": a, "b": b, **_link_dict(link)} for a, b, link in net.region_links]
    if net.links:
        network["links"] = [{"a": a, "b": b, **_link_dict(link)} for a, b, link in net.links]
    data: dict[str, Any] = {
        "name": cluster.name,
        "source": cluster.source,
        "model": model,
        "overhead_bytes": cluster.overhead_bytes,
        "weight_memory_fraction": cluster.weight_memory_fraction,
        "token_bytes": cluster.token_bytes,
        "nodes": nodes,
        "network": network,
        "workload": {
            "avg_input_tokens": cluster.workload.avg_input_tokens,
            "avg_output_tokens": cluster.workload.avg_output_tokens,
        },
    }
    if cluster.cost_model != "roofline":
        data["cost_model"] = cluster.cost_model
    if cluster.expected:
        data["expected"] = {
            alg: {n: list(r) for n, r in placement.items()} for alg, placement in cluster.expected.items()
        }
    data.update(cluster.extra)
    return data
