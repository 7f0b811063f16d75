"""A node's memory stays within its offer (`--leftover-mem`) while a session fills its whole KV-cache budget.

The node measures its fixed overhead at start (its processes before any block, plus a step's workspace),
announces it, and sizes its KV budget from what the offer leaves after the weights. Here a bfloat16 node holds
the whole model with an 880 MiB offer; one session reserves (nearly) the node's whole KV budget and generates, while the
test reads the memory of the node's processes (PSS summed over the node, its DHT process and `p2pd`, from
`/proc`) every 100 ms. Its peak must not pass the offer, and the peak resident set of the serving process
(VmHWM, loading included) must not either.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from swarmnode.client import DistributedModelForCausalLM
from swarmnode.runtime import footprint

pytestmark = pytest.mark.swarm

# leaves a KV budget of about 2,500-6,500 tokens, by the node's measured overhead (500-620 MiB seen): one session
# (8,192 positions at most) fills it
OFFER = 880 * 2**20


def _hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


def test_node_memory_stays_within_offer_with_a_full_cache(swarm_factory, model_dir, chat_prompts):
    assert footprint.available(), "this test reads PSS from /proc/PID/smaps_rollup (Linux 4.14+)"
    swarm = swarm_factory()
    swarm.start_bootstrap()
    node = swarm.start_node(0, 30, extra=["--dtype", "bfloat16", "--leftover-mem", str(OFFER)])
    info = swarm.node_info(node)
    budget = info["cache_tokens"]
    assert budget > 1000, f"an 880 MiB offer should leave room for KV cache beside 30 bfloat16 blocks: {info}"
    assert "runtime overhead" in node.log() and "before any block" in node.log()

    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(footprint.tree_pss(node.pid))
            time.sleep(0.1)

    length = min(budget, 8000)  # the model's 8192 positions cap a session
    assert length >= 0.9 * budget, (length, budget)
    baseline = footprint.tree_pss(node.pid)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        input_ids = chat_prompts[0]
        with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                         dtype=torch.bfloat16) as remote:
            with remote.inference_session(max_length=length):
                out = remote.generate(input_ids, max_new_tokens=48, min_new_tokens=48, do_sample=False)
            assert out.shape[1] == input_ids.shape[1] + 48
    finally:
        done.set()
        sampler.join(5)
    assert samples and node.alive()
    peak = max(samples)
    assert peak <= OFFER, f"node processes peaked at {peak / 2**20:.0f} MiB, over the {OFFER / 2**20:.0f} MiB offer"
    # the session's cache really was held (the bound is not met by leaving the budget unused): bfloat16 keys
    # and values of 3 KV heads of 64 for every token of the session in 30 blocks
    kv = length * 30 * 2 * 3 * 64 * 2
    assert peak - baseline >= 0.9 * kv, f"the session added {(peak - baseline) / 2**20:.0f} MiB for {kv / 2**20:.0f} MiB of KV"
    assert _hwm(node.pid) <= OFFER, f"the serving process's peak RSS {_hwm(node.pid) / 2**20:.0f} MiB passed the offer"
