"""No process leaves processes behind: every `swarmnode` command that starts a P2P daemon stops it when it
exits, whether it ends on an error (no initial peer reachable) or on SIGTERM / SIGINT, and a client that
ends without `shutdown()` (an uncaught exception, `os._exit`, SIGKILL) takes its DHT process and `p2pd`
daemons down with it.

Each command runs in its own process group; once it has exited, nothing of that group (its `p2pd`
daemons, the DHT's child process) may be left. Failing commands must say what was wrong in one line, not
with a traceback. A dying client's leftovers are looked for by PID (its descendants, recorded while it
ran) and by an environment marker that every process it starts inherits.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from swarmnode.testing.other_program import http_port

pytestmark = pytest.mark.swarm

# a well-formed address where nothing listens
UNREACHABLE = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWF4wEr5XtqQayPrXS8NnvDGNZqpszHir9fBj4b7KJ3i9j"


def _group(pgid: int) -> list[str]:
    out = subprocess.run(["ps", "-e", "-o", "pgid=,pid=,args="], capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines() if line.split(None, 1)[0] == str(pgid)]


def _spawn(args: list[str], tmp_path, name: str) -> tuple[subprocess.Popen, object]:
    log = open(tmp_path / f"{name}.log", "w+b")  # noqa: SIM115 (closed by the caller, after the process)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SWARMNODE_KEY_DIR": str(tmp_path / "keys")}
    popen = subprocess.Popen([sys.executable, "-m", "swarmnode", *args], stdout=log, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    return popen, log


def _assert_group_gone(pgid: int, what: str) -> None:
    deadline = time.monotonic() + 15
    while _group(pgid) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _group(pgid)
    if left:
        os.killpg(pgid, signal.SIGKILL)
    assert not left, f"{what} left processes behind: {left}"


# the line `swarmnode bootstrap` prints for each of its addresses
_MADDR_RE = re.compile(r"^--initial-peers (\S+)", re.MULTILINE)
_API_RE = re.compile(r"^API (http://\S+)", re.MULTILINE)


def _ready(marker: str | re.Pattern, output: str) -> bool:
    """The command is up: its marker line is out, and for the API server, it answers HTTP."""
    if isinstance(marker, str):
        return marker in output
    match = marker.search(output)
    if match is None:
        return False
    try:
        with urllib.request.urlopen(match.group(1) + "/v1/models", timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


def _output(log) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")


def test_commands_that_cannot_reach_the_swarm_fail_clearly_and_leave_nothing(model_dir, tmp_path):
    model = str(model_dir)
    commands = {
        "status": ["status", "--model", model, "--initial-peers", UNREACHABLE],
        "generate": ["generate", "--model", model, "--initial-peers", UNREACHABLE, "hello"],
        "coordinate": ["coordinate", "--model", model, "--host", "127.0.0.1", "--initial-peers", UNREACHABLE],
        "join": ["join", "--model", model, "--host", "127.0.0.1", "--blocks", "0:30", "--num-threads", "1",
                 "--initial-peers", UNREACHABLE],
        "api": ["api", "--model", model, "--host", "127.0.0.1", "--port", "0", "--initial-peers", UNREACHABLE],
    }
    running = {name: _spawn(args, tmp_path, name) for name, args in commands.items()}  # in parallel: each waits
    try:
        for name, (popen, log) in running.items():
            code = popen.wait(180)
            out = _output(log)
            assert code != 0, f"{name} exited 0 without reaching the swarm:\n{out[-2000:]}"
            assert "could not reach any initial peer" in out, f"{name} did not say what was wrong:\n{out[-2000:]}"
            assert "Traceback" not in out, f"{name} failed with a traceback:\n{out[-3000:]}"
            _assert_group_gone(popen.pid, name)
    finally:
        for popen, log in running.values():
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait(10)
            log.close()


def test_an_initial_peer_that_speaks_another_protocol_is_named(model_dir, tmp_path):
    """The address names a port where another program answers (here a server that writes an HTTP reply and
    closes): the commands say that something answers there but not as the swarm's peer, and leave nothing."""
    with http_port() as port:
        other = f"/ip4/127.0.0.1/tcp/{port}/p2p/{UNREACHABLE.rsplit('/', 1)[-1]}"
        model = str(model_dir)
        commands = {
            "generate": ["generate", "--model", model, "--initial-peers", other, "hello"],
            "join": ["join", "--model", model, "--host", "127.0.0.1", "--blocks", "0:30", "--num-threads", "1",
                     "--initial-peers", other],
        }
        running = {name: _spawn(args, tmp_path, name) for name, args in commands.items()}
        try:
            for name, (popen, log) in running.items():
                code = popen.wait(180)
                out = _output(log)
                assert code != 0, f"{name} exited 0:\n{out[-2000:]}"
                assert "something answers at" in out and "not as the swarm peer" in out, out[-2000:]
                assert "Traceback" not in out, out[-3000:]
                _assert_group_gone(popen.pid, name)
        finally:
            for popen, log in running.values():
                if popen.poll() is None:
                    os.killpg(popen.pid, signal.SIGKILL)
                    popen.wait(10)
                log.close()


def test_commands_stopped_by_a_signal_leave_nothing(model_dir, tmp_path):
    model = str(model_dir)
    bootstrap, boot_log = _spawn(["bootstrap", "--host", "127.0.0.1", "--port", "0"], tmp_path, "bootstrap")
    started = []
    try:
        deadline = time.monotonic() + 60
        while not (match := _MADDR_RE.search(_output(boot_log))):
            assert bootstrap.poll() is None and time.monotonic() < deadline, _output(boot_log)
            time.sleep(0.2)
        peers = ["--initial-peers", match.group(1)]
        status = subprocess.run([sys.executable, "-m", "swarmnode", "status", "--model", model, "--json", *peers],
                                capture_output=True, text=True, timeout=120, start_new_session=True,
                                env={**os.environ, "SWARMNODE_KEY_DIR": str(tmp_path / "keys")})
        assert status.returncode == 0, status.stderr[-2000:]
        long_running = {
            "coordinate": (["coordinate", "--model", model, "--host", "127.0.0.1", *peers], signal.SIGTERM,
                           "COORDINATOR "),
            "api": (["api", "--model", model, "--host", "127.0.0.1", "--port", "0", *peers], signal.SIGINT,
                    _API_RE),
        }
        for name, (args, sig, ready) in long_running.items():
            popen, log = _spawn(args, tmp_path, name)
            started.append((popen, log))
            deadline = time.monotonic() + 120
            while not _ready(ready, _output(log)):
                assert popen.poll() is None and time.monotonic() < deadline, f"{name}:\n{_output(log)[-2000:]}"
                time.sleep(0.2)
            os.kill(popen.pid, sig)  # the process itself, as an operator's kill or Ctrl-C does
            code = popen.wait(60)
            assert code == 0, f"{name} exited {code} on {sig.name}:\n{_output(log)[-2000:]}"
            _assert_group_gone(popen.pid, name)
        os.kill(bootstrap.pid, signal.SIGTERM)
        assert bootstrap.wait(60) == 0, _output(boot_log)[-2000:]
        _assert_group_gone(bootstrap.pid, "bootstrap")
    finally:
        for popen, log in [(bootstrap, boot_log), *started]:
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGKILL)
                popen.wait(10)
            log.close()


# A real swarm client: it joins the DHT through the bootstrap, says READY, and ends as the test says on stdin.
_CLIENT = """
import os, sys, time
from swarmnode.client import DistributedModelForCausalLM

model = DistributedModelForCausalLM.from_pretrained(sys.argv[1], initial_peers=[sys.argv[2]])
print("READY", flush=True)
ending = sys.stdin.readline().strip()
if ending == "exception":
    raise RuntimeError("the client failed without shutting down")
if ending == "os_exit":
    os._exit(1)
time.sleep(600)  # until the test kills it
"""
_MARKER_ENV = "SWARMNODE_TEST_ORPHAN_MARKER"


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time in clock ticks) of a process, or None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return int(fields[1]), fields[0], int(fields[19])


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _descendants(root: int) -> dict[int, tuple[int, str]]:
    """Every live descendant of `root`: pid -> (start time, command name)."""
    children: dict[int, list[int]] = {}
    for pid in _pids():
        stat = _stat(pid)
        if stat is not None:
            children.setdefault(stat[0], []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        stat = _stat(pid)
        if stat is None or stat[1] == "Z":
            continue
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except FileNotFoundError:
            continue
        found[pid] = (stat[2], name)
        todo += children.get(pid, [])
    return found


def _running(pid: int, start: int) -> bool:
    """Whether that process (not a later one that reused its pid) still runs; a zombie runs nothing."""
    stat = _stat(pid)
    return stat is not None and stat[2] == start and stat[1] != "Z"


def _marked(marker: str) -> dict[int, int]:
    """Every running process whose environment holds `marker`: pid -> start time."""
    needle = f"{_MARKER_ENV}={marker}".encode()
    found = {}
    for pid in _pids():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        stat = _stat(pid)
        if needle in environ.split(b"\0") and stat is not None and stat[1] != "Z":
            found[pid] = stat[2]
    return found


def _kill_all(processes: dict[int, int]) -> None:
    for pid, start in processes.items():
        if _running(pid, start):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def bootstrap_peer(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("orphans-bootstrap")
    popen, log = _spawn(["bootstrap", "--host", "127.0.0.1", "--port", "0"], tmp_path, "bootstrap")
    try:
        deadline = time.monotonic() + 60
        while not (match := _MADDR_RE.search(_output(log))):
            assert popen.poll() is None and time.monotonic() < deadline, _output(log)
            time.sleep(0.2)
        yield match.group(1)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
        popen.wait(10)
        log.close()


@pytest.mark.parametrize("ending", ["exception", "os_exit", "sigkill"])
def test_a_client_that_ends_without_shutdown_leaves_nothing(model_dir, bootstrap_peer, tmp_path, ending):
    marker = uuid.uuid4().hex
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SWARMNODE_KEY_DIR": str(tmp_path / "keys"), _MARKER_ENV: marker}
    log = open(tmp_path / "client.log", "w+b")  # noqa: SIM115 (closed below, after the process)
    client = subprocess.Popen([sys.executable, "-c", _CLIENT, str(model_dir), bootstrap_peer], stdin=subprocess.PIPE,
                              stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    started: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 180
        while "READY" not in _output(log):
            assert client.poll() is None and time.monotonic() < deadline, f"the client did not start:\n{_output(log)}"
            time.sleep(0.2)
        family = _descendants(client.pid)
        started = {pid: start for pid, (start, _) in family.items()}
        names = sorted(name for _, name in family.values())
        assert "p2pd" in names and len(family) >= 2, f"expected the DHT process and its p2pd, found {names}"
        assert set(started) <= set(_marked(marker)), "the environment marker did not reach every process"

        if ending == "sigkill":
            os.kill(client.pid, signal.SIGKILL)
        else:
            client.stdin.write(f"{ending}\n".encode())
            client.stdin.flush()
        code = client.wait(60)
        expected = {"exception": 1, "os_exit": 1, "sigkill": -signal.SIGKILL}[ending]
        assert code == expected, f"the client exited {code}:\n{_output(log)[-2000:]}"
        if ending == "exception":
            assert "the client failed without shutting down" in _output(log)

        deadline = time.monotonic() + 30
        while True:
            left = {pid: family[pid] for pid, start in started.items() if _running(pid, start)}
            marked = _marked(marker)
            if not (left or marked) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not left, f"the client's processes outlived it ({ending}): {left}"
        assert not marked, f"processes started by the client outlived it ({ending}): {sorted(marked)}"
    finally:
        if client.poll() is None:
            client.kill()
        client.wait(10)
        _kill_all(started)
        _kill_all(_marked(marker))
        try:
            os.killpg(client.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is empty: nothing was left
            pass
        client.stdin.close()
        log.close()
