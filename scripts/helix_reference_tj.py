"""Write the ``T_j`` tables Helix's own code computes, as reference data for the helix cost model's tests.

Helix's published code (Thesys-lab/Helix-ASPLOS25) is not part of this project; this script imports it from
a checkout given on the command line, asks its ``LLaMa70BStatistics`` / ``LLaMa30BStatistics`` for every
machine kind's typical token throughput at every layer count (tokens per second, prompt and decode tokens
alike, at Helix's 750/240 request lengths), and writes them with their provenance:

    git clone https://github.com/Thesys-lab/Helix-ASPLOS25 /tmp/helix
    python scripts/helix_reference_tj.py /tmp/helix > tests/data/helix_reference_tj.json

``tests/test_helix_cost_model.py`` checks :class:`planner.costs.helix_profiled.HelixCostModel` against it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarmnode.planner import load_shared_cluster
from swarmnode.planner.cluster.helix_profiles import profile_key

#: Clusters whose machine mixes are written, and the Helix statistics class of their model.
CASES = {
    "helix-single-24": "llama2_70b",
    "helix-hetero-42": "llama2_70b",
    "helix-single-24-llama30b": "llama1_30b",
}


def helix_name(key: str) -> str:
    """``l4x2`` -> ``L4x2``: Helix's machine names."""
    kind, _, count = key.partition("x")
    return kind.upper() + (f"x{count}" if count else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("helix", type=Path, help="a checkout of Thesys-lab/Helix-ASPLOS25")
    parser.add_argument("--commit", help="the checkout's commit, when it is not a git work tree")
    args = parser.parse_args()
    sys.path.insert(0, str(args.helix))
    from simulator.model_manager.llama1_30b.llama1_30b import LLaMa30BStatistics
    from simulator.model_manager.llama2_70b.llama2_70b import LLaMa70BStatistics

    classes = {"llama2_70b": LLaMa70BStatistics, "llama1_30b": LLaMa30BStatistics}
    try:
        commit = subprocess.run(
            ["git", "-C", str(args.helix), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = args.commit or "unknown"
    out = {
        "source": "Thesys-lab/Helix-ASPLOS25 simulator/model_manager/<model>/<model>.py, "
        "get_typical_token_throughput(j) for every machine kind and layer count (tokens/s, 750/240 requests)",
        "commit": commit,
        "cases": {},
    }
    for name, model in CASES.items():
        cluster = load_shared_cluster(name)
        counts = Counter(helix_name(profile_key(n)) for n in cluster.nodes if profile_key(n))
        stats = classes[model](dict(counts))
        tables = {}
        for machine in counts:
            holder = getattr(stats, machine.lower())
            tables[machine.lower()] = [
                holder.get_typical_token_throughput(j) for j in range(1, holder.get_max_num_layers() + 1)
            ]
        out["cases"][name] = {
            "model": model,
            "machines": dict(counts),
            "typical_layers": {k.lower(): v for k, v in stats.typical_layers_dict.items()},
            "speed": {k.lower(): v for k, v in stats.normalized_perf_dict.items()},
            "tokens_per_second": tables,
        }
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
