"""A discrete-event simulator of a placement serving a request trace.

It scores every kind of plan the planner makes with one set of rules:

- a plain :class:`~planner.placement.Placement` (node -> ``[start, end)``, the Helix/LLaMPS algorithms):
  each node is a server; a request's pipeline is chosen when it is admitted by walking Helix's flow graph
  from the coordinator with one interleaved weighted round-robin (IWRR) scheduler per vertex, weighted by
  the max-flow solution (Helix §5.1), and kept for all its tokens. With partial inference a node runs only
  the layers the request still needs (Helix §4.4);
- HexGen replicas (:class:`~planner.replicas.ReplicaPlan` with role ``replica``): each stage (a
  tensor-parallel GPU group) is a server and a request is sent to one whole pipeline, chosen by IWRR over
  the replicas' capacities (HexGen App. C: the task coordinator directs a request to a worker group);
- HexGen-2 disaggregated plans: a request is prefilled by a prefill replica, its KV cache is sent over the
  layer-matched GPU pairs to a decode replica (HexGen-2 §3.3), which generates the remaining tokens; both
  replicas are chosen by IWRR weighted by the max-flow assignment.

How each kind of plan becomes servers and a router is in :mod:`planner.simulator.serving`, the routers are in
:mod:`planner.simulator.routers`, the knobs and metrics in :mod:`planner.simulator.metrics`; the event loop is
:class:`_Simulation` below.

Per server, batching per layer as Helix's simulator does (``simulator/event_simulator/compute_node.py``
in Helix's code): work waits before the layer where it enters the server (its first layer, or with partial
inference the layer after a predecessor's last one), a batch runs layer after layer and picks up the work
waiting before each layer it reaches, and an idle server starts its next batch at the first layer with
work (Helix's ``march_to_next_layer``). What the batch holds (:meth:`_Simulation.start_batch`): the decode
steps waiting there first, at most the node's share of a pipeline's requests
(:func:`~planner.simulator.serving.pipeline_batch`), then prompt tokens up to the node's chunk
(:func:`~planner.simulator.serving.prefill_chunk`): a longer prompt is prefilled in chunks, one per batch,
each sent on to the next server as soon as it is done (Sarathi-Serve's chunked prefills, as vLLM's
chunked-prefill scheduler runs them: decode steps first, prompt chunks in what is left of a step's token
budget). Helix's per-node caps on prompt tokens and decode
sequences (its ``InferenceSettings``, the cost model's ``batch_limits``) bound every batch. A batch takes
the cost model's ``batch_seconds`` for the node and the layers it runs (HexGen Eq. 4 for the roofline
model, Helix's measured per-layer times for the ``helix`` one), the model the flow graph's ``T_j`` is made
of; a HexGen stage takes :meth:`~planner.costs.hexgen_gpus.ServerTiming.batch_time` (HexGen Eqs. 4-5).

Why this and not Helix §5.1's "everything queued in one batch": with Helix's 763/232 requests the KV cache
bounds the requests in flight, and a batch of everything that arrived together goes down the pipeline as
one cohort that the smaller cohorts behind it catch up with and join, while a prompt, whose batch takes
as long as hundreds of decode steps, carries the decode steps that wait for it or ride with it along every
stage. Nodes were then busy a quarter of the time and the simulated throughput at 1.1 times the max flow's
load was 0.22-0.26 of the max flow; bounded batches go down the pipeline as a train that keeps every stage
busy, and chunked prefills keep a 763-token prompt from holding a one-layer T4's decode steps for 49 ms
at each of a 30-stage pipeline's stages (with whole prompts: 0.68 of the max flow on helix-hetero-42).
Under Helix's cost model the simulated throughput at 1.1 times the max flow's load is now 1.10 of it on
helix-single-24 and 0.98 on helix-hetero-42 (``scripts/bench_simulator.py``).

Per link: transfers are serialised on the directed link and arrive one link latency after
they finish (the alpha-beta model of HexGen App. B); they also queue for the sender's NIC, which is busy
for the bytes at its own rate, so a fast NIC feeds several slow links at once. Tokens return to the
coordinator after the last stage, which sends the next decode step through the same pipeline (Helix
Fig. 3). KV cache: every server has room for a number of token-layers (the cost model's
``kv_token_layers`` for a node: its free memory over the per-token, per-layer KV size, or vLLM's measured
blocks in Helix's profiles); a request reserves its KV on each layer it runs when it is admitted: for a
placement its prompt and half the average output (:data:`~planner.simulator.serving.EXPECTED_OUTPUT_SHARE`,
Helix's scheduler's KV expectation), for HexGen's plans its prompt and whole output (a prefill replica
of a disaggregated plan only ``s_in``, until its KV cache has been sent); servers without room are
masked out of the IWRR choice (Helix §5.2), and requests wait at the coordinator, first come first served.

Metrics: output tokens per second inside the measurement window, prompt latency (arrival to first token),
per-token decode latency ((finish - first token) / (s_out - 1)), end-to-end latency, and SLO attainment:
the share of requests that finish within ``slo_scale`` times their execution latency on a reference GPU
(HexGen §5.1 scales the SLO to multiples of the A100 execution latency; here one A100-80G alone, HexGen
Eq. 4, without memory limits).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..cluster.spec import COORDINATOR
from ..costs.roofline import kv_bytes_per_token
from ..errors import PlannerError
from .metrics import SimConfig, SimResult, _mean, _percentile, reference_latency
from .routers import Route
from .serving import ServingModel
from .trace import Request, poisson_trace

__all__ = ["simulate", "simulate_rate"]


# ---------------------------------------------------------------------------------------------------
# The event loop
# ---------------------------------------------------------------------------------------------------

_ARRIVE, _DELIVER, _DONE, _COORD, _KV = range(5)
_PREFILL, _DECODE = 0, 1


class _Req:
    """A request in flight: its route (servers and layers per step, flattened for speed), tokens generated
    so far, first-token and finish times, and the KV token-layers it holds (``early``: until its KV cache
    has moved to the decode replica; ``late``: until it ends)."""

    __slots__ = (
        "dec_lay",
        "dec_srv",
        "disagg",
        "early",
        "finish",
        "first",
        "generated",
        "late",
        "n_in",
        "n_out",
        "pre_lay",
        "pre_srv",
        "prefilled",
        "r",
        "route",
        "slo",
    )

    def __init__(self, r: Request, slo: float) -> None:
        self.r = r
        self.n_in = r.input_tokens
        self.n_out = r.output_tokens
        self.route: Route | None = None
        self.pre_srv: tuple[str, ...] = ()
        self.pre_lay: tuple[int, ...] = ()
        self.dec_srv: tuple[str, ...] = ()
        self.dec_lay: tuple[int, ...] = ()
        self.disagg = False
        self.generated = 0
        self.prefilled = 0.0  # prompt tokens the last prefill server has run (chunks arrive in order)
        self.first: float | None = None
        self.finish: float | None = None
        self.early: dict[str, float] = {}
        self.late: dict[str, float] = {}
        self.slo = slo

    def admit(self, route: Route, reserve_output: float | None) -> None:
        """Take ``route`` and the KV reservations it implies (``reserve_output``: the output tokens
        reserved, :attr:`ServingModel.reserve_output`)."""
        self.route = route
        self.pre_srv = tuple(h.server for h in route.prefill)
        self.pre_lay = tuple(h.layers for h in route.prefill)
        self.dec_srv = tuple(h.server for h in route.decode)
        self.dec_lay = tuple(h.layers for h in route.decode)
        self.disagg = route.disaggregated
        self.early, self.late = route.reservations(self.r, reserve_output)


#: A unit of work queued at a server: (request, _PREFILL or _DECODE, index of the step in that phase,
#: prompt tokens: the whole prompt or a chunk of it; 1 for a decode step).
_Item = tuple[_Req, int, int, float]


class _Simulation:
    """The discrete-event loop behind :func:`simulate`; the module docstring states the rules.

    Events, each handled by one method: a request arrives at the coordinator (:meth:`on_arrival`), work
    reaches a server over a link (:meth:`on_delivery`), a batch finishes a step of a server's layers
    (:meth:`on_step_done`),
    tokens reach the coordinator (:meth:`on_tokens`), and a disaggregated request's KV cache has reached its
    decode replica (:meth:`on_kv_moved`). Transfers are not events of their own: :meth:`transfer` books a
    transfer on the sender's NIC and the link and returns when it arrives."""

    def __init__(self, model: ServingModel, trace: Sequence[Request], config: SimConfig) -> None:
        cluster = model.cluster
        self.model = model
        self.config = config
        self.servers = model.servers
        self.activation_bytes = cluster.model.hidden_size * cluster.model.dtype_bytes
        self.kv_bytes_per_token = kv_bytes_per_token(cluster.model)
        self.token_bytes = cluster.token_bytes
        # per server: KV token-layers left, work queued at each entry layer, the batch it runs (None when
        # idle) and where that batch's current step ends, and the statistics of its batches
        self.free = {s: srv.kv_capacity for s, srv in self.servers.items()}
        self.waiting: tuple[dict[str, dict[int, list[_Item]]], ...] = (
            {s: {} for s in self.servers},  # prompts, by the layer offset where they enter
            {s: {} for s in self.servers},  # decode steps
        )
        self.queued = dict.fromkeys(self.servers, 0)
        self.running: dict[str, list[_Item] | None] = dict.fromkeys(self.servers)
        self.step_end = dict.fromkeys(self.servers, 0)
        self.busy_time = dict.fromkeys(self.servers, 0.0)
        self.batch_count = dict.fromkeys(self.servers, 0)
        self.item_count = dict.fromkeys(self.servers, 0)
        # per directed link and per sending NIC: when it is free again
        self.link_free: dict[tuple[str, str], float] = {}
        self.nic_free: dict[str, float] = {}
        self.link_cache: dict[tuple[str, str], tuple[float, float, str | None, float]] = {}
        self.events: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        # the coordinator: requests waiting for room, requests admitted and not finished
        self.pending: deque[_Req] = deque()
        self.active = 0
        self.rejected = 0
        last_arrival = max(r.arrival for r in trace)
        self.horizon = last_arrival + config.drain
        self.window_start = config.warmup
        window_end = config.window_end if config.window_end is not None else last_arrival
        if window_end <= self.window_start:
            window_end = max(last_arrival, self.window_start) + 1e-9
        self.window_end = window_end
        self.tokens_in_window = 0
        self.finished_in_window = 0
        self.slo_cache: dict[tuple[int, int], float] = {}
        self.requests = [_Req(r, self.slo_of(r)) for r in trace]
        for q in self.requests:
            self.push(q.r.arrival, _ARRIVE, q)

    # --- bookkeeping ---------------------------------------------------------------------------------

    def push(self, t: float, kind: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def slo_of(self, r: Request) -> float:
        """The request's SLO: ``slo_scale`` times its latency alone on the reference GPU."""
        key = (r.input_tokens, r.output_tokens)
        v = self.slo_cache.get(key)
        if v is None:
            v = reference_latency(self.model.cluster, r.input_tokens, r.output_tokens, self.config)
            self.slo_cache[key] = v
        return self.config.slo_scale * v

    def in_window(self, now: float) -> bool:
        return self.window_start <= now <= self.window_end

    # --- the network ---------------------------------------------------------------------------------

    def link_params(self, src: str, dst: str) -> tuple[float, float, str | None, float]:
        """(bytes/s, latency s, sender NIC key or None, sender NIC bytes/s) of the directed link
        ``src -> dst``; the link's rate is capped by both ends' NICs."""
        value = self.link_cache.get((src, dst))
        if value is not None:
            return value
        servers = self.servers
        link = self.model.link(src, dst)
        src_node = None if src == COORDINATOR else servers[src].node
        dst_node = None if dst == COORDINATOR else servers[dst].node
        rate = link.bytes_per_second
        nic_key = None
        nic_rate = math.inf
        if src_node != dst_node:
            if src_node is not None:
                nic_rate = servers[src].nic
                rate = min(rate, nic_rate)
                nic_key = src_node
            if dst_node is not None:
                rate = min(rate, servers[dst].nic)
        value = (rate, link.latency_s, nic_key, nic_rate)
        self.link_cache[(src, dst)] = value
        return value

    def transfer(self, now: float, src: str, dst: str, nbytes: float) -> float:
        """Serialise ``nbytes`` on the directed link and on the sender's NIC; return the arrival time.

        The sender's NIC is a FIFO queue in front of its links: the bytes hold it for ``nbytes`` at the
        NIC's own rate from when it is free; the transfer then holds the link from when both the NIC has
        started it and the link is free, for ``nbytes`` at the link's rate (capped by both NICs). A NIC
        faster than its links thus feeds several slow links at once (each link is its own alpha-beta
        channel, HexGen App. B), and one backlogged link delays only its own transfers."""
        rate, latency, nic_key, nic_rate = self.link_params(src, dst)
        start = now
        if nic_key is not None:
            nic_start = self.nic_free.get(nic_key, 0.0)
            if nic_start < now:
                nic_start = now
            self.nic_free[nic_key] = nic_start + nbytes / nic_rate
            start = nic_start
        busy_until = self.link_free.get((src, dst), 0.0)
        if busy_until > start:
            start = busy_until
        end = start + nbytes / rate
        self.link_free[(src, dst)] = end
        return end + latency

    # --- servers -------------------------------------------------------------------------------------

    def join(self, sid: str, offset: int, batch: list[_Item]) -> list[_Item]:
        """``batch`` and the waiting items that join it before layer ``offset``, in arrival order: decode
        steps first, up to the server's :attr:`~Server.cap` and its decode cap, then prompt tokens, first
        come first served, up to the server's :attr:`~Server.chunk` less what the batch holds (and Helix's
        prompt-token cap): a prompt that does not fit whole is split, its first tokens join as a chunk and
        the rest waits at the head of the queue for the next batch. :attr:`SimConfig.max_batch` bounds
        the decode steps of a batch, and its prompts."""
        server = self.servers[sid]
        limits = server.limits
        decode = 0
        prompt = 0.0
        for _, phase, _, tokens in batch:
            if phase:
                decode += 1
            else:
                prompt += tokens
        joined: list[_Item] = []
        queue = self.waiting[_DECODE][sid]
        waiting = queue.get(offset)
        if waiting:
            take = self.config.max_batch - decode
            if server.cap is not None:
                take = min(take, server.cap - decode)
            if limits is not None:
                take = min(take, int(limits[1]) - decode)
            if take >= len(waiting):
                del queue[offset]
                joined = waiting
            elif take > 0:
                joined = waiting[:take]
                queue[offset] = waiting[take:]
        queue = self.waiting[_PREFILL][sid]
        waiting = queue.get(offset)
        if waiting:
            budget = server.chunk if limits is None else min(server.chunk, limits[0])
            left = budget - prompt
            chosen: list[_Item] = []
            used = 0
            most = self.config.max_batch  # prompts (or chunks) per batch, as before chunks existed
            for item in waiting:
                if left < 1.0 or len(chosen) >= most:
                    break
                tokens = item[3]
                if tokens <= left:
                    chosen.append(item)
                    left -= tokens
                    used += 1
                    continue
                piece = float(math.floor(left))
                chosen.append((item[0], _PREFILL, item[2], piece))
                waiting[used] = (item[0], _PREFILL, item[2], tokens - piece)
                self.queued[sid] += 1  # the rest stays queued as its own item
                break
            if used == len(waiting):
                del queue[offset]
            elif used:
                queue[offset] = waiting[used:]
            joined = joined + chosen if joined else chosen
        if not joined:
            return batch
        self.queued[sid] -= len(joined)
        self.item_count[sid] += len(joined)
        return batch + joined if batch else list(joined)

    def run_step(self, now: float, sid: str, offset: int, batch: list[_Item]) -> None:
        """Run ``batch`` and the items that join it before layer ``offset`` (:meth:`join`) through the next
        step of the server's layers, as Helix's compute nodes batch per layer
        (``event_simulator/compute_node.py``: one queue before each layer, a batch runs layer after layer,
        and requests that enter the node at a later layer join it there). A step runs to the next layer
        where requests enter: in between nothing can join, so one step of ``seconds(layers, ...)`` is the
        same as one per layer."""
        server = self.servers[sid]
        batch = self.join(sid, offset, batch)
        end = server.depth
        for e in server.entries:
            if offset < e < end:
                end = e
                break
        prompt = 0.0
        decode = 0
        context = 0.0
        for q, phase, _, tokens in batch:
            if phase:
                decode += 1
                context += q.n_in + q.generated
            else:
                prompt += tokens
        duration = server.seconds(end - offset, prompt, decode, context)
        self.running[sid] = batch
        self.step_end[sid] = end
        self.busy_time[sid] += duration
        self.push(now + duration, _DONE, sid)

    def start_batch(self, now: float, sid: str) -> None:
        """What an idle server runs next (Helix §5.1's dynamic batching, in the order of vLLM's
        chunked-prefill scheduler, ``vllm/core/scheduler.py``, which schedules decode steps before
        prefills and gives prefill chunks what is left of a step's token budget): a batch of the decode
        steps waiting before the first layer where some wait (Helix's ``march_to_next_layer`` wraps
        around to the first layer), which prompt chunks join; else a batch of prompt chunks. A prompt
        thus never holds a decode step for longer than one chunk
        (:func:`~planner.simulator.serving.prefill_chunk`): a whole prompt takes as long as hundreds of decode
        steps, and the decode steps that waited for it or rode with it would follow it down the whole
        pipeline (a convoy that stretches every round trip and, with the KV cache full, the throughput)."""
        decode = self.waiting[_DECODE][sid]
        if decode:
            self.batch_count[sid] += 1
            self.run_step(now, sid, min(decode), [])
            return
        prompt = self.waiting[_PREFILL][sid]
        if prompt:
            self.batch_count[sid] += 1
            self.run_step(now, sid, min(prompt), [])

    def enqueue(self, now: float, sid: str, items: list[_Item]) -> None:
        """Queue ``items`` before the layer where each enters the server; start a batch if it is idle."""
        depth = self.servers[sid].depth
        for item in items:
            q, phase, idx, _ = item
            layers = q.dec_lay[idx] if phase else q.pre_lay[idx]
            offset = depth - layers if depth > layers else 0
            queue = self.waiting[phase][sid]
            waiting = queue.get(offset)
            if waiting is None:
                queue[offset] = [item]
            else:
                waiting.append(item)
        self.queued[sid] += len(items)
        if self.running[sid] is None:
            self.start_batch(now, sid)


    # --- the coordinator -----------------------------------------------------------------------------

    def release(self, amounts: Mapping[str, float]) -> None:
        for s, v in amounts.items():
            self.free[s] += v

    def try_admit(self, now: float) -> None:
        """Admit waiting requests first come first served while a route with room exists; a request that
        fits nowhere even on an idle cluster is rejected."""
        pending = self.pending
        free = self.free
        while pending:
            q = pending[0]
            route = self.model.router.route(q.r, free)
            if route is None:
                if self.active == 0:
                    pending.popleft()  # can never fit, even on an empty cluster
                    self.rejected += 1
                    continue
                return
            pending.popleft()
            q.admit(route, self.model.reserve_output)
            for s, v in q.early.items():
                free[s] -= v
            for s, v in q.late.items():
                free[s] -= v
            self.active += 1
            first = route.prefill[0].server
            at = self.transfer(now, COORDINATOR, first, q.r.input_tokens * self.token_bytes)
            self.push(at, _DELIVER, (first, [(q, _PREFILL, 0, float(q.n_in))]))

    def finish(self, now: float, q: _Req) -> None:
        q.finish = now
        self.active -= 1
        self.release(q.early)
        q.early = {}
        self.release(q.late)
        if self.in_window(now):
            self.finished_in_window += 1
        self.try_admit(now)

    # --- events --------------------------------------------------------------------------------------

    def on_arrival(self, now: float, q: _Req) -> None:
        self.pending.append(q)
        self.try_admit(now)

    def on_delivery(self, now: float, payload: tuple[str, list[_Item]]) -> None:
        sid, items = payload
        self.enqueue(now, sid, items)

    def on_step_done(self, now: float, sid: str) -> None:
        """A batch has run one step of a server's layers: it goes on to the next step, or, past the last
        layer, each item's output is sent on: activations to the next step's server (one transfer per
        destination), tokens to the coordinator, and after a disaggregated prefill the KV cache to the
        decode replica (HexGen-2 §3.3); then the next batch starts if work is queued."""
        items = self.running[sid]
        assert items is not None  # run_step set the batch before scheduling its step's end
        end = self.step_end[sid]
        if end < self.servers[sid].depth:
            self.run_step(now, sid, end, items)
            return
        self.running[sid] = None
        act = self.activation_bytes
        outgoing: dict[str, list[_Item]] = {}
        out_bytes: dict[str, float] = {}
        to_coord: list[_Item] = []
        kv_starts: list[_Req] = []
        for item in items:
            q, phase, idx, tokens = item
            srv = q.dec_srv if phase else q.pre_srv
            nxt = idx + 1
            if nxt < len(srv):
                # a prompt chunk goes on as soon as it is done here: the next server prefills it while
                # this one runs the next chunk
                dst = srv[nxt]
                batch = outgoing.get(dst)
                if batch is None:
                    outgoing[dst] = batch = []
                    out_bytes[dst] = 0.0
                batch.append((q, phase, nxt, tokens))
                out_bytes[dst] += act if phase else tokens * act
            elif phase:
                to_coord.append(item)
            else:
                q.prefilled += tokens
                if q.prefilled >= q.n_in - 1e-9:  # the prompt's last chunk: its first token
                    to_coord.append(item)
                    if q.disagg and q.n_out > 1:
                        kv_starts.append(q)
        for dst, batch in outgoing.items():
            self.push(self.transfer(now, sid, dst, out_bytes[dst]), _DELIVER, (dst, batch))
        if to_coord:
            at = self.transfer(now, sid, COORDINATOR, len(to_coord) * self.token_bytes)
            self.push(at, _COORD, to_coord)
        for q in kv_starts:
            self.push(self.move_kv(now, q), _KV, q)
        if self.queued[sid]:
            self.start_batch(now, sid)

    def move_kv(self, now: float, q: _Req) -> float:
        """Send a prefilled request's KV cache over its layer-matched segments; return when all of it
        has arrived."""
        arrival = now
        assert q.route is not None  # an admitted request
        for src, dst, layers in q.route.kv_segments:
            if src == dst:
                continue
            nbytes = q.r.input_tokens * self.kv_bytes_per_token * layers
            arrival = max(arrival, self.transfer(now, src, dst, nbytes))
        return arrival

    def on_tokens(self, now: float, items: list[_Item]) -> None:
        """Tokens reach the coordinator: count them, finish requests that are done, and send the next
        decode step of the others (Helix Fig. 3); a disaggregated request's first decode step waits for
        its KV cache instead."""
        for q, phase, _, _ in items:
            q.generated += 1
            if self.in_window(now):
                self.tokens_in_window += 1
            if q.first is None:
                q.first = now
            if q.generated >= q.r.output_tokens:
                self.finish(now, q)
            elif phase == _DECODE or not q.disagg:
                first = q.dec_srv[0]
                at = self.transfer(now, COORDINATOR, first, self.token_bytes)
                self.push(at, _DELIVER, (first, [(q, _DECODE, 0, 1.0)]))

    def on_kv_moved(self, now: float, q: _Req) -> None:
        """A disaggregated request's KV cache is at its decode replica: the prefill replica's share is
        freed, and decoding starts there."""
        self.release(q.early)
        q.early = {}
        if q.finish is None:
            self.enqueue(now, q.dec_srv[0], [(q, _DECODE, 0, 1.0)])
        self.try_admit(now)

    # --- the loop and its result ---------------------------------------------------------------------

    def run(self) -> SimResult:
        handlers: tuple[Callable[[float, Any], None], ...] = (
            self.on_arrival,
            self.on_delivery,
            self.on_step_done,
            self.on_tokens,
            self.on_kv_moved,
        )
        events = self.events
        max_events = self.config.max_events
        events_done = 0
        now = 0.0
        while events:
            now, _, kind, payload = heapq.heappop(events)
            if now > self.horizon:
                break
            events_done += 1
            if events_done > max_events:
                raise PlannerError(
                    f"simulation exceeded {max_events} events; shorten the trace", code="too_many_events"
                )
            handlers[kind](now, payload)
        return self.result(min(now, self.horizon) if events else now)

    def result(self, end_time: float) -> SimResult:
        prompt, decode_lat, e2e = [], [], []
        met = 0
        completed = 0
        for q in self.requests:
            if q.first is not None:
                prompt.append(q.first - q.r.arrival)
            if q.finish is None:
                continue
            completed += 1
            latency = q.finish - q.r.arrival
            e2e.append(latency)
            if q.r.output_tokens > 1:
                assert q.first is not None  # a finished request has had its first token (on_tokens)
                decode_lat.append((q.finish - q.first) / (q.r.output_tokens - 1))
            if latency <= q.slo:
                met += 1
        span = self.window_end - self.window_start
        sim_span = max(end_time, 1e-9)
        servers = self.servers
        return SimResult(
            requests=len(self.requests),
            completed=completed,
            rejected=self.rejected,
            window=(self.window_start, self.window_end),
            throughput=self.tokens_in_window / span,
            request_throughput=self.finished_in_window / span,
            prompt_latency_mean=_mean(prompt),
            prompt_latency_p95=_percentile(prompt, 95),
            decode_latency_mean=_mean(decode_lat),
            decode_latency_p95=_percentile(decode_lat, 95),
            latency_mean=_mean(e2e),
            latency_p95=_percentile(e2e, 95),
            slo_scale=self.config.slo_scale,
            slo_attainment=met / len(self.requests),
            simulated_seconds=end_time,
            server_utilisation={s: min(1.0, b / sim_span) for s, b in self.busy_time.items()},
            server_mean_batch={
                s: self.item_count[s] / self.batch_count[s] if self.batch_count[s] else 0.0 for s in servers
            },
            server_backlog=dict(self.queued),
            waiting=len(self.pending),
        )


def simulate(model: ServingModel, trace: Sequence[Request], config: SimConfig | None = None) -> SimResult:
    """Run ``trace`` through ``model``; see the module docstring for the rules."""
    if not trace:
        raise PlannerError("the trace has no requests", code="empty_trace")
    return _Simulation(model, trace, config or SimConfig()).run()


def simulate_rate(
    model: ServingModel,
    rate: float,
    duration: float,
    *,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
    spread: float = 0.0,
    seed: int = 0,
    config: SimConfig | None = None,
) -> SimResult:
    """Simulate Poisson arrivals at ``rate`` requests/s for ``duration`` seconds with the average lengths
    the plan was made for (``model.workload``, else the cluster's), or the given ones."""
    w = model.workload or model.cluster.workload
    n_in = round(input_tokens if input_tokens is not None else w.avg_input_tokens)
    n_out = round(output_tokens if output_tokens is not None else w.avg_output_tokens)
    trace = poisson_trace(rate, duration, max(1, n_in), max(1, n_out), spread=spread, seed=seed)
    if not trace:
        raise PlannerError(
            f"no request arrives in {duration} s at {rate} requests/s; raise the rate or the duration",
            code="empty_trace",
        )
    return simulate(model, trace, config)
