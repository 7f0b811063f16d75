"""A node's settings (`swarmnode join`'s flags), in typed parts as vLLM composes `VllmConfig`.

`NodeConfig` holds four parts, each of which checks its own fields when it is built and raises
`NodeConfigError` naming the flag, what was wrong and what to do:

- `ModelConfig`: what is served and how it computes (the checkpoint, its name, a manual range, device,
  dtype, quantization);
- `MemoryConfig`: the memory offer (weights plus KV cache) and an explicit KV budget;
- `NetworkConfig`: how the node joins and is reached (addresses, initial peers, identity, reachability,
  relay service, DHT prefix, its public name and metrics port);
- `ServingConfig`: how it serves (session limits, prefill chunks, phase, threads and cores, throughput
  re-measurement, shutdown grace, the coordinator keys whose placements it follows).

What can only be checked against the opened checkpoint (a `--blocks` range within the model, a quantization
its layers take, an offer that holds a block) is checked by `server.node.Node`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmnode.admission import Admission
from swarmnode.errors import SwarmError
from swarmnode.records import PHASE_NAMES, QUANTIZATION_NAMES, DtypeName, Phase, QuantizationName
from swarmnode.relay import reachability_problem
from swarmnode.runtime.dtypes import DTYPES
from swarmnode.runtime.scheduler import DEFAULT_PREFILL_CHUNK
from swarmnode.server.handler import SessionLimits

__all__ = ["MemoryConfig", "ModelConfig", "NetworkConfig", "NodeConfig", "NodeConfigError", "ServingConfig"]


class NodeConfigError(SwarmError, ValueError):
    """A node cannot start with these settings; the message says which and what to do."""

    code = "node_config"


@dataclass(frozen=True)
class ModelConfig:
    """What the node serves and how its blocks compute."""

    model: str  # a checkpoint folder or a Hub name
    model_name: str | None = None  # the model's name in the swarm (default: `Checkpoint.name`)
    blocks: tuple[int, int] | None = None  # manual range; None: follow the coordinator's placement
    device: str = "cpu"
    dtype: DtypeName = "float32"
    # weight-only quantization of the blocks' linear layers (`runtime.quantize`)
    quantization: QuantizationName = "none"

    def __post_init__(self) -> None:
        if not self.model:
            raise NodeConfigError("--model is empty: give a checkpoint folder or a Hub name")
        if self.blocks is not None and not 0 <= self.blocks[0] < self.blocks[1]:
            raise NodeConfigError(f"--blocks {self.blocks[0]}:{self.blocks[1]} is empty or negative: give A:B "
                                  f"with 0 <= A < B")
        if self.dtype not in DTYPES:
            raise NodeConfigError(f"--dtype {self.dtype} is not one of {', '.join(DTYPES)}")
        if self.quantization not in QUANTIZATION_NAMES:
            raise NodeConfigError(f"--quantize {self.quantization} is not one of {', '.join(QUANTIZATION_NAMES)}")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise NodeConfigError("--device cuda was asked for, but torch sees no CUDA device here")

    @property
    def start(self) -> int | None:
        return self.blocks[0] if self.blocks else None

    @property
    def end(self) -> int | None:
        return self.blocks[1] if self.blocks else None


@dataclass(frozen=True)
class MemoryConfig:
    """The memory the node offers; every byte budget is planned in it (`server.memory_plan`)."""

    leftover_mem: int = 0  # bytes offered for weights and KV cache
    cache_tokens: int | None = None  # explicit KV budget; overrides the one derived from memory

    def __post_init__(self) -> None:
        if self.leftover_mem < 0:
            raise NodeConfigError(f"--leftover-mem {self.leftover_mem} is negative: offer a size such as 4G")
        if self.cache_tokens is not None and self.cache_tokens < 1:
            raise NodeConfigError(f"--cache-tokens {self.cache_tokens} is below 1: give a positive budget, or leave "
                                  f"it out to derive one from --leftover-mem")


@dataclass(frozen=True)
class NetworkConfig:
    """How the node joins the swarm and is reached."""

    initial_peers: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 0
    announce_host: str | None = None
    identity_path: str | None = None
    # auto: ask the swarm whether others can dial this node; direct; relay (`swarmnode.relay`)
    reachability: str = "auto"
    relay_service: bool = True  # relay calls for nodes behind NAT, when this node can be dialled itself
    dht_prefix: str | None = None
    public_name: str | None = None
    metrics_port: int | None = None  # serve Prometheus metrics on this port (None: off)
    # a private swarm's admission (`swarmnode.admission`): the node's identity is the admitted one; None: public
    admission: Admission | None = None

    def __post_init__(self) -> None:
        if self.admission is not None and self.identity_path not in (None, self.admission.identity.path):
            raise NodeConfigError(f"--identity {self.identity_path} is not the identity the node was admitted with "
                                  f"({self.admission.identity.path})")
        if not 0 <= self.port <= 65535:
            raise NodeConfigError(f"--port {self.port} is not a TCP port: give 1-65535, or 0 for any free one")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise NodeConfigError(f"--metrics-port {self.metrics_port} is not a TCP port: give 1-65535, or 0 for "
                                  f"any free one")
        if problem := reachability_problem(self.reachability, has_initial_peers=bool(self.initial_peers),
                                           announce_host=self.announce_host, port=self.port):
            raise NodeConfigError(problem)


@dataclass(frozen=True)
class ServingConfig:
    """How the node serves sessions and which placements it follows."""

    limits: SessionLimits = field(default_factory=SessionLimits)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens run between two turns of decode steps (0: whole)
    phase: Phase = Phase.BOTH  # the phase of requests served: both, prefill or decode (HexGen-2's split)
    # the operator chose `phase` (`join --phase`): a two-phase placement keeps it; otherwise the placement's phase
    # (if any) is taken
    phase_pinned: bool = False
    num_threads: int | None = None
    cores: int | None = None  # cores offered (--leftover-cores); sets the default thread count
    remeasure: bool = False  # measure block throughput again, ignoring the cached figure (`server.capacity`)
    shutdown_grace: float = 10.0  # seconds open sessions may go on after SIGTERM
    trusted_keys: frozenset[str] = frozenset()  # coordinator keys whose placements are followed

    def __post_init__(self) -> None:
        if self.phase not in PHASE_NAMES:
            raise NodeConfigError(f"--phase {self.phase} is not one of {', '.join(PHASE_NAMES)}")
        object.__setattr__(self, "phase", Phase(self.phase))  # a name given for the member: the member
        if self.prefill_chunk < 0:
            raise NodeConfigError(f"--prefill-chunk {self.prefill_chunk} is negative: give a token count, or 0 to "
                                  f"run every prompt whole")
        for flag, value in (("--num-threads", self.num_threads), ("--leftover-cores", self.cores)):
            if value is not None and value < 1:
                raise NodeConfigError(f"{flag} {value} is below 1: give at least 1, or leave it out to use all")
        if self.shutdown_grace < 0:
            raise NodeConfigError(f"--shutdown-grace {self.shutdown_grace} is negative: give 0 or more seconds")


@dataclass(frozen=True)
class NodeConfig:
    """Everything a node is started with, in its four parts."""

    model: ModelConfig
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
