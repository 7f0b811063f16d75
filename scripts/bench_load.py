"""Load: 16 concurrent clients generate through a 3-node swarm; every output is checked against local
`transformers`, and the nodes must come out of it alive with their KV cache all given back. Prints a table
and one JSON line last.

A bootstrap, a coordinator and three planned nodes (`--leftover-mem` offers, no `--blocks`; or `--fixed`
ranges 0:10, 10:20, 20:30 without a coordinator) run as real processes on 127.0.0.1. Each phase starts a
fresh swarm and measures, side by side in the same swarm:

- one client alone (`--single-runs` requests one after another), then `--clients` concurrent clients, each
  generating `--new-tokens` greedy tokens for its own chat prompt; threads sharing one
  `DistributedModelForCausalLM` (sessions are thread-local), or `--client-processes P` processes with their
  own client each, to take the client's GIL and event loop out of the measurement;
- aggregate tokens/s (all generated tokens over the wall time of the concurrent run) and its ratio to the
  single client's tokens/s; time per token p50/p95 (gaps between streamed tokens, over all clients); time
  to first token p50/p95;
- requests, completed, failed (with their messages; a session the swarm refused for lack of cache is one),
  waited (sessions that waited for some peer with room for their cache), retries, cache refusals the nodes
  logged, and afterwards: every node process alive and its `free_cache_tokens` (the `info` RPC) back to
  what it was before the load.

Phases (`--phases`): `roomy` (the cache each node derives from its offer: all sessions fit at once) and
`tight` (every node started with `--cache-tokens` for only `--tight-sessions` sessions, so the others must
wait or be refused; the JSON says which happened).

    .venv/bin/python scripts/bench_load.py [--clients 16] [--new-tokens 32] [--phases roomy,tight]
        [--fixed] [--client-processes 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict

from swarmnode.naming import short_id

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from swarmnode.testing.workload import TimedRequest, timed_request

OFFERS = ("850M", "900M", "950M")
FIXED_RANGES = ((0, 10), (10, 20), (20, 30))
_CACHE_REFUSAL_RE = re.compile(r"refused inference from \S+: session needs", re.MULTILINE)


class SessionEvents(logging.Handler):
    """Which sessions waited for a route, and what the client warned about (bans, refusals), from the
    client's own log records.

    A session's steps run as tasks on the client's event loop; a record logged from inside one belongs to
    the `InferenceSession` whose `_step` coroutine that task runs, found from the task's coroutine frame."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.waited: set[int] = set()  # id() of sessions that logged a wait for peers
        self.waits = 0
        self.warnings: Counter[str] = Counter()
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        with self._lock:
            if record.levelno >= logging.WARNING:
                self.warnings[re.sub(r"\b[0-9A-Za-z]{6,8}\b(?=[\[:( ])", "PEER", message)[:200]] += 1
            if "waiting" in message and record.name.endswith("session"):
                self.waits += 1
                session = _current_session()
                if session is not None:
                    self.waited.add(id(session))

    LOGGERS = ("swarmnode.client.session", "swarmnode.client.swarm")

    def __enter__(self) -> SessionEvents:
        self._levels = {}
        for name in self.LOGGERS:
            log = logging.getLogger(name)
            self._levels[name] = log.level
            log.addHandler(self)
            log.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        for name in self.LOGGERS:
            log = logging.getLogger(name)
            log.removeHandler(self)
            log.setLevel(self._levels[name])


def _current_session():
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return None
    frame = getattr(task.get_coro(), "cr_frame", None) if task is not None else None
    return frame.f_locals.get("self") if frame is not None else None


def concurrent_requests(remote, prompts: list, indices: list[int], new_tokens: int, *,
                        session_length: int | None = None) -> list[TimedRequest]:
    """One thread per request (prompt index), all started together, sharing `remote` (sessions are
    thread-local)."""
    results: list[TimedRequest | None] = [None] * len(indices)

    def client(slot: int) -> None:
        results[slot] = timed_request(remote, indices[slot], prompts[indices[slot]], new_tokens,
                                      session_length=session_length)

    threads = [threading.Thread(target=client, args=(slot,), name=f"client-{i}") for slot, i in enumerate(indices)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def client_config(args, trusted):
    """The clients' settings: this swarm's coordinator key, and `--route-wait` when given."""
    from swarmnode.client import ClientConfig

    config = ClientConfig(trusted_coordinators=trusted)
    if args.route_wait is not None:
        config.route_wait = args.route_wait
    return config


def _client_process(args, model_dir, initial_peers, trusted, prompts, indices, ready, go, queue) -> None:
    """A client process: its own `DistributedModelForCausalLM`, one thread per request; results to `queue`.
    It leads its own process group (with its DHT process and `p2pd`), so the parent can stop all of it."""
    from swarmnode.client import DistributedModelForCausalLM

    os.setsid()
    try:
        with DistributedModelForCausalLM.from_pretrained(
                model_dir, initial_peers=initial_peers,
                config=client_config(args, trusted)) as remote, SessionEvents() as events:
            timed_request(remote, indices[0], prompts[indices[0]][:, :4], 1)  # routes, RTTs, connections
            ready.put(None)
            go.wait()
            requests = concurrent_requests(remote, prompts, indices, args.new_tokens)
            queue.put([{**asdict(r), "waited": r.session_key in events.waited or r.cache_waits > 0}
                       for r in requests])
    except BaseException as exc:
        message = f"client process {os.getpid()} failed: {type(exc).__name__}: {exc}"
        ready.put(message)
        queue.put(message)
        raise


def in_processes(args, swarm, model_dir, trusted, prompts, indices) -> tuple[list, list[bool], float]:
    """Split the requests over `args.client_processes` client processes, start them together once all are
    connected; (requests, whether each waited for a route, wall s)."""
    import multiprocessing
    import signal

    context = multiprocessing.get_context("spawn")
    ready, queue, go = context.Queue(), context.Queue(), context.Event()
    shares = [indices[i::args.client_processes] for i in range(args.client_processes)]
    workers = [context.Process(target=_client_process,
                               args=(args, model_dir, swarm.initial_peers, trusted, prompts, share, ready, go, queue))
               for share in shares]
    for worker in workers:
        worker.start()
    try:
        for _ in workers:
            failure = ready.get(timeout=300)
            if failure is not None:
                raise RuntimeError(failure)
        began = time.perf_counter()
        go.set()
        results = [queue.get(timeout=900) for _ in workers]
        wall = time.perf_counter() - began
    finally:
        for worker in workers:
            worker.join(30)
            try:
                os.killpg(worker.pid, signal.SIGKILL)  # whatever is left of its group: DHT process, p2pd
            except ProcessLookupError:
                pass
            worker.join(5)
    failures = [r for r in results if isinstance(r, str)]
    if failures:
        raise RuntimeError("; ".join(failures))
    requests = [r for share in results for r in share]
    waited = [r.pop("waited") for r in requests]
    return [TimedRequest(**r) for r in requests], waited, wall


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def summarize(requests: list[TimedRequest], wall: float, truths: list[list[int]], waited: list[bool]) -> dict:
    """Counts and timings of `requests` (`waited[i]`: request i waited for a route) run in `wall` s."""
    done = [r for r in requests if r.error is None]
    gaps = [g for r in done for g in r.gaps]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tokens = sum(r.tokens for r in done)
    return {
        "requests": len(requests),
        "completed": len(done),
        "failed": len(requests) - len(done),
        "mismatched": sum(1 for r in done if r.output != truths[r.prompt]),
        "exact": len(done) == len(requests) and all(r.output == truths[r.prompt] for r in done),
        "waited": sum(waited),
        "retries": sum(r.retries for r in requests),
        "cache_waits": sum(r.cache_waits for r in requests),
        "tokens": tokens,
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 2) if wall > 0 else None,
        "time_per_token_p50_ms": _ms(_percentile(gaps, 0.5)),
        "time_per_token_p95_ms": _ms(_percentile(gaps, 0.95)),
        "ttft_p50_ms": _ms(_percentile(ttfts, 0.5)),
        "ttft_p95_ms": _ms(_percentile(ttfts, 0.95)),
        "errors": sorted(Counter(r.error for r in requests if r.error).items()),
    }


def start_swarm(swarm, *, fixed: bool, cache_tokens: int | None, timeout: float = 300.0) -> list:
    """Bootstrap (+ coordinator) + 3 nodes, started side by side; the node processes once each serves."""
    extra = ["--cache-tokens", str(cache_tokens)] if cache_tokens else []
    swarm.start_bootstrap()
    if fixed:
        nodes = [swarm.launch_node(a, b, extra=extra) for a, b in FIXED_RANGES]
    else:
        nodes = [swarm.launch_node(leftover_mem=m, extra=extra) for m in OFFERS]
        # one pipeline (Helix's objective, no redundancy floor): every session crosses every node, so the
        # nodes' caches and their sharing under load are what is measured, the same in both phases
        swarm.start_coordinator(extra=["--time-limit", "5", "--min-replicas", "1"])
    for node in nodes:
        swarm.wait_serving(node, timeout)
    return nodes


def wait_settled(swarm, remote, nodes: list, timeout: float = 300.0) -> None:
    """Until the placement assigns exactly `nodes` and each serves its assignment (read through `remote`)."""
    from swarmnode.testing.swarm_reader import client_status, settled

    swarm.wait_status(lambda s: settled(s, {n.peer_id for n in nodes}), timeout, read=lambda: client_status(remote))


def run_phase(name: str, args, model_dir, prompts, truths, cache_tokens: int | None) -> dict:
    """A fresh swarm; one client alone, then `args.clients` together; node health after."""
    from swarmnode.client import DistributedModelForCausalLM
    from swarmnode.testing.local_swarm import LocalSwarm, peak_open_sessions
    from swarmnode.testing.swarm_reader import client_status, node_info, wait_cache_free

    indices = list(range(args.clients))
    with LocalSwarm(model_dir) as swarm:
        began = time.monotonic()
        nodes = start_swarm(swarm, fixed=args.fixed, cache_tokens=cache_tokens)
        trusted = None if args.fixed else swarm.trusted_coordinators()
        with DistributedModelForCausalLM.from_pretrained(
                model_dir, initial_peers=swarm.initial_peers,
                config=client_config(args, trusted)) as remote, SessionEvents() as events:
            if not args.fixed:
                wait_settled(swarm, remote, nodes)
            startup = time.monotonic() - began
            print(f"  swarm serving in {startup:.0f} s (logs: {swarm.log_dir})", file=sys.stderr, flush=True)
            before = {n.peer_id: node_info(remote, n.peer_id) for n in nodes}
            timed_request(remote, 0, prompts[0][:, :4], 1)  # warm-up: routes, RTTs, connections
            single = [timed_request(remote, i, prompts[i], args.new_tokens) for i in range(args.single_runs)]
            single_summary = summarize(single, sum(r.ended - r.began for r in single), truths,
                                       [r.session_key in events.waited or r.cache_waits > 0 for r in single])
            events.waited.clear()
            events.waits, events.warnings = 0, Counter()
            client_cpu = None
            if args.client_processes > 1:
                load, waited, wall = in_processes(args, swarm, model_dir, trusted, prompts, indices)
            else:
                load_began, cpu = time.perf_counter(), time.process_time()
                load = concurrent_requests(remote, prompts, indices, args.new_tokens)
                wall = time.perf_counter() - load_began
                client_cpu = time.process_time() - cpu
                waited = [r.session_key in events.waited or r.cache_waits > 0 for r in load]
            summary = summarize(load, wall, truths, waited)
            expected = {peer: info["free_cache_tokens"] for peer, info in before.items()}
            free_after = wait_cache_free(remote, expected, timeout=20)
            placement = None
            if not args.fixed:
                status = client_status(remote)
                placement = {short_id(p): r for p, r in status["placement"]["assignments"].items()}
        cache_refusals = sum(len(_CACHE_REFUSAL_RE.findall(n.log())) for n in nodes)
        alive = {n.name: n.alive() for n in nodes}
        peaks = {short_id(n.peer_id): peak_open_sessions(n) for n in nodes}
    refused = [r for r in load if r.error and "cache" in r.error]
    summary.update({
        "phase": name,
        "startup_s": round(startup, 1),
        "cache_tokens_per_node": cache_tokens or {short_id(p): i["cache_tokens"] for p, i in before.items()},
        "session_tokens": max(p.shape[1] for p in prompts[: args.clients]) + args.new_tokens,
        "placement": placement,
        "single_client_tokens_per_s": single_summary["tokens_per_s"],
        "single_client_time_per_token_p50_ms": single_summary["time_per_token_p50_ms"],
        "single_client_exact": single_summary["exact"],
        "concurrency_ratio": round(summary["tokens_per_s"] / single_summary["tokens_per_s"], 3)
        if summary["tokens_per_s"] and single_summary["tokens_per_s"] else None,
        "refused": len(refused),
        "refusal_messages": sorted({r.error for r in refused}),
        "client_cpu_share": round(client_cpu / wall, 2) if client_cpu is not None else None,
        "route_wait_s": remote.swarm.config.route_wait,
        "waits_logged": events.waits if args.client_processes == 1 else None,
        "node_cache_refusals": cache_refusals,
        "client_warnings": events.warnings.most_common(6) if args.client_processes == 1 else None,
        "peak_sessions_per_node": peaks,
        "nodes_alive": all(alive.values()),
        "cache_restored": free_after == expected,
        "free_cache_before": {short_id(p): v for p, v in expected.items()},
        "free_cache_after": {short_id(p): v for p, v in free_after.items()},
    })
    outcome = []
    if summary["waited"]:
        served = summary["waited"] - sum(1 for r, w in zip(load, waited) if w and r.error)
        outcome.append(f"{summary['waited']} waited for cache ({served} then served)")
    if refused:
        outcome.append(f"{len(refused)} refused with an error naming the cache")
    if summary["failed"] > len(refused):
        outcome.append(f"{summary['failed'] - len(refused)} failed otherwise")
    summary["outcome"] = "; ".join(outcome) or "all sessions fit at once"
    return summary


def _row(cells, widths) -> str:
    return "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))


def print_table(phases: list[dict]) -> None:
    header = ("phase", "clients", "done", "failed", "mismatch", "waited", "refused", "retries", "agg tok/s",
              "1-client", "ratio", "tpt p50", "tpt p95", "ttft p50", "ttft p95", "alive", "cache ok")
    widths = [max(len(h), 7) for h in header]
    print(_row(header, widths), file=sys.stderr)
    for p in phases:
        print(_row((p["phase"], p["requests"], p["completed"], p["failed"], p["mismatched"], p["waited"],
                    p["refused"], p["retries"], p["tokens_per_s"], p["single_client_tokens_per_s"],
                    p["concurrency_ratio"], p["time_per_token_p50_ms"], p["time_per_token_p95_ms"],
                    p["ttft_p50_ms"], p["ttft_p95_ms"], p["nodes_alive"], p["cache_restored"]), widths),
              file=sys.stderr)
        for message in p["refusal_messages"]:
            print(f"  {p['phase']} refused: {message[:300]}", file=sys.stderr)
    print("(tpt: time per token, ms; ttft: time to first token, ms)", file=sys.stderr)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--single-runs", type=int, default=3, help="requests of the lone client")
    parser.add_argument("--phases", default="roomy,tight", help="comma-separated: roomy, tight")
    parser.add_argument("--tight-sessions", type=int, default=4,
                        help="sessions each node's cache holds at once in the tight phase")
    parser.add_argument("--fixed", action="store_true", help="fixed ranges 0:10, 10:20, 20:30, no coordinator")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="spread the concurrent clients over this many processes")
    parser.add_argument("--route-wait", type=float, default=None,
                        help="seconds a session waits for a peer with room (default: ClientConfig's)")
    args = parser.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not phases or set(phases) - {"roomy", "tight"}:
        parser.error(f"--phases takes roomy and/or tight, got {args.phases!r}")
    if not 1 <= args.clients <= 64:
        parser.error("--clients must be 1..64 on one machine")
    if not 1 <= args.client_processes <= args.clients:
        parser.error("--client-processes must be 1..--clients")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (time per token needs two tokens)")
    args.phases = phases
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from transformers import AutoTokenizer

    from swarmnode.model_prep import prepare_smollm2
    from swarmnode.testing.workload import chat_inputs, local_truths

    model_dir = prepare_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_inputs(tokenizer, max(args.clients, args.single_runs))
    truths = local_truths(model_dir, prompts, args.new_tokens)
    session_tokens = max(p.shape[1] for p in prompts[: args.clients]) + args.new_tokens

    results = []
    for phase in args.phases:
        cache_tokens = session_tokens * args.tight_sessions if phase == "tight" else None
        print(f"phase {phase}: 3 {'fixed' if args.fixed else 'planned'} nodes"
              f"{f', --cache-tokens {cache_tokens}' if cache_tokens else ''}; {args.clients} clients x "
              f"{args.new_tokens} tokens ...", file=sys.stderr, flush=True)
        results.append(run_phase(phase, args, model_dir, prompts, truths, cache_tokens))
    print_table(results)
    first = results[0]
    report = {
        "benchmark": "load",
        "nodes": 3,
        "placement": "fixed" if args.fixed else "planned",
        "clients": args.clients,
        "client_processes": args.client_processes,
        "new_tokens": args.new_tokens,
        "aggregate_tokens_per_s": first["tokens_per_s"],
        "single_client_tokens_per_s": first["single_client_tokens_per_s"],
        "concurrency_ratio": first["concurrency_ratio"],
        "time_per_token_p50_ms": first["time_per_token_p50_ms"],
        "time_per_token_p95_ms": first["time_per_token_p95_ms"],
        "ttft_p50_ms": first["ttft_p50_ms"],
        "ttft_p95_ms": first["ttft_p95_ms"],
        "phases": {p["phase"]: p for p in results},
    }
    print(json.dumps(report))
    # every phase: right text, live nodes, cache given back; roomy: nothing fails; tight: only clear refusals
    ok = all(p["nodes_alive"] and p["cache_restored"] and not p["mismatched"] for p in results)
    ok = ok and all(p["failed"] == (p["refused"] if p["phase"] == "tight" else 0) for p in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
