"""Churn soak: clients keep generating while nodes join, are killed with SIGKILL and restart; every request must
complete with exactly the text local `transformers` generates. Prints counts and one JSON line last; exits
non-zero when any request failed or differed.

A bootstrap, a coordinator and `--nodes` planned nodes (`--leftover-mem` offers, no `--blocks`) run as real
processes on 127.0.0.1. `--clients` client threads share one `DistributedModelForCausalLM` and generate
continuously, each through its own distinct chat prompts in turn (greedy, `--new-tokens` tokens), every output
compared with the local truth computed first. A churn driver acts at random, seeded intervals
(`--interval MIN:MAX` s, `--seed`):

- kill: SIGKILL a serving node (its whole process group, `p2pd` included), but only one whose loss leaves
  every block another online replica among the nodes still alive, and only while no node is loading, so
  the swarm can always serve while the coordinator re-plans (the first action is always a kill);
- restart: start a killed node again with the same identity (peer id) and offer;
- join: start a new node, while fewer than `--max-nodes` run.

At the end: requests, completed, failed, mismatched, retries (the sessions' `InferenceSession.retries`),
re-plans (placement versions the coordinator published after the swarm first settled), kills, joins,
restarts, and every process's state. Every process is stopped by PID on exit, also on an error or Ctrl-C,
and the script checks that none of their process groups (nodes' `p2pd` daemons included) is left.

    .venv/bin/python scripts/soak_churn.py [--duration 240] [--clients 3] [--seed 0]
    .venv/bin/python scripts/soak_churn.py --short     # the CI form: about two minutes in all
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from swarmnode.planner.naming import short_id

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Offers of 15 to 30 blocks: with four nodes the planner runs two pipelines side by side (more throughput
# than one), so every block has two replicas and any one node can be killed while the others serve.
OFFERS = ("850M", "900M", "950M", "1000M", "1050M")
JOIN_OFFER = "950M"


@dataclass
class Churn:
    """What the driver did, in order."""

    events: list[tuple[float, str, str]] = field(default_factory=list)  # (s since start, action, node)
    skipped: Counter[str] = field(default_factory=Counter)  # why an event found nothing safe to do

    def count(self, action: str) -> int:
        return sum(1 for _t, a, _n in self.events if a == action)


class Clients:
    """`count` threads generating continuously through `remote` until `stop` is set; every result is kept."""

    def __init__(self, remote, prompts: list, truths: list[list[int]], count: int, new_tokens: int):
        from swarmnode.testing.workload import TimedRequest

        self.remote, self.prompts, self.truths = remote, prompts, truths
        self.new_tokens = new_tokens
        self.stop = threading.Event()
        self.results: list[TimedRequest] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i, count), name=f"client-{i}", daemon=True)
                         for i in range(count)]

    def _run(self, index: int, count: int) -> None:
        from swarmnode.testing.workload import timed_request

        mine = list(range(index, len(self.prompts), count))  # distinct prompts per client
        turn = 0
        while not self.stop.is_set():
            prompt = mine[turn % len(mine)]
            turn += 1
            result = timed_request(self.remote, prompt, self.prompts[prompt], self.new_tokens)
            with self._lock:
                self.results.append(result)
            if result.error is not None:
                print(f"  client {index}: request failed: {result.error[:400]}", file=sys.stderr, flush=True)
                self.stop.wait(1.0)  # a failure can be immediate: do not spin
            elif result.output != self.truths[prompt]:
                print(f"  client {index}: output of prompt {prompt} differs from local transformers",
                      file=sys.stderr, flush=True)

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self, timeout: float) -> bool:
        """Stop after the requests under way; whether every thread finished within `timeout` s."""
        self.stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.1, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def counts(self) -> dict:
        with self._lock:
            results = list(self.results)
        done = [r for r in results if r.error is None]
        return {
            "requests": len(results),
            "completed": len(done),
            "failed": len(results) - len(done),
            "mismatched": sum(1 for r in done if r.output != self.truths[r.prompt]),
            "retries": sum(r.retries for r in results),
            "cache_waits": sum(r.cache_waits for r in results),
            "requests_with_retries": sum(1 for r in results if r.retries),
            "tokens": sum(r.tokens for r in done),
            "errors": sorted(Counter(r.error for r in results if r.error).items()),
        }


def drive_churn(swarm, remote, rng: random.Random, until: float, interval: tuple[float, float], max_nodes: int,
                churn: Churn, began: float, stop: threading.Event) -> None:
    """Kill, restart and join nodes at random intervals until `until` (time.monotonic()) or `stop`."""
    from swarmnode.testing.swarm_reader import can_lose, client_status

    killed: list = []  # processes killed and not restarted yet
    restarts: Counter[str] = Counter()
    joins = 0
    next_at = time.monotonic() + rng.uniform(*interval)
    while not stop.is_set():
        if stop.wait(max(0.0, min(next_at, until) - time.monotonic())) or time.monotonic() >= until:
            return
        status = client_status(remote)
        alive = [p for p in swarm.node_processes() if p.alive()]
        loading = [p for p in alive if status["nodes"].get(p.peer_id, {}).get("state") in ("loading", "measuring")]
        # a restarted node keeps its peer id, and the record of the killed one stays until it expires: a node
        # counts as serving only once this very process (the one that answers its peer id) says it serves
        infos = {p.peer_id: swarm.node_info(p) for p in alive}
        serving = {peer for peer, info in infos.items() if info and info["state"] == "online" and info["spans"]}
        victims = [p for p in alive if p.peer_id in serving and can_lose(status, serving, p.peer_id)
                   and status["nodes"].get(p.peer_id, {}).get("state") == "online"]
        options = []
        if victims and not loading and len(alive) >= 3:
            options += ["kill"] * 3
        if killed:
            options += ["restart"] * 2
        if len(alive) < max_nodes:
            options.append("join")
        if not churn.events and "kill" in options:
            options = ["kill"]
        if not options:
            churn.skipped["no safe victim and nothing to start" if not loading else "a node is loading"] += 1
            next_at = time.monotonic() + 2.0
            continue
        action = rng.choice(options)
        now = round(time.monotonic() - began, 1)
        if action == "kill":
            victim = rng.choice(victims)
            swarm.kill(victim)
            victim.popen.wait(10)
            killed.append(victim)
            churn.events.append((now, "kill", victim.name))
        elif action == "restart":
            process = killed.pop(rng.randrange(len(killed)))
            base = process.name.split("~")[0]
            restarts[base] += 1
            again = swarm.spawn(f"{base}~{restarts[base]}", process.args)  # same --identity: same peer id
            churn.events.append((now, "restart", again.name))
        else:
            joins += 1
            name = f"joiner-{joins}"
            swarm.launch_node(leftover_mem=JOIN_OFFER, name=name)
            churn.events.append((now, "join", name))
        print(f"  {now:6.1f} s  {action} {churn.events[-1][2]}", file=sys.stderr, flush=True)
        next_at = time.monotonic() + rng.uniform(*interval)


def run(args) -> dict:
    from transformers import AutoTokenizer

    from swarmnode.client import ClientConfig, DistributedModelForCausalLM
    from swarmnode.model_prep import prepare_smollm2
    from swarmnode.testing.local_swarm import LocalSwarm
    from swarmnode.testing.swarm_reader import client_status, settled
    from swarmnode.testing.workload import chat_inputs, local_truths

    model_dir = prepare_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_inputs(tokenizer, args.prompts)
    truth_began = time.monotonic()
    truths = local_truths(model_dir, prompts, args.new_tokens)
    truth_s = time.monotonic() - truth_began
    rng = random.Random(args.seed)
    churn = Churn()
    swarm = LocalSwarm(model_dir, **({"log_dir": Path(args.log_dir)} if args.log_dir else {}))
    with swarm:
        began = time.monotonic()
        swarm.start_bootstrap()
        nodes = [swarm.launch_node(leftover_mem=offer, name=f"node-{i}") for i, offer in enumerate(OFFERS[: args.nodes])]
        coordinator = swarm.start_coordinator(extra=["--time-limit", "5"])
        for node in nodes:
            swarm.wait_serving(node, 300)
        config = ClientConfig(trusted_coordinators=swarm.trusted_coordinators(),
                              request_timeout=args.request_timeout)
        with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                         config=config) as remote:
            swarm.wait_status(lambda s: settled(s, {n.peer_id for n in nodes}), 300,
                              read=lambda: client_status(remote))
            first_version = swarm.placement_version()
            startup = time.monotonic() - began
            print(f"swarm serving in {startup:.0f} s (placement v{first_version}; logs: {swarm.log_dir}); "
                  f"{args.clients} clients, churn for {args.duration:.0f} s ...", file=sys.stderr, flush=True)
            clients = Clients(remote, prompts, truths, args.clients, args.new_tokens)
            soak_began = time.monotonic()
            clients.start()
            try:
                drive_churn(swarm, remote, rng, soak_began + args.duration, args.interval, args.max_nodes,
                            churn, soak_began, clients.stop)
            except BaseException:  # an error or Ctrl-C: stop now; closing the client ends requests under way
                clients.join(timeout=5)
                raise
            finished = clients.join(timeout=args.request_timeout * 3 + 60)
            soak_s = time.monotonic() - soak_began
            final = client_status(remote)
            client_view = remote.swarm.placement.version if remote.swarm.placement else None
        final_version = swarm.placement_version()
        processes = {p.name: "alive" if p.alive() else f"exited {p.popen.returncode}" for p in swarm.processes}
        unexpected = [p.name for p in swarm.processes if not p.alive() and p.popen.returncode != -9]
        coordinator_alive = coordinator.alive()
    leftovers = swarm.leftover_pids()
    counts = clients.counts()
    return {
        "benchmark": "soak_churn",
        "seed": args.seed,
        "duration_s": args.duration,
        "soak_s": round(soak_s, 1),
        "startup_s": round(startup, 1),
        "truth_s": round(truth_s, 1),
        "clients": args.clients,
        "new_tokens": args.new_tokens,
        **counts,
        "tokens_per_s": round(counts["tokens"] / soak_s, 2),
        "replans": final_version - first_version,  # each publication takes the next version
        "placement_versions": [first_version, final_version],
        "client_placement_version": client_view,
        "final_placement": None if final["placement"] is None else
        {short_id(p): r for p, r in final["placement"]["assignments"].items()},
        "uncovered_at_end": final["uncovered_blocks"],
        "kills": churn.count("kill"),
        "joins": churn.count("join"),
        "restarts": churn.count("restart"),
        "events": churn.events,
        "skipped": dict(churn.skipped),
        "clients_finished": finished,
        "coordinator_alive": coordinator_alive,
        "exited_unexpectedly": unexpected,
        "processes": processes,
        "leftover_processes": leftovers,
        "log_dir": str(swarm.log_dir),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=240.0, help="seconds of churn under load")
    parser.add_argument("--short", action="store_true",
                        help="the CI form: 60 s of churn, 2 clients, 8 tokens, events every 6-12 s")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=24, help="distinct prompts, shared out among clients")
    parser.add_argument("--nodes", type=int, default=4, help=f"nodes at the start (2..{len(OFFERS)})")
    parser.add_argument("--max-nodes", type=int, default=5, help="joins stop at this many live nodes")
    parser.add_argument("--interval", default="10:25", help="MIN:MAX seconds between churn events")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=30.0, help="the clients' per-step timeout")
    parser.add_argument("--log-dir", default=None, help="keep the processes' logs here (default: a temp folder)")
    args = parser.parse_args(argv)
    if args.short:
        args.duration, args.clients, args.new_tokens, args.prompts = 60.0, 2, 8, 8
        args.interval = "6:12"
    try:
        low, high = (float(x) for x in args.interval.split(":"))
    except ValueError:
        parser.error(f"--interval must be MIN:MAX seconds, e.g. 10:25, got {args.interval!r}")
    if not 0 < low <= high:
        parser.error(f"--interval needs 0 < MIN <= MAX, got {args.interval!r}")
    args.interval = (low, high)
    if not 2 <= args.nodes <= len(OFFERS):
        parser.error(f"--nodes must be 2..{len(OFFERS)}")
    if args.max_nodes < args.nodes or args.max_nodes > 6:
        parser.error("--max-nodes must be between --nodes and 6 on one machine")
    if not 1 <= args.clients <= 16 or args.prompts < args.clients:
        parser.error("--clients must be 1..16 and --prompts at least --clients")
    if args.duration <= 0:
        parser.error("--duration must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(f"requests {report['requests']}, completed {report['completed']}, failed {report['failed']}, "
          f"mismatched {report['mismatched']}, retries {report['retries']}, re-plans {report['replans']}, "
          f"kills {report['kills']}, joins {report['joins']}, restarts {report['restarts']} "
          f"in {report['soak_s']:.0f} s", file=sys.stderr)
    for error, count in report["errors"]:
        print(f"  {count} x {error[:400]}", file=sys.stderr)
    if report["leftover_processes"]:
        print(f"  processes left running: {report['leftover_processes']}", file=sys.stderr)
    print(json.dumps(report))
    ok = report["requests"] > 0 and not report["failed"] and not report["mismatched"]
    return 0 if ok and not report["leftover_processes"] else 1


if __name__ == "__main__":
    sys.exit(main())
