"""A DHT process that dies or hangs before it is ready is reported, not waited for forever.

hivemind waits for its DHT process to say it is ready with no time limit, so an owner whose DHT process was
killed (or ran out of memory) before then would hang without a word (`swarmnode.dht.wait_ready`). Each case
runs in its own Python process: killing a DHT process mid-start may leave hivemind's process-shared locks
taken in whatever process forked it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_SCRIPT = r"""
import json, os, signal, sys, threading, time
import psutil
from swarmnode import dht as d

sig = getattr(signal, sys.argv[1])
d.READY_TIMEOUT = 4.0
me = psutil.Process()

def strike():  # the DHT process (a fork of this interpreter), the moment hivemind has made it
    while not (forks := [c for c in me.children() if c.exe() == me.exe()]):
        time.sleep(0.002)
    os.kill(forks[0].pid, sig)

threading.Thread(target=strike, daemon=True).start()
began = time.monotonic()
try:
    d.start_dht()
    said = {"code": None}
except d.DHTStartError as error:
    said = {"code": error.code, "message": str(error)}
said["seconds"] = time.monotonic() - began
time.sleep(0.5)
said["left"] = [p.name() for p in me.children(recursive=True) if not p.name().startswith("torch_shm")]
print(json.dumps(said))
"""


def _start_with(signal_name: str) -> dict:
    result = subprocess.run([sys.executable, "-c", _SCRIPT, signal_name], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("signal_name", "code", "within"), [("SIGKILL", "dht_process_died", 10.0),
                                                              ("SIGSTOP", "dht_not_ready", 20.0)])
def test_a_dht_process_that_never_gets_ready_is_an_error_that_says_so(signal_name, code, within):
    said = _start_with(signal_name)
    assert said["code"] == code, said
    assert "DHT process" in said["message"] and said["seconds"] < within, said
    assert said["left"] == [], f"processes outlived the failed start: {said['left']}"


_BUSY_PEER = r"""
import json, os, signal, sys, threading, time
import psutil
from swarmnode import dht as d

thaw_after = float(sys.argv[1])
d.BOOTSTRAP_RETRY_DELAY = 0.25
me = psutil.Process()
first = d.start_dht()
maddr = str(first.get_visible_maddrs()[0])
if sys.argv[2] == "dht":  # the first peer's DHT process: its daemon connects, but it answers no ping
    frozen = [c for c in me.children() if c.exe() == me.exe()][0]
else:  # its p2pd: a TCP connection opens (the kernel accepts it), but no libp2p handshake completes
    frozen = [c for c in me.children(recursive=True) if c.name() == "p2pd"][0]
os.kill(frozen.pid, signal.SIGSTOP)
if thaw_after >= 0:
    threading.Timer(thaw_after, os.kill, (frozen.pid, signal.SIGCONT)).start()
began = time.monotonic()
try:
    second = d.start_dht([maddr])
    said = {"code": None, "peers": len(second.get_visible_maddrs())}
    second.shutdown()
except d.DHTStartError as error:
    said = {"code": error.code, "message": str(error)}
said["seconds"] = time.monotonic() - began
os.kill(frozen.pid, signal.SIGCONT)
first.shutdown()
print(json.dumps(said))
"""


def _join_busy_peer(thaw_after: float, frozen: str = "dht") -> tuple[dict, str]:
    result = subprocess.run([sys.executable, "-c", _BUSY_PEER, str(thaw_after), frozen], capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_an_initial_peer_that_answers_late_is_tried_again():
    """The initial peer is frozen for the first 4 s of the start: hivemind's bootstrap ping (3 s) fails once,
    the start is tried again and succeeds; the log says why it waited."""
    said, log = _join_busy_peer(4.0)
    assert said["code"] is None, said
    assert 3.0 < said["seconds"] < 30.0, said
    assert "answered a ping within hivemind's 3 s (start 1 of 5)" in log


def test_an_initial_peer_that_never_answers_is_an_error_that_says_so():
    said, _ = _join_busy_peer(-1.0)
    assert said["code"] == "bootstrap_failed", said
    assert "in 5 starts (none answered a ping" in said["message"] and "/p2p/" in said["message"], said


def test_an_initial_peer_whose_daemon_is_busy_is_tried_again():
    """The initial peer's `p2pd` is frozen for 12 s: the new peer's daemon cannot finish the handshake and
    says only that it failed to connect. Dialing the peer again (`swarmnode.peer_dial`) finds it answering
    but not in time, which is a busy peer, not a wrong address: the start is tried again and succeeds."""
    said, log = _join_busy_peer(12.0, "p2pd")
    assert said["code"] is None, said
    assert "answered, but the connection did not complete in time (start 1 of 5)" in log, log[-3000:]
