"""Several "hosts" on one machine: a test bed of Linux network namespaces joined by one bridge.

Each host is a network namespace with its loopback and one veth interface (`eth0`) holding one address of a
private subnet (`10.77.0.0/24` by default) that exists only inside the bed. The bridge lives in a namespace of
its own (the *switch*), so nothing of the bed is added to the machine's own network: beds of parallel runs
never see each other, even with the same subnet, and the machine's other services are out of the bed's reach.
Every namespace name starts with `sn<pid>-` (the creating process's pid), so a bed's leftovers are
recognisable: :func:`clean_stale` deletes those whose creator is dead.

Processes run on a host with `ip netns exec NAME ...` (:meth:`Host.command`); :meth:`Host.entered` moves the
calling thread into a host for a moment, so that a DHT peer forked there (and its `p2pd`) lives on that host.
:meth:`NetnsBed.shape` limits one host's link bandwidth with `tc` (`tbf`; this kernel has no `netem`, so
delay is not available). :meth:`NetnsBed.close` ends every process left in the bed's namespaces (by PID) and
deletes the namespaces, and with them the veth pairs and the bridge; it also runs at interpreter exit.

Needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN) and `ip`/`tc` from iproute2. Where the bed cannot be made,
:class:`NetnsError` says why.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from swarmnode.errors import SwarmError
from swarmnode.testing.local_swarm import _BOOTSTRAP_MADDR_RE, LocalSwarm, Process

__all__ = ["Host", "NetnsBed", "NetnsError", "NetnsSwarm", "announced_maddrs", "clean_stale"]

NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
_STALE_RE = re.compile(r"^sn(\d+)-")


class NetnsError(SwarmError, RuntimeError):
    """The namespace test bed could not be built or changed; the message says which command failed and why."""

    code = "netns_failed"


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise NetnsError(f"`{args[0]}` is not installed (iproute2 provides `ip` and `tc`): {exc}") from None
    if check and result.returncode != 0:
        raise NetnsError(f"`{' '.join(args)}` failed ({result.returncode}): {result.stderr.strip() or result.stdout.strip()}")
    return result


def _namespaces() -> list[str]:
    result = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _kill_in(namespace: str, grace: float = 5.0) -> None:
    """End every process in `namespace` by PID: SIGTERM, then SIGKILL after `grace` s."""
    pids = _pids_in(namespace)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 2.0)
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = [p for p in pids if _pid_alive(p) and not _zombie(p)]
        if not pids:
            return


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _pids_in(namespace: str) -> list[int]:
    result = _run("ip", "netns", "pids", namespace, check=False)
    return [int(p) for p in result.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def _delete_namespace(namespace: str) -> None:
    _kill_in(namespace)
    _run("ip", "netns", "delete", namespace, check=False)


def clean_stale() -> list[str]:
    """Delete the namespaces of beds whose creating process is dead (`sn<pid>-...` with no such pid), ending
    any process still in them; the names deleted."""
    stale = []
    for namespace in _namespaces():
        match = _STALE_RE.match(namespace)
        if match and not _pid_alive(int(match.group(1))):
            stale.append(namespace)
    for namespace in sorted(stale, key=lambda n: n.endswith("-switch")):  # hosts first, then their switch
        _delete_namespace(namespace)
    return stale


@dataclass
class Host:
    """One host of the bed: a network namespace with `lo` and `eth0` (`address` on the bed's subnet)."""

    name: str  # the host's short name in the bed, e.g. "node-1"
    namespace: str  # the network namespace's name, e.g. "sn1234-node-1"
    address: str  # its IPv4 address on the bed's subnet
    index: int
    veth: str = ""  # the switch-side end of its link
    gateway: str | None = None  # behind NAT: the name of its router host (`NetnsBed.behind_nat`)

    def command(self, args: list[str]) -> list[str]:
        """`args` run on this host (`ip netns exec NAMESPACE ...`: the process keeps its pid)."""
        return ["ip", "netns", "exec", self.namespace, *args]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run(*self.command(list(args)), check=check)

    @contextlib.contextmanager
    def entered(self):
        """Move the calling thread into this host's network namespace, and back on exit. Sockets made and
        processes forked meanwhile (a DHT peer, its `p2pd`) belong to the host."""
        libc = ctypes.CDLL(None, use_errno=True)
        with open("/proc/thread-self/ns/net") as own, open(NETNS_DIR / self.namespace) as target:
            if libc.setns(target.fileno(), CLONE_NEWNET) != 0:
                errno = ctypes.get_errno()
                raise NetnsError(f"cannot enter network namespace {self.namespace}: {os.strerror(errno)}")
            try:
                yield self
            finally:
                if libc.setns(own.fileno(), CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise NetnsError(f"cannot go back to this thread's network namespace: {os.strerror(errno)}")


@dataclass
class NetnsBed:
    """A bed of hosts (network namespaces) on one bridge; see the module's docstring. Use it as a context
    manager, or call :meth:`close`: it also runs at interpreter exit."""

    subnet: str = "10.77.0.0/24"
    prefix: str = field(default_factory=lambda: f"sn{os.getpid()}-")
    hosts: dict[str, Host] = field(default_factory=dict)

    def __post_init__(self):
        self.network = ipaddress.ip_network(self.subnet)
        self.switch = f"{self.prefix}switch"
        self._closed = False
        self._open()
        atexit.register(self.close)

    def _open(self) -> None:
        if os.geteuid() != 0:
            raise NetnsError("the namespace test bed needs root (it creates network namespaces, veth pairs and a "
                             f"bridge); this process runs as uid {os.geteuid()}")
        clean_stale()
        if self.switch in _namespaces():
            raise NetnsError(f"namespace {self.switch} exists already: another bed of this process is open")
        _run("ip", "netns", "add", self.switch)
        try:
            self._in_switch("ip", "link", "set", "lo", "up")
            self._in_switch("ip", "link", "add", "br0", "type", "bridge")
            self._in_switch("ip", "link", "set", "br0", "up")
        except NetnsError:
            self.close()
            raise

    def _in_switch(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run("ip", "netns", "exec", self.switch, *args, check=check)

    # --- hosts ---------------------------------------------------------------------------------------
    def host(self, name: str) -> Host:
        """The host called `name`, made (namespace, veth pair on the bridge, address, routes) when missing."""
        if self._closed:
            raise NetnsError("this bed is closed")
        if name in self.hosts:
            return self.hosts[name]
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,40}", name):
            raise NetnsError(f"{name!r} is not a usable host name (letters, digits, '_', '.', '-')")
        index = len(self.hosts) + 1
        addresses = list(self.network.hosts())
        if index >= len(addresses):
            raise NetnsError(f"subnet {self.subnet} has no address left for {name}")
        address = str(addresses[index - 1])
        host = Host(name, f"{self.prefix}{name}", address, index)
        outside, inside = f"{self.prefix}v{index}", f"{self.prefix}i{index}"  # interface names: <= 15 chars
        if len(outside) > 15:
            raise NetnsError(f"interface name {outside} is too long for Linux (15 characters)")
        _run("ip", "netns", "add", host.namespace)
        self.hosts[name] = host
        # both ends are made in the host's namespace, then one end goes to the switch: nothing touches the
        # machine's own namespace
        host.run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        host.run("ip", "link", "set", outside, "netns", self.switch)
        host.run("ip", "link", "set", inside, "name", "eth0")
        host.run("ip", "link", "set", "lo", "up")
        host.run("ip", "addr", "add", f"{address}/{self.network.prefixlen}", "dev", "eth0")
        host.run("ip", "link", "set", "eth0", "up")
        self._in_switch("ip", "link", "set", outside, "master", "br0")
        self._in_switch("ip", "link", "set", outside, "up")
        host.veth = outside
        return host

    def behind_nat(self, name: str) -> Host:
        """A host behind NAT, made when missing: its own namespace on a private link (`192.168.N.0/24`) to a
        router host `NAME-gw` on the bridge, which masquerades what the host sends out and drops every
        connection from outside that the host did not open (`nft`): the host can dial every host of the bed,
        and no host can dial it, as with a home router."""
        if name in self.hosts:
            return self.hosts[name]
        if shutil.which("nft") is None:
            raise NetnsError("`nft` is not installed: hosts behind NAT need it (apt-get install nftables)")
        router = self.host(f"{name}-gw")
        behind = sum(1 for h in self.hosts.values() if h.gateway is not None)
        lan = ipaddress.ip_network(f"192.168.{100 + behind}.0/24")
        inside, gateway = (str(a) for a in list(lan.hosts())[1::-1])  # .2 for the host, .1 for the router
        host = Host(name, f"{self.prefix}{name}", inside, len(self.hosts) + 1, gateway=router.name)
        link = f"{self.prefix}n{behind}"
        if len(link) > 15:
            raise NetnsError(f"interface name {link} is too long for Linux (15 characters)")
        _run("ip", "netns", "add", host.namespace)
        self.hosts[name] = host
        router.run("ip", "link", "add", "lan0", "type", "veth", "peer", "name", link)
        router.run("ip", "link", "set", link, "netns", host.namespace)
        host.run("ip", "link", "set", link, "name", "eth0")
        router.run("ip", "addr", "add", f"{gateway}/{lan.prefixlen}", "dev", "lan0")
        router.run("ip", "link", "set", "lan0", "up")
        host.run("ip", "link", "set", "lo", "up")
        host.run("ip", "addr", "add", f"{inside}/{lan.prefixlen}", "dev", "eth0")
        host.run("ip", "link", "set", "eth0", "up")
        host.run("ip", "route", "add", "default", "via", gateway)
        router.run("sysctl", "-qw", "net.ipv4.ip_forward=1")
        rules = "\n".join([
            "table ip swarmnode_nat {",
            "  chain postrouting {",
            "    type nat hook postrouting priority srcnat; policy accept;",
            f"    oifname \"eth0\" ip saddr {lan} masquerade",
            "  }",
            "  chain forward {",
            "    type filter hook forward priority filter; policy drop;",
            "    iifname \"lan0\" oifname \"eth0\" accept",
            "    iifname \"eth0\" oifname \"lan0\" ct state established,related accept",
            "  }",
            "}",
            "",
        ])
        result = subprocess.run(router.command(["nft", "-f", "-"]), input=rules, capture_output=True, text=True,
                                timeout=30)
        if result.returncode != 0:
            raise NetnsError(f"nft could not set up NAT on {router.name}: {result.stderr.strip()}")
        return host

    def shape(self, host: Host | str, rate: str, *, burst: str = "64kb", latency: str = "50ms",
              direction: str = "both") -> None:
        """Limit `host`'s link to `rate` (a `tc` rate: "10mbit", "500kbit") with a token bucket (`tbf`):
        "egress" (what it sends), "ingress" (what it receives: shaped on the switch's end), or "both"."""
        host = self.host(host) if isinstance(host, str) else host
        if direction not in ("egress", "ingress", "both"):
            raise NetnsError(f"direction must be egress, ingress or both, not {direction!r}")
        qdisc = ["tbf", "rate", rate, "burst", burst, "latency", latency]
        if direction in ("egress", "both"):
            host.run("tc", "qdisc", "replace", "dev", "eth0", "root", *qdisc)
        if direction in ("ingress", "both"):
            self._in_switch("tc", "qdisc", "replace", "dev", host.veth, "root", *qdisc)

    def unshape(self, host: Host | str) -> None:
        """Take every limit off `host`'s link."""
        host = self.host(host) if isinstance(host, str) else host
        host.run("tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        self._in_switch("tc", "qdisc", "del", "dev", host.veth, "root", check=False)

    def end_processes(self, host: Host | str | None = None) -> None:
        """End every process on `host` (all hosts when None) by PID."""
        hosts = list(self.hosts.values()) if host is None else [self.host(host) if isinstance(host, str) else host]
        for each in hosts:
            _kill_in(each.namespace)

    # --- teardown ------------------------------------------------------------------------------------
    def close(self) -> None:
        """End the bed's processes and delete its namespaces (and so its veths and bridge); safe twice."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts.values():
            _delete_namespace(host.namespace)
        _delete_namespace(self.switch)
        self.hosts.clear()
        atexit.unregister(self.close)

    def __enter__(self) -> NetnsBed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class NetnsSwarm(LocalSwarm):
    """A :class:`LocalSwarm` whose processes each run on their own host of `bed` (the host is named after the
    process), started with no address options at all (`host` None: the commands' defaults), joining through
    the multiaddr the bootstrap printed for its own host's address. The swarm's reader (a client-mode DHT
    peer of this process) runs on the host `reader_host`. Processes are stopped as a LocalSwarm's are; the
    bed's hosts stay for the next swarm."""

    bed: NetnsBed | None = None
    host: str | None = None
    reader_host: str = "reader"

    def __post_init__(self):
        if self.bed is None:
            raise NetnsError("a NetnsSwarm needs a bed (NetnsBed) to run its processes in")
        super().__post_init__()

    def host_of(self, name: str) -> Host:
        """The bed's host that runs process `name` (made when missing)."""
        assert self.bed is not None, "`__post_init__` refuses a swarm without a bed"
        return self.bed.host(name.replace("~", "-"))

    def command_line(self, name: str, args: list[str]) -> list[str]:
        return self.host_of(name).command(super().command_line(name, args))

    def bootstrap_maddr(self, process: Process) -> str | None:
        from swarmnode.dht import maddr_host

        address = self.host_of(process.name).address
        return next((m for m in _BOOTSTRAP_MADDR_RE.findall(process.log()) if maddr_host(m) == address), None)

    @property
    def reader(self):
        if self._reader is None:
            with self.host_of(self.reader_host).entered():  # its DHT process and p2pd are forked there
                return super().reader
        return self._reader

    def run_python(self, host: Host | str, code: str, args: list[str], *, timeout: float,
                   name: str = "script") -> subprocess.CompletedProcess:
        """Run `python -c CODE ARGS` on `host` in its own process group, with this swarm's environment, and
        wait for it (its group is killed after `timeout` s, and the error says so with its output)."""
        import sys

        host = self.host_of(host) if isinstance(host, str) else host
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE",
               **self.env}
        popen = subprocess.Popen(host.command([sys.executable, "-c", code, *args]), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        try:
            out, err = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            out, err = popen.communicate()
            raise NetnsError(f"{name} on {host.name} did not finish within {timeout:.0f} s:\n{out[-2000:]}\n"
                             f"{err[-3000:]}") from None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)  # whatever it left behind (its p2pd daemons)
        return subprocess.CompletedProcess(popen.args, popen.returncode, out, err)


def error_tail(stderr: str, limit: int = 4000) -> str:
    """The last `limit` characters of a process's stderr without asyncio's "Task exception was never retrieved"
    reports (a client's P2P daemon connections reset as it exits print one each, and they crowd out the error
    that made it exit)."""
    kept: list[str] = []
    skipping = False
    for line in stderr.splitlines():
        if line.startswith("Task exception was never retrieved"):
            skipping = True
            continue
        if skipping:
            if line.startswith((" ", "future:", "Traceback")):
                continue
            skipping = False
            if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line):  # the report's own last line
                continue
        kept.append(line)
    return "\n".join(kept)[-limit:]


def announced_maddrs(reader, peer_id: str, timeout: float = 10.0) -> list[str]:
    """The addresses the swarm gives for `peer_id`: what the reader's `p2pd` answers to a libp2p DHT
    FIND_PEER (its peer store: the addresses the peer announced through libp2p's identify protocol, which
    every other peer dials)."""
    from hivemind.p2p import PeerID
    from hivemind.p2p.p2p_daemon_bindings.utils import raise_if_failed, read_pbmsg_safe, write_pbmsg
    from hivemind.proto import p2pd_pb2
    from hivemind.utils.multiaddr import Multiaddr

    async def find() -> list[str]:
        # hivemind's client has no call for this request of the daemon's control protocol: sent by hand
        connector = reader.p2p._client.control.daemon_connector
        stream_reader, writer = await connector.open_connection()
        try:
            request = p2pd_pb2.Request(type=p2pd_pb2.Request.DHT, dht=p2pd_pb2.DHTRequest(
                type=p2pd_pb2.DHTRequest.FIND_PEER, peer=PeerID.from_base58(peer_id).to_bytes(),
                timeout=int(timeout)))
            await write_pbmsg(writer, request)
            response = p2pd_pb2.Response()
            await read_pbmsg_safe(stream_reader, response)
        finally:
            writer.close()
        raise_if_failed(response)
        return [str(Multiaddr(a)) for a in response.dht.peer.addrs]

    return reader.loop.run(find(), timeout + 5)
