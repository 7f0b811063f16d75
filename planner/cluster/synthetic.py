"""Seeded synthetic clusters past the papers' scale: a swarm of a few hundred volunteer machines.

Helix evaluates its MILP on 24 and 42 nodes (§6.1); a swarm of internet volunteers is larger, and the
planner has to work there too. :func:`synthetic_cluster` builds such a cluster from a seed, out of the
hardware and the network the papers measured, so that a benchmark at 100 or 250 nodes plans something
real-looking and reproducible:

* **GPU nodes** — the seven kinds of Helix's high-heterogeneity cluster (§6.1, ``helix-hetero-42``), with
  that spec's figures (memory, fp16 TFLOPS, memory bandwidth, a 10 Gb/s NIC) and, for LLaMA-2 70B, the
  Helix artifact's layer caps ``max_blocks`` (A100-40G 12, V100-16G 4, L4 7, T4 4, 2xL4 14, 2xT4 9,
  4xT4 18), in the same proportions: 4 A100, 6 V100, 8 L4, 10 T4, 4 2xL4, 6 2xT4, 4 4xT4 in every 42
  GPU nodes.
* **CPU nodes** — one in five nodes, as in LLaMPS (ICPE 2024): servers lending their leftover cores
  and RAM (``llamps-bloom3b-3server``: 2-8 cores, 13-17 GB). Drawn from :data:`CPU_PROFILES` (4-16
  cores, 16 or 32 GiB, a 1 Gb/s NIC). Under the roofline cost model they serve 5-55 tokens/s each,
  next to thousands for an A100; they are there because volunteers bring them, and they add node types
  the planner must handle.
* **Regions** — 1 to 4 (2-4 drawn from the seed unless given) of the four Google Cloud regions of Helix
  Table 7, with the bandwidth Table 7 measured between each pair (iperf3; the smaller of the two
  directions, 54-196 Mb/s) and Helix's average 50 ms latency (§6.1); inside a region Helix's 10 Gb/s and
  1 ms (``helix-geo-24``). The coordinator sits in the first region drawn. Nodes spread over the regions
  with seeded, uneven weights, at least one node per region.

Node counts per kind follow the proportions by largest remainders (so a given size has the same mix for
every seed); the seed draws the regions, the spread of nodes over them and the CPU profiles. Node ids are
the kind and a number (``a100-0``, ``2xt4-3``, ``cpu-7``). The model defaults to LLaMA-2 70B, as in
Helix's specs, with half of every node's memory for weights (``weight_memory_fraction``: Helix keeps
the other half for the KV cache).

The spec is built as plain data and validated by :func:`planner.cluster.spec.cluster_from_dict`, so it is a
valid cluster spec (``planner/clusters/README.md``); :func:`synthetic_spec` returns that data and
:func:`spec_json` writes any cluster as spec JSON. ``python -m swarmnode.planner.cluster.synthetic 100 --seed 0``
prints one. A cluster whose nodes cannot hold :data:`MIN_COPIES` copies of the model is refused with a
:class:`~planner.cluster.spec.SpecError` naming the smallest size that can.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from types import MappingProxyType
from typing import Any

from ..costs.roofline import block_capacity
from .spec import Cluster, ModelSpec, SpecError, cluster_from_dict, cluster_to_dict

__all__ = [
    "CPU_PROFILES",
    "GPU_KINDS",
    "LLAMA2_70B",
    "MIN_COPIES",
    "REGIONS",
    "REGION_BANDWIDTH_MBPS",
    "spec_json",
    "synthetic_cluster",
    "synthetic_spec",
]

GIB = 1 << 30

#: The model of Helix's specs (``helix-*.json``): LLaMA-2 70B in fp16, 80 blocks.
LLAMA2_70B: Mapping[str, Any] = MappingProxyType(
    {
        "name": "llama-2-70b",
        "num_blocks": 80,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "dtype_bytes": 2,
        "block_bytes": 1711308800,
    }
)

#: Helix's GPU node kinds with the figures of ``helix-hetero-42`` and their share of every 42 GPU nodes
#: there (``weight``). ``max_blocks`` is the Helix artifact's cap for LLaMA-2 70B; it is applied only for
#: that model (for another model memory decides).
GPU_KINDS: tuple[Mapping[str, Any], ...] = tuple(
    MappingProxyType(kind)
    for kind in (
        {"prefix": "a100", "gpu": "A100-40G", "gpus": 1, "memory_bytes": 40 * GIB, "tflops": 312,
         "memory_bandwidth_gbs": 1555, "max_blocks": 12, "weight": 4},
        {"prefix": "v100", "gpu": "V100-16G", "gpus": 1, "memory_bytes": 16 * GIB, "tflops": 125,
         "memory_bandwidth_gbs": 900, "max_blocks": 4, "weight": 6},
        {"prefix": "l4", "gpu": "L4", "gpus": 1, "memory_bytes": 24 * GIB, "tflops": 121,
         "memory_bandwidth_gbs": 300, "max_blocks": 7, "weight": 8},
        {"prefix": "t4", "gpu": "T4", "gpus": 1, "memory_bytes": 16 * GIB, "tflops": 65,
         "memory_bandwidth_gbs": 320, "max_blocks": 4, "weight": 10},
        {"prefix": "2xl4", "gpu": "L4", "gpus": 2, "memory_bytes": 48 * GIB, "tflops": 121,
         "memory_bandwidth_gbs": 300, "max_blocks": 14, "weight": 4},
        {"prefix": "2xt4", "gpu": "T4", "gpus": 2, "memory_bytes": 32 * GIB, "tflops": 65,
         "memory_bandwidth_gbs": 320, "max_blocks": 9, "weight": 6},
        {"prefix": "4xt4", "gpu": "T4", "gpus": 4, "memory_bytes": 64 * GIB, "tflops": 65,
         "memory_bandwidth_gbs": 320, "max_blocks": 18, "weight": 4},
    )
)  # fmt: skip

#: NIC of a GPU node (Helix's 10 Gb/s) and of a CPU node (a volunteer's 1 Gb/s), Mb/s.
GPU_NIC_MBPS = 10_000
CPU_NIC_MBPS = 1_000

#: CPU nodes' share of every 42 GPU nodes: 10 of 52 nodes, about one in five.
CPU_WEIGHT = 10

#: Leftover cores and RAM a CPU node lends (LLaMPS-like: a server's spare capacity), drawn uniformly.
CPU_PROFILES: tuple[tuple[int, int], ...] = ((4, 16 * GIB), (8, 16 * GIB), (8, 32 * GIB), (16, 32 * GIB))

#: The regions of Helix Table 7 (iperf3 between Google Compute Engine zones).
REGIONS: tuple[str, ...] = ("us-central1", "europe-west3", "asia-east2", "australia-southeast1")

#: Helix Table 7's bandwidth between two regions, the smaller of its two directions (Mb/s).
REGION_BANDWIDTH_MBPS: Mapping[frozenset[str], float] = MappingProxyType(
    {
        frozenset(("asia-east2", "us-central1")): 122.0,
        frozenset(("asia-east2", "europe-west3")): 61.0,
        frozenset(("asia-east2", "australia-southeast1")): 159.0,
        frozenset(("us-central1", "europe-west3")): 196.0,
        frozenset(("us-central1", "australia-southeast1")): 118.0,
        frozenset(("europe-west3", "australia-southeast1")): 54.0,
    }
)

#: Latency between regions (Helix §6.1: "an average latency of 50 ms") and Helix's links inside one.
INTER_REGION_LATENCY_MS = 50.0
INTRA_REGION = MappingProxyType({"bandwidth_mbps": 10_000.0, "latency_ms": 1.0})

#: The nodes must hold at least this many copies of the model, so that a placement has room to choose.
MIN_COPIES = 2.0

#: Helix keeps half of every GPU's memory for the KV cache (the caps of ``max_blocks`` assume it).
WEIGHT_MEMORY_FRACTION = 0.5


def _kind_counts(num_nodes: int) -> list[int]:
    """Nodes of each kind (:data:`GPU_KINDS`, then CPU) for ``num_nodes``: the weights' proportions,
    rounded by largest remainders (ties to the earlier kind), so the counts add up to ``num_nodes``."""
    weights = [kind["weight"] for kind in GPU_KINDS] + [CPU_WEIGHT]
    total = sum(weights)
    exact = [num_nodes * w / total for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: num_nodes - sum(counts)]:
        counts[i] += 1
    return counts


def _model_data(model: Mapping[str, Any] | ModelSpec) -> dict[str, Any]:
    if isinstance(model, ModelSpec):
        return {k: v for k, v in asdict(model).items() if v is not None}
    if not isinstance(model, Mapping):
        raise SpecError(
            f"model must be a spec's model object (a mapping) or a ModelSpec, got {type(model).__name__}"
        )
    return dict(model)


def _check_arguments(num_nodes: Any, regions: Any, seed: Any) -> None:
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise SpecError(f"num_nodes must be a positive integer, got {num_nodes!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise SpecError(f"seed must be an integer, got {seed!r}")
    if regions is None:
        return
    if isinstance(regions, bool) or not isinstance(regions, int) or not 1 <= regions <= len(REGIONS):
        raise SpecError(
            f"regions must be an integer from 1 to {len(REGIONS)} (the regions of Helix Table 7), "
            f"got {regions!r}; leave it out to draw 2-4 from the seed"
        )
    if regions > num_nodes:
        raise SpecError(f"{regions} regions need at least {regions} nodes, got {num_nodes}; ask for fewer")


def _nodes(num_nodes: int, regions: list[str], rng: random.Random, *, caps: bool) -> list[dict[str, Any]]:
    """The nodes, listed region by region and kind by kind: :func:`_kind_counts` of each kind, every CPU
    node a profile of :data:`CPU_PROFILES`; in random order one node goes to each region, then each
    other node to a region drawn with seeded, uneven weights."""
    counts = _kind_counts(num_nodes)
    hardware: list[tuple[str, dict[str, Any]]] = []
    for kind, count in zip(GPU_KINDS, counts, strict=False):
        fields = {
            "device": "gpu",
            "gpu": kind["gpu"],
            "gpus": kind["gpus"],
            "memory_bytes": kind["memory_bytes"],
            "tflops": kind["tflops"],
            "memory_bandwidth_gbs": kind["memory_bandwidth_gbs"],
            "nic_mbps": GPU_NIC_MBPS,
            **({"max_blocks": kind["max_blocks"]} if caps else {}),
        }
        hardware += [(f"{kind['prefix']}-{i}", fields) for i in range(count)]
    for i in range(counts[-1]):
        cores, memory = rng.choice(CPU_PROFILES)
        fields = {"device": "cpu", "cores": cores, "memory_bytes": memory, "nic_mbps": CPU_NIC_MBPS}
        hardware.append((f"cpu-{i}", fields))
    order = list(range(len(hardware)))
    rng.shuffle(order)
    weights = [rng.uniform(0.5, 1.5) for _ in regions]
    region_of = [""] * len(hardware)
    for rank, index in enumerate(order):
        region_of[index] = regions[rank] if rank < len(regions) else rng.choices(regions, weights)[0]
    listed = sorted(range(len(hardware)), key=lambda i: (regions.index(region_of[i]), i))
    return [{"id": hardware[i][0], "region": region_of[i], **hardware[i][1]} for i in listed]


def _network(regions: list[str]) -> dict[str, Any]:
    region_links = [
        {
            "a": a,
            "b": b,
            "bandwidth_mbps": REGION_BANDWIDTH_MBPS[frozenset((a, b))],
            "latency_ms": INTER_REGION_LATENCY_MS,
        }
        for i, a in enumerate(regions)
        for b in regions[i + 1 :]
    ]
    network: dict[str, Any] = {"intra_region": dict(INTRA_REGION), "coordinator_region": regions[0]}
    if region_links:
        network["region_links"] = region_links
    return network


def _build(num_nodes: int, seed: int, regions: int | None, model: dict[str, Any]) -> dict[str, Any]:
    """The spec's plain data (no check); the seed alone draws the regions, the spread and the CPU nodes."""
    rng = random.Random(f"swarmnode.planner.cluster.synthetic:{seed}")
    count = regions if regions is not None else rng.randint(min(2, num_nodes), min(4, num_nodes))
    chosen = rng.sample(REGIONS, count)
    return {
        "name": f"synthetic-{num_nodes}-seed{seed}",
        "source": (
            f"planner.cluster.synthetic.synthetic_cluster({num_nodes}, seed={seed}, regions={count}): Helix §6.1 "
            "high-heterogeneity GPU mix, one node in five a LLaMPS-like CPU node, regions and links of "
            "Helix Table 7 and §6.1"
        ),
        "model": model,
        "weight_memory_fraction": WEIGHT_MEMORY_FRACTION,
        "nodes": _nodes(num_nodes, chosen, rng, caps=model == dict(LLAMA2_70B)),
        "network": _network(chosen),
        "workload": {"avg_input_tokens": 763, "avg_output_tokens": 232},
    }


def _held_copies(cluster: Cluster) -> float:
    return sum(block_capacity(cluster, n) for n in cluster.nodes) / cluster.model.num_blocks


def synthetic_spec(
    num_nodes: int,
    *,
    seed: int = 0,
    regions: int | None = None,
    model: Mapping[str, Any] | ModelSpec = LLAMA2_70B,
) -> dict[str, Any]:
    """The plain-data spec of :func:`synthetic_cluster` (module docstring), validated and checked to hold
    :data:`MIN_COPIES` copies of the model; ``json.dumps`` of it is a spec file."""
    _check_arguments(num_nodes, regions, seed)
    model_data = _model_data(model)
    spec = _build(num_nodes, seed, regions, model_data)
    copies = _held_copies(cluster_from_dict(spec))
    if copies >= MIN_COPIES:
        return spec
    # the smallest size that holds enough: the mix grows with the size, so search upwards
    hint = "; the model is too large for these nodes, give a smaller model"
    for larger in range(num_nodes + 1, 4 * num_nodes + 64):
        if _held_copies(cluster_from_dict(_build(larger, seed, regions, model_data))) >= MIN_COPIES:
            hint = f"; ask for at least {larger} nodes"
            break
    raise SpecError(
        f"a synthetic cluster of {num_nodes} nodes holds {copies:.2f} copies of {model_data.get('name')} "
        f"({model_data.get('num_blocks')} blocks), fewer than the {MIN_COPIES:g} it must hold{hint}"
    )


def synthetic_cluster(
    num_nodes: int,
    *,
    seed: int = 0,
    regions: int | None = None,
    model: Mapping[str, Any] | ModelSpec = LLAMA2_70B,
) -> Cluster:
    """A validated synthetic cluster of ``num_nodes`` nodes (module docstring): the same cluster for the
    same arguments. ``regions``: how many of Helix Table 7's regions (1-4; default 2-4 drawn from the
    seed). ``model``: a spec's model object or a :class:`~planner.cluster.spec.ModelSpec` (default LLaMA-2 70B).
    Raises :class:`~planner.cluster.spec.SpecError` for bad arguments or a cluster too small for the model."""
    return cluster_from_dict(synthetic_spec(num_nodes, seed=seed, regions=regions, model=model))


def spec_json(cluster: Cluster, *, indent: int | None = 2) -> str:
    """``cluster`` as cluster-spec JSON (``planner/clusters/README.md``), readable by ``swarmnode plan``."""
    return json.dumps(cluster_to_dict(cluster), indent=indent, ensure_ascii=False)


def main(argv: Sequence[str] | None = None) -> int:
    """Print (or write) the spec JSON of a synthetic cluster."""
    parser = argparse.ArgumentParser(
        prog="python -m swarmnode.planner.cluster.synthetic", description="Write a seeded synthetic cluster spec."
    )
    parser.add_argument("num_nodes", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--regions", type=int, default=None, help="1-4 (default: 2-4 drawn from the seed)")
    parser.add_argument("-o", "--output", default=None, help="file to write (default: standard output)")
    args = parser.parse_args(argv)
    try:
        cluster = synthetic_cluster(args.num_nodes, seed=args.seed, regions=args.regions)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = spec_json(cluster) + "\n"
    if args.output is None:
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
