"""A swarm of real peer processes on this machine: for the demo, the benchmarks and the tests.

Starts `swarmnode bootstrap`, `swarmnode coordinate` and `swarmnode join` as separate processes bound to
127.0.0.1, each in its own process group, waits until each says it is up, and stops them all by PID
(process group) on exit, also when the caller fails. Logs of each process go to files in a folder the
caller can read. The swarm gets its own key directory (its private swarm key) inside that folder.

Also what the benchmarks and tests read back from such a swarm: `swarmnode status --json`, whether a planned
swarm has settled, which blocks survive a node's loss, the placement versions its coordinators published, a
node's `info` reply (its KV-cache accounting), distinct chat prompts, and a streamer that timestamps tokens.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_MADDR_RE = re.compile(r"--initial-peers (\S+)")
_SERVING_RE = re.compile(r"^SERVING (\S+) (\d+):(\d+)", re.MULTILINE)
_WAITING_RE = re.compile(r"^WAITING (\S+)", re.MULTILINE)
_COORDINATOR_RE = re.compile(r"^COORDINATOR (\S+)", re.MULTILINE)
_PLACEMENT_RE = re.compile(r"^PLACEMENT v(\d+)", re.MULTILINE)
_LISTENING_RE = re.compile(r"listening on (/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)")
_SESSION_RE = re.compile(r"\bsession (\w+) (opened|closed)\b")


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log_path: Path
    peer_id: str | None = None
    args: list[str] = field(default_factory=list)  # the `swarmnode` command line: args[0] is the command

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass
class LocalSwarm:
    model: str
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="swarmnode-swarm-")))
    env: dict[str, str] = field(default_factory=dict)
    node_threads: int | None = 1

    def __post_init__(self):
        self.log_dir = Path(self.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env.setdefault("SWARMNODE_KEY_DIR", str(self.log_dir / "keys"))
        self.processes: list[Process] = []
        self.initial_peers: list[str] = []

    def spawn(self, name: str, args: list[str]) -> Process:
        """Start `python -m swarmnode ARGS` as a process of this swarm (stopped with it, by PID)."""
        log_path = self.log_dir / f"{name}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE",
               **self.env}
        with open(log_path, "wb") as log:
            popen = subprocess.Popen([sys.executable, "-m", "swarmnode", *args], stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)
        process = Process(name, popen, log_path, args=list(args))
        self.processes.append(process)
        return process

    def wait_for(self, process: Process, pattern: re.Pattern | str, timeout: float, *, count: int = 1) -> re.Match:
        """Wait until `pattern` appears `count` times in the process's log; the last match."""
        pattern = re.compile(pattern, re.MULTILINE) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            matches = list(pattern.finditer(process.log()))
            match = matches[count - 1] if len(matches) >= count else None
            if match:
                return match
            if not process.alive():
                raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n{process.log()[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"{process.name} did not start in {timeout:.0f} s:\n{process.log()[-3000:]}")

    def start_bootstrap(self, timeout: float = 60.0) -> str:
        process = self.spawn("bootstrap", ["bootstrap", "--host", "127.0.0.1", "--port", "0"])
        maddr = self.wait_for(process, _MADDR_RE, timeout).group(1)
        process.peer_id = maddr.rsplit("/", 1)[-1]
        self.initial_peers = [maddr]
        return maddr

    def _ensure_swarm_key(self) -> None:
        """Create this swarm's key before starting processes that would each create it when missing (planned
        nodes, coordinators): started side by side, two of them could race to write the same file."""
        from swarmnode.identity import SWARM_KEY_NAME, load_or_create_private_key

        load_or_create_private_key(Path(self.env["SWARMNODE_KEY_DIR"]) / SWARM_KEY_NAME)

    def start_coordinator(self, *, name: str | None = None, extra: list[str] | None = None,
                          timeout: float = 60.0) -> Process:
        self._ensure_swarm_key()
        args = ["coordinate", "--model", str(self.model), "--host", "127.0.0.1", *(extra or [])]
        for maddr in self.initial_peers:
            args += ["--initial-peers", maddr]
        process = self.spawn(name or f"coordinator-{len(self.processes)}", args)
        process.peer_id = self.wait_for(process, _COORDINATOR_RE, timeout).group(1)
        return process

    def launch_node(self, start: int | None = None, end: int | None = None, *, leftover_mem: str | None = None,
                    name: str | None = None, extra: list[str] | None = None) -> Process:
        """Start a `join` process and return at once, so several nodes start side by side; its `peer_id` is
        set by `wait_serving` (or read with `logged_peer_id`)."""
        args = ["join", "--model", str(self.model), "--host", "127.0.0.1"]
        if start is not None:
            args += ["--blocks", f"{start}:{end}"]
        else:
            self._ensure_swarm_key()
        if leftover_mem is not None:
            args += ["--leftover-mem", leftover_mem]
        for maddr in self.initial_peers:
            args += ["--initial-peers", maddr]
        if self.node_threads:
            args += ["--num-threads", str(self.node_threads)]
        args += extra or []
        label = f"{start}-{end}" if start is not None else "auto"
        return self.spawn(name or f"node-{len(self.processes)}-{label}", args)

    def start_node(self, start: int | None = None, end: int | None = None, *, leftover_mem: str | None = None,
                   name: str | None = None, wait: bool = True, extra: list[str] | None = None,
                   timeout: float = 120.0) -> Process:
        """A `join` process: with `start, end` it serves those blocks; without, it follows the placement
        (then `wait` waits until it serves what it was given)."""
        process = self.launch_node(start, end, leftover_mem=leftover_mem, name=name, extra=extra)
        if start is None:
            process.peer_id = self.wait_for(process, _WAITING_RE, timeout).group(1)
        if wait:
            self.wait_serving(process, timeout)
        return process

    @staticmethod
    def logged_peer_id(process: Process) -> str | None:
        """The peer id a node logged (`WAITING` or `SERVING` line), or None before it did; never waits."""
        match = _WAITING_RE.search(process.log()) or _SERVING_RE.search(process.log())
        return match.group(1) if match else None

    def maddr_of(self, process: Process, timeout: float = 30.0) -> str:
        """A multiaddr other peers can join through: the one a node logs when it joins the DHT."""
        return self.wait_for(process, _LISTENING_RE, timeout).group(1)

    def trusted_coordinators(self) -> frozenset[str]:
        """The public half of this swarm's key (what its coordinators sign with), for clients to trust."""
        from swarmnode.identity import load_trusted_keys

        return load_trusted_keys([str(Path(self.env["SWARMNODE_KEY_DIR"]) / "swarm_key.pem")])

    def wait_serving(self, process: Process, timeout: float = 120.0) -> None:
        process.peer_id = self.wait_for(process, _SERVING_RE, timeout).group(1)

    def kill(self, process: Process, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the process's group (the node and its p2pd daemons)."""
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass

    def signal(self, process: Process, sig: int = signal.SIGTERM) -> None:
        """Send `sig` to the process itself (not its p2pd daemons), as an operator's `kill PID` does."""
        try:
            os.kill(process.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, process: Process, timeout: float = 20.0) -> int | None:
        """SIGTERM to the process (it shuts its own daemons down), wait for a clean exit, then SIGKILL
        whatever is left of its group."""
        self.signal(process, signal.SIGTERM)
        try:
            code = process.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        self.kill(process, signal.SIGKILL)
        if process.alive():
            process.popen.wait(5)
        return code

    def close(self) -> None:
        for process in reversed(self.processes):
            if process.alive():
                self.signal(process, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for process in reversed(self.processes):
            try:
                process.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self.kill(process, signal.SIGKILL)  # the group: p2pd daemons too
            if process.alive():
                process.popen.wait(5)

    def node_processes(self) -> list[Process]:
        """Every `join` process this swarm started (alive or not), in start order."""
        return [p for p in self.processes if p.args[:1] == ["join"]]

    def status(self, timeout: float = 120.0) -> dict:
        """`swarmnode status --json` of this swarm: placement, leases, every node's record, replicas."""
        if not self.initial_peers:
            raise RuntimeError("the swarm has no bootstrap peer yet: call start_bootstrap() first")
        out = subprocess.run(
            [sys.executable, "-m", "swarmnode", "status", "--model", str(self.model), "--json",
             "--initial-peers", self.initial_peers[0]],
            capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **self.env},
        )
        if out.returncode != 0:
            raise RuntimeError(f"swarmnode status exited with {out.returncode}:\n{out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def wait_status(self, check: Callable[[dict], bool], timeout: float = 120.0, period: float = 2.0, *,
                    read: Callable[[], dict] | None = None) -> dict:
        """Poll `status()` (or `read()`, e.g. `lambda: client_status(remote)`, which starts no process) until
        `check(status)` holds; the status that passed. Raises TimeoutError with the last status when it does
        not within `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            status = read() if read is not None else self.status()
            if check(status):
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"the swarm did not reach the expected state in {timeout:.0f} s: "
                                   f"{json.dumps(status)[:3000]}")
            time.sleep(period)

    def placement_versions(self) -> list[int]:
        """Placement versions this swarm's coordinators published (their `PLACEMENT vN` log lines), each once,
        in order; a coordinator killed midway still counts what it logged."""
        versions: set[int] = set()
        for process in self.processes:
            if process.args[:1] == ["coordinate"] or "--coordinator" in process.args:
                versions.update(int(v) for v in _PLACEMENT_RE.findall(process.log()))
        return sorted(versions)

    def leftover_pids(self) -> dict[str, list[int]]:
        """Processes still running in the groups this swarm started (each node's, coordinator's and
        bootstrap's own group, `p2pd` daemons included), by process name; empty after a clean `close()`."""
        left: dict[str, list[int]] = {}
        for process in self.processes:
            pids = _group_members(process.pid)
            if pids:
                left[process.name] = pids
        return left

    def __enter__(self) -> LocalSwarm:
        # a SIGTERM to the launching script must still stop the swarm's processes: turn it into SystemExit
        import threading

        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _group_members(pgid: int) -> list[int]:
    """PIDs of live (not zombie) processes in process group `pgid`, read from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # fields: state, ppid, pgrp, ...
            members.append(int(entry.name))
    return sorted(members)


# --- reading a node's log -----------------------------------------------------------------------------


def peak_open_sessions(process: Process, since: int = 0) -> int:
    """The most inference sessions a node held open at once, from its log (`session ID opened` / `closed`)
    after character `since` (e.g. `len(process.log())` read before a run)."""
    open_now: set[str] = set()
    peak = 0
    for session, what in _SESSION_RE.findall(process.log()[since:]):
        if what == "opened":
            open_now.add(session)
            peak = max(peak, len(open_now))
        else:
            open_now.discard(session)
    return peak


# --- reading a planned swarm's state (`status()` dicts) ---------------------------------------------------


def settled(status: dict, peers: set[str]) -> bool:
    """Every node in `peers` is assigned by the placement and serves exactly its assignment, no block is
    uncovered, and the placement assigns no one else."""
    placement = status["placement"]
    if placement is None or status["uncovered_blocks"]:
        return False
    for peer in peers:
        node = status["nodes"].get(peer)
        if node is None or peer not in placement["assignments"]:
            return False
        if node["serving"] != [placement["assignments"][peer]]:
            return False
    return set(placement["assignments"]) <= peers


def serving_replicas(status: dict, peers: set[str]) -> list[int]:
    """Replicas per block counting only the online nodes in `peers` (records of a node that died stay in the
    DHT until they expire: pass the peers known to be alive)."""
    replicas = [0] * status["num_blocks"]
    for peer in peers:
        node = status["nodes"].get(peer)
        if node is None or node["state"] != "online":
            continue
        served = set()
        for start, end in node["serving"]:
            served.update(range(start, end))
        for block in served:
            replicas[block] += 1
    return replicas


def can_lose(status: dict, peers: set[str], victim: str) -> bool:
    """Whether every block keeps an online replica among `peers` without `victim`: losing it leaves the swarm
    able to serve the whole model while the coordinator re-plans."""
    return min(serving_replicas(status, peers - {victim}), default=0) > 0


# --- what a client reads -----------------------------------------------------------------------------


def client_status(remote, timeout: float = 60.0) -> dict:
    """The `swarmnode status --json` dict, read through the DHT peer of `remote` (a
    `DistributedModelForCausalLM`) instead of a new process: cheap enough to poll while clients generate."""
    from swarmnode.cli.status import state_dict
    from swarmnode.swarm_state import read_state

    view = remote.swarm
    state = view.loop.run(read_state(view.dht, view.prefix, view.num_blocks, view.config.trusted_coordinators or
                                     frozenset()), timeout)
    return state_dict(state, view.num_blocks, view.prefix)


def node_info(remote, peer_id: str, timeout: float = 30.0) -> dict:
    """A node's `info` reply (state, spans, `cache_tokens`, `free_cache_tokens`, ...) through the P2P of
    `remote`, a `DistributedModelForCausalLM`."""
    from hivemind.p2p import PeerID
    from hivemind.proto import runtime_pb2

    from swarmnode import messages

    response = remote.swarm.loop.run(remote.swarm.p2p.call_protobuf_handler(
        PeerID.from_base58(peer_id), messages.RPC_INFO, runtime_pb2.ExpertRequest(),
        runtime_pb2.ExpertResponse), timeout=timeout)
    error = messages.response_error(response)
    if error is not None:
        raise RuntimeError(f"info from {peer_id[-8:]} failed: {error}")
    return messages.MSGPackSerializer.loads(response.metadata)


def wait_cache_free(remote, expected: dict[str, int], timeout: float = 15.0) -> dict[str, int]:
    """Poll the nodes' `free_cache_tokens` until each equals `expected[peer]` (peers free a closed session's
    cache asynchronously) or `timeout` s pass; the last values read."""
    deadline = time.monotonic() + timeout
    while True:
        free = {peer: node_info(remote, peer)["free_cache_tokens"] for peer in expected}
        if free == expected or time.monotonic() > deadline:
            return free
        time.sleep(0.25)


# --- clients -------------------------------------------------------------------------------------------

CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "Why is the sky blue?",
    "Give me a tip for learning to cook.",
    "What is a prime number?",
    "Name three rivers in Europe.",
    "How do bees make honey?",
    "Suggest a name for a black cat.",
    "What does a compiler do?",
    "Describe a rainy morning in one sentence.",
    "How many legs does a spider have?",
    "What is the boiling point of water?",
    "Tell me a fun fact about octopuses.",
    "Why do leaves change colour in autumn?",
    "What is the tallest mountain on Earth?",
    "Explain photosynthesis simply.",
    "Recommend a board game for four people.",
    "What is the difference between weather and climate?",
    "How does a bicycle stay upright?",
    "Write a short greeting for a birthday card.",
    "What are the three states of matter?",
    "Who wrote Romeo and Juliet?",
    "How can I sleep better?",
)


def chat_inputs(tokenizer, count: int) -> list:
    """`count` distinct single-turn chat prompts as input_ids (1, n), cycling `CHAT_QUESTIONS` with a numbered
    suffix once they run out."""
    prompts = []
    for i in range(count):
        question = CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]
        if i >= len(CHAT_QUESTIONS):
            question += f" (version {i // len(CHAT_QUESTIONS) + 1})"
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                     add_generation_prompt=True, return_tensors="pt",
                                                     return_dict=True)["input_ids"])
    return prompts


@dataclass
class TimedRequest:
    """One generation through the swarm: its output (token ids, prompt included) or the error that ended it,
    when it began and ended (time.perf_counter()), time to first token, the gaps between later tokens, and
    the retries (failed hops re-routed) and cache waits of its session."""

    prompt: int
    began: float
    ended: float
    tokens: int = 0
    output: list[int] | None = None
    error: str | None = None
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    retries: int = 0
    cache_waits: int = 0  # refusals for a full KV cache the session waited out (`InferenceSession.cache_waits`)
    session_key: int = 0  # id() of its InferenceSession, to match what was logged about it


def timed_request(remote, prompt: int, input_ids, new_tokens: int, *,
                  session_length: int | None = None) -> TimedRequest:
    """Generate exactly `new_tokens` greedy tokens for `input_ids` (1, n) in a session of its own (of
    `session_length` tokens, default just enough), timed with a `TokenClock`. A failure is a result: its
    message is in `error`."""
    clock = TokenClock()
    began = time.perf_counter()
    session = None
    try:
        with remote.inference_session(max_length=session_length or input_ids.shape[1] + new_tokens) as session:
            out = remote.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, streamer=clock)
        request = TimedRequest(prompt, began, time.perf_counter(), out.shape[1] - input_ids.shape[1],
                               out[0].tolist())
    except Exception as exc:
        request = TimedRequest(prompt, began, time.perf_counter(), error=f"{type(exc).__name__}: {exc}")
    if len(clock.times) > 1:
        request.ttft = clock.times[1] - began
        request.gaps = clock.gaps()
    if session is not None:
        request.retries = session.retries
        request.cache_waits = getattr(session, "cache_waits", 0)
        request.session_key = id(session)
    return request


def local_truths(model_dir, prompts: list, new_tokens: int) -> list[list[int]]:
    """What local `transformers` generates greedily (exactly `new_tokens` tokens) for each prompt: the
    reference every swarm output is compared with."""
    import torch
    from transformers import AutoModelForCausalLM

    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [local.generate(p, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)[0].tolist()
            for p in prompts]


class TokenClock:
    """A `generate(streamer=...)` streamer that timestamps every `put`: `times[0]` is the prompt, `times[k]`
    the k-th new token (time.perf_counter()). Time to first token is `times[1] - began`; the gaps between
    later entries are the time per token a user sees."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times[1:], self.times[2:])]
