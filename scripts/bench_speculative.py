"""Speculative decoding through the swarm against plain decoding, side by side. One JSON line.

A bootstrap and `--nodes` nodes (each serving an even, contiguous share of the blocks with `--blocks`) serve
the model; a client generates greedily, `--new-tokens` tokens per prompt, on two workloads, in each mode,
one mode right after the other for every prompt, each going first every other time (`--repeats` rounds), so
load from elsewhere hits all alike:

- workloads: **passage** (a passage given in the prompt, to be repeated, edited or summarised:
  `swarmnode.testing.workload.passage_inputs`, where drafts can be right) and **chat** (open questions:
  `chat_inputs`, where they seldom are);
- modes: **plain** (one token a pass), **lookup** (`prompt_lookup_num_tokens=--lookup-tokens`: drafts taken
  from the prompt and the text so far by n-gram lookup, verified in one pass, rejected ones taken back on every
  node; one pass at a time, `transformers`' own loop: `speculative_passes=1`) and **pipelined** (the same drafts,
  with up to `--passes` passes in flight: `client.speculative`, what `generate` does by default). No draft model runs: no smaller model with SmolLM2's tokenizer ships in a package here, and a
  same-size draft costs the client what a pass costs the swarm.

Reported per setting, workload and mode: decode tokens/s (the tokens after the prompt's pass over the time
after it: a streamer's timestamps), mean accepted length (tokens a verified pass after the prompt's), passes per
token, passes sent ahead and given up per token, rejected drafts a pass, and the tensor bytes per token on the
client's link (`InferenceSession.traffic`); the lookup/plain and pipelined/plain ratios of tokens/s; whether the
modes' tokens are equal (`exact`); and the aims for the default, pipelined (passage >= 1.8x, chat >= 0.95x).

Settings: **loopback** (every process on 127.0.0.1) always; **netns** with `--netns` (root needed): each node
and the client on a host of its own in a bed of network namespaces, every link shaped to `--link-mbit`
Mbit/s both ways (`tc tbf`; the bed has no delay emulation).

    .venv/bin/python scripts/bench_speculative.py [--nodes 3] [--new-tokens 96] [--repeats 2] [--prompts 3]
        [--lookup-tokens 10] [--passes 2] [--netns --link-mbit 20]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

MODES = ("plain", "lookup", "pipelined")
WORKLOADS = ("passage", "chat")
AIMS = {"passage": 1.8, "chat": 0.95}


def log(message: str) -> None:
    print(f"[bench-speculative] {message}", file=sys.stderr, flush=True)


def measure(model_path: str, initial_peers: list[str], *, new_tokens: int, repeats: int, prompts: int,
            lookup_tokens: int, passes: int) -> list[dict]:
    """Run every (round, workload, prompt, mode) from a client of the swarm at `initial_peers`; one dict each."""
    import torch
    from transformers import AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    from swarmnode.client import DistributedModelForCausalLM
    from swarmnode.testing.workload import chat_inputs, passage_inputs

    class Clock(BaseStreamer):
        """When the prompt's pass answered, how many tokens it gave and how many drafts it rejected: decode
        is what comes after it."""

        def __init__(self, session):
            self.session = session
            self.puts = 0  # the first put() is the prompt
            self.first: float | None = None
            self.first_tokens = 0
            self.first_rewound = 0

        def put(self, value):
            self.puts += 1
            if self.puts == 2:
                self.first = time.perf_counter()
                self.first_tokens = value.numel()
                self.first_rewound = self.session.rewound

        def end(self):
            pass

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    inputs = {"passage": passage_inputs(tokenizer, prompts), "chat": chat_inputs(tokenizer, prompts)}
    runs = []
    settings = {"plain": {}, "lookup": {"prompt_lookup_num_tokens": lookup_tokens, "speculative_passes": 1},
                "pipelined": {"prompt_lookup_num_tokens": lookup_tokens, "speculative_passes": passes}}
    with DistributedModelForCausalLM.from_pretrained(model_path, initial_peers=initial_peers) as model:
        for mode in MODES:  # routes found, streams warm, every way of generating run once
            model.generate(inputs["chat"][0], max_new_tokens=8, do_sample=False, **settings[mode])
        turn = 0
        for round_, workload in itertools.product(range(repeats), WORKLOADS):
            for index, ids in enumerate(inputs[workload]):
                turn += 1
                for mode in MODES if turn % 2 else MODES[::-1]:  # plain goes first or last every other time
                    extra = settings[mode]
                    with model.inference_session(max_length=ids.shape[1] + new_tokens) as session:
                        clock = Clock(session)
                        began = time.perf_counter()
                        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                             do_sample=False, streamer=clock, **extra)
                        ended = time.perf_counter()
                    generated = out.shape[1] - ids.shape[1]
                    assert clock.first is not None
                    runs.append({"round": round_, "workload": workload, "prompt": index, "mode": mode,
                                 "tokens": out[0, ids.shape[1]:].tolist(), "new_tokens": generated,
                                 "seconds": ended - began, "decode_seconds": ended - clock.first,
                                 # the passes after the prompt's, what they gave and what they rejected
                                 "decoded": generated - clock.first_tokens, "passes": session.steps - 1,
                                 "discarded": session.discarded,
                                 "rewound": session.rewound - clock.first_rewound, "traffic": dict(session.traffic)})
                    log(f"round {round_} {workload}[{index}] {mode}: {generated} tokens in {ended - began:.2f} s, "
                        f"{session.steps - 1} passes after the prompt ({session.discarded} more given up), "
                        f"{session.rewound} drafted tokens rejected")
    del torch
    return runs


def summarise(runs: list[dict]) -> dict:
    """Per workload and mode: decode tok/s (over all its runs), accepted length, passes per token, client link
    bytes per token; the lookup/plain ratio; whether every prompt's tokens agree across modes and rounds."""
    result: dict = {}
    for workload in WORKLOADS:
        row: dict = {}
        for mode in MODES:
            mine = [r for r in runs if r["workload"] == workload and r["mode"] == mode]
            decoded = sum(r["decoded"] for r in mine)
            passes = sum(r["passes"] for r in mine)
            row[mode] = {
                "decode_tok_s": round(decoded / sum(r["decode_seconds"] for r in mine), 2),
                "per_round_tok_s": [round(sum(r["decoded"] for r in mine if r["round"] == k)
                                          / sum(r["decode_seconds"] for r in mine if r["round"] == k), 2)
                                    for k in sorted({r["round"] for r in mine})],
                "mean_accepted_length": round(decoded / passes, 3),
                "passes_per_token": round(passes / decoded, 3),
                "discarded_passes_per_token": round(sum(r["discarded"] for r in mine) / decoded, 3),
                "rejected_per_pass": round(sum(r["rewound"] for r in mine) / passes, 3),
                "client_link_bytes_per_token": round(
                    statistics.mean((r["traffic"]["up"] + r["traffic"]["down"]) / r["new_tokens"] for r in mine)),
            }
        row["ratio"] = round(row["pipelined"]["decode_tok_s"] / row["plain"]["decode_tok_s"], 3)
        row["lookup_ratio"] = round(row["lookup"]["decode_tok_s"] / row["plain"]["decode_tok_s"], 3)
        prompts = {r["prompt"] for r in runs if r["workload"] == workload}
        row["exact"] = all(len({tuple(r["tokens"]) for r in runs if r["workload"] == workload and r["prompt"] == p})
                           == 1 for p in prompts)
        row["aim"] = AIMS[workload]
        row["met"] = row["exact"] and row["ratio"] >= AIMS[workload]
        result[workload] = row
    return result


def run_loopback(model: Path, args) -> list[dict]:
    from swarmnode.testing.local_swarm import LocalSwarm

    bounds = _bounds(model, args.nodes)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-speculative-{os.getpid()}"
    with LocalSwarm(model, log_dir=log_dir) as swarm:
        log(f"loopback: starting a bootstrap and {args.nodes} nodes {list(itertools.pairwise(bounds))} "
            f"(logs in {log_dir})")
        _serve(swarm, bounds)
        return measure(str(model), swarm.initial_peers, new_tokens=args.new_tokens, repeats=args.repeats,
                       prompts=args.prompts, lookup_tokens=args.lookup_tokens, passes=args.passes)


# the client on its own namespace host: this script's `measure`, its runs as one RESULT line
NETNS_CLIENT = """
import json, runpy, sys
script, model, new_tokens, repeats, prompts, lookup, passes, *peers = sys.argv[1:]
bench = runpy.run_path(script)
runs = bench["measure"](model, peers, new_tokens=int(new_tokens), repeats=int(repeats), prompts=int(prompts),
                        lookup_tokens=int(lookup), passes=int(passes))
print("RESULT " + json.dumps(runs), flush=True)
"""


def run_netns(model: Path, args) -> list[dict]:
    from swarmnode.testing.netns import NetnsBed, NetnsSwarm

    bounds = _bounds(model, args.nodes)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-speculative-netns-{os.getpid()}"
    with NetnsBed(subnet="10.79.0.0/24") as bed, NetnsSwarm(model, log_dir=log_dir, bed=bed) as swarm:
        log(f"netns: bed of namespaces up; a bootstrap and {args.nodes} nodes on hosts of their own "
            f"(logs in {log_dir})")
        nodes = _serve(swarm, bounds)
        for name in [*(swarm.host_of(node.name).name for node in nodes), "client"]:
            bed.shape(name, f"{args.link_mbit}mbit", burst="32kb", latency="400ms")
        log(f"every node's link and the client's shaped to {args.link_mbit} Mbit/s")
        result = swarm.run_python("client", NETNS_CLIENT, [
            str(Path(__file__).resolve()), str(model), str(args.new_tokens), str(args.repeats), str(args.prompts),
            str(args.lookup_tokens), str(args.passes), *swarm.initial_peers], timeout=3600, name="client")
        if result.returncode != 0:
            raise SystemExit(f"the client failed:\n{result.stderr[-4000:]}")
        for line in result.stderr.splitlines():
            if line.startswith("[bench-speculative]"):
                print(line, file=sys.stderr)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):])


def _serve(swarm, bounds: list[int]) -> list:
    """A bootstrap and one node per consecutive pair of `bounds` (`--blocks a:b`), waited for until serving."""
    swarm.start_bootstrap()
    nodes = [swarm.launch_node(a, b, name=f"node-{a}") for a, b in itertools.pairwise(bounds)]
    for node in nodes:
        swarm.wait_serving(node, 300)
    return nodes


def _bounds(model: Path, nodes: int) -> list[int]:
    from swarmnode.runtime.checkpoint import Checkpoint

    num_blocks = Checkpoint(model).num_blocks
    if nodes > num_blocks:
        raise SystemExit(f"--nodes must be at most the model's {num_blocks} blocks")
    return [round(i * num_blocks / nodes) for i in range(nodes + 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the test model, SmolLM2-135M)")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2, help="rounds; every mode runs once a round")
    parser.add_argument("--prompts", type=int, default=3, help="prompts of each workload")
    parser.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--passes", type=int, default=None,
                        help="pipelined mode's passes in flight (default: ClientConfig.speculative_passes)")
    parser.add_argument("--netns", action="store_true", help="also run on namespace hosts with shaped links (root)")
    parser.add_argument("--link-mbit", type=float, default=20.0)
    args = parser.parse_args()
    if args.nodes < 1 or args.new_tokens < 2 or args.repeats < 1 or args.prompts < 1 or args.lookup_tokens < 1 \
            or args.link_mbit <= 0:
        parser.error("--nodes, --repeats, --prompts and --lookup-tokens >= 1, --new-tokens >= 2, --link-mbit > 0")
    from swarmnode.client.swarm import MAX_SPECULATIVE_PASSES, ClientConfig

    if args.passes is None:
        args.passes = ClientConfig().speculative_passes
    if not 2 <= args.passes <= MAX_SPECULATIVE_PASSES:
        parser.error(f"--passes: 2 to {MAX_SPECULATIVE_PASSES} passes in flight")
    if args.netns and os.geteuid() != 0:
        parser.error("--netns needs root (it creates network namespaces)")

    from swarmnode.model_prep import prepare_smollm2
    from swarmnode.runtime.checkpoint import Checkpoint

    model = Path(args.model) if args.model else prepare_smollm2()
    settings = {"loopback": summarise(run_loopback(model, args))}
    if args.netns:
        settings["netns"] = summarise(run_netns(model, args))
    print(json.dumps({
        "bench": "speculative", "model": Checkpoint(model).name, "nodes": args.nodes, "new_tokens": args.new_tokens,
        "repeats": args.repeats, "prompts": args.prompts, "lookup_tokens": args.lookup_tokens, "passes": args.passes,
        **({"link_mbit": args.link_mbit} if args.netns else {}), **settings,
        "aims_met": all(row["met"] for setting in settings.values() for row in setting.values()),
    }), flush=True)


if __name__ == "__main__":
    main()
