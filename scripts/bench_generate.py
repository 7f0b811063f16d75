"""Swarm vs local generation, side by side in one run: speed, node memory and the machine's ceiling.

Prints progress on stderr and one JSON line last on stdout.

What runs, in this order:

1. The machine's copy bandwidth: a 1 GiB tensor copied a few times with the benchmark's threads; the best
   copy's bytes read per second (measured again at the end of the run, and the better of the two kept, so
   that a moment of load from elsewhere does not lower the ceiling). Decode on CPU is memory-bound: each
   new token reads every weight once, so `ceiling_tps = copy bandwidth / weight_bytes_per_token` (all
   blocks' weights in the served dtype and quantization plus the client's LM head) is about the fastest any
   implementation could decode here, and both sides are reported as a fraction of it. A mixture of experts
   reads only the experts a token is routed to: its bytes per token count each block's attention, router,
   shared experts and norms whole and `num_experts_per_tok` of its routed experts (`active_block_bytes`),
   which is what a CPU cluster serving an MoE model gains, and the ceiling is computed on those bytes.
2. Local: `transformers` on the same checkpoint in this process, in `--dtype`; with `--quantize`, every
   decoder layer's linears are quantized with the nodes' own `quantize_block`, so the swarm's output must
   equal the local output token for token (`exact`). `--no-local` skips it (when it cannot fit beside the nodes).
3. Swarm: a bootstrap and `--nodes` nodes on 127.0.0.1, each serving a contiguous, even share of the blocks
   (`--blocks A:B`, default 3 nodes: 0:10, 10:20, 20:30 for SmolLM2), one client in this process, then
   `--clients` concurrent clients (0 skips them). Local and swarm runs alternate, `--repeats` times each, and
   the best of each side is kept, so a burst of load from elsewhere hits both alike.

Each generation takes a prompt of exactly `--prompt-tokens` token ids (repeated public-domain text through the
model's tokenizer, or random ids when it has none) and greedily decodes `--new-tokens`. Time to first token
comes from a streamer; decode speed counts the tokens after the first over the time after the first.

Threads: local `transformers` uses every core this process may run on (torch's default, `--threads`), and
so do the client and each node (`join --num-threads` with the same count). With one client the swarm is a
pipeline that runs one node at a time, so each node has the machine to itself while it computes, as local
has: the same cores do the same work, and the difference is the swarm's own cost (hops, serialization, the
client's loop). Idle threads sleep (`OMP_WAIT_POLICY=PASSIVE`) instead of spinning on the cores another
stage needs. Concurrent clients make the nodes compete for the cores, which is part of what that figure shows.

MoE models at a real size (`make_random_checkpoint.py --shape gpt-oss-20b`, 42 GB in bfloat16) do not fit
this machine in bfloat16 or beside a local copy: serve them quantized with `--no-local`, e.g.
`--model /work/models/gpt-oss-20b --dtype bfloat16 --quantize int4 --nodes 3 --no-local --clients 0`.

Memory: the proportional set size of each node's process tree (the node, its DHT process, `p2pd`) is
sampled every 0.15 s from launch to the end of the run, and its peak compared with the node's offer
(`--leftover-mem`). The default offer is what the node should need: its range's weights in the served
dtype and quantization, KV cache for the run's sessions (prompt plus new tokens, once per concurrent
client), a step's workspace for the prompt, and `PROCESS_ALLOWANCE` for the node's processes before any
block (interpreter, torch, hivemind, DHT process, `p2pd`: nodes measure theirs and log it). Each node's
record gives its weights and measured overhead beside the peak. The local model is copied out of the
checkpoint's memory-mapped files, so that no page is shared with a node (PSS would split such pages between
the two processes and understate the node). Nodes copy their weights out of the files as they load them,
so `start_to_serving_s` includes reading them.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from swarmnode.records import DTYPE_NAMES, QUANTIZATION_NAMES

# Memory of a node's processes before any block (measured by nodes at start, after a probe step through one
# block: about 600-650 MiB here).
PROCESS_ALLOWANCE = 768 * 2**20
SAMPLE_PERIOD = 0.15  # seconds between two readings of the nodes' memory
COPY_BYTES = 2**30
COPY_REPEATS = 5
# Opening of Charles Dickens, "A Tale of Two Cities" (1859), public domain: repeated into long prompts.
PROMPT_TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it "
    "was the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything "
    "before us, we had nothing before us, we were all going direct to Heaven, we were all going direct the "
    "other way - in short, the period was so far like the present period, that some of its noisiest "
    "authorities insisted on its being received, for good or for evil, in the superlative degree of "
    "comparison only. There were a king with a large jaw and a queen with a plain face, on the throne of "
    "England; there were a king with a large jaw and a queen with a fair face, on the throne of France. In "
    "both countries it was clearer than crystal to the lords of the State preserves of loaves and fishes, "
    "that things in general were settled for ever. "
)


def timed_generate(model, input_ids, new_tokens: int) -> dict:
    from swarmnode.testing.token_clock import TokenClock

    clock = TokenClock()
    began = time.perf_counter()
    out = model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         streamer=clock)
    ended = time.perf_counter()
    first = clock.times[1]  # times[0] is the prompt
    generated = out.shape[1] - input_ids.shape[1]
    return {"ttft": first - began, "decode_tps": (generated - 1) / (ended - first), "total_s": ended - began,
            "tokens": generated, "output": out}


def log(message: str) -> None:
    print(f"[bench_generate {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def copy_bandwidth(threads: int) -> float:
    """Bytes read per second by the best of `COPY_REPEATS` copies of a `COPY_BYTES` tensor on `threads`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(COPY_BYTES // 4, dtype=torch.float32)
        dst = torch.zeros_like(src)  # both written once, so no page fault is timed
        dst.copy_(src)
        best = float("inf")
        for _ in range(COPY_REPEATS):
            began = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - began)
        del src, dst
        return COPY_BYTES / best
    finally:
        torch.set_num_threads(previous)


def make_prompt(model: str, tokens: int, vocab_size: int) -> torch.Tensor:
    """`[1, tokens]` token ids: `PROMPT_TEXT` repeated through the model's tokenizer, or random ids in the
    vocabulary (fixed seed) when the model has no tokenizer."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as exc:
        log(f"no tokenizer ({exc.__class__.__name__}): random prompt ids")
        return torch.randint(0, vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    ids = tokenizer(PROMPT_TEXT, add_special_tokens=False)["input_ids"]
    repeated = ids * (tokens // len(ids) + 1)
    return torch.tensor([repeated[:tokens]], dtype=torch.long)


def split_blocks(num_blocks: int, nodes: int) -> list[tuple[int, int]]:
    """`nodes` contiguous ranges covering blocks 0..num_blocks, as even as whole blocks allow."""
    if not 1 <= nodes <= num_blocks:
        raise SystemExit(f"--nodes must be between 1 and the model's {num_blocks} blocks, not {nodes}")
    bounds = [round(i * num_blocks / nodes) for i in range(nodes + 1)]
    return list(itertools.pairwise(bounds))


class PssSampler:
    """Reads the PSS of each added process tree every `SAMPLE_PERIOD` s on a thread, until stopped."""

    def __init__(self):
        self.samples: dict[int, list[tuple[float, int]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pss-sampler", daemon=True)

    def add(self, pid: int) -> None:
        from swarmnode.runtime.footprint import tree_pss

        with self._lock:
            self.samples[pid] = [(time.perf_counter(), tree_pss(pid))]
        if not self._thread.is_alive():
            self._thread.start()

    def _run(self) -> None:
        from swarmnode.runtime.footprint import tree_pss

        while not self._stop.wait(SAMPLE_PERIOD):
            with self._lock:
                pids = list(self.samples)
            for pid in pids:
                value = tree_pss(pid)
                if value:
                    self.samples[pid].append((time.perf_counter(), value))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def peak(self, pid: int, since: float = 0.0, until: float = float("inf")) -> int:
        return max((v for t, v in self.samples.get(pid, []) if since <= t <= until), default=0)


def node_bound(checkpoint, start: int, end: int, dtype: torch.dtype, quantize: str, session_tokens: int,
               sessions: int, prompt_tokens: int) -> int:
    """What a node serving blocks [start, end) should need: weights, KV cache for `sessions` sessions of
    `session_tokens`, the larger of a step's workspace for the prompt and what loading holds beside the range
    (`memory_plan.loading_bytes`), and `PROCESS_ALLOWANCE` (rounded up to a MiB)."""
    from swarmnode.server.memory_plan import block_bytes, loading_bytes, workspace_bytes

    family = checkpoint.family
    weights = sum(block_bytes(family, i, dtype, quantize) for i in range(start, end))
    kv = family.kv_bytes_per_token(dtype) * (end - start) * session_tokens * sessions
    loading = loading_bytes(checkpoint, dtype)
    need = weights + kv + max(workspace_bytes(checkpoint.config, dtype, prompt_tokens), loading) + PROCESS_ALLOWANCE
    return -(-need // 2**20) * 2**20


def active_block_bytes(family, index: int, dtype: torch.dtype, quantize: str) -> int:
    """Bytes of block `index` one token reads: the whole block, less the routed experts it is not sent to (a
    block of a mixture of experts reads `num_experts_per_tok` of its experts' matrices and biases)."""
    from swarmnode.runtime.quantize import block_bytes, expert_weights

    layer = family.new_layer(index)
    whole = block_bytes(layer, quantize, dtype)
    top_k = int(getattr(family.config, "num_experts_per_tok", 0) or 0)
    unread = 0
    for module in layer.modules():
        weights = expert_weights(module)
        if not weights or not top_k:
            continue
        experts = next(iter(weights.values())).shape[0]
        holder = torch.nn.Module()
        for name, tensor in module.named_parameters(recurse=False):  # the fused weights and their biases
            holder.register_parameter(name, tensor)
        holder.has_gate, holder.is_transposed = module.has_gate, module.is_transposed
        unread += block_bytes(holder, quantize, dtype) * (experts - min(top_k, experts)) // experts
    return whole - unread


def load_local(model: str, dtype: torch.dtype, quantize: str):
    from transformers import AutoModelForCausalLM

    from swarmnode.runtime.quantize import quantize_block

    local = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
    # Tensors loaded in the checkpoint's own dtype are views of its memory-mapped safetensors files, the same
    # page-cache pages the nodes map for their blocks: PSS would split those pages between this process and
    # the nodes, and the nodes would look smaller than they are. Private copies keep the nodes' figures whole.
    with torch.no_grad():
        for tensor in itertools.chain(local.parameters(), local.buffers()):
            tensor.data = tensor.data.clone()
    gc.collect()
    if quantize != "none":
        for layer in local.model.layers:
            quantize_block(layer, quantize, dtype)
        gc.collect()
    return local


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", metavar="DIR|ORG/NAME", default=None,
                        help="checkpoint (default: the prepared SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    parser.add_argument("--quantize", choices=QUANTIZATION_NAMES, default="none")
    parser.add_argument("--nodes", type=int, default=3, help="nodes, each serving an even contiguous range")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients after the single-client runs "
                                                               "(0: skip)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--leftover-mem", metavar="SIZE", default=None,
                        help="offer of each node (default: its weights + KV cache of the run + overhead)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="torch threads of local, the client and each node (default: this process's cores)")
    parser.add_argument("--no-local", action="store_true", help="skip the local model (report null ratios)")
    parser.add_argument("--serving-timeout", type=float, default=600.0)
    args = parser.parse_args()
    if args.prompt_tokens < 1 or args.new_tokens < 2 or args.clients < 0 or args.repeats < 1:
        parser.error("--prompt-tokens >= 1, --new-tokens >= 2, --clients >= 0 and --repeats >= 1")

    from swarmnode.client import DistributedModelForCausalLM
    from swarmnode.model_prep import prepare_smollm2
    from swarmnode.runtime.checkpoint import Checkpoint
    from swarmnode.runtime.dtypes import DTYPES
    from swarmnode.runtime.footprint import tree_pss
    from swarmnode.server.memory_plan import block_bytes
    from swarmnode.sizes import format_size, parse_size
    from swarmnode.testing.local_swarm import LocalSwarm

    torch.set_num_threads(args.threads)
    model = str(args.model or prepare_smollm2())
    dtype = DTYPES[args.dtype]
    checkpoint = Checkpoint(model)
    config = checkpoint.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    ranges = split_blocks(checkpoint.num_blocks, args.nodes)
    session_tokens = args.prompt_tokens + args.new_tokens

    family = checkpoint.family
    blocks_bytes = sum(block_bytes(family, i, dtype, args.quantize) for i in range(checkpoint.num_blocks))
    read_bytes = sum(active_block_bytes(family, i, dtype, args.quantize) for i in range(checkpoint.num_blocks))
    head_bytes = int(text_config.vocab_size) * int(text_config.hidden_size) * dtype.itemsize
    weight_bytes_per_token = read_bytes + head_bytes
    log(f"{family.name}: {checkpoint.num_blocks} blocks, {format_size(blocks_bytes)} of weights in {args.dtype}"
        f"{'' if args.quantize == 'none' else ' + ' + args.quantize}, {format_size(read_bytes)} of them read per "
        f"token, plus the head's {format_size(head_bytes)}")

    log(f"copy bandwidth: {COPY_REPEATS} copies of {format_size(COPY_BYTES)} on {args.threads} threads")
    bandwidth = copy_bandwidth(args.threads)
    log(f"copy bandwidth {bandwidth / 1e9:.2f} GB/s read; {format_size(weight_bytes_per_token)} read per token "
        f"({args.dtype}, quantization {args.quantize}): ceiling {bandwidth / weight_bytes_per_token:.1f} tok/s")

    input_ids = make_prompt(model, args.prompt_tokens, int(text_config.vocab_size))
    local = None
    local_runs: list[dict] = []
    if not args.no_local:
        log(f"loading local {model} in {args.dtype} (quantization {args.quantize})")
        local = load_local(model, dtype, args.quantize)
        timed_generate(local, input_ids, 4)  # warm-up

    if args.leftover_mem is not None:
        bounds = [parse_size(args.leftover_mem)] * len(ranges)
    else:
        bounds = [node_bound(checkpoint, a, b, dtype, args.quantize, session_tokens, max(1, args.clients),
                             args.prompt_tokens) for a, b in ranges]

    sampler = PssSampler()
    swarm = LocalSwarm(model, node_threads=args.threads)
    log(f"swarm logs in {swarm.log_dir}")
    nodes = []
    try:
        with swarm:
            swarm.start_bootstrap()
            launched = {}
            for (a, b), bound in zip(ranges, bounds, strict=True):
                node = swarm.launch_node(a, b, extra=["--dtype", args.dtype, "--quantize", args.quantize,
                                                      "--leftover-mem", str(bound)])
                launched[node.pid] = time.perf_counter()
                sampler.add(node.pid)
                nodes.append(node)
                log(f"launched {node.name} (pid {node.pid}) on blocks {a}:{b}, offer {format_size(bound)}")
            serving_at: dict[int, float] = {}
            failures: list[BaseException] = []
            swarm.reader  # noqa: B018 - start the shared reader before threads wait through it

            def wait(node) -> None:
                try:
                    swarm.wait_serving(node, args.serving_timeout)
                    serving_at[node.pid] = time.perf_counter()
                except BaseException as exc:  # reported by the main thread
                    failures.append(exc)

            waiters = [threading.Thread(target=wait, args=(node,)) for node in nodes]
            for t in waiters:
                t.start()
            for t in waiters:
                t.join()
            if failures:
                raise failures[0]
            for node in nodes:
                log(f"{node.name} serving after {serving_at[node.pid] - launched[node.pid]:.1f} s, "
                    f"PSS {format_size(tree_pss(node.pid))}")
            status = swarm.wait_status(lambda s: all(n.peer_id in s["nodes"] and s["nodes"][n.peer_id]["serving"]
                                                     for n in nodes))
            records = {n.pid: status["nodes"][n.peer_id] for n in nodes}

            with DistributedModelForCausalLM.from_pretrained(model, initial_peers=swarm.initial_peers,
                                                             dtype=dtype) as remote:
                timed_generate(remote, input_ids, 4)  # warm-up: routes, RTTs, connections
                swarm_runs = []
                for i in range(args.repeats):
                    if local is not None:
                        local_runs.append(timed_generate(local, input_ids, args.new_tokens))
                        log(f"local run {i + 1}: ttft {local_runs[-1]['ttft']:.3f} s, "
                            f"decode {local_runs[-1]['decode_tps']:.2f} tok/s")
                    swarm_runs.append(timed_generate(remote, input_ids, args.new_tokens))
                    log(f"swarm run {i + 1}: ttft {swarm_runs[-1]['ttft']:.3f} s, "
                        f"decode {swarm_runs[-1]['decode_tps']:.2f} tok/s")

                results = [None] * args.clients
                wall = 0.0
                if args.clients:
                    def client(i: int) -> None:
                        results[i] = timed_generate(remote, input_ids, args.new_tokens)

                    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
                    began = time.perf_counter()
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    wall = time.perf_counter() - began
                    if any(r is None for r in results):
                        raise RuntimeError("a concurrent client failed (its traceback is above)")
            ended = time.perf_counter()
            sampler.stop()
    except BaseException:
        sampler.stop()
        for node in nodes:
            print(f"--- {node.name} ({node.log_path}) log tail ---\n{node.log_tail()}", file=sys.stderr)
        raise

    del local
    gc.collect()
    bandwidth_end = copy_bandwidth(args.threads)
    log(f"copy bandwidth {bandwidth_end / 1e9:.2f} GB/s read at the end, {bandwidth / 1e9:.2f} GB/s at the start")
    bandwidth_start, bandwidth = bandwidth, max(bandwidth, bandwidth_end)
    ceiling_tps = bandwidth / weight_bytes_per_token

    reference = local_runs[0]["output"] if local_runs else None
    exact = None
    if reference is not None:
        exact = all(torch.equal(r["output"], reference) for r in [*swarm_runs, *results[:args.clients]])

    node_reports = []
    for node, (a, b), bound in zip(nodes, ranges, bounds, strict=True):
        record = records[node.pid]
        peak = sampler.peak(node.pid)
        node_reports.append({
            "blocks": [a, b],
            "peak_pss_bytes": peak,
            "peak_pss_loading_bytes": sampler.peak(node.pid, until=serving_at[node.pid]),
            "peak_pss_serving_bytes": sampler.peak(node.pid, since=serving_at[node.pid], until=ended),
            "bound_bytes": bound,
            "within_bound": peak <= bound,
            "start_to_serving_s": round(serving_at[node.pid] - launched[node.pid], 2),
            "weights_bytes": record["block_bytes"] * (b - a),
            "overhead_bytes": record["overhead_bytes"],
            "cache_tokens": record["cache_tokens"],
            "pss_samples": len(sampler.samples[node.pid]),
        })

    swarm_tps = max(r["decode_tps"] for r in swarm_runs)
    local_tps = max(r["decode_tps"] for r in local_runs) if local_runs else None
    report = {
        "benchmark": "generate",
        "model": model,
        "family": family.name,
        "weights_bytes": blocks_bytes + head_bytes,
        "dtype": args.dtype,
        "quantize": args.quantize,
        "num_nodes": len(ranges),
        "threads": args.threads,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "local_decode_tps": None if local_tps is None else round(local_tps, 2),
        "swarm_decode_tps": round(swarm_tps, 2),
        "decode_ratio": None if local_tps is None else round(swarm_tps / local_tps, 3),
        "local_ttft_s": round(min(r["ttft"] for r in local_runs), 3) if local_runs else None,
        "swarm_ttft_s": round(min(r["ttft"] for r in swarm_runs), 3),
        "exact": exact,
        "copy_bandwidth_gbps": round(bandwidth / 1e9, 2),
        "copy_bandwidth_start_end_gbps": [round(bandwidth_start / 1e9, 2), round(bandwidth_end / 1e9, 2)],
        "weight_bytes_per_token": weight_bytes_per_token,
        "ceiling_tps": round(ceiling_tps, 2),
        "swarm_fraction_of_ceiling": round(swarm_tps / ceiling_tps, 3),
        "local_fraction_of_ceiling": None if local_tps is None else round(local_tps / ceiling_tps, 3),
        "nodes": node_reports,
    }
    if args.clients:
        single_total = min(r["total_s"] for r in swarm_runs)
        aggregate = sum(r["tokens"] for r in results) / wall
        report.update({
            "swarm_1_client_tps": round(args.new_tokens / single_total, 2),
            f"swarm_{args.clients}_clients_aggregate_tps": round(aggregate, 2),
            "concurrency_gain": round(aggregate / (args.new_tokens / single_total), 3),
        })
    report["log_dir"] = str(swarm.log_dir)
    local_text = "no local" if local_tps is None else f"local decode {local_tps:.2f} tok/s"
    log(f"{local_text} | swarm decode {swarm_tps:.2f} tok/s (ratio {report['decode_ratio']}) | ceiling "
        f"{ceiling_tps:.2f} tok/s | exact {exact} | within bounds "
        f"{[n['within_bound'] for n in node_reports]}")
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
