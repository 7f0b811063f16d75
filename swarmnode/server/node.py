"""A serving node: joins the DHT, offers its capacity, serves the blocks it is given, and stops cleanly.

Lifecycle: start the DHT peer (before torch spins up threads) and the RPC handlers; announce a capacity
record (MEASURING); time one block of the model (cached, `server.capacity`); then either load the range
given with `--blocks` (a manual node) or WAIT for a placement from a trusted coordinator and follow it
(`server.follower`). Links to the other nodes are measured in the background (`server.probe`). Records
are refreshed on a heartbeat. SIGINT/SIGTERM: announce OFFLINE, refuse new sessions, let open ones finish
for up to `shutdown_grace` s, shut the DHT (and its p2pd) down, exit 0; a second signal exits at once.
A node in a process that installed an output filter (`server.output_hook`: only the tests do, to make a node
that corrupts its outputs on purpose) says so loudly.
Every byte budget (blocks that fit, KV cache per range) comes from its `MemoryPlan` (`server.memory_plan`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from hivemind.utils.crypto import RSAPrivateKey

import swarmnode
from swarmnode import rpc
from swarmnode.identity import PeerIdentity
from swarmnode.membership import Membership
from swarmnode.messages import InfoReply, SpanInfo
from swarmnode.records import (
    GGUF_QUANTIZATION,
    NodeRecord,
    NodeState,
    Phase,
    PlacementRecord,
    ServerRecord,
    ServerState,
    model_prefix,
)
from swarmnode.relay.dialer import RelayDialer
from swarmnode.relay.keeper import RelayKeeper
from swarmnode.relay.service import RelayService
from swarmnode.runtime import footprint
from swarmnode.runtime.blocks import BlockStack
from swarmnode.runtime.checkpoint import Checkpoint
from swarmnode.runtime.dtypes import DTYPES
from swarmnode.runtime.family_check import check_family
from swarmnode.runtime.ggml.checkpoint import GGUFCheckpoint
from swarmnode.runtime.kv_cache import CacheBudget
from swarmnode.runtime.memory import release_free_memory
from swarmnode.runtime.quantize import QuantizationError, check_supported
from swarmnode.runtime.sources import open_checkpoint
from swarmnode.server.announcer import Announcer
from swarmnode.server.capacity import measured_block_throughput
from swarmnode.server.config import NodeConfig, NodeConfigError
from swarmnode.server.handler import BlockHandler
from swarmnode.server.memory_plan import (
    MIN_CACHE_TOKENS,
    SERVING_RESERVE_BYTES,
    WORKSPACE_TOKENS,
    MemoryPlan,
    OfferTooSmallError,
    loading_bytes,
    workspace_bytes,
)
from swarmnode.server.node_status import NodeStatus
from swarmnode.server.output_hook import installed_output_filter
from swarmnode.server.unit import ServingUnit
from swarmnode.sizes import format_size
from swarmnode.swarm_state import Rejected, read_block_servers, read_placement

if TYPE_CHECKING:
    from hivemind import DHT

    from swarmnode.coordinator.service import CoordinatorConfig
    from swarmnode.server.probe import LinkProber

logger = logging.getLogger(__name__)

__all__ = ["EmbeddedCoordinator", "Node"]


@dataclass(frozen=True)
class EmbeddedCoordinator:
    """A coordinator run in the node's own process (`join --coordinator`): the key it signs placements with,
    and its settings."""

    key: RSAPrivateKey
    config: CoordinatorConfig


def _served_as_stored(config: NodeConfig, checkpoint: Checkpoint) -> NodeConfig:
    """`config` for `checkpoint`: a GGUF file is served in its own quantization ("gguf") on the CPU, so a node asked
    for another quantization or device is refused with a line that says why; "gguf" for anything else is too."""
    model = config.model
    if not isinstance(checkpoint, GGUFCheckpoint):
        if model.quantization == GGUF_QUANTIZATION:
            raise NodeConfigError(f"quantization {GGUF_QUANTIZATION!r} is a GGUF file's own: {checkpoint.name} is a "
                                  f"Hugging Face checkpoint (pick --quantize none, int8 or int4)")
        return config
    name = checkpoint.file.path.name
    if model.quantization not in ("none", GGUF_QUANTIZATION):
        raise NodeConfigError(f"{name} is a GGUF file and is served in its own quantization "
                              f"({checkpoint.file_type}): drop --quantize {model.quantization}")
    if model.device != "cpu":
        raise NodeConfigError(f"{name} is a GGUF file, whose blocks run on CPU kernels: drop --device {model.device} "
                              f"(a GPU node serves the model's safetensors checkpoint)")
    return dataclasses.replace(config, model=dataclasses.replace(model, quantization=GGUF_QUANTIZATION))


class Node:
    def __init__(self, config: NodeConfig, checkpoint: Checkpoint | None = None, *,
                 coordinator: EmbeddedCoordinator | None = None):
        """`config`'s parts checked their own fields; what needs the checkpoint (a `--blocks` range within the
        model, a quantization its layers take, an offer that holds a block) is checked here.
        `checkpoint`: `config.model.model` already opened (the CLI opens it first to read the context length);
        opened here when not given. `coordinator`: run one in this process too."""
        self.checkpoint = checkpoint or open_checkpoint(config.model.model, model_name=config.model.model_name)
        self.config = config = _served_as_stored(config, self.checkpoint)
        if config.model.blocks:
            start, end = config.model.blocks
            if not 0 <= start < end <= self.checkpoint.num_blocks:
                raise NodeConfigError(f"--blocks {start}:{end} is outside the model's 0:{self.checkpoint.num_blocks}")
            self.checkpoint.require_blocks(start, end)  # the range's shards must be here (or fetchable) before it joins
        family = self.checkpoint.family  # a family this project cannot serve is refused here, in one line
        check_family(self.checkpoint.config)  # and one whose path here is not transformers' (`runtime.family_check`)
        if config.model.quantization not in ("none", GGUF_QUANTIZATION):
            try:
                check_supported(family, config.model.quantization, device=config.model.device)
            except QuantizationError as exc:
                raise NodeConfigError(f"{self.checkpoint.name}: {exc}", code=exc.code) from None
        self.dtype = DTYPES[config.model.dtype]
        self.output_filter = installed_output_filter()  # None but in a test's faulty node (`server.output_hook`)
        self.prefix = config.network.dht_prefix or model_prefix(self.checkpoint.name)
        threads = torch.get_num_threads()
        self.threads = config.serving.num_threads or min(config.serving.cores or threads, threads)
        self.memory = MemoryPlan.from_checkpoint(self.checkpoint, self.dtype, config.memory.leftover_mem,
                                                 quantization=config.model.quantization,
                                                 fixed_cache_tokens=config.memory.cache_tokens)
        self._check_offer()
        # the libp2p identity's RSA key also signs the node's records, binding them to its peer id (identity.py):
        # a given --identity is read here, so a bad one is refused before anything starts; without one, a fresh
        # identity is made when the DHT starts
        path = config.network.identity_path
        admission = config.network.admission
        self.identity: PeerIdentity | None = (admission.identity if admission is not None
                                              else PeerIdentity.load_or_create(path) if path else None)
        self.members: Membership | None = None  # a private swarm's members, once the DHT runs (`serve`)
        self.block_throughput = 0.0
        self.prefill_throughput = 0.0
        self.phase = config.serving.phase  # changes when a two-phase placement gives the node another phase
        blocks = config.model.blocks
        # units, assignment, state and note: what the node serves and announces (changed by the follower too)
        self.status = NodeStatus(assigned=(blocks[0], blocks[1]) if blocks else None, on_change=self._wake_announcer)
        self.handler: BlockHandler | None = None
        self.announcer: Announcer | None = None
        self.prober: LinkProber | None = None
        self._workspace: int | None = None  # bytes of workspace in the measured overhead (`measure_overhead`)
        self.dht: DHT | None = None  # started by `run`, before `serve`
        self.p2p: RelayDialer | None = None
        self.peer_id = ""
        self.relayed = config.network.reachability == "relay"  # behind NAT: serves through a relay (`relay.keeper`)
        self.keeper: RelayKeeper | None = None
        self.relay_service: RelayService | None = None
        self.coordinator = coordinator

    def _check_offer(self) -> None:
        """Refuse an offer that cannot hold the asked range (`--blocks`) or a single block, with some cache."""
        config = self.config
        try:
            if config.model.blocks:
                self.memory.cache_tokens(*config.model.blocks)  # the range and some cache must fit
            else:
                self.memory.check_holds_a_block()
        except OfferTooSmallError as exc:
            raise NodeConfigError(f"{self.checkpoint.name}: {exc}", code=exc.code) from None

    def measure_overhead(self) -> None:
        """Replace the overhead estimate with this node's measured one, then check the offer again with it.

        The overhead is what the node's processes hold without any block (the DHT process and `p2pd`
        included), measured after a probe step has run, plus a workspace: the larger of what a
        `WORKSPACE_TOKENS` prefill through one block of random weights (in the served dtype and
        quantization) adds to the peak resident set, and the largest tensor of a block as stored, which
        loading holds beside the range while it converts it. Computing leaves memory in the allocator's
        arenas; measuring after the probe counts that too.
        """
        model, offered = self.config.model, self.config.memory.leftover_mem
        if not footprint.available() or model.device != "cpu":
            logger.info("planning with the %s overhead estimate (%s)", format_size(self.memory.overhead),
                        "the offer is device memory" if model.device != "cpu" else "no /proc memory figures")
            return
        torch.set_num_threads(self.threads)
        estimate = workspace_bytes(self.checkpoint.config, self.dtype)
        loading = self._largest_stored_tensor()  # read (and cast or quantized) beside the range as it loads
        workspace = max(estimate, loading, self._probe_workspace())
        self._workspace = workspace
        processes = footprint.tree_pss()
        self.memory = self.memory.with_overhead(processes + workspace, serving_reserve=SERVING_RESERVE_BYTES)
        logger.info("runtime overhead %s: %s held by this node's processes before any block, %s of workspace "
                    "(a %d-token step, or a tensor being loaded), %s kept for what they grow by once serving; %s of "
                    "the %s offer is left for blocks (%s each in %s%s) and KV cache", format_size(self.memory.overhead),
                    format_size(processes), format_size(workspace), WORKSPACE_TOKENS,
                    format_size(SERVING_RESERVE_BYTES),
                    format_size(max(0, offered - self.memory.overhead - SERVING_RESERVE_BYTES)),
                    format_size(offered), format_size(self.memory.block_size), model.dtype,
                    "" if model.quantization == "none" else f" + {model.quantization}")
        self._check_offer()

    def _overhead_now(self, loaded: int = 0) -> int | None:
        """The overhead as measured now: the node's processes less the `loaded` block weights, plus the workspace
        of `measure_overhead`; None where it measured nothing (no /proc figures, or device memory)."""
        if not footprint.available() or self.config.model.device != "cpu" or self._workspace is None:
            return None
        return footprint.tree_pss() - loaded + self._workspace

    def _settle_overhead(self) -> None:
        """Measure the overhead again once the node serves (its P2P client, handler, announcer and the compute
        threads of the throughput measurement are running) and before it announces a capacity the coordinator
        may plan with: what those take is overhead too (3-8 MiB on the test model, more where the throughput
        measurement computes). The growth comes out of the serving reserve (`MemoryPlan.grown`), so
        `max_blocks` falls only where it goes beyond it; the node keeps running when the offer no longer holds
        a block (the coordinator then places nothing here, and the log says why)."""
        now = self._overhead_now()
        if now is None or now <= self.memory.overhead:
            return
        before = self.memory
        self.memory = self.memory.grown(now)
        logger.info("runtime overhead measured again with the node's services running: %s (was %s; %s of the "
                    "serving reserve left); %d blocks fit with KV cache for %d tokens each (%d before)",
                    format_size(now), format_size(before.overhead), format_size(self.memory.serving_reserve),
                    self.memory.max_blocks, MIN_CACHE_TOKENS, before.max_blocks)
        if self.memory.max_blocks < 1 and not self.config.model.blocks:
            logger.warning("the offer of %s now holds no block with KV cache: the coordinator will not place "
                           "blocks here; offer more with --leftover-mem", format_size(self.config.memory.leftover_mem))

    def _remeasure_overhead(self, start: int, end: int, cache_tokens: int) -> int:
        """The KV budget of the first range, with the overhead measured again now that its blocks are loaded:
        between the first measurement and serving, the node's processes grow by another 25-33 MiB on the test
        model (`p2pd`'s buffers after link probes and DHT traffic, what loading leaves in the allocator's
        arenas). The larger of the two measurements stands, so the offer holds once the cache fills. The
        growth is paid out of the serving reserve; where it goes beyond it, the node announces the smaller
        `max_blocks` that now leaves `MIN_CACHE_TOKENS` of cache per block, and the coordinator re-plans a
        range that holds more blocks than that (`coordinator.events.RangeTooLarge`): the range loaded stays
        served, with the smaller cache, until the new placement arrives."""
        now = self._overhead_now(loaded=self.memory.span_weight_bytes(start, end))
        if now is None or now <= self.memory.overhead:
            return cache_tokens
        before = self.memory
        self.memory = before.grown(now)
        try:  # the range stays as planned until a new placement says otherwise; only the cache shrinks
            tokens = min(cache_tokens, self.memory.cache_tokens(start, end))
        except OfferTooSmallError:
            tokens = cache_tokens
        logger.info("runtime overhead measured again with blocks [%d, %d) loaded: %s (was %s; %s of the serving "
                    "reserve left); the KV budget is %d tokens", start, end, format_size(now),
                    format_size(before.overhead), format_size(self.memory.serving_reserve), tokens)
        if self.memory.max_blocks < before.max_blocks and not self.config.model.blocks:
            logger.warning("the node's processes grew by %s, more than the %s left of the serving reserve: it now "
                           "offers %d blocks (was %d) so that each keeps KV cache for %d tokens%s",
                           format_size(now - before.overhead), format_size(before.serving_reserve),
                           self.memory.max_blocks, before.max_blocks, MIN_CACHE_TOKENS,
                           f"; the coordinator will re-plan its {end - start}-block range"
                           if end - start > self.memory.max_blocks else "")
        return tokens

    def _largest_stored_tensor(self) -> int:
        """Bytes of what loading holds beside the range (`memory_plan.loading_bytes`)."""
        return loading_bytes(self.checkpoint, self.dtype)

    def _probe_workspace(self) -> int:
        """Peak bytes a `WORKSPACE_TOKENS` prefill through the largest random-weight block adds to this process."""
        block = self.checkpoint.family.largest_block
        stack = BlockStack(self.checkpoint, block, block + 1, dtype=self.dtype, device=self.config.model.device,
                           quantization=self.config.model.quantization, random_weights=True)
        hidden = torch.randn(1, WORKSPACE_TOKENS, self.checkpoint.hidden_size).to(self.dtype)
        positions = torch.arange(WORKSPACE_TOKENS)[None]
        release_free_memory()
        before = footprint.rss()
        if not footprint.reset_peak():
            return 0
        stack.forward(block, block + 1, hidden, positions)
        grown = footprint.peak_rss() - before
        del stack, hidden
        release_free_memory()
        return max(0, grown)

    # --- records -------------------------------------------------------------------------------------
    def server_records(self) -> list[ServerRecord]:
        model = self.config.model
        return [
            ServerRecord(
                state=ServerState.ONLINE, peer_id=self.peer_id, start=u.start, end=u.end,
                throughput=self.block_throughput, free_cache_tokens=u.budget.free_tokens,
                cache_tokens=u.budget.tokens, public_name=self.config.network.public_name, version=swarmnode.__version__,
                device=model.device, dtype=model.dtype, quantization=model.quantization,
                relay=self.keeper.relay if self.keeper else None, phase=self.phase.value,
            )
            for u in self.status.live_units()
        ]

    def node_record(self) -> NodeRecord:
        status, model = self.status, self.config.model
        units = status.live_units()
        return NodeRecord(
            peer_id=self.peer_id, state=status.state, device=model.device, dtype=model.dtype,
            quantization=model.quantization, memory_bytes=self.config.memory.leftover_mem,
            cores=self.config.serving.cores, num_threads=self.threads,
            block_bytes=self.memory.block_size, overhead_bytes=self.memory.overhead,
            max_blocks=self.memory.max_blocks, block_throughput=self.block_throughput,
            links=dict(self.prober.links) if self.prober else {}, manual=model.blocks is not None,
            assigned=status.assigned, placement_version=status.placement_version,
            serving=[u.span for u in units], loading=status.loading, progress=round(status.progress, 3),
            cache_tokens=sum(u.budget.tokens for u in units),
            free_cache_tokens=sum(u.budget.free_tokens for u in units),
            note=status.note[:300], public_name=self.config.network.public_name, version=swarmnode.__version__,
            relayed=self.relayed, relay=self.keeper.relay if self.keeper else None,
            relay_service=self.relay_service is not None, phase=self.phase.value,
            phase_pinned=self.config.serving.phase_pinned, prefill_throughput=self.prefill_throughput,
        )

    def info(self) -> InfoReply:
        units = self.status.live_units()
        return InfoReply(
            state=self.status.state.value,
            spans=[SpanInfo(start=u.start, end=u.end, cache_tokens=u.budget.tokens,
                            free_cache_tokens=u.budget.free_tokens) for u in units],
            num_blocks=self.checkpoint.num_blocks, hidden_size=self.checkpoint.hidden_size,
            free_cache_tokens=sum(u.budget.free_tokens for u in units),
            cache_tokens=sum(u.budget.tokens for u in units), throughput=self.block_throughput,
            version=swarmnode.__version__, dtype=self.config.model.dtype, device=self.config.model.device,
            quantization=self.config.model.quantization,
        )

    @property
    def units(self) -> list[ServingUnit]:
        """The node's serving units, newest last (`status` owns them; the handler and metrics read them)."""
        return self.status.units

    @property
    def placement_version(self) -> int | None:
        """The version of the placement the node follows (None: none yet, or a manual node)."""
        return self.status.placement_version

    def _wake_announcer(self) -> None:
        """`status` changed: announce the records again soon (once the announcer runs)."""
        if self.announcer is not None:
            self.announcer.wake()

    def set_phase(self, phase: Phase | str, why: str) -> None:
        """Serve `phase` from now on (a two-phase placement's choice): sessions already open go on; new ones
        of the other phase are refused with `wrong_phase`, which clients route around."""
        phase = Phase(phase)
        if phase is self.phase:
            return
        logger.info("serving the %s phase (was %s): %s", phase, self.phase, why)
        self.phase = phase
        if self.handler is not None:
            self.handler.phase = phase
        self._wake_announcer()

    # --- what the placement follower asks of the node (`server.follower.FollowerHost`) -------------------
    async def read_placement(self, trusted: frozenset[str], rejected: list[Rejected]) -> PlacementRecord | None:
        return await read_placement(self.dht, self.prefix, trusted, rejected)

    async def read_block_servers(self) -> dict[int, list[ServerRecord]]:
        return await read_block_servers(self.dht, self.prefix, self.checkpoint.num_blocks, self.members)

    async def answering(self, peers: list[str], timeout: float) -> set[str]:
        if self.p2p is None:  # not on the network yet: no way to check, trust the records
            return set(peers)
        return await rpc.answering(self.p2p, peers, timeout)

    # --- loading -------------------------------------------------------------------------------------
    async def aload_unit(self, start: int, end: int, *, cache_tokens: int | None = None,
                         reuse: ServingUnit | None = None) -> ServingUnit:
        """:meth:`load_unit` on a worker thread: reading and building blocks never blocks the event loop, so
        the node keeps answering RPCs and heartbeats while it loads."""
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.load_unit(start, end, cache_tokens=cache_tokens, reuse=reuse))

    def load_unit(self, start: int, end: int, *, cache_tokens: int | None = None,
                  reuse: ServingUnit | None = None) -> ServingUnit:
        """Load blocks [start, end) (sharing what `reuse` already holds) with progress in the record."""
        model = self.config.model
        explicit = cache_tokens
        if cache_tokens is None:
            cache_tokens = self.memory.cache_tokens(start, end)  # before loading: a range that cannot fit fails fast
        status = self.status
        status.loading, status.progress = (start, end), 0.0
        status.set_state(NodeState.LOADING if not status.units else status.state,
                         f"loading blocks [{start}, {end}) of {self.checkpoint.name} "
                         f"({format_size(self.memory.span_weight_bytes(start, end))} in {model.dtype}"
                         f"{'' if model.quantization == 'none' else ' + ' + model.quantization} on {model.device})")
        began = time.perf_counter()
        last = [0.0]

        def progress(done: int, total: int) -> None:
            status.progress = done / total
            now = time.perf_counter()
            if done == total or now - last[0] > 2.0:
                last[0] = now
                logger.info("loaded %d/%d blocks (%.1f s)", done, total, now - began)
                status.changed()  # the record shows the progress

        try:
            stack = BlockStack(self.checkpoint, start, end, dtype=self.dtype, device=model.device,
                               quantization=model.quantization, progress=progress,
                               reuse=reuse.stack if reuse is not None else None)
        finally:
            status.loading = None
        release_free_memory()  # what reading and quantizing freed goes back to the system, not to an arena
        logger.info("blocks [%d, %d) loaded; shard files read so far: %s", start, end,
                    ", ".join(sorted(self.checkpoint.opened_shards)))
        if explicit is None and not status.units:
            cache_tokens = self._remeasure_overhead(start, end, cache_tokens)
        unit = ServingUnit(stack, CacheBudget(cache_tokens, end - start), prefill_chunk=self.config.serving.prefill_chunk)
        logger.info("blocks [%d, %d) ready; KV cache budget %d tokens (%s)", start, end, unit.budget.tokens,
                    format_size(self.memory.cache_bytes(start, end, unit.budget.tokens)))
        return unit

    @property
    def key(self) -> RSAPrivateKey:
        """The key the node signs its records with: its libp2p identity's (made when the DHT starts)."""
        assert self.identity is not None, "the node's identity is made when its DHT starts"
        return self.identity.key

    # --- lifecycle -----------------------------------------------------------------------------------
    def _start_dht(self) -> None:
        from swarmnode.dht import start_dht

        port = self._check_reachability()
        network = self.config.network
        if self.identity is None:
            self.identity = PeerIdentity.load_or_create(None)
        # a fresh identity made for this process is not taken by anyone: hivemind need not dial the swarm to check
        identity, fresh = self.identity, self.identity.temporary
        try:
            if self.relayed:  # nobody can dial in: a DHT client (others must not try to reach it), served via a relay
                self.dht = dht = start_dht(network.initial_peers, client_mode=True, identity_path=identity.path,
                                           key=identity.key, check_if_identity_free=not fresh,
                                           admission=network.admission)
                self.peer_id = dht.peer_id.to_base58()
                logger.info("joined the DHT as %s (behind NAT: calls come through a relay)", self.peer_id)
                return
            self.dht = dht = start_dht(network.initial_peers, host=network.host, port=port,
                                       announce_host=network.announce_host, identity_path=identity.path,
                                       key=identity.key, check_if_identity_free=not fresh,
                                       admission=network.admission)
        finally:
            self.identity.discard()  # `p2pd` has read it (or will not start): a temporary key leaves no file
        self.peer_id = dht.peer_id.to_base58()
        logger.info("joined the DHT as %s, listening on %s", self.peer_id,
                    ", ".join(str(a) for a in dht.get_visible_maddrs()))

    def _check_reachability(self) -> int:
        """With `--reachability auto`, ask the initial peers whether this node can be dialled where it will
        listen (`relay.reachability`) and serve through a relay when it cannot; the port to listen on."""
        from swarmnode.dht import announced_hosts, pick_port

        cfg = self.config.network
        if cfg.reachability != "auto" or not cfg.initial_peers:
            return cfg.port
        from swarmnode.relay import reachability

        port = cfg.port or pick_port(cfg.host)
        announce = announced_hosts(cfg.host, cfg.announce_host, cfg.initial_peers) or [cfg.host]
        result = reachability.check(cfg.initial_peers, host=cfg.host, port=port, announce=announce)
        if result.reachable is False:
            self.relayed = True
            logger.info("other peers cannot dial this node (%s; checked in %.1f s): it will serve through a relay",
                        result.detail, result.seconds)
        elif result.reachable is None:
            logger.warning("could not learn whether other peers can dial this node (%s): serving directly; pass "
                           "--reachability relay if it is behind NAT", result.detail)
        else:
            logger.info("other peers can dial this node (%s; checked in %.1f s)", result.detail, result.seconds)
        return port

    async def serve(self) -> None:
        """Serve until SIGINT/SIGTERM, then go offline (see the module's docstring)."""
        stop = asyncio.Event()
        self._handle_signals(stop)
        torch.set_num_threads(self.threads)
        dht = self.dht
        assert dht is not None, "`run` starts the DHT peer before serving"
        raw = await dht.replicate_p2p()
        self.p2p = RelayDialer(raw)
        admission = self.config.network.admission
        if admission is not None:  # a private swarm: known to its members before anyone is called or answered
            self.members = Membership(dht, admission, self.key)
            await self.members.start()
            logger.info("admitted to private swarm %s as %s until %s", self.members.swarm,
                        ", ".join(sorted(r.value for r in admission.roles)), admission.invitation.describe()["expires"])
        await self._start_handler()
        self.announcer = announcer = Announcer(dht, self.prefix, self.key, server_records=self.server_records,
                                               node_record=self.node_record)
        relaying = await self._start_relaying(raw, stop)
        if self.members is not None:  # publish and read the members every heartbeat from now on
            relaying.append(asyncio.create_task(self.members.run(stop)))
        self.status.note = f"measuring one block on {self.config.model.device} with {self.threads} threads"
        announcing = asyncio.create_task(announcer.run(stop))
        model = self.config.model
        self.block_throughput, self.prefill_throughput = await asyncio.get_running_loop().run_in_executor(None, lambda: (
            measured_block_throughput(self.checkpoint, device=model.device, dtype_name=model.dtype,
                                      dtype=self.dtype, threads=self.threads, quantization=model.quantization,
                                      remeasure=self.config.serving.remeasure)))
        self._settle_overhead()
        tasks = self._start_background(stop)
        if self.config.model.blocks:
            await self._serve_manual_range()
        else:
            tasks.append(self._follow_placements(stop))
        await stop.wait()
        for task in [*tasks, *relaying]:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await announcing
        await self._go_offline()

    async def _start_relaying(self, p2p, stop: asyncio.Event) -> list[asyncio.Task]:
        """Behind NAT: reserve with a relay (the node's records name it) and keep it. Otherwise offer relay
        service to nodes behind NAT, unless told not to (`swarmnode.relay`)."""
        if not self.relayed:
            if self.config.network.relay_service:
                self.relay_service = RelayService()
                await self.relay_service.register(p2p, gate=self.members)
            return []

        async def candidates() -> list[str]:
            from swarmnode.relay.reachability import peer_ids
            from swarmnode.swarm_state import read_nodes

            ids = peer_ids(self.config.network.initial_peers)
            try:
                records = await asyncio.wait_for(read_nodes(self.dht, self.prefix, members=self.members), 10)
            except Exception:  # safe: the initial peers are candidates enough
                records = {}
            return ids + [p for p, r in records.items() if r.relay_service and r.state != NodeState.OFFLINE
                          and not r.relayed and p not in ids and p != self.peer_id]

        handler, announcer = self.handler, self.announcer
        assert handler is not None and announcer is not None, "`serve` starts them before relaying"

        def changed(relay: str | None) -> None:
            handler.relay = relay
            announcer.wake()

        self.keeper = RelayKeeper(p2p, candidates, on_change=changed)
        await self.keeper.acquire()
        return [asyncio.create_task(self.keeper.run(stop))]

    def _handle_signals(self, stop: asyncio.Event) -> None:
        """The first SIGINT/SIGTERM sets `stop` (a clean shutdown); a second one exits at once."""
        loop = asyncio.get_running_loop()
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

    async def _start_handler(self) -> None:
        """Register the RPC handlers (and the metrics server when asked for)."""
        self.handler = handler = BlockHandler(lambda: self.status.units, limits=self.config.serving.limits,
                                              info=self.info, phase=self.phase,
                                              output_filter=self.output_filter.apply if self.output_filter else None)
        if self.output_filter is not None:
            logger.warning("!!! FAULT INJECTION: %s; this node returns WRONG hidden states on purpose (tests only) !!!",
                           self.output_filter.description)
        assert self.p2p is not None, "`serve` opens the P2P client first"
        await handler.register(self.p2p, gate=self.members)
        if self.config.network.metrics_port is not None:
            from swarmnode import metrics

            metrics.bind_node(self)
            port = metrics.start_node_metrics_server(self.config.network.metrics_port, self.config.network.host)
            logger.info("metrics on http://%s:%d/metrics", self.config.network.host, port)

    def _start_background(self, stop: asyncio.Event) -> list[asyncio.Task]:
        """Link probes to the other nodes, and a coordinator when this process runs one (`join --coordinator`)."""
        from swarmnode.server.probe import LinkProber
        from swarmnode.swarm_state import read_nodes

        p2p, announcer = self.p2p, self.announcer
        assert p2p is not None and announcer is not None, "`serve` starts them first"

        async def node_peers() -> list[str]:
            records = await read_nodes(self.dht, self.prefix, members=self.members)
            p2p.learn({p: r.relay for p, r in records.items()})  # nodes behind NAT are probed through relays
            return [p for p, r in records.items() if r.state != NodeState.OFFLINE]

        # a link measured for the first time, or changed, is announced at once rather than at the next heartbeat
        self.prober = prober = LinkProber(p2p, self.peer_id, on_change=announcer.wake)
        tasks = [asyncio.create_task(prober.run(stop, node_peers))]
        if self.coordinator is not None:
            from swarmnode.coordinator.service import Coordinator, model_info_from_checkpoint

            coordinator = Coordinator(self.dht, self.prefix, model_info_from_checkpoint(self.checkpoint),
                                      self.coordinator.key, self.config.serving.trusted_keys, self.coordinator.config,
                                      members=self.members)
            tasks.append(asyncio.create_task(coordinator.run(stop)))
        return tasks

    async def _serve_manual_range(self) -> None:
        assert self.config.model.blocks is not None, "`serve` serves a manual range when one was given"
        start, end = self.config.model.blocks
        unit = await self.aload_unit(start, end)
        self.status.add_unit(unit)
        self.status.set_state(NodeState.ONLINE, f"serving blocks [{start}, {end}) (chosen with --blocks)")

    def _follow_placements(self, stop: asyncio.Event) -> asyncio.Task:
        from swarmnode.server.follower import PlacementFollower

        serving = self.config.serving
        self.status.set_state(NodeState.WAITING, f"offering {format_size(self.config.memory.leftover_mem)} "
                                                 f"({self.memory.max_blocks} blocks) and waiting for a placement")
        follower = PlacementFollower(self, self.status, serving.trusted_keys, phase=serving.phase,
                                     phase_pinned=serving.phase_pinned)
        return asyncio.create_task(follower.run(stop))

    async def _go_offline(self) -> None:
        """Announce OFFLINE, let open sessions finish for up to `shutdown_grace` s, then free every unit."""
        self.status.state = NodeState.OFFLINE
        units = self.status.units
        for unit in units:
            unit.retiring = True  # no new sessions; open ones may finish
        try:
            assert self.announcer is not None, "`serve` starts the announcer before it goes offline"
            await asyncio.wait_for(self.announcer.announce(offline=True, ttl=10.0), timeout=5)
        except Exception:  # safe: any failure (timeout, DHT, daemon) only leaves the records to expire by TTL
            logger.warning("could not announce OFFLINE; the records will expire on their own")
        open_sessions = sum(len(u.sessions) for u in units)
        if open_sessions:
            logger.info("letting %d open sessions finish (up to %.0f s; a second signal exits at once)",
                        open_sessions, self.config.serving.shutdown_grace)
            deadline = time.monotonic() + self.config.serving.shutdown_grace
            while any(u.sessions for u in units) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            left = sum(len(u.sessions) for u in units)
            if left:
                logger.info("closing %d sessions still open: their clients fail over to other peers", left)
        for unit in units:
            await unit.aclose()  # off the event loop: RPCs (ping, info) go on answering meanwhile

    def run(self) -> None:
        self._start_dht()
        try:
            self.measure_overhead()
            asyncio.run(self.serve())
        finally:
            assert self.dht is not None, "`_start_dht` set it"
            self.dht.shutdown()
            logger.info("node stopped")
