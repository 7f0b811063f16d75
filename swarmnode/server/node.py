"""A serving node: joins the DHT, loads its blocks, serves RPCs, announces itself, and stops cleanly.

Lifecycle: start the DHT peer (before torch spins up threads), announce JOINING, load the span's tensors
with progress in the log, measure block throughput, derive the KV-cache budget from the memory the node
was given, register the RPC handlers, announce ONLINE on a heartbeat. SIGINT/SIGTERM: announce OFFLINE,
stop the heartbeat, shut the DHT (and its p2pd) down, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass, field

import torch

import swarmnode
from swarmnode.messages import InfoReply
from swarmnode.records import ServerRecord, ServerState, model_prefix
from swarmnode.runtime.blocks import DTYPES, BlockStack, measure_block_throughput
from swarmnode.runtime.checkpoint import Checkpoint
from swarmnode.runtime.kv_cache import CacheBudget
from swarmnode.runtime.scheduler import StepScheduler
from swarmnode.server.announcer import Announcer
from swarmnode.server.handler import BlockHandler, SessionLimits
from swarmnode.sizes import format_size

logger = logging.getLogger(__name__)

# Memory a node process takes before any block: interpreter, torch, hivemind, buffers.
RUNTIME_OVERHEAD_BYTES = 400 * 2**20
MAX_CACHE_TOKENS = 1 << 20


@dataclass
class NodeConfig:
    model: str
    start: int
    end: int
    initial_peers: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 0
    announce_host: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    num_threads: int | None = None
    public_name: str | None = None
    leftover_mem: int | None = None  # bytes offered; None: what is free now, with a margin
    cache_tokens: int | None = None  # explicit KV budget; overrides the one derived from memory
    dht_prefix: str | None = None
    identity_path: str | None = None
    limits: SessionLimits = field(default_factory=SessionLimits)


class NodeConfigError(ValueError):
    """A node cannot start with these settings; the message says which and what to do."""


def derive_cache_tokens(offered: int, weight_bytes: int, kv_bytes_per_token: int) -> int:
    """KV-cache tokens that fit in what is offered once weights and the runtime overhead are paid."""
    room = offered - weight_bytes - RUNTIME_OVERHEAD_BYTES
    tokens = room // kv_bytes_per_token
    if tokens < 1:
        raise NodeConfigError(
            f"the offer of {format_size(offered)} does not hold the blocks ({format_size(weight_bytes)}) plus "
            f"{format_size(RUNTIME_OVERHEAD_BYTES)} of runtime overhead and any KV cache: offer more memory "
            f"(--leftover-mem) or serve fewer blocks"
        )
    return int(min(tokens, MAX_CACHE_TOKENS))


class Node:
    def __init__(self, config: NodeConfig):
        self.config = config
        self.checkpoint = Checkpoint(config.model)
        if not 0 <= config.start < config.end <= self.checkpoint.num_blocks:
            raise NodeConfigError(
                f"--blocks {config.start}:{config.end} is outside the model's 0:{self.checkpoint.num_blocks}"
            )
        if config.dtype not in DTYPES:
            raise NodeConfigError(f"--dtype {config.dtype} is not one of {', '.join(DTYPES)}")
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise NodeConfigError("--device cuda was asked for, but torch sees no CUDA device here")
        self.dtype = DTYPES[config.dtype]
        self.prefix = config.dht_prefix or model_prefix(self.checkpoint.name)
        self.state = ServerState.JOINING
        self.throughput = 0.0
        self.stack: BlockStack | None = None
        self.handler: BlockHandler | None = None
        self.budget: CacheBudget | None = None
        self.dht = None

    # --- records -------------------------------------------------------------------------------------
    def record(self) -> ServerRecord:
        budget = self.budget
        return ServerRecord(
            state=self.state, start=self.config.start, end=self.config.end, throughput=self.throughput,
            free_cache_tokens=budget.free_tokens if budget else 0, cache_tokens=budget.tokens if budget else 0,
            public_name=self.config.public_name, version=swarmnode.__version__, device=self.config.device,
            dtype=self.config.dtype,
        )

    def info(self) -> InfoReply:
        return InfoReply(
            start=self.config.start, end=self.config.end, num_blocks=self.checkpoint.num_blocks,
            hidden_size=self.checkpoint.hidden_size, free_cache_tokens=self.budget.free_tokens,
            cache_tokens=self.budget.tokens, throughput=self.throughput, version=swarmnode.__version__,
            dtype=self.config.dtype, device=self.config.device,
        )

    # --- lifecycle -----------------------------------------------------------------------------------
    def _start_dht(self):
        import hivemind

        host_maddrs = [f"/ip4/{self.config.host}/tcp/{self.config.port}"]
        announce = [f"/ip4/{self.config.announce_host}/tcp/{self.config.port}"] if self.config.announce_host else None
        self.dht = hivemind.DHT(
            initial_peers=self.config.initial_peers, start=True, host_maddrs=host_maddrs,
            announce_maddrs=announce, identity_path=self.config.identity_path, num_workers=2,
        )
        logger.info("joined the DHT as %s, listening on %s", self.dht.peer_id,
                    ", ".join(str(a) for a in self.dht.get_visible_maddrs()))

    def _load(self) -> None:
        cfg = self.config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        weights = sum(self.checkpoint.block_param_bytes(i, self.dtype) for i in range(cfg.start, cfg.end))
        kv_per_token = self.checkpoint.kv_bytes_per_token(self.dtype, cfg.end - cfg.start)
        if cfg.cache_tokens is not None:
            tokens = cfg.cache_tokens
        else:
            tokens = derive_cache_tokens(cfg.leftover_mem, weights, kv_per_token)
        logger.info("loading blocks [%d, %d) of %s (%s in %s on %s)", cfg.start, cfg.end, self.checkpoint.name,
                    format_size(weights), cfg.dtype, cfg.device)
        began = time.perf_counter()
        last_log = [0.0]

        def progress(done: int, total: int) -> None:
            now = time.perf_counter()
            if done == total or now - last_log[0] > 2.0:
                last_log[0] = now
                logger.info("loaded %d/%d blocks (%.1f s)", done, total, now - began)

        self.stack = BlockStack(self.checkpoint, cfg.start, cfg.end, dtype=self.dtype, device=cfg.device,
                                progress=progress)
        self.throughput = measure_block_throughput(self.stack)
        self.budget = CacheBudget(tokens, cfg.end - cfg.start)
        logger.info("block throughput %.0f tokens/s; KV cache budget %d tokens (%s)", self.throughput, tokens,
                    format_size(tokens * kv_per_token))

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        signals = {"count": 0}

        def on_signal(signum: int) -> None:
            signals["count"] += 1
            if signals["count"] > 1:
                logger.warning("second %s: exiting at once", signal.Signals(signum).name)
                os._exit(1)
            logger.info("%s received: going offline", signal.Signals(signum).name)
            stop.set()

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_signal, signum)

        announcer = Announcer(self.dht, self.prefix, self.record)
        await announcer.announce()  # JOINING, so operators see the node while it loads
        await loop.run_in_executor(None, self._load)
        scheduler = StepScheduler(self.stack)
        self.handler = BlockHandler(self.stack, scheduler, self.budget, limits=self.config.limits, info=self.info)
        p2p = await self.dht.replicate_p2p()
        await self.handler.register(p2p)
        self.state = ServerState.ONLINE
        heartbeat = asyncio.create_task(announcer.run(stop))
        logger.info("serving blocks [%d, %d) as %s", self.config.start, self.config.end, self.dht.peer_id)
        print(f"SERVING {self.dht.peer_id} {self.config.start}:{self.config.end}", flush=True)
        await stop.wait()
        await heartbeat
        self.state = ServerState.OFFLINE
        try:
            await asyncio.wait_for(announcer.announce(ttl=10.0), timeout=5)
        except Exception:
            logger.warning("could not announce OFFLINE; the records will expire on their own")
        scheduler.shutdown()

    def run(self) -> None:
        self._start_dht()
        try:
            asyncio.run(self.serve())
        finally:
            self.dht.shutdown()
            logger.info("node stopped")
