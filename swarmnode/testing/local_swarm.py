"""A swarm of real peer processes on this machine: for the demo, the benchmarks and the tests.

Starts `swarmnode bootstrap`, `swarmnode coordinate`, `swarmnode join` (and `swarmnode api`) as separate
processes bound to 127.0.0.1, each in its own process group with its output in a log file of the swarm's
folder, and stops them all by PID (process group) on close, also when the caller fails. The swarm gets its
own key directory (its private swarm key) in that folder.

Every process gets an identity file made before it starts (`--identity`), so its peer id is known at once.
Waiting for a process means reading the swarm's own state through one :class:`SwarmReader` (a client-mode
DHT peer started when first needed and shut down by :meth:`LocalSwarm.close`): a node is waiting or serving
when its `info` RPC says so, a coordinator is up when the DHT holds its lease, placements are read from
the DHT. The only output read is the multiaddr `swarmnode bootstrap` prints (`--initial-peers MADDR`) and
the URL `swarmnode api` prints (`API http://...`): that is those commands' documented output for users.

Subclasses may run the processes elsewhere: :meth:`LocalSwarm.command_line` builds each command,
:meth:`LocalSwarm.bootstrap_maddr` picks the printed multiaddr to join through, and `host` None starts them
with no `--host` (`swarmnode.testing.netns.NetnsSwarm` runs each on a network namespace of its own).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from swarmnode.errors import SwarmError
from swarmnode.testing import forkserver
from swarmnode.testing.errors import ProcessExitedError, SwarmTimeoutError
from swarmnode.testing.faults import FLAG as FAULT_FLAG
from swarmnode.testing.forkserver import ForkedProcess, ForkServer
from swarmnode.testing.swarm_reader import SwarmReader, wait_until_status

__all__ = ["LocalSwarm", "Process", "free_port", "peak_open_sessions"]

T = TypeVar("T")

# `swarmnode bootstrap` prints `--initial-peers MADDR` for its users to paste: its documented output
_BOOTSTRAP_MADDR_RE = re.compile(r"^--initial-peers (\S+)", re.MULTILINE)
# `swarmnode api` prints `API http://HOST:PORT` (its `--port` help says so): the bound port when --port 0
_API_URL_RE = re.compile(r"^API (http://\S+)", re.MULTILINE)
_SESSION_RE = re.compile(r"\bsession (\w+) (opened|closed)\b")


@dataclass
class Process:
    name: str
    popen: subprocess.Popen | ForkedProcess
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

    def log_tail(self, chars: int = 3000) -> str:
        return self.log()[-chars:]

    def alive(self) -> bool:
        return self.popen.poll() is None


def make_identity(path: Path) -> str:
    """The peer id of the libp2p identity in `path`, written first when the file does not exist."""
    from hivemind.p2p import P2P, PeerID

    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
    return PeerID.from_identity(path.read_bytes()).to_base58()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it), for a process that must be told its port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class LocalSwarm:
    model: str
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="swarmnode-swarm-")))
    env: dict[str, str] = field(default_factory=dict)
    node_threads: int | None = 1
    host: str | None = "127.0.0.1"  # the `--host` every process gets; None: none (the commands' default)
    # forks the processes instead of `exec` where it can (`testing.forkserver`: the suite installs one)
    fork_server: ForkServer | None = field(default_factory=forkserver.installed)
    # a private swarm (`swarmnode.admission`) owned by this swarm's key: the bootstrap holds the owner key, every
    # other process is started with an invitation for its role unless the caller passes its own admission flags
    private: bool = False

    def __post_init__(self) -> None:
        self.log_dir = Path(self.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env.setdefault("SWARMNODE_KEY_DIR", str(self.log_dir / "keys"))
        self.processes: list[Process] = []
        self.initial_peers: list[str] = []
        self._reader: SwarmReader | None = None

    # --- processes ---------------------------------------------------------------------------------------
    def spawn(self, name: str, args: list[str]) -> Process:
        """Start `python -m swarmnode ARGS` as a process of this swarm (stopped with it, by PID). With
        `--identity FILE` among the args, its peer id is that identity's (the file is made if missing)."""
        log_path = self.log_dir / f"{name}.log"
        peer_id = make_identity(Path(args[args.index("--identity") + 1])) if "--identity" in args else None
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE",
               **self.env}
        popen: subprocess.Popen | ForkedProcess
        if self._forks() and self.fork_server is not None and self.fork_server.can_run(env):
            popen = self.fork_server.spawn(self.module(args), args, log_path=log_path, env=env)
        else:
            with open(log_path, "wb") as log:
                popen = subprocess.Popen(self.command_line(name, args), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)
        process = Process(name, popen, log_path, peer_id=peer_id, args=list(args))
        self.processes.append(process)
        return process

    def command_line(self, name: str, args: list[str]) -> list[str]:
        """The command that runs `swarmnode ARGS` as process `name` (a subclass may run it elsewhere, e.g. in
        a network namespace; it must keep the pid, as `exec` does)."""
        return [sys.executable, "-m", self.module(args), *args]

    @staticmethod
    def module(args: list[str]) -> str:
        """The module `python -m` runs for `swarmnode ARGS`."""
        if FAULT_FLAG in args:  # a node made to compute wrong answers (test-only: `testing.faults`)
            return "swarmnode.testing.faults"
        return "swarmnode"

    def _forks(self) -> bool:
        """Whether the processes may be forked: not where a subclass runs its command line elsewhere."""
        return type(self).command_line is LocalSwarm.command_line

    def _host_args(self) -> list[str]:
        return ["--host", self.host] if self.host else []

    def _identity_args(self, name: str, extra: list[str] | None, role: str | None = None) -> list[str]:
        """`--identity FILE` for a new process, unless the caller gave one; in a private swarm with `role`, and
        an invitation for it in that role too, unless the caller gave admission flags of its own."""
        given = set(extra or [])
        args = [] if "--identity" in given else ["--identity", str(self.identity_path(name))]
        if self.private and role is not None and not given & {"--invitation", "--owner-key"}:
            if "--identity" in given:
                assert extra is not None, "given flags come from extra"
                path = Path(extra[extra.index("--identity") + 1])
            else:
                path = self.identity_path(name)
            args += ["--invitation", str(self.invite(path, [role], name=name))]
        return args

    def identity_path(self, name: str) -> Path:
        """Where the identity file of this swarm's process `name` lives."""
        return self.log_dir / "identities" / f"{name}.key"

    def invite(self, identity: Path, roles: list[str], *, expires_in: float = 6 * 3600.0,
               name: str | None = None) -> Path:
        """An invitation to this (private) swarm for the identity in `identity` (made if missing), signed with
        the swarm's key as `swarmnode invite` signs it, written to a file; that file."""
        from swarmnode.admission import Invitation, Role
        from swarmnode.identity import load_identity_key, load_or_create_private_key, public_key_text

        make_identity(identity)
        owner = load_or_create_private_key(self._swarm_key_path())
        invitation = Invitation.issue(owner, public_key_text(load_identity_key(str(identity))),
                                      [Role(r) for r in roles], time.time() + expires_in)
        path = self.log_dir / "invitations" / f"{name or Path(identity).stem}-{'-'.join(roles)}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(invitation.text())
        return path

    def owner_admission(self):
        """An `Admission` holding this private swarm's owner key (every role), for in-test clients and readers."""
        from swarmnode.admission import Admission

        self._ensure_swarm_key()
        return Admission.load(None, owner_key=str(self._swarm_key_path()))

    def _unique_name(self, name: str) -> str:
        taken = {p.name for p in self.processes}
        if name not in taken:
            return name
        return next(f"{name}~{i}" for i in range(1, len(taken) + 2) if f"{name}~{i}" not in taken)

    def start_bootstrap(self, timeout: float = 60.0) -> str:
        """A bootstrap peer; its multiaddr (also `initial_peers[0]`)."""
        name = self._unique_name("bootstrap")
        if self.private:
            self._ensure_swarm_key()
        owner = ["--owner-key", str(self._swarm_key_path())] if self.private else []
        process = self.spawn(name, ["bootstrap", *self._host_args(), "--port", "0",
                                    *self._identity_args(name, None), *owner])
        maddr = self.wait_until(lambda: self.bootstrap_maddr(process), timeout,
                                "the bootstrap peer printing its multiaddr", process)
        self.initial_peers = [maddr]
        return maddr

    def bootstrap_maddr(self, process: Process) -> str | None:
        """The multiaddr, of those the bootstrap printed, that this swarm's peers join through (None while it
        printed none)."""
        return _last_match(_BOOTSTRAP_MADDR_RE, process.log())

    def _ensure_swarm_key(self) -> None:
        """Create this swarm's key before starting processes that would each create it when missing (planned
        nodes, coordinators): started side by side, two of them could race to write the same file."""
        from swarmnode.identity import load_or_create_private_key

        load_or_create_private_key(self._swarm_key_path())

    def _swarm_key_path(self) -> Path:
        """This swarm's private key, in the swarm's own key directory."""
        from swarmnode.identity import SWARM_KEY_NAME

        return Path(self.env["SWARMNODE_KEY_DIR"]) / SWARM_KEY_NAME

    def _peer_args(self) -> list[str]:
        if not self.initial_peers:
            raise SwarmError("the swarm has no bootstrap peer yet: call start_bootstrap() first",
                             code="no_bootstrap")
        return [a for maddr in self.initial_peers for a in ("--initial-peers", maddr)]

    def start_coordinator(self, *, name: str | None = None, extra: list[str] | None = None,
                          timeout: float = 60.0, wait: bool = True) -> Process:
        """A `coordinate` process. With `wait`, return once a coordinator holds the swarm's lease (this one,
        or one that held it already: then this one stands by); :meth:`wait_lease` waits for this one."""
        self._ensure_swarm_key()
        name = self._unique_name(name or f"coordinator-{len(self.processes)}")
        args = ["coordinate", "--model", str(self.model), *self._host_args(), *self._peer_args(),
                *self._identity_args(name, extra, "coordinator"), *(extra or [])]
        process = self.spawn(name, args)
        if wait:
            self.wait_until(lambda: self.reader.lease_holders(), timeout, "a coordinator holding the lease",
                            process)
        return process

    def wait_lease(self, process: Process, timeout: float = 60.0) -> None:
        """Wait until `process` (a coordinator) holds the swarm's lease, as the DHT says."""
        self.wait_until(lambda: self.reader.lease_holders()[:1] == [process.peer_id], timeout,
                        f"{process.name} holding the coordinator lease", process)

    def launch_node(self, start: int | None = None, end: int | None = None, *, leftover_mem: str | None = None,
                    name: str | None = None, extra: list[str] | None = None, model: str | Path | None = None
                    ) -> Process:
        """Start a `join` process and return at once (its peer id is known), so several nodes start side by
        side; :meth:`wait_serving` waits until it serves. `model`: another `--model` than the swarm's (e.g. a GGUF
        file of it, whose nodes form a swarm of their own name on the same DHT)."""
        args = ["join", "--model", str(model or self.model), *self._host_args()]
        if start is not None:
            args += ["--blocks", f"{start}:{end}"]
        else:
            self._ensure_swarm_key()
        if leftover_mem is not None:
            args += ["--leftover-mem", leftover_mem]
        args += self._peer_args()
        if self.node_threads:
            args += ["--num-threads", str(self.node_threads)]
        label = f"{start}-{end}" if start is not None else "auto"
        name = self._unique_name(name or f"node-{len(self.processes)}-{label}")
        args += [*self._identity_args(name, extra, "node"), *(extra or [])]
        return self.spawn(name, args)

    def start_node(self, start: int | None = None, end: int | None = None, *, leftover_mem: str | None = None,
                   name: str | None = None, wait: bool = True, extra: list[str] | None = None,
                   timeout: float = 120.0) -> Process:
        """A `join` process: with `start, end` it serves those blocks; without, it follows the placement.
        With `wait`, return once it serves."""
        process = self.launch_node(start, end, leftover_mem=leftover_mem, name=name, extra=extra)
        if wait:
            self.wait_serving(process, timeout)
        return process

    def node_processes(self) -> list[Process]:
        """Every `join` process this swarm started (alive or not), in start order."""
        return [p for p in self.processes if p.args[:1] == ["join"]]

    def start_api(self, *, name: str = "api", extra: list[str] | None = None,
                  timeout: float = 120.0) -> tuple[Process, str]:
        """`swarmnode api` on a free port; (its process, its base URL) once its HTTP server answers."""
        name = self._unique_name(name)
        admission = self._identity_args(name, extra, "client") if self.private else []
        process = self.spawn(name, ["api", "--model", str(self.model), "--host", self.host or "127.0.0.1",
                                    "--port", "0", *self._peer_args(), *admission, *(extra or [])])
        url = self.wait_until(lambda: _last_match(_API_URL_RE, process.log()), timeout,
                              "the API printing its URL", process)
        self.wait_http(f"{url}/metrics", timeout, process)  # open with or without API keys
        return process, url

    def wait_http(self, url: str, timeout: float = 60.0, process: Process | None = None) -> None:
        """Wait until GET `url` answers 200 (a server of `process` is up)."""
        import httpx

        def answers() -> bool:
            try:
                return httpx.get(url, timeout=5).status_code == 200
            except httpx.TransportError:  # not listening yet
                return False

        self.wait_until(answers, timeout, f"{url} answering", process)

    # --- waiting on the swarm's state ----------------------------------------------------------------------
    @property
    def reader(self) -> SwarmReader:
        """This swarm's DHT reader, started on first use (it joins through `initial_peers`)."""
        if self._reader is None:
            self._peer_args()
            self._ensure_swarm_key()  # its public half is what the reader trusts, coordinators or not
            self._reader = SwarmReader(self.model, self.initial_peers, self.trusted_coordinators(),
                                       admission=self.owner_admission() if self.private else None)
        return self._reader

    def wait_until(self, check: Callable[[], T | None], timeout: float, what: str, process: Process | None = None,
                   period: float = 0.2) -> T:
        """Call `check()` until it returns something true and return that; raise ProcessExitedError (with
        its log) if `process` exits first, SwarmTimeoutError (with its log) after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            result = check()
            if result:
                return result
            if process is not None and not process.alive():
                raise ProcessExitedError(f"{process.name} exited with {process.popen.returncode} while waiting "
                                         f"for {what}:\n{process.log_tail()}")
            if time.monotonic() > deadline:
                tail = ""
                if process is not None:  # a forked process first writes where its threads wait into its log
                    stacks = isinstance(process.popen, ForkedProcess) and process.popen.dump_stacks()
                    tail = f":\n{process.log_tail(12000 if stacks else 3000)}"
                raise SwarmTimeoutError(f"no {what} within {timeout:.0f} s{tail}")
            time.sleep(period)

    def node_info(self, process: Process) -> dict | None:
        """The node's `info` reply (state, spans, cache tokens), or None while it cannot be reached."""
        assert process.peer_id is not None, "nodes are started with an identity"
        return self.reader.try_info(process.peer_id)

    def wait_node(self, process: Process, check: Callable[[dict], bool], timeout: float, what: str) -> dict:
        """Wait until the node's `info` reply passes `check`; that reply."""

        def passed() -> dict | None:
            info = self.node_info(process)
            return info if info is not None and check(info) else None

        return self.wait_until(passed, timeout, f"{process.name} {what}", process)

    def wait_serving(self, process: Process, timeout: float = 120.0) -> dict:
        """Wait until the node is online with blocks to serve (its `info` reply; that reply)."""
        return self.wait_node(process, lambda info: info["state"] == "online" and bool(info["spans"]), timeout,
                              "serving")

    def maddr_of(self, process: Process, timeout: float = 30.0) -> str:
        """A multiaddr other peers can join through: where this swarm's reader reaches the node."""
        self.wait_node(process, lambda info: True, timeout, "answering info")
        assert process.peer_id is not None, "nodes are started with an identity"
        maddrs = [m for m in self.reader.maddrs(process.peer_id)
                  if m.startswith(f"/ip4/{self.host}/tcp/" if self.host else "/ip4/")]
        if not maddrs:
            raise SwarmTimeoutError(f"no TCP address of {process.name} is known to the reader",
                                    code="no_address")
        return maddrs[0]

    def trusted_coordinators(self) -> frozenset[str]:
        """The public half of this swarm's key (what its coordinators sign with), for clients to trust."""
        from swarmnode.identity import load_trusted_keys

        return load_trusted_keys([str(self._swarm_key_path())])

    def status(self, timeout: float = 60.0) -> dict:
        """The `swarmnode status --json` dict of this swarm: placement, leases, every node's record, replicas."""
        return self.reader.status(timeout)

    def wait_status(self, check: Callable[[dict], bool], timeout: float = 120.0, period: float = 0.5, *,
                    read: Callable[[], dict] | None = None) -> dict:
        """Read `status()` (or `read()`, e.g. `lambda: client_status(remote)`) until `check(status)` holds;
        the status that passed. Raises SwarmTimeoutError with the last status when it does not within
        `timeout` s."""
        return wait_until_status(read or self.status, check, timeout, period)

    def placement_version(self) -> int | None:
        """The version of the newest placement this swarm's coordinators published, from the DHT."""
        placement = self.reader.placement()
        return None if placement is None else placement.version

    # --- stopping ------------------------------------------------------------------------------------------
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
        """Stop every process (SIGTERM, then SIGKILL to each group) and the reader."""
        try:
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
        finally:
            if self._reader is not None:
                self._reader.close()
                self._reader = None

    def leftover_pids(self) -> dict[str, list[int]]:
        """Processes still running in the groups this swarm started (each node's, coordinator's and
        bootstrap's own group, `p2pd` daemons included), by process name; empty after a clean `close()`."""
        left: dict[str, list[int]] = {}
        for process in self.processes:
            pids = group_members(process.pid)
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


def _last_match(pattern: re.Pattern, text: str) -> str | None:
    matches = pattern.findall(text)
    return matches[-1] if matches else None


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def group_members(pgid: int) -> list[int]:
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


def peak_open_sessions(process: Process, since: int = 0) -> int:
    """The most inference sessions a node held open at once, counted from its log (`session ID opened` /
    `closed`) after character `since` (e.g. `len(process.log())` read before a run). A measurement of what
    happened between two moments, which the node's `info` reply (open sessions now) cannot give."""
    open_now: set[str] = set()
    peak = 0
    for session, what in _SESSION_RE.findall(process.log()[since:]):
        if what == "opened":
            open_now.add(session)
            peak = max(peak, len(open_now))
        else:
            open_now.discard(session)
    return peak
