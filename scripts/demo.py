"""The demo: a bootstrap peer, a coordinator and three nodes on loopback that offer different amounts of
memory (`--leftover-mem`, no `--blocks`); the coordinator plans where the blocks go, the nodes load what they
are given, and a chat answer streams through them.

Prepares SmolLM2-135M-Instruct if needed, starts the swarm as real processes, prints the placement,
streams the answer, prints tokens/s, and stops every process it started. `--manual` starts three nodes
with fixed ranges (0:10, 10:20, 20:30) and no coordinator instead.
"""

import argparse
import os
import sys
import time

from swarmnode.naming import short_id

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt", default="What are three good reasons to learn to cook at home?")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--manual", action="store_true", help="fixed --blocks ranges, no coordinator")
    args = parser.parse_args()

    from transformers import AutoTokenizer, TextStreamer

    from swarmnode.client import ClientConfig, DistributedModelForCausalLM
    from swarmnode.model_prep import prepare_smollm2
    from swarmnode.testing.local_swarm import LocalSwarm

    model_dir = prepare_smollm2()
    with LocalSwarm(model_dir) as swarm:
        swarm.start_bootstrap()
        if args.manual:
            print("starting a bootstrap peer and 3 nodes with fixed ranges on 127.0.0.1 ...", flush=True)
            nodes = [swarm.start_node(a, b, wait=False) for a, b in ((0, 10), (10, 20), (20, 30))]
        else:
            print("starting a bootstrap peer, a coordinator and 3 nodes offering 850M, 900M and 950M "
                  "on 127.0.0.1 ...", flush=True)
            swarm.start_coordinator(extra=["--time-limit", "5"])
            nodes = [swarm.start_node(leftover_mem=m, wait=False) for m in ("850M", "900M", "950M")]
        for node in nodes:
            info = swarm.wait_serving(node, 300)
            served = ", ".join(f"{span['start']}:{span['end']}" for span in info["spans"])
            print(f"  {node.name}: peer {short_id(node.peer_id)} serves blocks {served}", flush=True)
        config = ClientConfig(trusted_coordinators=None if args.manual else swarm.trusted_coordinators())
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        messages = [{"role": "user", "content": args.prompt}]
        input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)["input_ids"]
        with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                         config=config) as model:
            print(f"\nuser: {args.prompt}\nassistant: ", end="", flush=True)
            began = time.perf_counter()
            output = model.generate(input_ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                    streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
            elapsed = time.perf_counter() - began
        new_tokens = output.shape[1] - input_ids.shape[1]
        print(f"\n[{new_tokens} tokens in {elapsed:.1f} s: {new_tokens / elapsed:.1f} tokens/s through 3 nodes]")
        print(f"logs: {swarm.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
