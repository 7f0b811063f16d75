"""Starting a DHT peer the way every swarmnode process does: signed records, and no process left behind.

Bootstrap peers, nodes, coordinators and clients all validate signed records (`swarmnode.identity`), so
a forged or overwritten record is refused where it is stored and again where it is read.

hivemind runs the DHT in a child process it forks (the *DHT process*), which starts the `p2pd` daemon
(a Go binary) as its own child. Neither would end when the process that started them (the *owner*: a
client, node, coordinator or bootstrap) ends without `shutdown()`: an uncaught exception only sends the
DHT process SIGTERM (multiprocessing's exit handler), whose default action leaves its `p2pd` running, and
`os._exit` or SIGKILL send nothing at all. So the DHT process follows its owner down:

- a thread waits on the owner's pidfd (or polls the parent pid where pidfds are missing); when the owner
  is gone it ends the DHT process's children and then the process itself;
- SIGTERM ends its children before the process exits, instead of leaving them orphaned.

A parent-death signal (`PR_SET_PDEATHSIG`) is not used: it fires when the *thread* that forked the child
exits, and owners may start their DHT from a worker thread that ends long before they do. A `p2pd` that
the DHT process starts in the instant between the owner's death and its own exit is the one thing this
does not end; it never gets a client, and hivemind's `idleTimeout` (30 s) makes it exit by itself.

Readiness. hivemind waits for its DHT process to say it is ready with no time limit, so an owner whose DHT
process was killed or ran out of memory before then would hang without a word. `wait_ready` watches the
process while it waits: one that exits first is a `DHTStartError` at once (`dht_process_died`), and one that
is not ready after `READY_TIMEOUT` s is killed with its `p2pd` and reported (`dht_not_ready`).

Addresses. A peer bound to one address (`--host 10.0.0.5`, `--host 127.0.0.1`) announces that address, as
hivemind does. A peer on all interfaces (`0.0.0.0`, the commands' default) would announce every interface
address `p2pd` finds, loopback included (in its identify replies and in `get_visible_maddrs`, which peers
print and log); libp2p drops loopback addresses that arrive over a non-loopback connection, but an address
list handed to another machine would still offer `127.0.0.1`, where that machine reaches itself or a
stranger. So it announces this machine's non-loopback IPv4 addresses (read once, at start), and loopback
only when its initial peers are on loopback (a swarm on one machine) or the machine has nothing else.
`--announce-host` replaces all of that with one address. `p2pd` refuses port 0 in announced addresses, so a
peer that announces and was given no port picks a free one first (and picks again if it is taken before
the daemon binds it).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import select
import signal
import socket
import threading
import time

import hivemind
import psutil
from hivemind.p2p.p2p_daemon_bindings.control import P2PDaemonError
from hivemind.utils.crypto import RSAPrivateKey

from swarmnode.admission import Admission
from swarmnode.errors import SwarmError
from swarmnode.identity import make_validator
from swarmnode.peer_dial import DialOutcome, dial

logger = logging.getLogger(__name__)

CHILD_GRACE = 2.0  # seconds a child (p2pd) gets to exit on SIGTERM before it is killed
#: Seconds a DHT process may take to be ready (its `p2pd` up, its initial peers tried) before its owner gives up
#: on it (at least twice a given `startup_timeout`); a DHT process that exits first is reported at once.
READY_TIMEOUT = 300.0
READY_POLL = 0.5  # seconds between looks at whether the DHT process still runs while it gets ready
#: Starts tried when no initial peer answers the bootstrap ping (hivemind gives each ping 3 s), or one answers but
#: does not finish the libp2p connection in time: a busy initial peer (a loaded machine, a peer that is itself
#: still starting; 28 nodes starting at once on 2 cores kept a bootstrap from answering for tens of seconds) is
#: tried again before a node gives up. A wrong address fails at once (`swarmnode.peer_dial` tells them apart).
BOOTSTRAP_ATTEMPTS = 5
BOOTSTRAP_RETRY_DELAY = 2.0  # seconds before the second start, doubled before each next one (2, 4, 8, 16)
_NO_PING = "none of the initial_peers responded to a ping"
_BUSY = "busy"  # `_explain`'s code for initial peers that answer but did not finish joining in time
MAX_DIALED = 5  # initial peers dialed again to learn why none could be joined
PARENT_POLL = 0.5  # seconds between looks at the parent pid, where pidfds are not available


class DHTStartError(SwarmError, RuntimeError):
    """The DHT peer could not start: the message says why and what to do (no initial peer answered, the
    address is taken, the daemon did not come up)."""

    code = "dht_start_failed"


ALL_INTERFACES = "0.0.0.0"
PORT_ATTEMPTS = 3  # tries when a port picked here is taken before the daemon binds it


def local_ipv4_addresses() -> list[str]:
    """This machine's IPv4 interface addresses (loopback included), in interface order."""
    addresses = []
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family == socket.AF_INET and entry.address not in addresses:
                addresses.append(entry.address)
    return addresses


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def maddr_host(maddr: str) -> str | None:
    """The IPv4 address of a multiaddr (`/ip4/A/...`), or None when it names none."""
    parts = str(maddr).split("/")
    return parts[2] if len(parts) > 2 and parts[1] == "ip4" else None


def announced_hosts(host: str, announce_host: str | None, initial_peers: list[str]) -> list[str] | None:
    """The addresses a peer listening on `host` announces: `announce_host` when given; for a peer on all
    interfaces, this machine's non-loopback addresses, plus loopback when an initial peer is on loopback
    (a swarm on this machine) or when the machine has no other address; None: announce what it listens on
    (hivemind's default, for a peer bound to one address)."""
    if announce_host:
        return [announce_host]
    if host != ALL_INTERFACES:
        return None
    addresses = local_ipv4_addresses()
    outside = [a for a in addresses if not is_loopback(a)]
    on_loopback = any(h is not None and is_loopback(h) for h in map(maddr_host, initial_peers))
    loopback = [a for a in addresses if is_loopback(a)][:1] or ["127.0.0.1"]
    return outside + loopback if on_loopback or not outside else outside


def pick_port(host: str) -> int:
    """A TCP port free on `host` now (the OS picks it), for a peer that must announce its port up front."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start_dht(initial_peers: list[str] | None = None, *, host: str = "127.0.0.1", port: int = 0,
              announce_host: str | None = None, identity_path: str | None = None, client_mode: bool = False,
              key: RSAPrivateKey | None = None, admission: Admission | None = None, **kwargs) -> hivemind.DHT:
    """A DHT peer listening on `host`:`port` (not in client mode). A peer on all interfaces (`0.0.0.0`) or
    with `announce_host` announces the addresses of :func:`announced_hosts`, never `0.0.0.0` itself; since
    announced addresses need a port, `port` 0 then means a free port picked here first. With `admission` (a
    private swarm) it starts with the admitted identity and signs and checks every DHT message with
    invitations (`membership.SwarmAuthorizer`)."""
    options = dict(num_workers=2)
    options.update(kwargs)
    if admission is not None:
        from swarmnode.membership import SwarmAuthorizer

        if identity_path is not None and identity_path != admission.identity.path:
            raise DHTStartError(f"identity {identity_path} is not the one admitted ({admission.identity.path})",
                                code="bad_identity")
        identity_path = admission.identity.path
        options["authorizer"] = SwarmAuthorizer(admission)
    peers = list(initial_peers or [])
    announce_to = None if client_mode else announced_hosts(host, announce_host, peers)
    attempts = PORT_ATTEMPTS if announce_to and port == 0 else 1
    attempt = bootstraps = 0
    while True:
        chosen = pick_port(host) if announce_to and port == 0 else port
        host_maddrs = None if client_mode else [f"/ip4/{host}/tcp/{chosen}"]
        announce = [f"/ip4/{a}/tcp/{chosen}" for a in announce_to] if announce_to else None
        dht = _FollowingDHT(
            initial_peers=peers, start=False, host_maddrs=host_maddrs, announce_maddrs=announce,
            identity_path=identity_path, client_mode=client_mode, record_validators=[make_validator(key)],
            **options,
        )
        try:
            dht.run_in_background(await_ready=False)
            wait_ready(dht, max(READY_TIMEOUT, 2 * float(options.get("startup_timeout", 0))))
            return dht
        except P2PDaemonError as exc:
            code, message = _explain(str(exc), peers, host_maddrs)
            attempt += 1
            if code == "address_in_use" and attempt < attempts:  # the picked port was taken meanwhile
                continue
            if code != _BUSY:
                raise DHTStartError(message, code=code) from None
            _stop_quietly(dht)
        except RuntimeError as exc:  # hivemind's own bootstrap failure, raised in the DHT process
            if _NO_PING not in str(exc):
                raise
            _stop_quietly(dht)
            message = "none answered a ping within hivemind's 3 s"
        bootstraps += 1
        if bootstraps >= BOOTSTRAP_ATTEMPTS:
            raise DHTStartError(
                f"could not join the initial peers ({', '.join(peers)[:300]}) in {BOOTSTRAP_ATTEMPTS} starts "
                f"({message}): check that they run, that this machine can reach their addresses, and the load of "
                f"both machines" + _PRIVATE_HINT[admission is not None], code="bootstrap_failed") from None
        delay = BOOTSTRAP_RETRY_DELAY * 2 ** (bootstraps - 1)
        logger.warning("could not join the initial peers (%s): %s (start %d of %d); trying again in %.0f s",
                       ", ".join(peers)[:300], message, bootstraps, BOOTSTRAP_ATTEMPTS, delay)
        time.sleep(delay)


_PRIVATE_HINT = {
    False: "; if the swarm is private, its peers answer only peers with an invitation (--invitation with "
           "--identity, or --owner-key)",
    True: "; if they run a swarm of another owner, or this peer's invitation was revoked, they drop every "
          "message from it",
}


def _stop_quietly(dht: hivemind.DHT) -> None:
    """End a DHT peer whose start failed (its process and `p2pd`), ignoring what is already gone."""
    try:
        dht.shutdown()
    except Exception:  # safe: a failed start may have left nothing to stop
        pass
    if dht.is_alive():
        dht.join(CHILD_GRACE)


def wait_ready(dht: hivemind.DHT, timeout: float) -> None:
    """Wait until `dht`'s process is ready, or raise what went wrong there (hivemind's P2PDaemonError, say).

    hivemind's own wait has no end when the DHT process dies before it says it is ready (killed, or out of
    memory): the owner would hang without a word. Here a DHT process that exits first is a DHTStartError at
    once, and one that is still not ready after `timeout` s is ended (with its `p2pd`) and reported."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            dht.wait_until_ready(timeout=READY_POLL)
            return
        except TimeoutError:  # concurrent.futures' (the builtin since Python 3.11): not ready yet
            pass
        if not dht.is_alive():
            try:  # what it sent just before it exited (an error it caught) comes first
                dht.wait_until_ready(timeout=1.0)
                return
            except TimeoutError:
                pass
            raise DHTStartError(f"the DHT process (pid {dht.pid}) exited with status {dht.exitcode} before it was "
                                f"ready: was it killed, or out of memory? Start again; if it keeps happening, check "
                                f"that hivemind's `p2pd` runs on this machine", code="dht_process_died")
        if time.monotonic() > deadline:
            _end_stuck(dht)
            raise DHTStartError(f"the DHT process was not ready within {timeout:.0f} s: the P2P daemon or the "
                                f"initial peers did not answer; check the addresses and the machine's load",
                                code="dht_not_ready")


def _end_stuck(dht: hivemind.DHT) -> None:
    """SIGKILL a DHT process that never got ready, its `p2pd` first (it may not even take SIGTERM: stopped)."""
    try:
        children = psutil.Process(dht.pid).children(recursive=True)
    except psutil.Error:
        children = []
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
    dht.kill()
    dht.join(CHILD_GRACE)


class _FollowingDHT(hivemind.DHT):
    """hivemind's DHT process, ending (with its `p2pd` daemons) when the process that started it ends."""

    def __init__(self, *args, **kwargs):
        self._owner_pid = os.getpid()  # set before hivemind's __init__, which forks the process
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        follow_owner(self._owner_pid)
        super().run()


def follow_owner(owner_pid: int) -> None:
    """Make the calling process (a child of `owner_pid`) end its children and itself when the owner ends
    or when it receives SIGTERM. Call it in the child's main thread, before it starts anything."""
    signal.signal(signal.SIGTERM, _end_on_signal)
    threading.Thread(target=_watch_owner, args=(owner_pid,), name="swarmnode-follow-owner", daemon=True).start()


def _watch_owner(owner_pid: int) -> None:
    _wait_for_exit(owner_pid)
    logger.warning("the process that started this DHT peer (pid %d) has ended: stopping", owner_pid)
    end_children()
    os._exit(0)


def _wait_for_exit(owner_pid: int) -> None:
    """Return once `owner_pid`, this process's parent, has exited."""
    try:
        pidfd = os.pidfd_open(owner_pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd_open here (not Linux, or a kernel before 5.3): poll instead
        while os.getppid() == owner_pid:
            time.sleep(PARENT_POLL)
        return
    try:
        if os.getppid() != owner_pid:  # it ended before the pidfd was opened, which may name a reused pid
            return
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)  # readable once the process has exited
        poller.poll()
    finally:
        os.close(pidfd)


def _end_on_signal(signum, _frame) -> None:
    end_children()
    os._exit(128 + signum)


def end_children(grace: float = CHILD_GRACE) -> None:
    """End every child of this process (the `p2pd` daemons): SIGTERM, then SIGKILL after `grace` s."""
    try:
        children = psutil.Process().children()
    except psutil.Error as exc:
        logger.warning("cannot list this process's children to stop them: %s", exc)
        return
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:  # already gone
            pass
    _, alive = psutil.wait_procs(children, timeout=grace)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:  # exited between the wait and the kill
            pass
    psutil.wait_procs(alive, timeout=grace)


def _explain(message: str, initial_peers: list[str], host_maddrs: list[str] | None) -> tuple[str, str]:
    """The error's code and a message that says what to do; code `_BUSY` when the start is worth trying again.

    `p2pd` says only that it could not connect to its initial peers; each is dialed again from a bare daemon
    (`swarmnode.peer_dial`) to learn why. A peer that answers now, or whose handshake timed out, was busy."""
    if "failed to connect to bootstrap peers" in message:
        results = [dial(m) for m in initial_peers[:MAX_DIALED]]
        busy = [r for r in results if r.outcome in (DialOutcome.CONNECTED, DialOutcome.TIMED_OUT)]
        if busy:
            return _BUSY, (f"{', '.join(r.address for r in busy)} answered, but the connection did not complete "
                           f"in time")
        wrong = [r for r in results if r.outcome is DialOutcome.WRONG_PEER]
        if wrong:
            return "not_a_peer", "; ".join(
                f"a swarm peer answers at {r.address.rsplit('/p2p/', 1)[0]}, but its peer id is {r.peer_id}, not the "
                f"one after /p2p/ in {r.address}" for r in wrong) + (
                ": use the address `swarmnode bootstrap` printed, whole")
        other = [r for r in results if r.outcome is DialOutcome.NOT_A_PEER]
        if other:  # something listens there, but the libp2p handshake failed
            return "not_a_peer", (
                f"something answers at {', '.join(r.address for r in other)}, but not as the swarm peer that "
                f"address names: another program has that port; use the address `swarmnode bootstrap` printed, "
                f"whole")
        return "unreachable", (f"could not reach any initial peer ({', '.join(initial_peers)}): check the address "
                               f"(the one `swarmnode bootstrap` printed) and that the peer is running and "
                               f"reachable from here")
    if "address already in use" in message.lower():
        return "address_in_use", (f"cannot listen on {', '.join(host_maddrs or [])}: the address is in use; "
                                  f"pick another --port")
    return "daemon_failed", f"the P2P daemon could not start: {message}"
