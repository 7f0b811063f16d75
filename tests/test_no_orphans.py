"""No command leaves processes behind: every `swarmnode` command that starts a P2P daemon stops it when it
exits, whether it ends on an error (no initial peer reachable) or on SIGTERM / SIGINT.

Each command runs in its own process group; once it has exited, nothing of that group (its `p2pd`
daemons, the DHT's child process) may be left. Failing commands must say what was wrong in one line, not
with a traceback.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

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


def test_commands_stopped_by_a_signal_leave_nothing(model_dir, tmp_path):
    from swarmnode.local_swarm import _MADDR_RE

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
