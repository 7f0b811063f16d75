"""Hidden states pushed node to node vs relayed through the client, over a slow client link. One JSON line.

A bed of network namespaces (`swarmnode.testing.netns`, root needed) holds a bootstrap, `--nodes` nodes
(each serving an even, contiguous share of the blocks with `--blocks`, one host each) and a client host
whose link is shaped to `--client-mbit` Mbit/s both ways with `tc tbf`; the nodes' links are not shaped.
The client process, on its host, generates greedily from a prompt of exactly `--prompt-tokens` token ids,
`--new-tokens` new tokens, in two modes side by side, alternating, `--repeats` times each:

- **push** (the default): each node sends its output straight to the next node; the client's link carries
  the prompt's states up once and the last hop's output down once;
- **relay** (`push=False`): every hop's output comes back to the client and goes out to the next hop, so the
  client's link carries the hidden states twice per hop.

Reported per mode (the best run of each, so a burst of load from elsewhere hits both alike): time to first
token (a streamer's timestamp, from the call), decode tokens/s (tokens after the first over the time after
the first) and the tensor bytes the session moved over the client's link (`InferenceSession.traffic`);
then the ratios push/relay and whether the aims hold (`ttft_ratio <= 0.6`, `decode_ratio >= 1`). The two
modes' tokens must be equal (`exact`). Progress goes to stderr.

    sudo .venv/bin/python scripts/bench_network.py [--client-mbit 8] [--nodes 3] [--prompt-tokens 400]
        [--new-tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

PROMPT_TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
               "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of "
               "Light, it was the season of Darkness, it was the spring of hope, it was the winter of despair. ")

# a streamer that stamps each generated token after the first (time to first token, decode speed); the
# clients of this script and of scripts/bench_relay.py define it
CLOCK = """
class Clock(BaseStreamer):
    def __init__(self):
        self.times = []
        self.seen = -1
    def put(self, value):
        self.seen += 1
        if self.seen:
            self.times.append(time.perf_counter())
    def end(self):
        pass
"""

# the client, on its own host: prints one RESULT line per run
CLIENT = """
import json, sys, time
import torch
from transformers.generation.streamers import BaseStreamer
from swarmnode.client import ClientConfig, DistributedModelForCausalLM

model_dir, ids, new_tokens, modes, *peers = sys.argv[1:]
ids, new_tokens = torch.tensor(json.loads(ids)), int(new_tokens)

""" + CLOCK + """
models = {}
for push in (True, False):
    models[push] = DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=peers,
                                                               config=ClientConfig(push=push))
    models[push].generate(ids[:, :8], max_new_tokens=2, do_sample=False)  # connections to every node made
print("READY", flush=True)
for mode in modes.split(","):
    push = mode == "push"
    model, clock = models[push], Clock()
    with model.inference_session(max_length=ids.shape[1] + new_tokens) as session:
        began = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             streamer=clock)
        assert session.push is push
        traffic = dict(session.traffic)
    ttft = clock.times[0] - began
    decode = (len(clock.times) - 1) / (clock.times[-1] - clock.times[0])
    print("RESULT " + json.dumps({"mode": mode, "ttft_s": ttft, "decode_tok_s": decode, "traffic": traffic,
                                  "tokens": out[0, ids.shape[1]:].tolist()}), flush=True)
for model in models.values():
    model.shutdown()
"""


def log(message: str) -> None:
    print(f"[bench_network {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def make_prompt(model: str, tokens: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model)(PROMPT_TEXT, add_special_tokens=False)["input_ids"]
    return [(ids * (tokens // len(ids) + 1))[:tokens]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the test model, SmolLM2-135M)")
    parser.add_argument("--client-mbit", type=float, default=8.0)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.client_mbit <= 0 or args.nodes < 1 or args.prompt_tokens < 1 or args.new_tokens < 2 \
            or args.repeats < 1:
        parser.error("--client-mbit > 0, --nodes >= 1, --prompt-tokens >= 1, --new-tokens >= 2, --repeats >= 1")

    from swarmnode.model_prep import prepare_smollm2
    from swarmnode.runtime.checkpoint import Checkpoint
    from swarmnode.testing.netns import NetnsBed, NetnsSwarm

    model = Path(args.model) if args.model else prepare_smollm2()
    checkpoint = Checkpoint(model)
    num_blocks = checkpoint.num_blocks
    if args.nodes > num_blocks:
        parser.error(f"--nodes must be at most the model's {num_blocks} blocks")
    bounds = [round(i * num_blocks / args.nodes) for i in range(args.nodes + 1)]
    prompt = make_prompt(str(model), args.prompt_tokens)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-network-{os.getpid()}"
    with NetnsBed(subnet="10.78.0.0/24") as bed, NetnsSwarm(model, log_dir=log_dir, bed=bed) as swarm:
        log(f"bed of namespaces up; starting a bootstrap and {args.nodes} nodes (logs in {log_dir})")
        swarm.start_bootstrap()
        nodes = [swarm.launch_node(a, b, name=f"node-{a}") for a, b in itertools.pairwise(bounds)]
        for node in nodes:
            swarm.wait_serving(node, 300)
        bed.shape("client", f"{args.client_mbit}mbit", burst="32kb", latency="400ms")
        log(f"nodes serving {list(itertools.pairwise(bounds))}; client link shaped to {args.client_mbit} Mbit/s")
        modes = ",".join(["push", "relay"] * args.repeats)
        result = swarm.run_python("client", CLIENT, [str(model), json.dumps(prompt), str(args.new_tokens), modes,
                                                     *swarm.initial_peers], timeout=1800, name="client")
        if result.returncode != 0:
            raise SystemExit(f"the client failed:\n{result.stderr[-4000:]}")
    runs = [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    best = {}
    for mode in ("push", "relay"):
        mine = [r for r in runs if r["mode"] == mode]
        log(f"{mode}: TTFT {[round(r['ttft_s'], 2) for r in mine]} s, decode "
            f"{[round(r['decode_tok_s'], 1) for r in mine]} tok/s")
        best[mode] = {"ttft_s": round(min(r["ttft_s"] for r in mine), 3),
                      "decode_tok_s": round(max(r["decode_tok_s"] for r in mine), 2),
                      "client_link_mb": {k: round(v / 1e6, 3) for k, v in mine[0]["traffic"].items()}}
    exact = all(r["tokens"] == runs[0]["tokens"] for r in runs)
    ttft_ratio = best["push"]["ttft_s"] / best["relay"]["ttft_s"]
    decode_ratio = best["push"]["decode_tok_s"] / best["relay"]["decode_tok_s"]
    print(json.dumps({
        "bench": "network", "model": checkpoint.name, "nodes": args.nodes, "client_mbit": args.client_mbit,
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "push": best["push"], "relay": best["relay"], "ttft_ratio": round(ttft_ratio, 3),
        "decode_ratio": round(decode_ratio, 3), "exact": exact,
        "aims": {"ttft_ratio_max": 0.6, "decode_ratio_min": 1.0,
                 "met": exact and ttft_ratio <= 0.6 and decode_ratio >= 1.0},
    }), flush=True)


if __name__ == "__main__":
    main()
