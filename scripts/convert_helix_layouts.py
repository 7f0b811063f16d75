"""Convert the model placements Helix published into this project's placements, as test data.

Helix's artifact (Thesys-lab/Helix-ASPLOS25, ``artifact_evaluation/model_placement/``) holds the LLaMA-2
70B placements of its model-placement deep dive (Helix §6.6, Fig. 9): its MILP's (``ilp/ilp_sol.ini``),
its Petals baseline's (``petals/petals_sol.ini``) and its SWARM baseline's (``swarm/swarm_sol.ini``), on
the single cluster (``layout_single/``, nodes in ``config_single/cluster24.ini``) and on the three-region
cluster (``layout_distributed/``, ``config_distributed/3cluster24.ini``). Its
``artifact_evaluation/high_heterogeneity/`` holds the same three for the 42-node high-heterogeneity
cluster (Helix §6.1: ``layout_llama70b/{ilp,petals,swarm}/``, nodes in ``config/cluster42.ini``). This
script reads them from a copy of that repository, maps Helix's nodes onto the node ids of
``helix-single-24``, ``helix-geo-24`` and ``helix-hetero-42``, checks each placement against our specs and
writes ``tests/data/helix_layouts/<cluster>.<method>.json``:

    python scripts/convert_helix_layouts.py /path/to/Helix-ASPLOS25            # a checkout
    python scripts/convert_helix_layouts.py /path/to/Helix-ASPLOS25.git        # or a bare git directory

Node mapping: Helix's ``ComputeNode-i`` (``compute_node_{i + offset}`` in a solution file, ``offset`` from
its ``[Settings]``) has a ``type`` (A100, V100, L4, T4; L4x2, T4x2, T4x4 for machines with several GPUs);
the k-th Helix node of a type, by index, becomes the k-th node of that GPU and GPU count in our spec's
order (``T4x2`` is a node with ``gpu`` T4 and ``gpus`` 2: ``2xt4-*`` in ``helix-hetero-42``). For the
three-region cluster Helix's header lists its partitions in index order; the script checks that each
partition lands in one of our regions.

A solution lists each node's layers; they must be consecutive and become the half-open ``[first, last +
1)``. Each written placement is checked: ranges inside ``[0, L)``, no node above its ``max_blocks`` (nor
above what its memory holds in our spec), every block served. Problems are printed and kept in the
file's ``problems`` list; the script exits with status 1 if any placement has one.
"""

from __future__ import annotations

import argparse
import ast
import configparser
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmnode.planner import load_shared_cluster, placement_problems

REPOSITORY = "Thesys-lab/Helix-ASPLOS25"
COMMIT = "148b733080c0c5d3ddca0fe3c985b2e52a7f7b35"
BASE = "artifact_evaluation/model_placement"
HETERO = "artifact_evaluation/high_heterogeneity"
OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "helix_layouts"

#: Our cluster spec -> Helix's cluster file and layout folder.
CLUSTERS = {
    "helix-single-24": (f"{BASE}/config_single/cluster24.ini", f"{BASE}/layout_single"),
    "helix-geo-24": (f"{BASE}/config_distributed/3cluster24.ini", f"{BASE}/layout_distributed"),
    "helix-hetero-42": (f"{HETERO}/config/cluster42.ini", f"{HETERO}/layout_llama70b"),
}
#: Helix's method folder -> its solution file.
METHODS = {"ilp": "ilp/ilp_sol.ini", "petals": "petals/petals_sol.ini", "swarm": "swarm/swarm_sol.ini"}
#: Our spec's ``gpu`` -> Helix's machine type (of a one-GPU machine; see ``helix_type``).
HELIX_TYPE = {"A100-40G": "A100", "L4": "L4", "T4": "T4", "V100-16G": "V100"}


class Source:
    """Files of Helix's repository: a checkout (files on disk) or a bare git directory (``git show``)."""

    def __init__(self, path: Path, commit: str) -> None:
        self.path = path
        self.commit = commit

    def read(self, name: str) -> str:
        on_disk = self.path / name
        if on_disk.is_file():
            return on_disk.read_text()
        return subprocess.run(
            ["git", "--git-dir", str(self.path), "show", f"{self.commit}:{name}"],
            check=True, capture_output=True, text=True,
        ).stdout


def _ini(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    parser.read_string(text)
    return parser


def helix_types(cluster_ini: str) -> list[str]:
    """Machine type of each ``ComputeNode-i``, by index."""
    parser = _ini(cluster_ini)
    count = int(parser["NodeNames"]["total_compute_nodes"])
    return [parser[f"ComputeNode-{i}"]["type"].strip() for i in range(count)]


def helix_partitions(cluster_ini: str) -> list[int] | None:
    """Partition of each node index from the header's ``partition-k: [...]`` lines (Helix's fake-cluster
    generator lists the partitions' types in index order), or None when the file has none."""
    partitions = []
    for line in cluster_ini.splitlines():
        match = re.match(r"#\s+partition-(\d+):\s*(\[.*\])", line)
        if match:
            partitions.extend([int(match.group(1))] * len(ast.literal_eval(match.group(2))))
    return partitions or None


def helix_type(node) -> str:
    """Helix's machine type of one of our nodes: ``HELIX_TYPE`` of its GPU, ``x<n>`` appended for a node
    with n > 1 GPUs (Helix's ``L4x2``, ``T4x2``, ``T4x4``)."""
    kind = HELIX_TYPE.get(node.gpu, node.gpu)
    return f"{kind}x{node.gpus}" if node.gpus > 1 else kind


def node_map(cluster, types: list[str]) -> list[str]:
    """Our node id of each Helix node index: the k-th Helix node of a type is our k-th node of it."""
    ours: dict[str, list[str]] = {}
    for node_id in cluster.node_ids:
        ours.setdefault(helix_type(cluster.node(node_id)), []).append(node_id)
    used: dict[str, int] = {}
    mapping = []
    for kind in types:
        k = used.get(kind, 0)
        if k >= len(ours.get(kind, [])):
            raise SystemExit(f"{cluster.name}: Helix has more {kind} nodes than our spec; fix the spec or map")
        mapping.append(ours[kind][k])
        used[kind] = k + 1
    leftover = {kind: ids[used.get(kind, 0):] for kind, ids in ours.items() if ids[used.get(kind, 0):]}
    if leftover:
        raise SystemExit(f"{cluster.name}: our spec has nodes Helix's cluster lacks: {leftover}")
    return mapping


def read_solution(text: str) -> dict[int, list[int]]:
    """Helix node index -> the layers its solution file gives it."""
    parser = _ini(text)
    offset = int(parser["Settings"]["offset"])
    layers = {}
    for name, value in parser["Solution"].items():
        layers[int(name.rsplit("_", 1)[1]) - offset] = ast.literal_eval(value)
    return layers


def convert(source: Source, cluster_name: str, method: str) -> dict:
    cluster = load_shared_cluster(cluster_name)
    cluster_file, layout_dir = CLUSTERS[cluster_name]
    cluster_ini = source.read(cluster_file)
    types = helix_types(cluster_ini)
    mapping = node_map(cluster, types)
    problems = []
    partitions = helix_partitions(cluster_ini)
    if partitions is not None:
        for part in sorted(set(partitions)):
            regions = {cluster.node(mapping[i]).region for i, p in enumerate(partitions) if p == part}
            if len(regions) != 1:
                problems.append(f"Helix's partition-{part} maps onto regions {sorted(regions)}, not one")
    solution_file = f"{layout_dir}/{METHODS[method]}"
    placement = {}
    for index, layers in sorted(read_solution(source.read(solution_file)).items()):
        node_id = mapping[index]
        if not layers:
            continue
        if layers != list(range(layers[0], layers[-1] + 1)):
            problems.append(f"{node_id} (Helix node {index}): layers {layers} are not consecutive")
            continue
        start, end = layers[0], layers[-1] + 1
        cap = cluster.node(node_id).max_blocks
        if cap is not None and end - start > cap:
            problems.append(f"{node_id} (Helix node {index}, {types[index]}): {end - start} blocks, max_blocks {cap}")
        placement[node_id] = [start, end]
    problems += placement_problems(cluster, {n: tuple(r) for n, r in placement.items()})
    return {
        "cluster": cluster_name,
        "method": method,
        "source": {
            "repository": REPOSITORY,
            "commit": source.commit,
            "file": solution_file,
            "cluster_file": cluster_file,
        },
        "helix_node_ids": mapping,
        "placement": {n: placement[n] for n in cluster.node_ids if n in placement},
        "problems": problems,
    }


def to_json(layout: dict) -> str:
    """The layout as JSON with one line per node (lists of scalars kept on one line)."""
    text = json.dumps(layout, indent=1)
    return re.sub(r"\[[^\[\]{}]*\]", lambda m: json.dumps(json.loads(m.group(0))), text) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("repository", type=Path, help="a checkout or bare git directory of " + REPOSITORY)
    parser.add_argument("--commit", default=COMMIT, help="commit to read from a bare git directory")
    parser.add_argument("--out", type=Path, default=OUT, help="folder to write the JSON files to")
    args = parser.parse_args()
    source = Source(args.repository, args.commit)
    args.out.mkdir(parents=True, exist_ok=True)
    failed = False
    for cluster_name in CLUSTERS:
        for method in METHODS:
            layout = convert(source, cluster_name, method)
            path = args.out / f"{cluster_name}.{method}.json"
            path.write_text(to_json(layout))
            status = "; ".join(layout["problems"]) or "valid"
            print(f"{path.name}: {len(layout['placement'])} nodes, {status}")
            failed = failed or bool(layout["problems"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
