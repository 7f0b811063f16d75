"""Swarm vs local generation speed, measured side by side in one run; prints one JSON line last.

Local: `transformers` on the same checkpoint in this process. Swarm: a bootstrap and three nodes
(0:10, 10:20, 20:30) on 127.0.0.1, one client, then four concurrent clients. Decode speed counts the tokens
after the first one over the time after the first one; time to first token is measured with a streamer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from transformers.generation.streamers import BaseStreamer


class _Clock(BaseStreamer):
    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def timed_generate(model, input_ids, new_tokens: int) -> dict:
    clock = _Clock()
    began = time.perf_counter()
    out = model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         streamer=clock)
    ended = time.perf_counter()
    first = clock.times[1]  # times[0] is the prompt
    generated = out.shape[1] - input_ids.shape[1]
    return {"ttft": first - began, "decode_tps": (generated - 1) / (ended - first), "total_s": ended - began,
            "tokens": generated, "output": out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarmnode.client import DistributedModelForCausalLM
    from swarmnode.model_prep import prepare_smollm2
    from swarmnode.testing.local_swarm import LocalSwarm

    model_dir = prepare_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    input_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the history of Rome."}],
                                              add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    timed_generate(local, input_ids, 4)  # warm-up
    local_runs = [timed_generate(local, input_ids, args.new_tokens) for _ in range(args.repeats)]

    with LocalSwarm(model_dir) as swarm:
        swarm.start_bootstrap()
        nodes = [swarm.start_node(a, b, wait=False) for a, b in ((0, 10), (10, 20), (20, 30))]
        for node in nodes:
            swarm.wait_serving(node)
        with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers) as remote:
            timed_generate(remote, input_ids, 4)  # warm-up: routes, RTTs, connections
            swarm_runs = [timed_generate(remote, input_ids, args.new_tokens) for _ in range(args.repeats)]
            exact = all(torch.equal(r["output"], local_runs[0]["output"]) for r in swarm_runs)

            results = [None] * args.clients

            def client(i: int) -> None:
                results[i] = timed_generate(remote, input_ids, args.new_tokens)

            threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
            began = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - began
            concurrent_exact = all(torch.equal(r["output"], local_runs[0]["output"]) for r in results)

    local_tps = max(r["decode_tps"] for r in local_runs)
    swarm_tps = max(r["decode_tps"] for r in swarm_runs)
    single_total = min(r["total_s"] for r in swarm_runs)
    aggregate = sum(r["tokens"] for r in results) / wall
    report = {
        "benchmark": "generate",
        "new_tokens": args.new_tokens,
        "local_decode_tps": round(local_tps, 2),
        "swarm_decode_tps": round(swarm_tps, 2),
        "swarm_to_local_ratio": round(swarm_tps / local_tps, 3),
        "local_ttft_s": round(min(r["ttft"] for r in local_runs), 3),
        "swarm_ttft_s": round(min(r["ttft"] for r in swarm_runs), 3),
        "swarm_1_client_tps": round(args.new_tokens / single_total, 2),
        f"swarm_{args.clients}_clients_aggregate_tps": round(aggregate, 2),
        "concurrency_gain": round(aggregate / (args.new_tokens / single_total), 3),
        "exact": exact and concurrent_exact,
    }
    print(f"local decode {local_tps:.1f} tok/s | swarm decode {swarm_tps:.1f} tok/s "
          f"(ratio {report['swarm_to_local_ratio']}) | {args.clients} clients {aggregate:.1f} tok/s together",
          file=sys.stderr)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
