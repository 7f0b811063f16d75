"""A swarm of real peer processes on this machine: for the demo, the benchmarks and the tests.

Starts `swarmnode bootstrap`, `swarmnode coordinate` and `swarmnode join` as separate processes bound to
127.0.0.1, each in its own process group, waits until each says it is up, and stops them all by PID
(process group) on exit, also when the caller fails. Logs of each process go to files in a folder the
caller can read. The swarm gets its own key directory (its private swarm key) inside that folder.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

_MADDR_RE = re.compile(r"--initial-peers (\S+)")
_SERVING_RE = re.compile(r"^SERVING (\S+) (\d+):(\d+)", re.MULTILINE)
_WAITING_RE = re.compile(r"^WAITING (\S+)", re.MULTILINE)
_COORDINATOR_RE = re.compile(r"^COORDINATOR (\S+)", re.MULTILINE)


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log_path: Path
    peer_id: str | None = None

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
        process = Process(name, popen, log_path)
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

    def start_coordinator(self, *, name: str | None = None, extra: list[str] | None = None,
                          timeout: float = 60.0) -> Process:
        args = ["coordinate", "--model", str(self.model), "--host", "127.0.0.1", *(extra or [])]
        for maddr in self.initial_peers:
            args += ["--initial-peers", maddr]
        process = self.spawn(name or f"coordinator-{len(self.processes)}", args)
        process.peer_id = self.wait_for(process, _COORDINATOR_RE, timeout).group(1)
        return process

    def start_node(self, start: int | None = None, end: int | None = None, *, leftover_mem: str | None = None,
                   name: str | None = None, wait: bool = True, extra: list[str] | None = None,
                   timeout: float = 120.0) -> Process:
        """A `join` process: with `start, end` it serves those blocks; without, it follows the placement
        (then `wait` waits until it serves what it was given)."""
        args = ["join", "--model", str(self.model), "--host", "127.0.0.1"]
        if start is not None:
            args += ["--blocks", f"{start}:{end}"]
        if leftover_mem is not None:
            args += ["--leftover-mem", leftover_mem]
        for maddr in self.initial_peers:
            args += ["--initial-peers", maddr]
        if self.node_threads:
            args += ["--num-threads", str(self.node_threads)]
        args += extra or []
        label = f"{start}-{end}" if start is not None else "auto"
        process = self.spawn(name or f"node-{len(self.processes)}-{label}", args)
        if start is None:
            process.peer_id = self.wait_for(process, _WAITING_RE, timeout).group(1)
        if wait:
            self.wait_serving(process, timeout)
        return process

    def maddr_of(self, process: Process, timeout: float = 30.0) -> str:
        """A multiaddr other peers can join through: the one a node logs when it joins the DHT."""
        return self.wait_for(process, r"listening on (/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)", timeout).group(1)

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
