"""The fork server starts a command as `python -m` would: same output, exit status, signals and environment.

Each check runs the real command both ways, forked and with `exec`, and compares what a user would see.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from swarmnode.runtime.footprint import tree_pss
from swarmnode.testing.forkserver import ForkedProcess, ForkServer, _unknown_shared_locks
from swarmnode.testing.local_swarm import LocalSwarm, group_members

pytestmark = pytest.mark.swarm


def _exec(args: list[str], log_path, env: dict[str, str]) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "swarmnode", *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)


@pytest.fixture
def env(tmp_path):
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "SWARMNODE_KEY_DIR": str(tmp_path / "keys")}


def test_a_refused_command_exits_and_says_the_same_both_ways(fork_server, tmp_path, env):
    args = ["join", "--model", str(tmp_path / "no-such-model"), "--blocks", "0:2"]
    forked = fork_server.spawn("swarmnode", args, log_path=tmp_path / "forked.log", env=env)
    assert isinstance(forked, ForkedProcess)
    executed = _exec(args, tmp_path / "exec.log", env)
    assert forked.wait(120) == executed.wait(120) != 0
    said = (tmp_path / "forked.log").read_text(), (tmp_path / "exec.log").read_text()
    assert "no-such-model" in said[0] and said[0] == said[1], said


def test_a_bootstrap_serves_and_stops_on_sigterm_as_exec_does(fork_server, tmp_path, env):
    codes = []
    for way in ("fork", "exec"):
        log_path = tmp_path / f"{way}.log"
        args = ["bootstrap", "--host", "127.0.0.1"]
        process = (fork_server.spawn("swarmnode", args, log_path=log_path, env=env) if way == "fork"
                   else _exec(args, log_path, env))
        try:
            swarm = LocalSwarm("unused", log_dir=tmp_path / way)
            swarm.wait_until(lambda path=log_path: "--initial-peers /ip4/127.0.0.1/" in path.read_text(), 60,
                             "the maddr")
            assert os.getpgid(process.pid) == process.pid, "the command has its own process group"
            os.kill(process.pid, signal.SIGTERM)
            codes.append(process.wait(30))
        finally:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # whatever the command left in its group
            except ProcessLookupError:
                pass
        assert group_members(process.pid) == []
    assert codes[0] == codes[1], codes


def test_the_child_gets_the_callers_environment_and_a_changed_import_time_one_is_refused(tmp_path, env):
    with ForkServer(env={"HF_HUB_OFFLINE": "1"}) as server:
        assert server.can_run({**env, "SWARMNODE_LOG_LEVEL": "DEBUG"})
        assert not server.can_run({**env, "HF_HOME": str(tmp_path / "elsewhere")}), "HF_HOME is read at import"
        # a bad log level is refused by the command, with the level named: the child saw the caller's value
        process = server.spawn("swarmnode", ["bootstrap", "--host", "127.0.0.1"], log_path=tmp_path / "b.log",
                               env={**env, "SWARMNODE_LOG_LEVEL": "NOISY"})
        assert process.wait(60) != 0
        assert "NOISY" in (tmp_path / "b.log").read_text()


def test_a_local_swarm_forks_unless_its_command_line_runs_elsewhere(fork_server, model_dir, tmp_path):
    class Wrapped(LocalSwarm):
        def command_line(self, name, args):
            return ["env", *super().command_line(name, args)]

    with LocalSwarm(model_dir, log_dir=tmp_path / "plain") as plain, \
            Wrapped(model_dir, log_dir=tmp_path / "wrapped") as wrapped:
        assert plain.fork_server is fork_server
        assert isinstance(plain.spawn("boot", ["bootstrap", "--host", "127.0.0.1"]).popen, ForkedProcess)
        assert isinstance(wrapped.spawn("boot", ["bootstrap", "--host", "127.0.0.1"]).popen, subprocess.Popen)


def test_a_forked_node_holds_and_measures_what_an_execed_one_does(fork_server, model_dir, tmp_path):
    """The pages a child shares with the server are made its own (`_own_private_pages`), so the node's
    footprint, and so the overhead it measures and the KV cache it offers, is an `exec`ed node's."""
    footprints = {}
    for way, server in (("fork", fork_server), ("exec", None)):
        with LocalSwarm(model_dir, log_dir=tmp_path / way, fork_server=server) as swarm:
            swarm.start_bootstrap()
            node = swarm.start_node(0, 2, name="node")
            assert isinstance(node.popen, ForkedProcess) == (server is not None)
            footprints[way] = tree_pss(node.pid)
    assert abs(footprints["fork"] - footprints["exec"]) < 0.15 * footprints["exec"], footprints


def test_a_child_killed_holding_hivemind_locks_leaves_them_free_for_the_next(fork_server, tmp_path, env):
    # hivemind's multiprocessing locks, made when the server imported it, are each child's own: a node killed
    # while its DHT process held one must not leave every later node's DHT process waiting for it
    holder = fork_server.spawn("tests.forked_lock_probe", ["hold"], log_path=tmp_path / "hold.log", env=env)
    try:
        deadline = time.monotonic() + 60
        while "holding every lock" not in (tmp_path / "hold.log").read_text():
            assert holder.poll() is None and time.monotonic() < deadline, (tmp_path / "hold.log").read_text()
            time.sleep(0.1)
    finally:
        holder.kill()
    assert holder.wait(10) == -signal.SIGKILL
    taker = fork_server.spawn("tests.forked_lock_probe", ["take"], log_path=tmp_path / "take.log", env=env)
    assert taker.wait(60) == 0, (tmp_path / "take.log").read_text()
    assert "took every lock" in (tmp_path / "take.log").read_text()


def test_a_process_shared_lock_the_server_does_not_know_is_named():
    # the server refuses to fork while such a lock exists (a child could not make it its own)
    lock = multiprocessing.Lock()
    assert any(f"{id(lock):#x}" in found for found in _unknown_shared_locks())
