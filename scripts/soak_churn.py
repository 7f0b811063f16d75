"""Churn soak: clients keep generating while nodes join, are killed with SIGKILL and restart; every request must
complete with exactly the text local `transformers` generates. Prints counts and one JSON line last; exits
non-zero when any request failed or differed (with `--check-aims`, also when an aim below is missed).

A bootstrap, a coordinator and `--nodes` planned nodes (`--leftover-mem` offers, no `--blocks`) run as real
processes on 127.0.0.1. `--clients` client threads share one `DistributedModelForCausalLM` and generate
continuously, each through its own distinct chat prompts in turn (greedy, `--new-tokens` tokens), every output
compared with the local truth computed first, every token timestamped as it arrives. A churn driver acts at
random, seeded intervals (`--interval MIN:MAX` s, `--seed`); at each event it draws what it means to do:

- kill (weight 3; the first event always): SIGKILL a serving node (its whole process group, `p2pd`
  included), while at least 3 nodes are alive. By default only a node whose loss leaves every block another
  replica that a live node serves at that moment (what each node process says it serves, not what its
  records or the placement say), so the swarm can always serve while the coordinator re-plans; with `--kill-any`, any serving node, whatever it leaves uncovered
  (the clients then wait for the blocks, up to `--route-wait` s). A kill the driver cannot make is a
  skipped attempt, counted with its reason, and the driver restarts or joins a node instead when it can;
- restart (weight 2, while a node is down): start a killed node again with the same identity (peer id)
  and offer;
- join (weight 1, while fewer than `--max-nodes` run): start a new node.

Measured besides the requests' counts:

- coverage: every `--sample-period` s (and right after each action) the script asks every live node process
  for its `info` (state and the spans it serves); a block is covered while some live node is online with a
  span holding it. The windows in which some block was uncovered give `uncovered_longest_s` and
  `uncovered_total_s` (and per kill, the uncovered time until the next kill);
- failover: a kill hits the requests whose route (their session's hops) went through the killed node at
  that moment; its failover delay is the time from the kill until each of them has a new token that came
  through a route without the node (the longest of them; `failover_delays_s`, p50/p95/max). Kills that hit
  no request under way, or only requests whose last step had already passed the node, are listed;
- kill attempts, kills and skipped attempts with their reasons;
- `uncovered_bound_s`: the coordinator's re-plan bound (two missed pings, the debounce, the planner's time
  limit, a node's placement poll; `replan_bound_s`) plus the longest time a node took to load its blocks in
  this run (from its log, `load_s`); with `--kill-any` the longest uncovered window is compared with it.

Aims (reported; asserted only with `--check-aims`): no request failed or differed, at least 8 kills with
fewer than 20% of the kill attempts skipped, failover delay p95 <= 8 s, and with `--kill-any` the longest
uncovered window within `uncovered_bound_s`.

A request still under way when the clients should long have finished counts as failed (`unfinished`).
At the end also: retries (the sessions' `InferenceSession.retries`), re-plans (placement versions the
coordinator published after the swarm first settled), joins, restarts, and every process's state. Every
process is stopped by PID on exit, also on an error or Ctrl-C, and the script checks that none of their
process groups (nodes' `p2pd` daemons included) is left.

    .venv/bin/python scripts/soak_churn.py [--duration 240] [--clients 3] [--seed 0] [--kill-any]
    .venv/bin/python scripts/soak_churn.py --short     # the CI form: about a minute and a half in all
    .venv/bin/python scripts/soak_churn.py --duration 600 --nodes 5 --seed 7 [--kill-any]   # the aims' form
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import re
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from swarmnode.naming import short_id

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Offers of 15 to 30 blocks: with four nodes the planner runs two pipelines side by side (more throughput
# than one), so every block has two replicas and any one node can be killed while the others serve.
OFFERS = ("850M", "900M", "950M", "1000M", "1050M")
JOIN_OFFER = "950M"
COORDINATOR_TIME_LIMIT = 5.0  # the coordinator's `--time-limit`: part of the re-plan bound
MIN_ALIVE_TO_KILL = 3  # a kill leaves at least two nodes running

AIM_MIN_KILLS = 8
AIM_MAX_SKIP_FRACTION = 0.2
AIM_MAX_FAILOVER_P95_S = 8.0

# a node's log line when a range finished loading: `loaded 16/16 blocks (4.2 s)`
_LOADED_RE = re.compile(r"\bloaded (\d+)/(\d+) blocks \(([\d.]+) s\)")


class Flight:
    """One request under way, and its `generate(streamer=...)`: its session once open, when each of its
    tokens arrived (time.monotonic(); `times[0]` is the prompt, `times[k]` the k-th new token) and the peers
    of its route as each arrived."""

    def __init__(self, new_tokens: int):
        self.new_tokens = new_tokens
        self.session = None
        self.times: list[float] = []
        self.routes: list[set[str]] = []

    def put(self, value) -> None:
        route = self.route()
        self.times.append(time.monotonic())
        self.routes.append(route)

    @property
    def done(self) -> bool:
        return len(self.times) > self.new_tokens

    def end(self) -> None:
        pass

    def route(self) -> set[str]:
        """Peers of the session's hops now (empty before its first step, once every token has arrived, and
        once it is closed)."""
        session = self.session
        if self.done:
            return set()
        hops = list(session.hops or []) if session is not None else []
        return {h.hop.peer_id for h in hops}

    def token_without(self, peer_id: str, moment: float) -> float | None:
        """When the first new token after `moment` came through a route without `peer_id`, or None."""
        times, routes = list(self.times), list(self.routes)
        return next((t for t, route in zip(times[1:], routes[1:]) if t > moment and peer_id not in route), None)


@dataclass
class Kill:
    """A SIGKILL: when (time.monotonic()), which node, and the requests whose route went through it then."""

    at: float
    node: str
    peer_id: str
    hit: list[Flight]


@dataclass
class Churn:
    """What the driver did, in order."""

    events: list[tuple[float, str, str]] = field(default_factory=list)  # (s since start, action, node)
    skipped: Counter[str] = field(default_factory=Counter)  # why a kill attempt found no node to kill
    kill_attempts: int = 0
    kills: list[Kill] = field(default_factory=list)
    started: list[tuple[object, float]] = field(default_factory=list)  # restarts and joins: (Process, when)

    def count(self, action: str) -> int:
        return sum(1 for _t, a, _n in self.events if a == action)


def tracked_request(remote, prompt: int, input_ids, new_tokens: int, flight: Flight):
    """Generate exactly `new_tokens` greedy tokens for `input_ids` in a session of its own, with `flight`
    holding the session and timestamping the tokens. A failure is a result: its message is in `error`."""
    from swarmnode.testing.workload import TimedRequest

    began, began_at = time.perf_counter(), time.monotonic()
    session = None
    try:
        with remote.inference_session(max_length=input_ids.shape[1] + new_tokens) as session:
            flight.session = session
            out = remote.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, streamer=flight)
        request = TimedRequest(prompt, began, time.perf_counter(), out.shape[1] - input_ids.shape[1],
                               out[0].tolist())
    except Exception as exc:  # any failure is this request's result, counted by the caller: keep its message
        request = TimedRequest(prompt, began, time.perf_counter(), error=f"{type(exc).__name__}: {exc}")
    if len(flight.times) > 1:
        request.ttft = flight.times[1] - began_at
        request.gaps = [b - a for a, b in zip(flight.times[1:], flight.times[2:])]
    if session is not None:
        request.retries = session.retries
        request.cache_waits = session.cache_waits
        request.session_key = id(session)
    return request


class Clients:
    """`count` threads generating continuously through `remote` until `stop` is set; every result is kept,
    and the request each thread has under way can be asked for its route."""

    def __init__(self, remote, prompts: list, truths: list[list[int]], count: int, new_tokens: int):
        from swarmnode.testing.workload import TimedRequest

        self.remote, self.prompts, self.truths = remote, prompts, truths
        self.new_tokens = new_tokens
        self.stop = threading.Event()
        self.results: list[TimedRequest] = []
        self.flights: dict[int, Flight] = {}  # client -> its request under way
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i, count), name=f"client-{i}", daemon=True)
                         for i in range(count)]

    def _run(self, index: int, count: int) -> None:
        mine = list(range(index, len(self.prompts), count))  # distinct prompts per client
        turn = 0
        while not self.stop.is_set():
            prompt = mine[turn % len(mine)]
            turn += 1
            flight = Flight(self.new_tokens)
            with self._lock:
                self.flights[index] = flight
            result = tracked_request(self.remote, prompt, self.prompts[prompt], self.new_tokens, flight)
            with self._lock:
                del self.flights[index]
                self.results.append(result)
            if result.error is not None:
                print(f"  client {index}: request failed: {result.error[:400]}", file=sys.stderr, flush=True)
                self.stop.wait(1.0)  # a failure can be immediate: do not spin
            elif result.output != self.truths[prompt]:
                print(f"  client {index}: output of prompt {prompt} differs from local transformers",
                      file=sys.stderr, flush=True)

    def on_route(self, peer_id: str) -> list[Flight]:
        """The requests under way whose route goes through `peer_id` now."""
        with self._lock:
            flights = list(self.flights.values())
        return [f for f in flights if peer_id in f.route()]

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
        """The requests' counts; a request still under way (a client that did not finish) counts as failed and
        as `unfinished`."""
        with self._lock:
            results = list(self.results)
            unfinished = len(self.flights)
        done = [r for r in results if r.error is None]
        return {
            "requests": len(results) + unfinished,
            "completed": len(done),
            "failed": len(results) - len(done) + unfinished,
            "unfinished": unfinished,
            "mismatched": sum(1 for r in done if r.output != self.truths[r.prompt]),
            "retries": sum(r.retries for r in results),
            "cache_waits": sum(r.cache_waits for r in results),
            "requests_with_retries": sum(1 for r in results if r.retries),
            "tokens": sum(r.tokens for r in done),
            "errors": sorted(Counter(r.error for r in results if r.error).items()),
        }


class Coverage:
    """Which blocks some live node serves, sampled every `period` s (and at once after `poke()`) on a thread
    of its own: every live node process is asked for its `info`; a block is covered while a node is online
    with a span holding it. A live node that does not answer in time keeps its last answer for `grace` s."""

    def __init__(self, swarm, num_blocks: int, period: float = 0.5, grace: float = 3.0):
        self.swarm, self.num_blocks, self.period, self.grace = swarm, num_blocks, period, grace
        self.samples: list[tuple[float, list[int]]] = []  # (time.monotonic(), uncovered blocks)
        self.serving_since: dict[int, float] = {}  # pid -> first time the node was seen serving
        self._last: dict[int, tuple[float, dict]] = {}  # pid -> (when, its last info reply)
        self.errors: list[str] = []  # samples that failed
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="coverage-info")
        self._thread = threading.Thread(target=self._run, name="coverage", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def poke(self) -> None:
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(30)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception as exc:  # the sampling thread's boundary: a failed sample is counted, not fatal
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self._wake.wait(self.period)
            self._wake.clear()

    def _info(self, process) -> dict | None:
        from swarmnode.testing.errors import NodeInfoError

        try:
            return self.swarm.reader.try_info(process.peer_id, timeout=2.0)
        except NodeInfoError:
            return None

    def sample(self) -> list[int]:
        at = time.monotonic()
        alive = [p for p in list(self.swarm.node_processes()) if p.alive()]
        replies = list(self._pool.map(self._info, alive))
        covered: set[int] = set()
        for process, info in zip(alive, replies):
            if info is not None:
                self._last[process.pid] = (at, info)
            else:
                when, last = self._last.get(process.pid, (0.0, None))
                info = last if at - when <= self.grace and process.alive() else None
            if info is None or info["state"] != "online" or not info["spans"]:
                continue
            self.serving_since.setdefault(process.pid, at)
            for span in info["spans"]:
                covered.update(range(span["start"], span["end"]))
        uncovered = sorted(set(range(self.num_blocks)) - covered)
        self.samples.append((at, uncovered))
        return uncovered

    def windows(self) -> list[tuple[float, float, list[int]]]:
        """(start, end, blocks uncovered at some point) of every stretch of samples with a block uncovered; a
        window ends at the first sample with every block covered (or the last sample)."""
        windows = []
        start, blocks = None, set()
        for at, uncovered in self.samples:
            if uncovered and start is None:
                start, blocks = at, set(uncovered)
            elif uncovered:
                blocks.update(uncovered)
            elif start is not None:
                windows.append((start, at, sorted(blocks)))
                start = None
        if start is not None:
            windows.append((start, self.samples[-1][0], sorted(blocks)))
        return windows


def covered_without(infos: dict, peers: set[str], num_blocks: int) -> bool:
    """Whether the spans the live `peers` say they serve now (their `info`) hold every block."""
    covered = [False] * num_blocks
    for peer in peers:
        for span in (infos.get(peer) or {}).get("spans", []):
            for block in range(span["start"], min(span["end"], num_blocks)):
                covered[block] = True
    return all(covered)


def kill_blocker(alive: list, victims: list, kill_any: bool) -> str | None:
    """Why no node can be killed now, or None when one can."""
    if len(alive) < MIN_ALIVE_TO_KILL:
        return f"fewer than {MIN_ALIVE_TO_KILL} nodes alive"
    if not victims:
        return "no node serving" if kill_any else "no node whose blocks all have another replica"
    return None


def drive_churn(swarm, remote, clients: Clients, coverage: Coverage, rng: random.Random, until: float,
                interval: tuple[float, float], max_nodes: int, churn: Churn, began: float, stop: threading.Event,
                kill_any: bool = False, opening: tuple[str, ...] = ("kill",)) -> None:
    """Kill, restart and join nodes at random intervals until `until` (time.monotonic()) or `stop`. The first
    events are `opening`'s, in order (a kill that no node can take is tried again at the next turn), then drawn
    at random: a kill three times as likely as a restart or a join."""
    from swarmnode.testing.swarm_reader import client_status

    killed: list = []  # processes killed and not restarted yet
    restarts: Counter[str] = Counter()
    joins = 0
    turn = 0  # the opening's events done so far
    next_at = time.monotonic() + rng.uniform(*interval)
    while not stop.is_set():
        if stop.wait(max(0.0, min(next_at, until) - time.monotonic())) or time.monotonic() >= until:
            return
        status = client_status(remote)
        alive = [p for p in swarm.node_processes() if p.alive()]
        # a restarted node keeps its peer id, and the record of the killed one stays until it expires: a node
        # counts as serving only once this very process (the one that answers its peer id) says it serves
        infos = {p.peer_id: swarm.node_info(p) for p in alive}
        serving = {peer for peer, info in infos.items() if info and info["state"] == "online" and info["spans"]}
        if kill_any:
            victims = [p for p in alive if p.peer_id in serving]
        else:
            victims = [p for p in alive if p.peer_id in serving
                       and covered_without(infos, serving - {p.peer_id}, status["num_blocks"])]
        others = ["restart"] * 2 if killed else []
        if len(alive) < max_nodes:
            others.append("join")
        planned = opening[turn] if turn < len(opening) else None
        action = planned if planned == "kill" or planned in others else rng.choice(["kill"] * 3 + others)
        now = round(time.monotonic() - began, 1)
        if action == "kill":
            churn.kill_attempts += 1
            blocker = kill_blocker(alive, victims, kill_any)
            if blocker is not None:
                churn.skipped[blocker] += 1
                action = rng.choice(others) if others else None
                print(f"  {now:6.1f} s  kill skipped: {blocker}", file=sys.stderr, flush=True)
        if action == "kill":
            victim = rng.choice(victims)
            hit = clients.on_route(victim.peer_id)
            swarm.kill(victim)
            at = time.monotonic()
            coverage.poke()
            victim.popen.wait(10)
            killed.append(victim)
            churn.kills.append(Kill(at, victim.name, victim.peer_id, hit))
            churn.events.append((now, "kill", victim.name))
        elif action == "restart":
            process = killed.pop(rng.randrange(len(killed)))
            base = process.name.split("~")[0]
            restarts[base] += 1
            again = swarm.spawn(f"{base}~{restarts[base]}", process.args)  # same --identity: same peer id
            churn.started.append((again, time.monotonic()))
            churn.events.append((now, "restart", again.name))
        elif action == "join":
            joins += 1
            name = f"joiner-{joins}"
            churn.started.append((swarm.launch_node(leftover_mem=JOIN_OFFER, name=name), time.monotonic()))
            churn.events.append((now, "join", name))
        if action is not None and action == planned:
            turn += 1
        if action is not None:
            coverage.poke()
            print(f"  {now:6.1f} s  {action} {churn.events[-1][2]}", file=sys.stderr, flush=True)
        next_at = time.monotonic() + rng.uniform(*interval)


def percentile(values: list[float], share: float) -> float | None:
    """The nearest-rank percentile (`share` in (0, 1]) of `values`, or None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def replan_bound(time_limit: float) -> float:
    """Seconds from a node's death to a new placement reaching the nodes, by the coordinator's constants: two
    missed pings (one per tick of `LEASE_RENEW` s plus a ping's timeout), then quiet for the debounce (acted on
    at the next tick, and at most `max_wait` s after the change), the planner's time limit, and one placement
    poll of the nodes."""
    from swarmnode.coordinator.service import DEAD_AFTER_PINGS, PING_TIMEOUT, CoordinatorConfig
    from swarmnode.records import LEASE_RENEW
    from swarmnode.server.follower import POLL

    config = CoordinatorConfig()
    tick = LEASE_RENEW + PING_TIMEOUT
    return DEAD_AFTER_PINGS * tick + min(config.debounce + tick, config.max_wait) + time_limit + POLL


def longest_load(processes: list) -> float | None:
    """The longest time any of `processes` (nodes) logged for loading a whole range of blocks."""
    times = [float(seconds) for p in processes for done, total, seconds in _LOADED_RE.findall(p.log())
             if done == total]
    return max(times, default=None)


def measure(churn: Churn, coverage: Coverage, swarm, began: float, kill_any: bool) -> dict:
    """Failover delays per kill, uncovered windows, kill attempts and the uncovered bound, as report fields."""
    windows = coverage.windows()
    kills, details, delays, missed = churn.kills, [], [], []
    for i, kill in enumerate(kills):
        until = kills[i + 1].at if i + 1 < len(kills) else math.inf
        after = [(f, f.token_without(kill.peer_id, kill.at)) for f in kill.hit]
        resumed = [t - kill.at for _f, t in after if t is not None]
        delay = max(resumed) if resumed else None
        if delay is None:
            missed.append(kill.node)
        else:
            delays.append(delay)
        details.append({
            "at_s": round(kill.at - began, 1), "node": kill.node, "requests_hit": len(kill.hit),
            "next_token_s": [round(d, 2) for d in resumed],  # of each request hit that went on through a new route
            # requests hit whose last step had already been through the node, which never needed it again
            "done_on_old_route": sum(1 for f, t in after if t is None and f.done),
            "failover_s": None if delay is None else round(delay, 2),
            "uncovered_s": round(sum((end - start for start, end, _b in windows if kill.at <= start < until), 0.0),
                                 2),
        })
    durations = [end - start for start, end, _b in windows]
    load_s = longest_load(swarm.node_processes())
    replan_s = replan_bound(COORDINATOR_TIME_LIMIT)
    bound = None if load_s is None else replan_s + load_s
    to_serving = [coverage.serving_since[p.pid] - t for p, t in churn.started if p.pid in coverage.serving_since]
    attempts, made = churn.kill_attempts, len(kills)
    return {
        "kill_any": kill_any,
        "kill_attempts": attempts,
        "kills_skipped": attempts - made,
        "kill_skip_fraction": round((attempts - made) / attempts, 3) if attempts else None,
        "failover_delays_s": [round(d, 2) for d in delays],
        "failover_p50_s": None if not delays else round(statistics.median(delays), 2),
        "failover_p95_s": None if not delays else round(percentile(delays, 0.95), 2),
        "failover_max_s": None if not delays else round(max(delays), 2),
        "kills_hitting_no_request": missed,  # no request under way needed the node (or none went on)
        "kill_details": details,
        "uncovered_longest_s": round(max(durations, default=0.0), 2),
        "uncovered_total_s": round(sum(durations, 0.0), 2),
        "uncovered_windows": [[round(start - began, 1), round(end - start, 2), blocks]
                              for start, end, blocks in windows],
        "coverage_samples": len(coverage.samples),
        "coverage_period_s": coverage.period,
        "coverage_errors": sorted(Counter(coverage.errors).items()),
        "replan_bound_s": round(replan_s, 1),
        "load_s": load_s,
        "uncovered_bound_s": None if bound is None else round(bound, 1),
        "restart_to_serving_s": [round(s, 1) for s in to_serving],
    }


def aims(report: dict) -> tuple[dict, dict]:
    """Each aim met (True), missed (False) or not measurable (None), and its threshold."""
    met = {
        "no_failed": report["failed"] == 0,
        "no_mismatched": report["mismatched"] == 0,
        "enough_kills": report["kills"] >= AIM_MIN_KILLS,
        "few_skipped": report["kill_skip_fraction"] is not None
        and report["kill_skip_fraction"] < AIM_MAX_SKIP_FRACTION,
        "failover_p95": None if report["failover_p95_s"] is None
        else report["failover_p95_s"] <= AIM_MAX_FAILOVER_P95_S,
    }
    thresholds = {
        "no_failed": "failed == 0",
        "no_mismatched": "mismatched == 0",
        "enough_kills": f"kills >= {AIM_MIN_KILLS}",
        "few_skipped": f"kill_skip_fraction < {AIM_MAX_SKIP_FRACTION}",
        "failover_p95": f"failover_p95_s <= {AIM_MAX_FAILOVER_P95_S}",
    }
    if report["kill_any"]:
        bound = report["uncovered_bound_s"]
        met["uncovered_within_bound"] = None if bound is None else report["uncovered_longest_s"] <= bound
        thresholds["uncovered_within_bound"] = "uncovered_longest_s <= uncovered_bound_s"
    return met, thresholds


@contextlib.contextmanager
def client_log(path: Path):
    """Log what the clients do and why (re-routes, waits for peers, bans) at INFO to `path`, timestamped,
    beside the nodes' logs; the logger is put back as it was on exit."""
    logger = logging.getLogger("swarmnode.client")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [%(name)s] %(message)s"))
    handler.setLevel(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()


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
    with swarm, client_log(swarm.log_dir / "clients.log"):
        began = time.monotonic()
        swarm.start_bootstrap()
        nodes = [swarm.launch_node(leftover_mem=offer, name=f"node-{i}") for i, offer in enumerate(OFFERS[: args.nodes])]
        coordinator = swarm.start_coordinator(extra=["--time-limit", str(COORDINATOR_TIME_LIMIT)])
        for node in nodes:
            swarm.wait_serving(node, 300)
        config = ClientConfig(trusted_coordinators=swarm.trusted_coordinators(),
                              request_timeout=args.request_timeout, route_wait=args.route_wait)
        with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                         config=config) as remote:
            swarm.wait_status(lambda s: settled(s, {n.peer_id for n in nodes}), 300,
                              read=lambda: client_status(remote))
            first_version = swarm.placement_version()
            startup = time.monotonic() - began
            print(f"swarm serving in {startup:.0f} s (placement v{first_version}; logs: {swarm.log_dir}); "
                  f"{args.clients} clients, churn for {args.duration:.0f} s"
                  f"{' killing any node' if args.kill_any else ''} ...", file=sys.stderr, flush=True)
            clients = Clients(remote, prompts, truths, args.clients, args.new_tokens)
            coverage = Coverage(swarm, remote.swarm.num_blocks, args.sample_period)
            soak_began = time.monotonic()
            coverage.start()
            try:
                clients.start()
                try:
                    drive_churn(swarm, remote, clients, coverage, rng, soak_began + args.duration, args.interval,
                                args.max_nodes, churn, soak_began, clients.stop, args.kill_any, args.opening)
                except BaseException:  # an error or Ctrl-C: stop now; closing the client ends requests under way
                    clients.join(timeout=5)
                    raise
                finished = clients.join(timeout=args.request_timeout * 3 + args.route_wait + 60)
                soak_s = time.monotonic() - soak_began
                counts = clients.counts()  # before the client closes: a request still under way is unfinished
            finally:
                coverage.close()
            replanned_after = await_replan(swarm, coordinator, first_version, timeout=REPLAN_WAIT)
            final = client_status(remote)
            client_view = remote.swarm.placement.version if remote.swarm.placement else None
        final_version = swarm.placement_version()
        processes = {p.name: "alive" if p.alive() else f"exited {p.popen.returncode}" for p in swarm.processes}
        unexpected = [p.name for p in swarm.processes if not p.alive() and p.popen.returncode != -9]
        coordinator_alive = coordinator.alive()
        measured = measure(churn, coverage, swarm, soak_began, args.kill_any)
    leftovers = swarm.leftover_pids()
    report = {
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
        "replanned_after_end_s": replanned_after,  # after the soak, for the nodes left dead (None: not within the wait)
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
        **measured,
        "clients_finished": finished,
        "coordinator_alive": coordinator_alive,
        "exited_unexpectedly": unexpected,
        "processes": processes,
        "leftover_processes": leftovers,
        "log_dir": str(swarm.log_dir),
    }
    report["aims"], report["aim_thresholds"] = aims(report)
    return report


#: Seconds after the soak's end that the coordinator has to publish a placement without the nodes left dead
#: (a kill in the soak's last seconds is noticed after two missed pings, and the plan takes its time limit)
REPLAN_WAIT = 90.0


def await_replan(swarm, coordinator, first_version: int | None, timeout: float) -> float | None:
    """Wait until the coordinator has published a placement newer than `first_version` that assigns none of
    the nodes dead at the end (a killed peer that was not restarted); the seconds that took, None if it did
    not within `timeout` (the report then shows the last placement as it was)."""
    nodes = [p for p in swarm.processes if p.name.startswith("node-") and p.peer_id]
    dead = {p.peer_id for p in nodes} - {p.peer_id for p in nodes if p.alive()}
    began = time.monotonic()
    while coordinator.alive():
        placement = swarm.reader.placement()
        if (placement is not None and first_version is not None and placement.version > first_version
                and not dead & set(placement.assignments)):
            return round(time.monotonic() - began, 1)
        if time.monotonic() - began > timeout:
            return None
        time.sleep(1.0)
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=240.0, help="seconds of churn under load")
    parser.add_argument("--short", action="store_true",
                        help="the CI form: 30 s of churn, 2 clients, 8 tokens, events every 5-9 s, opening with a "
                             "kill and the killed node's restart")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=24, help="distinct prompts, shared out among clients")
    parser.add_argument("--nodes", type=int, default=4, help=f"nodes at the start (2..{len(OFFERS)})")
    parser.add_argument("--max-nodes", type=int, default=5, help="joins stop at this many live nodes")
    parser.add_argument("--interval", default="10:25", help="MIN:MAX seconds between churn events")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-any", action="store_true",
                        help="kill any serving node, even the last replica of a block (clients wait for it)")
    parser.add_argument("--request-timeout", type=float, default=30.0, help="the clients' per-step timeout")
    parser.add_argument("--route-wait", type=float, default=None,
                        help="how long a client step waits for an unserved block (default 60 s, 300 s with "
                             "--kill-any)")
    parser.add_argument("--sample-period", type=float, default=0.5, help="seconds between coverage samples")
    parser.add_argument("--check-aims", action="store_true", help="exit non-zero when an aim is not met")
    parser.add_argument("--log-dir", default=None, help="keep the processes' logs here (default: a temp folder)")
    args = parser.parse_args(argv)
    args.opening = ("kill",)
    if args.short:  # the shortest soak that still kills, re-plans and restarts
        args.duration, args.clients, args.new_tokens, args.prompts = 30.0, 2, 8, 8
        args.interval = "5:9"
        args.opening = ("kill", "restart")
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
    if args.route_wait is None:
        args.route_wait = 300.0 if args.kill_any else 60.0
    if args.route_wait <= 0 or args.sample_period <= 0:
        parser.error("--route-wait and --sample-period must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(f"requests {report['requests']}, completed {report['completed']}, failed {report['failed']} "
          f"({report['unfinished']} unfinished), "
          f"mismatched {report['mismatched']}, retries {report['retries']}, re-plans {report['replans']}, "
          f"kills {report['kills']} of {report['kill_attempts']} attempts ({report['kills_skipped']} skipped: "
          f"{report['skipped']}), joins {report['joins']}, restarts {report['restarts']} "
          f"in {report['soak_s']:.0f} s", file=sys.stderr)
    print(f"failover delays {report['failover_delays_s']} s (p50 {report['failover_p50_s']}, p95 "
          f"{report['failover_p95_s']}, max {report['failover_max_s']}); kills hitting no request under way: "
          f"{report['kills_hitting_no_request']}", file=sys.stderr)
    print(f"uncovered: longest {report['uncovered_longest_s']} s, total {report['uncovered_total_s']} s in "
          f"{len(report['uncovered_windows'])} windows; bound {report['uncovered_bound_s']} s (re-plan "
          f"{report['replan_bound_s']} s + load {report['load_s']} s)", file=sys.stderr)
    print("aims: " + ", ".join(f"{name} ({report['aim_thresholds'][name]}): {met}"
                               for name, met in report["aims"].items()), file=sys.stderr)
    for error, count in report["errors"]:
        print(f"  {count} x {error[:400]}", file=sys.stderr)
    if report["leftover_processes"]:
        print(f"  processes left running: {report['leftover_processes']}", file=sys.stderr)
    print(json.dumps(report))
    ok = report["requests"] > 0 and not report["failed"] and not report["mismatched"]
    if args.check_aims:
        ok = ok and all(met is True for met in report["aims"].values())
    return 0 if ok and not report["leftover_processes"] else 1


if __name__ == "__main__":
    sys.exit(main())
