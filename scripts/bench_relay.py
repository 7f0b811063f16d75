"""What serving through a relay costs: one node's blocks served by a node behind NAT vs by a node anyone can
dial, side by side in one swarm. One JSON line.

A bed of network namespaces (`swarmnode.testing.netns`, root needed) holds a bootstrap (which relays, as every
bootstrap does), a client host, a node serving blocks [0, M), and two nodes serving [M, N): *direct* on a host
of its own, and *natted* on a host behind a masquerading router (`NetnsBed.behind_nat`: it can dial out,
nobody can dial in), which finds that out at start and serves through the bootstrap (`swarmnode.relay`).
Both are started the same way, with no address options. The client generates greedily, `--new-tokens` from a
`--prompt-tokens` prompt, alternating between a route through *direct* and one through *natted* (the other
excluded), `--repeats` times each, with push on (the default: the first node pushes to the second through
the relay when it is natted).

Reported per route, the best run of each: time to first token, decode tokens/s, and the ratios natted/direct
(`decode_ratio`: the relay's cost in tok/s); the two routes' tokens must be equal (`exact`). Progress goes to
stderr.

    sudo .venv/bin/python scripts/bench_relay.py [--prompt-tokens 128] [--new-tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_network import CLOCK, make_prompt  # the same prompt text and token clock

# the client, on its own host: prints one RESULT line per run
CLIENT = """
import json, sys, time
import torch
from transformers.generation.streamers import BaseStreamer
from swarmnode.client import ClientConfig, DistributedModelForCausalLM

model_dir, ids, new_tokens, routes, *peers = sys.argv[1:]
ids, new_tokens, routes = torch.tensor(json.loads(ids)), int(new_tokens), json.loads(routes)

""" + CLOCK + """
model = DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=peers)
for name, exclude in routes:
    model.swarm.config.exclude_peers = frozenset(exclude)
    model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)  # connections along this route made
    clock = Clock()
    with model.inference_session(max_length=ids.shape[1] + new_tokens) as session:
        began = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             streamer=clock)
        hops = [h.hop.peer_id for h in session.hops]
    ttft = clock.times[0] - began
    decode = (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])
    print("RESULT " + json.dumps({"route": name, "ttft_s": ttft, "decode_tok_s": decode, "hops": hops,
                                  "tokens": out[0, ids.shape[1]:].tolist()}), flush=True)
model.shutdown()
"""


def log(message: str) -> None:
    print(f"[bench_relay {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the test model, SmolLM2-135M)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.prompt_tokens < 1 or args.new_tokens < 2 or args.repeats < 1:
        parser.error("--prompt-tokens >= 1, --new-tokens >= 2, --repeats >= 1")

    from swarmnode.model_prep import prepare_smollm2
    from swarmnode.runtime.checkpoint import Checkpoint
    from swarmnode.testing.netns import NetnsBed, NetnsSwarm

    model = Path(args.model) if args.model else prepare_smollm2()
    checkpoint = Checkpoint(model)
    middle = checkpoint.num_blocks // 2
    prompt = make_prompt(str(model), args.prompt_tokens)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-relay-{os.getpid()}"
    with NetnsBed(subnet="10.79.0.0/24") as bed, NetnsSwarm(model, log_dir=log_dir, bed=bed) as swarm:
        log(f"bed of namespaces up; starting a bootstrap and 3 nodes, one behind NAT (logs in {log_dir})")
        swarm.start_bootstrap()
        bed.behind_nat("natted")
        first = swarm.launch_node(0, middle, name="first")
        direct = swarm.launch_node(middle, checkpoint.num_blocks, name="direct")
        natted = swarm.launch_node(middle, checkpoint.num_blocks, name="natted")
        for node in (first, direct, natted):
            swarm.wait_serving(node, 300)
        relay = swarm.status()["nodes"][natted.peer_id].get("relay")
        if relay is None:
            raise SystemExit(f"the node behind NAT serves without a relay:\n{natted.log_tail()}")
        log(f"serving [0, {middle}) and [{middle}, {checkpoint.num_blocks}) twice; the natted copy through "
            f"relay {relay[-6:]}")
        routes = [("direct", [natted.peer_id]), ("natted", [direct.peer_id])] * args.repeats
        result = swarm.run_python("client", CLIENT, [str(model), json.dumps(prompt), str(args.new_tokens),
                                                     json.dumps(routes), *swarm.initial_peers], timeout=1800,
                                  name="client")
        if result.returncode != 0:
            raise SystemExit(f"the client failed:\n{result.stderr[-4000:]}")
    runs = [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    best = {}
    for route, node in (("direct", direct), ("natted", natted)):
        mine = [r for r in runs if r["route"] == route]
        if not all(node.peer_id in r["hops"] for r in mine):
            raise SystemExit(f"a {route} run did not go through {route}: {[r['hops'] for r in mine]}")
        log(f"{route}: TTFT {[round(r['ttft_s'], 3) for r in mine]} s, decode "
            f"{[round(r['decode_tok_s'], 1) for r in mine]} tok/s")
        best[route] = {"ttft_s": round(min(r["ttft_s"] for r in mine), 3),
                       "decode_tok_s": round(max(r["decode_tok_s"] for r in mine), 2)}
    print(json.dumps({
        "bench": "relay", "model": checkpoint.name, "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens, "repeats": args.repeats, "direct": best["direct"], "natted": best["natted"],
        "ttft_ratio": round(best["natted"]["ttft_s"] / best["direct"]["ttft_s"], 3),
        "decode_ratio": round(best["natted"]["decode_tok_s"] / best["direct"]["decode_tok_s"], 3),
        "exact": all(r["tokens"] == runs[0]["tokens"] for r in runs),
    }), flush=True)


if __name__ == "__main__":
    main()
