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
