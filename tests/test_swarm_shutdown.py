"""Clean shutdown: SIGTERM lets open sessions finish within the grace period while new ones are refused,
the node goes offline and exits 0, and nothing of it (p2pd included) is left; a second SIGTERM exits at
once. Real processes on 127.0.0.1; the truth is local transformers."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
import torch

from swarmnode.client import DistributedModelForCausalLM

pytestmark = pytest.mark.swarm


def _group_members(pgid: int) -> list[str]:
    out = subprocess.run(["ps", "-e", "-o", "pgid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split(None, 1)[0] == str(pgid)]


def test_sigterm_lets_open_sessions_finish_then_exits_cleanly(swarm_factory, model_dir, local_model, chat_prompts):
    swarm = swarm_factory()
    swarm.start_bootstrap()
    node = swarm.start_node(0, 30, extra=["--shutdown-grace", "60"])
    ids = chat_prompts[0]
    expected = local_model.generate(ids, max_new_tokens=12, do_sample=False)
    with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers) as remote:
        with remote.inference_session(max_length=64):
            first = remote.generate(ids, max_new_tokens=6, do_sample=False)
            swarm.signal(node, signal.SIGTERM)
            swarm.wait_node(node, lambda info: info["state"] == "offline", 30, "going offline")
            # and says so in the DHT at once, not when its last online record expires (the DHT refuses a
            # record that expires before the one it replaces)
            swarm.wait_status(lambda s: s["nodes"].get(node.peer_id, {}).get("state") == "offline", 10)
            # the open session goes on through the stopping node and gives the same tokens
            rest = remote.generate(first, max_new_tokens=6, do_sample=False)
            assert torch.equal(rest, expected)
            assert node.alive(), "the node must wait for its open session"
        # the session closed: the node exits 0 well before the grace period ends
        assert node.popen.wait(30) == 0
    assert "announcing" in node.log() or "offline" in node.log().lower()
    assert "records (offline)" not in node.log(), "the OFFLINE announcement was refused"
    deadline = time.monotonic() + 10
    while _group_members(node.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _group_members(node.pid), f"left behind: {_group_members(node.pid)}"


def test_second_sigterm_exits_at_once(swarm_factory, model_dir, chat_prompts):
    swarm = swarm_factory()
    swarm.start_bootstrap()
    node = swarm.start_node(0, 30, extra=["--shutdown-grace", "600"])
    remote = DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers)
    with remote, remote.inference_session(max_length=64):
        remote.generate(chat_prompts[1], max_new_tokens=4, do_sample=False)
        swarm.signal(node, signal.SIGTERM)
        swarm.wait_node(node, lambda info: info["state"] == "offline", 30, "going offline")
        began = time.monotonic()
        swarm.signal(node, signal.SIGTERM)
        code = node.popen.wait(20)
        assert time.monotonic() - began < 10
        assert code != 0  # cut short on purpose, not a clean exit
