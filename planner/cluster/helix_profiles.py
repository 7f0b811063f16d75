"""Helix's measured GPU profiles: per-layer batch times, vLLM KV-cache room and batch caps per GPU kind.

The data is ``clusters/profiles/helix-gpu-profiles.json``, a copy of what Helix's authors measured with
vLLM 0.4 on Google Cloud and published in Helix-ASPLOS25 (``simulator/model_manager/<model>/<gpu>/``:
``prompt_bs2time.csv``, ``decode_bs2time.csv`` and the dictionaries of ``llama2_70b_<gpu>.py``), for
LLaMA-2 70B and LLaMA 30B on seven GPU kinds (A100-40G, V100-16G, L4, T4, and machines of 2 L4, 2 T4 and
4 T4). Times are milliseconds for ONE layer; :func:`load_profile_csv` in Helix's
``simulator/event_simulator/utils.py`` reads them the same way.

This module is plain data: which profile a model and a node have (:func:`model_profiles`,
:func:`profile_key`), and a profile's figures (:class:`GpuProfile`). The cost model built on it is
:mod:`planner.costs.helix_profiled`.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..errors import PlannerError
from .spec import ModelSpec, NodeSpec

__all__ = [
    "PROFILES_PATH",
    "GpuProfile",
    "ModelProfiles",
    "model_profiles",
    "profile_key",
]

PROFILES_PATH = Path(__file__).resolve().parent.parent / "clusters" / "profiles" / "helix-gpu-profiles.json"

#: The models Helix profiled, by their shapes (blocks, hidden size): the key in the profiles file and the
#: name of the model in Helix's code.
_MODELS = {(80, 8192): ("llama2_70b", "LLaMA-2 70B"), (60, 6656): ("llama1_30b", "LLaMA 30B")}

#: GPU names a spec's node may carry (``gpu``), as Helix names its machines (``num_machines_dict`` keys in
#: ``simulator/model_manager/llama2_70b/llama2_70b.py``), before a machine's GPU count is appended.
_GPU_KINDS = {"A100-40G": "a100", "A100": "a100", "V100-16G": "v100", "V100": "v100", "L4": "l4", "T4": "t4"}


@dataclass(frozen=True)
class GpuProfile:
    """One GPU kind's measured figures for one model (Helix ``ModelOnMachine`` subclasses).

    ``prompt_ms`` / ``decode_ms``: sorted ``(tokens, milliseconds)`` points for one layer to run a batch of
    that many prompt tokens / decode sequences; ``max_layers``: the most layers the machine holds;
    ``vllm_blocks[j]``: vLLM's KV blocks (of ``block_size`` tokens) when it holds ``j`` layers;
    ``prompt_max_requests[j]`` and ``decode_max_tokens[j]``: the caps on one batch."""

    key: str
    prompt_ms: tuple[tuple[int, float], ...]
    decode_ms: tuple[tuple[int, float], ...]
    max_layers: int
    vllm_blocks: Mapping[int, int]
    prompt_max_requests: Mapping[int, int]
    decode_max_tokens: Mapping[int, int]

    def prompt_seconds(self, tokens: float) -> float:
        """Seconds for one layer to run ``tokens`` prompt tokens (Helix's ``_get_prompt_time``)."""
        return _interpolate(self.prompt_ms, tokens) / 1000.0

    def decode_seconds(self, sequences: float) -> float:
        """Seconds for one layer to run one decode step of ``sequences`` sequences (``_get_decode_time``)."""
        return _interpolate(self.decode_ms, sequences) / 1000.0

    def kv_token_layers(self, layers: int, block_size: int) -> int:
        """Token-layers of KV cache next to ``layers`` layers: ``block_size x vllm_blocks[j] x j`` (Helix's
        ``kv_cache_capacity`` in ``llama2_70b_<gpu>.py``)."""
        return block_size * self.vllm_blocks[layers] * layers


def _interpolate(points: tuple[tuple[int, float], ...], x: float) -> float:
    """Linear interpolation between the measured points around ``x`` (Helix's ``linear_interpolate``), and
    along the last segment past the largest point, where Helix's lookup would fail."""
    if x <= 0:
        return 0.0
    xs = [p[0] for p in points]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return points[i][1]
    if i == 0:
        (x1, y1) = points[0]
        return y1 * x / x1
    if i == len(xs):
        (x0, y0), (x1, y1) = points[-2], points[-1]
    else:
        (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class ModelProfiles:
    """Every GPU profile of one model, with Helix's constants (``simulator/event_simulator/utils.py``)."""

    key: str
    title: str
    gpus: Mapping[str, GpuProfile]
    constants: Mapping[str, float]


@lru_cache(maxsize=1)
def _load() -> dict:
    try:
        return json.loads(PROFILES_PATH.read_text())
    except (OSError, ValueError) as exc:
        raise PlannerError(
            f"cannot read Helix's GPU profiles at {PROFILES_PATH} ({exc}); reinstall swarmnode",
            code="missing_profiles",
        ) from None


def model_profiles(model: ModelSpec) -> ModelProfiles:
    """The profiles Helix measured for ``model``, recognised by its shape (80 blocks of width 8192 is
    LLaMA-2 70B, 60 of 6656 LLaMA 30B); any other model has none."""
    found = _MODELS.get((model.num_blocks, model.hidden_size))
    if found is None:
        known = ", ".join(f"{title} ({blocks} blocks, hidden {h})" for (blocks, h), (_, title) in _MODELS.items())
        raise PlannerError(
            f"Helix profiled no model shaped like {model.name!r} ({model.num_blocks} blocks, hidden "
            f"{model.hidden_size}); it profiled {known}. Use the roofline cost model for this model",
            code="no_profile",
        )
    key, title = found
    data = _load()
    gpus = {}
    for gpu_key, raw in data["models"][key].items():
        gpus[gpu_key] = GpuProfile(
            key=gpu_key,
            prompt_ms=tuple(sorted((int(k), float(v)) for k, v in raw["prompt_bs2time_ms"].items())),
            decode_ms=tuple(sorted((int(k), float(v)) for k, v in raw["decode_bs2time_ms"].items())),
            max_layers=int(raw["max_num_layers"]),
            vllm_blocks={int(k): int(v) for k, v in raw["vllm_num_blocks_dict"].items()},
            prompt_max_requests={int(k): int(v) for k, v in raw["prompt_max_requests_dict"].items()},
            decode_max_tokens={int(k): int(v) for k, v in raw["decode_max_tokens_dict"].items()},
        )
    return ModelProfiles(key=key, title=title, gpus=gpus, constants=dict(data["constants"]))


def profile_key(node: NodeSpec) -> str | None:
    """The Helix machine a node is (``a100``, ``l4x2``, ``t4x4`` ...), or None when Helix profiled no such
    machine: CPU nodes, nodes with a measured ``block_throughput``, and GPU kinds outside Helix's seven."""
    if node.device != "gpu" or node.block_throughput is not None or node.gpu is None:
        return None
    kind = _GPU_KINDS.get(node.gpu)
    if kind is None:
        return None
    return kind if node.gpus == 1 else f"{kind}x{node.gpus}"
