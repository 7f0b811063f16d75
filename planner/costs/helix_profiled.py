"""Helix's cost model as its published code computes it: ``T_j`` from measured per-layer batch times.

Reference: Helix (ASPLOS 2025) §4.3 ("we profile each node's throughput with a typical batch") and its code,
Thesys-lab/Helix-ASPLOS25 at commit 148b733, ``simulator/model_manager/llama2_70b/`` (and ``llama1_30b/``):

* **Batch times** (``<gpu>/prompt_bs2time.csv``, ``decode_bs2time.csv``): one layer's time for a batch of
  prompt tokens or decode sequences, linearly interpolated; a node holding ``j`` layers takes ``j`` times
  as long (``get_typical_token_throughput`` in ``llama2_70b_<gpu>.py``). Data: :mod:`planner.cluster.helix_profiles`.
* **KV room** (``vllm_num_blocks_dict``): vLLM's KV blocks of 16 tokens measured next to ``j`` layers;
  only ``KV_CACHE_HWM = 0.3`` of it counts when sizing the typical batch (``llama70b_typical_statistics``
  in ``helper.py``; the constant is in ``simulator/event_simulator/utils.py``).
* **A node's share of requests** (``llama70b_workload_ratio`` in ``helper.py``): ``j t / (j t + (L - j)
  t_avg)``, where ``t`` is the node's time per layer and ``t_avg`` the cluster's layer-weighted average
  over every machine kind at its *typical* layer count (fixed per kind, the larger set when the cluster
  holds less than 1.2 copies of the model at the smaller one); the per-kind speeds are refined over ten
  rounds (``LLaMa70BStatistics.__init__`` in ``llama2_70b.py``).
* **Typical batch** (``llama70b_typical_statistics``): ``n = 0.3 KV / (j (s_in + s_out)) x share``
  requests in flight at the node; the batch holds ``n / s_out`` of a prompt and ``n`` decode tokens, and,
  when that is less than one prompt, is rescaled to exactly one prompt plus ``s_out`` decode steps of ``n``
  sequences (``1 / (n / s_out)`` times as many). Past one prompt per batch it is one prompt plus ``s_out``
  decode tokens.
* **T_j** = typical batch tokens / its time, capped by the NIC (``ilp_layout.py``: ``min(inference
  throughput, nic / activation size)``).

Helix's ``T_j`` counts prompt and decode tokens alike; here, as in :mod:`planner.costs.roofline`, capacities
are output tokens per second, so ``T_j`` is divided by the tokens a request brings per output token
(:attr:`planner.costs.roofline.RequestShape.tokens_per_pass`), the same factor that turns Helix's link
capacities into the flow graph's. The request lengths are the workload's (763/232 for Helix's trace as the
paper reports it; Helix's code uses 750/240).

Nodes Helix did not profile (CPU nodes, measured nodes, other GPU kinds) keep the roofline figures of
:class:`~planner.costs.roofline.CostModel` and are left out of the share's cluster average;
:meth:`HelixCostModel.sources` names each node's source.
"""

from __future__ import annotations

from collections import Counter

from ..cluster.helix_profiles import GpuProfile, ModelProfiles, model_profiles, profile_key
from ..cluster.spec import Cluster, Workload
from .roofline import CostModel, CostParams, nic_capacity

__all__ = ["INITIAL_SPEED", "TYPICAL_LAYERS", "HelixCostModel"]

#: Typical layers per machine kind (``typical_layers_dict`` in ``llama2_70b.py`` / ``llama1_30b.py``):
#: the first set, and the second when the cluster holds less than 1.2 copies of the model at the first.
TYPICAL_LAYERS: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    "llama2_70b": (
        {"a100": 8, "v100": 3, "l4": 4, "l4x2": 9, "t4": 3, "t4x2": 6, "t4x4": 12},
        {"a100": 12, "v100": 4, "l4": 7, "l4x2": 14, "t4": 4, "t4x2": 9, "t4x4": 18},
    ),
    "llama1_30b": (
        {"a100": 12, "v100": 4, "l4": 8, "l4x2": 14, "t4": 4, "t4x2": 10, "t4x4": 20},
        {"a100": 18, "v100": 7, "l4": 11, "l4x2": 22, "t4": 7, "t4x2": 15, "t4x4": 30},
    ),
}

#: The starting per-kind speeds (layer-tokens per second) of the ten refinement rounds
#: (``normalized_perf_dict`` in ``llama2_70b.py`` / ``llama1_30b.py``).
INITIAL_SPEED: dict[str, dict[str, float]] = {
    "llama2_70b": {"a100": 80, "v100": 40, "l4": 20, "l4x2": 30, "t4": 12.5, "t4x2": 20, "t4x4": 30},
    "llama1_30b": {"a100": 48, "v100": 25, "l4": 9, "l4x2": 15, "t4": 8, "t4x2": 15, "t4x4": 23},
}

_ROUNDS = 10


class HelixCostModel(CostModel):
    """The cost model of Helix's code for the nodes it profiled (module docstring), the roofline's for the
    rest. The same interface as :class:`~planner.costs.roofline.CostModel`, so every planner and the flow graph
    take it."""

    name = "helix"

    def __init__(
        self, cluster: Cluster, params: CostParams | None = None, workload: Workload | None = None
    ) -> None:
        super().__init__(cluster, params, workload)
        self.profiles: ModelProfiles = model_profiles(cluster.model)
        self._kind: dict[str, str] = {}
        for node in cluster.nodes:
            key = profile_key(node)
            if key is not None and key in self.profiles.gpus:
                self._kind[node.id] = key
        constants = self.profiles.constants
        #: Share of vLLM's KV room a typical batch is sized by (``KV_CACHE_HWM``).
        self.kv_high_water = float(constants["KV_CACHE_HWM"])
        self.block_size = int(constants["VLLM_BLOCK_SIZE"])
        self.max_input_tokens = int(constants["MAX_INPUT_LEN"])
        counts = Counter(self._kind.values())
        first, second = TYPICAL_LAYERS[self.profiles.key]
        held = sum(n * first[k] for k, n in counts.items())
        typical = first if held >= cluster.model.num_blocks * 1.2 else second
        #: Typical layers per profiled machine kind in this cluster, and the kinds' refined speeds.
        self.typical_layers = {k: typical[k] for k in counts}
        self.speed = {k: float(INITIAL_SPEED[self.profiles.key][k]) for k in counts}
        self._counts = counts
        for _ in range(_ROUNDS):
            self.speed = {
                k: self._typical_rate(k, self.typical_layers[k]) * self.typical_layers[k] for k in counts
            }
        for node_id, kind in self._kind.items():
            node = cluster.node(node_id)
            profile = self.profiles.gpus[kind]
            cap = profile.max_layers if node.max_blocks is None else min(profile.max_layers, node.max_blocks)
            cap = min(cap, cluster.model.num_blocks)
            nic = nic_capacity(cluster, node)
            per_output = self.shape.tokens_per_pass
            self.capacity[node_id] = cap
            self.table[node_id] = tuple(
                [0.0] + [min(self._typical_rate(kind, j), nic) / per_output for j in range(1, cap + 1)]
            )

    # -- Helix's helper.py -------------------------------------------------------------------------

    def workload_ratio(self, kind: str, layers: int) -> float:
        """The share of a request's round trip a node of ``kind`` holding ``layers`` layers is busy with it
        (``llama70b_workload_ratio``): ``j t / ((L - j) t_avg + j t)``."""
        layer_time = {k: 1.0 / s for k, s in self.speed.items()}
        total_time = sum(n * self.typical_layers[k] * layer_time[k] for k, n in self._counts.items())
        total_layers = sum(n * self.typical_layers[k] for k, n in self._counts.items())
        busy = layers * layer_time[kind]
        round_trip = (self.cluster.model.num_blocks - layers) * (total_time / total_layers) + busy
        return busy / round_trip

    def typical_batch(self, kind: str, layers: int) -> tuple[float, int, int]:
        """``(prompt requests, prompt tokens, decode tokens)`` of the typical batch
        (``llama70b_typical_statistics``)."""
        profile = self.profiles.gpus[kind]
        s_in, s_out = self.shape.s_in, self.shape.s_out
        entries = profile.kv_token_layers(layers, self.block_size)
        available = int(self.kv_high_water * entries / layers)
        in_flight = available / (s_in + s_out) * self.workload_ratio(kind, layers)
        requests = in_flight / s_out
        if requests > 1:  # Helix: "already in linear region, just cap at 1"
            return 1.0, round(s_in), round(s_out)
        return requests, round(requests * s_in), round(in_flight)

    def _typical_rate(self, kind: str, layers: int) -> float:
        """Tokens (prompt and decode) per second through ``layers`` layers at the typical batch
        (``get_typical_token_throughput``)."""
        profile: GpuProfile = self.profiles.gpus[kind]
        requests, prompt, decode = self.typical_batch(kind, layers)
        if requests <= 0 or prompt + decode <= 0:
            return 0.0
        if requests >= 1:
            seconds = layers * (profile.prompt_seconds(prompt) + profile.decode_seconds(decode))
            return (prompt + decode) / seconds
        scale = 1.0 / requests
        tokens = scale * (prompt + decode)
        seconds = layers * (profile.prompt_seconds(int(prompt * scale)) + profile.decode_seconds(decode) * scale)
        return tokens / seconds

    # -- the CostModel interface -------------------------------------------------------------------

    def profile_of(self, node_id: str) -> GpuProfile | None:
        """The node's Helix profile, or None when it uses the roofline figures."""
        kind = self._kind.get(node_id)
        return None if kind is None else self.profiles.gpus[kind]

    def batch_seconds(
        self, node_id: str, blocks: int, prompt_tokens: float, decode_tokens: float, context: float = 0.0
    ) -> float:
        """``j`` times one layer's profiled prompt time plus decode time. Helix's profiles were measured at
        its trace's context lengths, so ``context`` does not enter (``decode_bs2time.csv`` has one column)."""
        profile = self.profile_of(node_id)
        if profile is None:
            return super().batch_seconds(node_id, blocks, prompt_tokens, decode_tokens, context)
        if blocks <= 0:
            return 0.0
        return blocks * (profile.prompt_seconds(prompt_tokens) + profile.decode_seconds(decode_tokens))

    def kv_token_layers(self, node_id: str, blocks: int) -> float:
        """vLLM's measured room: ``16 x vllm_num_blocks[j] x j`` token-layers (``kv_cache_capacity``)."""
        profile = self.profile_of(node_id)
        if profile is None:
            return super().kv_token_layers(node_id, blocks)
        if blocks <= 0 or blocks not in profile.vllm_blocks:
            return 0.0
        return float(profile.kv_token_layers(blocks, self.block_size))

    def batch_limits(self, node_id: str, blocks: int) -> tuple[float, float] | None:
        """``(prompt_max_requests[j] x MAX_INPUT_LEN, decode_max_tokens[j])`` (``InferenceSettings``)."""
        profile = self.profile_of(node_id)
        if profile is None or blocks not in profile.prompt_max_requests:
            return None
        return (
            float(profile.prompt_max_requests[blocks] * self.max_input_tokens),
            float(profile.decode_max_tokens[blocks]),
        )

    def sources(self) -> dict[str, str]:
        base = super().sources()
        return {n: f"helix:{self._kind[n]}" if n in self._kind else src for n, src in base.items()}

    def token_latency(self, node_id: str, blocks: int) -> float:
        """Seconds one token spends in ``blocks`` blocks: a batch of one decode sequence."""
        if self.profile_of(node_id) is None:
            return super().token_latency(node_id, blocks)
        return self.batch_seconds(node_id, blocks, 0.0, 1.0)
