"""HexGen-2's two phases on real peers: steady decode streams under long-prompt arrivals, colocated vs split
onto prefill and decode nodes, side by side in one run. One JSON line on stdout; progress on stderr.

The same 4 `join --blocks` nodes (each `--leftover-cores 1 --num-threads 1`, run under `taskset` on one core)
serve the model in two layouts, one swarm after the other:

- **colocated**: 4 nodes `--phase both`, two full pipelines A = [0, M) + [M, N) and B = [0, M) + [M, N);
  the client sends steady stream k and long prompt i through pipeline k % 2 and i % 2 (each of its two
  client objects excludes the other pipeline's nodes: the client's shortest-latency routing would otherwise
  put every session on the same pipeline and leave half the nodes idle);
- **disaggregated**: 2 `--phase prefill` nodes [0, M) + [M, N) and 2 `--phase decode` nodes [0, M) + [M, N);
  every session's prompt runs on the prefill nodes, which hand its KV cache over to the decode nodes
  (`ClientConfig(disaggregate=True)`, docs/architecture.md step 7).

Cores: node i (in the order A1 A2 B1 B2, or P1 P2 D1 D2) runs on core `cores[i * len(cores) // 4]` of the
cores this process may use, so with 4 or more cores each node has a core of its own; with 2 cores nodes 0-1
share the first and nodes 2-3 the second: one core holds pipeline A (colocated) or the prefill pair
(disaggregated), the other pipeline B or the decode pair, as if each core were a machine of two nodes (a
round-robin pinning would put a prefill and a decode node on every core, and a prompt would then take half
of a decode node's core whatever the layout). The bootstrap and the clients (this process) are not pinned.

Workload, per layout: `--streams` steady streams, each a closed loop of requests of a `--decode-prompt`-token
prompt and `--decode-tokens` new tokens; from `--warmup` s on, a `--long-prompt`-token prompt with
`--long-tokens` new tokens arrives every `--long-every` s (open loop, whatever is still running); measured
over the `--duration` s after the warm-up, then every generation is stopped at its next token. Greedy
decoding with a fixed number of new tokens (`min_new_tokens`). Reported per layout:

- `itl_p50_s`, `itl_p95_s`, `itl_p99_s`, `itl_max_s`: the steady streams' inter-token latencies (time
  between consecutive tokens of a request, after its first), those ending inside the window. A prompt that
  holds a colocated node delays each stream on that pipeline by one long gap, one sample among the hundreds
  a stream makes meanwhile, so it shows in p99 and max long before p95;
- `ttft_p50_s`, `ttft_p95_s` (steady requests started in the window), `long_ttft_p50_s`, `long_ttft_p95_s`
  (long prompts): from the `generate()` call to the first token;
- `tok_s`: every request's output tokens stamped inside the window, over the window;
- disaggregated: `kv_bytes_per_request`, the tensor bytes one request's handover moves (what
  `server/handover.py` sends for each decode target: keys and values of every block, `2 x kv_heads x head_dim
  x 4 bytes` (float32 nodes) per token per block, and the int64 token mask), computed from the prompts the
  client reports handed over (`InferenceSession.prefills`) since nothing exposes the bytes; the prefill nodes'
  "handed blocks [a, b) of N tokens" log lines give the same figure (`kv_bytes_logged_per_request`).

Then `itl_p95_ratio` and `tok_s_ratio` (disaggregated / colocated) against the issue's aims (<= 0.6 and
>= 0.9), `itl_p99_ratio`, and `exact`: every request completed in both layouts with the same prompt
(stream k's, or long prompt i's) generated the same tokens.

`simulator`: the planner's discrete-event simulator (`planner.simulator.engine`) run on the same setting: the same
closed-loop streams and long-prompt arrivals, window and routes (stream k and long prompt i on pipeline
k % 2 and i % 2; disaggregated: prefill pair, then KV handover, then decode pair), links of the clients'
measured RTT. The simulator reports no per-token times (`SimResult.decode_latency_p95` is a per-request mean),
so its event loop is subclassed to record every token's time and to start a stream's next request when one
ends; its figures are then computed exactly like the measured ones. Two node models:

- `cost_model`: the servers `serving_from_placement` makes from a cluster spec of the nodes' records (their
  measured `block_throughput` and `prefill_throughput`, as `coordinator.cluster_view` turns records into a
  cluster) with the cost model's batch caps and prefill chunks; a batch of `d` decode steps and `p` prompt
  tokens takes `blocks x (d / block_throughput + p / prefill_throughput)`
  (`planner.costs.roofline.CostModel.batch_seconds`).
  (`serving_from_disaggregated` takes HexGen GPU replica plans only, so for the split layout the same node
  servers get a HexGen-2 route of their own.)
- `profiled`: the same event loop with one server per core (the nodes pinned to it run one batch at a
  time) and batch times from a profile of one block taken here before the swarms start, on one thread and
  one core: decode steps of 1 and `--streams` sequences, prefills of both prompt lengths (linear in
  between), and prompts run whole, as the nodes' scheduler runs them.

Neither model has the cost of a step's RPCs, daemons and client beyond the link latency, so the simulated
latencies are lower than the measured ones: compare the ratios.

With the defaults the whole run takes about 6 minutes on 2 cores (`make bench-disaggregation`):

    .venv/bin/python scripts/bench_disaggregation.py [--streams 4] [--decode-prompt 64] [--decode-tokens 128]
        [--long-prompt 1024] [--long-tokens 16] [--long-every 20] [--duration 120] [--warmup 10]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import re
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_network import CLOCK, make_prompt  # the same prompt text and token clock

from swarmnode.testing.local_swarm import LocalSwarm

NODES = 4
AIM_ITL_P95_RATIO = 0.6
AIM_TOK_S_RATIO = 0.9
KV_DTYPE_BYTES = 4  # the nodes compute and cache in float32 (`join --dtype` default)
_HANDED_RE = re.compile(r"handed blocks \[(\d+), (\d+)\) of (\d+) tokens")


def log(message: str) -> None:
    print(f"[bench_disaggregation {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class PinnedSwarm(LocalSwarm):
    """A local swarm whose processes named in `pins` run under `taskset -c CORE` (it execs: same pid)."""

    pins: dict[str, int] = dataclasses.field(default_factory=dict)

    def command_line(self, name: str, args: list[str]) -> list[str]:
        line = super().command_line(name, args)
        return ["taskset", "-c", str(self.pins[name]), *line] if name in self.pins else line


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def figures(requests: list[dict], window: tuple[float, float]) -> dict:
    """The reported figures of finished or stopped requests (`kind`, `start`, token `times`), window (a, b)."""
    a, b = window
    itl, ttft, long_ttft, tokens = [], [], [], 0
    for r in requests:
        times = r["times"]
        tokens += sum(1 for t in times if a <= t <= b)
        if r["kind"] == "steady":
            itl += [y - x for x, y in itertools.pairwise(times) if a <= y <= b]
            if times and a <= r["start"] <= b:
                ttft.append(times[0] - r["start"])
        elif times:
            long_ttft.append(times[0] - r["start"])
    return {"itl_p50_s": _round(_percentile(itl, 50)), "itl_p95_s": _round(_percentile(itl, 95)),
            "itl_p99_s": _round(_percentile(itl, 99)), "itl_max_s": _round(max(itl, default=None)),
            "ttft_p50_s": _round(_percentile(ttft, 50), 3), "ttft_p95_s": _round(_percentile(ttft, 95), 3),
            "long_ttft_p50_s": _round(_percentile(long_ttft, 50), 3),
            "long_ttft_p95_s": _round(_percentile(long_ttft, 95), 3),
            "tok_s": round(tokens / (b - a), 2), "itl_samples": len(itl)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


# --- the measurement ------------------------------------------------------------------------------------


class Workload:
    """Steady closed-loop streams and long prompts at a fixed rate, through `clients` (stream k and long
    prompt i go through `clients[k % len]` and `clients[i % len]`), each generation in a thread."""

    def __init__(self, args, clients, steady_prompts: list[list[int]], long_prompts: list[list[int]]):
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList
        from transformers.generation.streamers import BaseStreamer

        namespace = {"BaseStreamer": BaseStreamer, "time": time}
        exec(CLOCK, namespace)  # bench_network's token clock: `times` of every token after the prompt
        self.clock_class = namespace["Clock"]
        self.torch, self.args, self.clients = torch, args, clients
        self.steady_prompts, self.long_prompts = steady_prompts, long_prompts
        self.stop = threading.Event()
        self.requests: list[dict] = []
        self.errors: list[str] = []
        stop = self.stop

        class Stop(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), stop.is_set(), dtype=torch.bool)

        self.stopping = StoppingCriteriaList([Stop()])

    def generate(self, client, ids: list[int], new_tokens: int, *, kind: str, key: int) -> None:
        clock = self.clock_class()
        try:
            start = time.perf_counter()
            with client.inference_session(max_length=len(ids) + new_tokens) as session:
                out = client.generate(self.torch.tensor([ids]), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False, streamer=clock,
                                      stopping_criteria=self.stopping)
                prefills = session.prefills
        except Exception as exc:  # a failed generation is reported with the run's figures, not hidden
            self.errors.append(f"{kind} {key}: {type(exc).__name__}: {exc}")
            return
        tokens = out[0, len(ids):].tolist()
        self.requests.append({"kind": kind, "key": key, "start": start, "times": list(clock.times),
                              "tokens": tokens, "complete": len(tokens) == new_tokens, "prompt": len(ids),
                              "prefills": prefills})

    def _steady(self, k: int, until: float) -> None:
        client = self.clients[k % len(self.clients)]
        while not self.stop.is_set() and time.perf_counter() < until and len(self.errors) < 10:
            self.generate(client, self.steady_prompts[k], self.args.decode_tokens, kind="steady", key=k)

    def run(self) -> tuple[float, float]:
        """Run the workload; the measurement window (perf_counter seconds)."""
        args = self.args
        began = time.perf_counter()
        window = (began + args.warmup, began + args.warmup + args.duration)
        threads = [threading.Thread(target=self._steady, args=(k, window[1]), daemon=True)
                   for k in range(args.streams)]
        for thread in threads:
            thread.start()
        for i in range(math.ceil(args.duration / args.long_every)):
            at = window[0] + i * args.long_every
            time.sleep(max(0.0, at - time.perf_counter()))
            client = self.clients[i % len(self.clients)]
            thread = threading.Thread(target=self.generate, daemon=True, args=(
                client, self.long_prompts[i % len(self.long_prompts)], args.long_tokens),
                kwargs={"kind": "long", "key": i % len(self.long_prompts)})
            thread.start()
            threads.append(thread)
            log(f"long prompt {i} sent; {len(self.requests)} requests done so far")
        time.sleep(max(0.0, window[1] - time.perf_counter()))
        self.stop.set()
        deadline = time.monotonic() + 600
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in threads):
            self.errors.append("some generations did not stop within 600 s of the window's end")
        return window


def run_layout(layout: str, args, model_dir: Path, checkpoint, cores: list[int], split: int,
               prompts: tuple[list[list[int]], list[list[int]]], log_dir: Path) -> dict:
    import torch

    from swarmnode.client import ClientConfig, DistributedModelForCausalLM

    n = checkpoint.num_blocks
    if layout == "colocated":
        nodes = [("A1", 0, split, "both"), ("A2", split, n, "both"), ("B1", 0, split, "both"),
                 ("B2", split, n, "both")]
    else:
        nodes = [("P1", 0, split, "prefill"), ("P2", split, n, "prefill"), ("D1", 0, split, "decode"),
                 ("D2", split, n, "decode")]
    pins = core_of([name for name, *_ in nodes], cores)
    with PinnedSwarm(model_dir, log_dir=log_dir / layout, pins=pins) as swarm, contextlib.ExitStack() as stack:
        log(f"{layout}: starting a bootstrap and nodes {[(name, a, b, phase) for name, a, b, phase in nodes]} "
            f"on cores {pins} (logs in {log_dir / layout})")
        swarm.start_bootstrap()
        procs = {name: swarm.launch_node(a, b, name=name, extra=["--leftover-cores", "1", "--phase", phase])
                 for name, a, b, phase in nodes}
        for process in procs.values():
            swarm.wait_serving(process, 600)
        status = swarm.wait_status(lambda st: all(
            st["nodes"].get(p.peer_id, {}).get("block_throughput") for p in procs.values()), 120)
        records = {name: status["nodes"][p.peer_id] for name, p in procs.items()}
        log(f"{layout}: serving; block throughput " + ", ".join(
            f"{name} {r.get('block_throughput', 0):.0f}" for name, r in records.items()) + " tokens/s")
        ids = {name: p.peer_id for name, p in procs.items()}
        if layout == "colocated":
            configs = [ClientConfig(disaggregate=False, exclude_peers=frozenset({ids["B1"], ids["B2"]})),
                       ClientConfig(disaggregate=False, exclude_peers=frozenset({ids["A1"], ids["A2"]}))]
        else:
            configs = [ClientConfig(disaggregate=True), ClientConfig(disaggregate=True)]
        clients = [stack.enter_context(DistributedModelForCausalLM.from_pretrained(
            model_dir, initial_peers=swarm.initial_peers, config=config)) for config in configs]
        for client in clients:  # connections to every node along its routes made, the prompt split once
            client.generate(torch.tensor([prompts[0][0][:8]]), max_new_tokens=2, do_sample=False)
        rtts = [rtt for client in clients for peer, rtt in client.swarm.rtts.items() if peer in ids.values()]
        marks = {name: len(p.log()) for name, p in procs.items()}  # handovers of the warm-up left out
        log(f"{layout}: {args.streams} steady streams, a {args.long_prompt}-token prompt every "
            f"{args.long_every} s after {args.warmup} s, measured for {args.duration} s")
        workload = Workload(args, clients, *prompts)
        window = workload.run()
        if workload.errors:
            tails = "\n".join(f"--- {name}:\n{p.log_tail(1500)}" for name, p in procs.items())
            raise SystemExit(f"{layout}: generations failed: {workload.errors[:5]}\n{tails}")
        logged = [(int(a), int(b), int(t)) for name in ("P1", "P2") if name in procs
                  for a, b, t in _HANDED_RE.findall(procs[name].log()[marks[name]:])]
    result = figures(workload.requests, window)
    result["requests"] = {"steady": sum(r["kind"] == "steady" for r in workload.requests),
                          "long": sum(r["kind"] == "long" for r in workload.requests)}
    if layout == "disaggregated":
        handed = [r for r in workload.requests if r["prefills"]]
        per_token_block = checkpoint.family.layer_caches[0].elements_per_token * KV_DTYPE_BYTES
        mask = 8 * 2  # int64 token mask, once per decode target (two decode nodes)
        computed = [r["prompt"] * (per_token_block * n + mask) for r in handed]
        from_logs = sum(t * (per_token_block * (b - a) + 8) for a, b, t in logged)
        result["prompts_handed_over"] = len(handed)
        result["prompts_on_decode_route"] = len(workload.requests) - len(handed)
        result["kv_bytes_per_request"] = round(statistics.mean(computed)) if computed else None
        result["kv_bytes_per_long_request"] = args.long_prompt * (per_token_block * n + mask)
        result["kv_bytes_per_steady_request"] = args.decode_prompt * (per_token_block * n + mask)
        result["kv_bytes_logged_per_request"] = round(from_logs / len(handed)) if handed else None
    log(f"{layout}: {json.dumps(result)}")
    return {"figures": result, "requests": workload.requests, "window": window, "records": records,
            "rtt_s": statistics.median(rtts) if rtts else 0.002}


# --- the simulator ----------------------------------------------------------------------------------------


def profile_block(checkpoint, core: int, rows: int, short: int, long: int, context: int) -> dict:
    """Seconds one block takes here on one thread and one core: decode steps of 1 and `rows` sequences
    (`context` cached tokens each), prefills of `short` and `long` tokens (medians; 2 blocks timed)."""
    import torch

    from swarmnode.runtime.blocks import BlockStack

    affinity = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    try:
        stack = BlockStack(checkpoint, 0, 2)
        hidden_size = checkpoint.hidden_size

        def run(batch: int, n: int, prefix: int, repeats: int) -> float:
            caches = [stack.new_session_cache(0, 2, 1, prefix + n * (repeats + 1)) for _ in range(batch)]
            for cache in caches:
                if prefix:
                    stack.step([cache], 0, 2, torch.zeros(1, prefix, hidden_size), torch.arange(prefix)[None],
                               torch.ones(1, prefix, dtype=torch.bool))
            seconds, position = [], prefix
            for _ in range(repeats + 1):  # the first is a warm-up
                began = time.perf_counter()
                positions = (torch.arange(n)[None] + position).repeat(batch, 1)
                stack.step(caches, 0, 2, torch.zeros(batch, n, hidden_size), positions,
                           torch.ones(batch, n, dtype=torch.bool))
                seconds.append(time.perf_counter() - began)
                position += n
            return statistics.median(seconds[1:]) / 2

        rows = max(rows, 2)
        profile = {"decode_1_s": run(1, 1, context, 20), f"decode_{rows}_s": run(rows, 1, context, 20),
                   f"prefill_{short}_s": run(1, short, 0, 3), f"prefill_{long}_s": run(1, long, 0, 3)}
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, affinity)
    return profile


def _profile_seconds(profile: dict, rows: int, short: int, long: int):
    """A simulator server's batch time (`planner.simulator.serving.BatchSeconds`) from a one-block profile."""
    rows = max(rows, 2)
    d1, dn = profile["decode_1_s"], profile[f"decode_{rows}_s"]
    p_short, p_long = profile[f"prefill_{short}_s"], profile[f"prefill_{long}_s"]
    per_row = max(0.0, (dn - d1) / (rows - 1))
    per_token = max(0.0, (p_long - p_short) / (long - short)) if long > short else p_long / long
    fixed = max(0.0, p_short - per_token * short)

    def seconds(layers: int, prompt: float, decode: float, context: float) -> float:
        step = (d1 + per_row * (decode - 1)) if decode else 0.0
        if prompt:
            step += fixed + per_token * prompt
        return layers * step

    return seconds


def core_of(names: list[str], cores: list[int]) -> dict[str, int]:
    """The core node i of `names` runs on: `cores[i * len(cores) // 4]`, or `cores[i]` with 4 cores or more."""
    return {name: cores[i * len(cores) // NODES] if len(cores) < NODES else cores[i]
            for i, name in enumerate(names)}


def _core_steps(pair: list[str], ranges: dict[str, tuple[int, int]], cores: dict[str, int]):
    """A pipeline of nodes as simulator steps of per-core servers: consecutive nodes on one core merged."""
    from swarmnode.planner.simulator.routers import PipelineStep

    merged: list[list] = []
    for name in pair:
        layers = ranges[name][1] - ranges[name][0]
        if merged and merged[-1][0] == f"core{cores[name]}":
            merged[-1][1] += layers
        else:
            merged.append([f"core{cores[name]}", layers])
    return tuple(PipelineStep(server, layers) for server, layers in merged)


def _cluster(layout: str, run: dict, checkpoint, split: int, args):
    """The planner's cluster of one layout's nodes, from their records (as `coordinator.cluster_view` makes
    it: CPU nodes with their measured decode and prefill rates), links of the clients' measured RTT."""
    from swarmnode.coordinator.cluster_view import model_section
    from swarmnode.coordinator.service import model_info_from_checkpoint
    from swarmnode.planner.cluster.spec import cluster_from_dict

    model = model_info_from_checkpoint(checkpoint)
    records = run["records"]
    overhead = max(int(r.get("overhead_bytes", 0)) for r in records.values())
    nodes = []
    for name, r in records.items():
        blocks = max(int(r.get("max_blocks", 0)), split, checkpoint.num_blocks - split)
        node = {"id": name, "region": "swarm", "device": "cpu", "cores": 1, "max_blocks": blocks,
                "memory_bytes": max(int(r.get("memory_bytes", 0)), overhead + 2 * blocks * model.block_bytes),
                "block_throughput": float(r["block_throughput"])}
        if r.get("prefill_throughput"):
            node["prefill_throughput"] = float(r["prefill_throughput"])
        nodes.append(node)
    mix = [(q["prompt"], len(q["tokens"])) for q in run["requests"]] or [(args.decode_prompt, args.decode_tokens)]
    return cluster_from_dict({
        "name": f"bench-disaggregation-{layout}", "source": "this machine's nodes",
        "model": model_section(model), "overhead_bytes": overhead, "nodes": nodes,
        "network": {"intra_region": {"bandwidth_mbps": 1000.0, "latency_ms": run["rtt_s"] * 1e3 / 2},
                    "coordinator_region": "swarm"},
        "workload": {"avg_input_tokens": statistics.mean(m[0] for m in mix),
                     "avg_output_tokens": max(1.0, statistics.mean(m[1] for m in mix))}})


def _closed_loop_class():
    """The simulator's event loop (`planner.simulator.engine._Simulation`, which `simulate()` runs) with every
    token's time recorded and closed-loop steady streams: a stream's next request arrives when its previous
    one ends, until `until`, its (kind, key) added to `kinds`."""
    from swarmnode.planner.simulator import engine as sim
    from swarmnode.planner.simulator.trace import Request

    class ClosedLoop(sim._Simulation):
        def __init__(self, model, trace, config, *, kinds, until, steady):
            self.token_times: dict[int, list[float]] = defaultdict(list)
            self.kinds, self.until, self.steady = kinds, until, steady  # kinds: shared with the router
            self.next_rid = len(trace)
            super().__init__(model, trace, config)

        def on_tokens(self, now, items):
            for q, *_ in items:
                self.token_times[q.r.rid].append(now)
            super().on_tokens(now, items)

        def finish(self, now, q):
            super().finish(now, q)
            kind, key = self.kinds[q.r.rid]
            if kind == "steady" and now < self.until:
                r = Request(self.next_rid, now, *self.steady)
                self.next_rid += 1
                self.kinds[r.rid] = (kind, key)
                fresh = sim._Req(r, self.slo_of(r))
                self.requests.append(fresh)
                self.on_arrival(now, fresh)

    return ClosedLoop


class FixedRouter:
    """A simulator router (`route(request, free)`) that gives every request the route the benchmark's
    clients give it: `assign(kind, key)` of its `kinds[rid]`, whatever the servers' free KV cache."""

    def __init__(self, kinds: dict, assign):
        self.kinds, self.assign = kinds, assign

    def route(self, request, free):
        return self.assign(*self.kinds[request.rid])


def simulate_layouts(args, checkpoint, split: int, runs: dict, profile: dict, cores: list[int]) -> dict:
    """The simulator's figures for both layouts under both node models, and their ratios."""
    from swarmnode.planner.simulator.metrics import SimConfig
    from swarmnode.planner.simulator.routers import PipelineStep, Route
    from swarmnode.planner.simulator.serving import Server, ServingModel, serving_from_placement
    from swarmnode.planner.simulator.trace import Request

    n = checkpoint.num_blocks
    longs = math.ceil(args.duration / args.long_every)
    trace = [Request(k, 0.0, args.decode_prompt, args.decode_tokens) for k in range(args.streams)]
    trace += [Request(args.streams + i, args.warmup + i * args.long_every, args.long_prompt, args.long_tokens)
              for i in range(longs)]
    window = (args.warmup, args.warmup + args.duration)
    config = SimConfig(warmup=window[0], window_end=window[1], drain=300.0, max_batch=64)
    seconds = _profile_seconds(profile, args.streams, args.decode_prompt, args.long_prompt)
    closed_loop = _closed_loop_class()
    out: dict = {"profile_s_per_block": {k: round(v, 6) for k, v in profile.items()},
                 "records": {name: {k: r.get(k) for k in ("block_throughput", "prefill_throughput")}
                             for run in runs.values() for name, r in run["records"].items()}}
    for variant in ("cost_model", "profiled"):
        results: dict = {}
        for layout in ("colocated", "disaggregated"):
            run = runs[layout]
            names = list(run["records"])  # A1 A2 B1 B2, or P1 P2 D1 D2
            ranges = dict(zip(names, [(0, split), (split, n), (0, split), (split, n)]))
            cluster = _cluster(layout, run, checkpoint, split, args)
            if variant == "cost_model":
                servers = serving_from_placement(cluster, ranges).servers
                first = (PipelineStep(names[0], split), PipelineStep(names[1], n - split))
                second = (PipelineStep(names[2], split), PipelineStep(names[3], n - split))
            else:  # one server per core: the nodes pinned to a core run one batch at a time
                cores_of = core_of(names, cores)
                first, second = _core_steps(names[:2], ranges, cores_of), _core_steps(names[2:], ranges, cores_of)
                depth: dict[str, int] = {}
                for step in first + second:
                    depth[step.server] = max(depth.get(step.server, 0), step.layers)
                host = {f"core{cores_of[m]}": m for m in reversed(names)}  # the core's first node
                servers = {s: Server(s, seconds, 1e15, host[s], depth=d) for s, d in depth.items()}
            segments = tuple((a.server, b.server, min(a.layers, b.layers)) for a, b in zip(first, second))
            if layout == "colocated":
                routes = [Route(prefill=pipe, decode=pipe) for pipe in (first, second)]
            else:
                routes = [Route(prefill=first, decode=second, kv_segments=segments)] * 2
            kinds = {r.rid: ("steady", r.rid) if r.rid < args.streams else ("long", r.rid - args.streams)
                     for r in trace}
            router = FixedRouter(kinds, lambda kind, key, routes=routes: routes[key % 2])
            loop = closed_loop(ServingModel(cluster, servers, router, layout),
                               sorted(trace, key=lambda r: r.arrival), config, kinds=kinds, until=window[1],
                               steady=(args.decode_prompt, args.decode_tokens))
            loop.run()
            simulated = [{"kind": kinds[q.r.rid][0], "start": q.r.arrival, "times": loop.token_times[q.r.rid]}
                         for q in loop.requests]
            results[layout] = figures(simulated, window)
        results["itl_p95_ratio"] = _ratio(results["disaggregated"]["itl_p95_s"], results["colocated"]["itl_p95_s"])
        results["tok_s_ratio"] = _ratio(results["disaggregated"]["tok_s"], results["colocated"]["tok_s"])
        out[variant] = results
    return out


# --- the run ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the test model, SmolLM2-135M)")
    parser.add_argument("--streams", type=int, default=4, help="steady decode streams")
    parser.add_argument("--decode-prompt", type=int, default=64, help="prompt tokens of a steady request")
    parser.add_argument("--decode-tokens", type=int, default=128, help="new tokens of a steady request")
    parser.add_argument("--long-prompt", type=int, default=1024, help="prompt tokens of a long request")
    parser.add_argument("--long-tokens", type=int, default=16, help="new tokens of a long request")
    parser.add_argument("--long-every", type=float, default=20.0, help="seconds between long prompts")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds measured per layout")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of steady streams before the window")
    args = parser.parse_args()
    if args.streams < 1 or args.decode_prompt < 1 or args.decode_tokens < 2 or args.long_prompt < 1 \
            or args.long_tokens < 1 or args.long_every <= 0 or args.duration <= 0 or args.warmup < 0:
        parser.error("--streams, --decode-prompt, --long-prompt, --long-tokens >= 1, --decode-tokens >= 2, "
                     "--long-every and --duration > 0, --warmup >= 0")

    from swarmnode.model_prep import prepare_smollm2
    from swarmnode.runtime.checkpoint import Checkpoint

    began = time.monotonic()
    model_dir = Path(args.model) if args.model else prepare_smollm2()
    checkpoint = Checkpoint(model_dir)
    longest = max(args.decode_prompt + args.decode_tokens, args.long_prompt + args.long_tokens)
    max_positions = int(getattr(checkpoint.config, "max_position_embeddings", 8192))
    if longest > max_positions:
        parser.error(f"a request of {longest} tokens is longer than the model's {max_positions} positions")
    split = checkpoint.num_blocks // 2
    cores = sorted(os.sched_getaffinity(0))
    # every stream and long prompt its own window of the same text (stream k from token 11 k, long prompt i
    # from token 11 i): the same prompts in both layouts, so their tokens can be compared
    text = make_prompt(str(model_dir), max(args.decode_prompt, args.long_prompt) + 11 * (args.streams + 8))[0]
    steady_prompts = [text[11 * k:11 * k + args.decode_prompt] for k in range(args.streams)]
    long_prompts = [text[11 * i:11 * i + args.long_prompt] for i in range(8)]

    context = args.decode_prompt + args.decode_tokens // 2
    log(f"profiling one block on core {cores[0]} (decode 1 and {max(args.streams, 2)} sequences, prefill "
        f"{args.decode_prompt} and {args.long_prompt} tokens)")
    profile = profile_block(checkpoint, cores[0], args.streams, args.decode_prompt, args.long_prompt, context)
    log(f"profile, seconds per block: {json.dumps({k: round(v, 5) for k, v in profile.items()})}")

    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-disaggregation-{os.getpid()}"
    runs = {layout: run_layout(layout, args, model_dir, checkpoint, cores, split, (steady_prompts, long_prompts),
                               log_dir)
            for layout in ("colocated", "disaggregated")}
    log("simulating both layouts")
    simulated = simulate_layouts(args, checkpoint, split, runs, profile, cores)

    by_prompt: dict[tuple[str, int], set[tuple[int, ...]]] = defaultdict(set)
    compared = defaultdict(set)
    for layout, run in runs.items():
        for r in run["requests"]:
            if r["complete"]:
                by_prompt[(r["kind"], r["key"])].add(tuple(r["tokens"]))
                compared[(r["kind"], r["key"])].add(layout)
    both = [key for key, layouts in compared.items() if len(layouts) == 2]
    exact = bool(both) and all(len(by_prompt[key]) == 1 for key in both)
    colocated, disaggregated = runs["colocated"]["figures"], runs["disaggregated"]["figures"]
    itl_ratio = _ratio(disaggregated["itl_p95_s"], colocated["itl_p95_s"])
    tok_ratio = _ratio(disaggregated["tok_s"], colocated["tok_s"])
    print(json.dumps({
        "bench": "disaggregation", "model": checkpoint.name, "nodes": NODES, "cores": len(cores),
        "pinning": core_of(["A1/P1", "A2/P2", "B1/D1", "B2/D2"], cores),
        "workload": {"streams": args.streams, "decode_prompt": args.decode_prompt,
                     "decode_tokens": args.decode_tokens, "long_prompt": args.long_prompt,
                     "long_tokens": args.long_tokens, "long_every_s": args.long_every,
                     "duration_s": args.duration, "warmup_s": args.warmup, "split_at_block": split},
        "colocated": colocated, "disaggregated": disaggregated,
        "itl_p95_ratio": itl_ratio, "tok_s_ratio": tok_ratio,
        "itl_p99_ratio": _ratio(disaggregated["itl_p99_s"], colocated["itl_p99_s"]),
        "aims": {"itl_p95_ratio_max": AIM_ITL_P95_RATIO, "tok_s_ratio_min": AIM_TOK_S_RATIO,
                 "met": itl_ratio is not None and tok_ratio is not None and itl_ratio <= AIM_ITL_P95_RATIO
                 and tok_ratio >= AIM_TOK_S_RATIO},
        "simulator": simulated,
        "exact": exact, "exact_prompts_compared": len(both),
        "wall_s": round(time.monotonic() - began, 1),
    }), flush=True)


if __name__ == "__main__":
    main()
