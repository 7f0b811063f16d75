"""A CUDA node beside a CPU node in one swarm, checked against local `transformers` (needs a GPU).

Starts a bootstrap peer, a CPU node serving the first half of the model's blocks and a `--device cuda` node
serving the second half, generates greedily through them, and compares the token ids with local
`transformers` on the same weights, in float32 and in bfloat16 (`--dtype` of the nodes and the client). Any
checkpoint folder works; a random one needs no download and no tokenizer (token ids are compared):

    .venv/bin/python scripts/make_random_checkpoint.py --shape tiny --out /tmp/tiny
    .venv/bin/python scripts/check_cuda_node.py /tmp/tiny

Prints one JSON line per dtype and, last, one with all of them (and the GPU's name); exits 1 when a
generation differs or no GPU is visible. CI has no GPU, so this runs by hand on a machine that has one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from swarmnode.client import DistributedModelForCausalLM
from swarmnode.testing.local_swarm import LocalSwarm

NEW_TOKENS = 16


def check(model_dir: str, dtype: str, prompts: list[torch.Tensor]) -> dict:
    tdtype = getattr(torch, dtype)
    layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdtype)
    truths = [local.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=torch.ones_like(p))
              for p in prompts]
    half = layers // 2
    began = time.monotonic()
    with LocalSwarm(model_dir) as swarm:
        swarm.start_bootstrap()
        swarm.start_node(0, half, extra=["--dtype", dtype], timeout=300)
        gpu = swarm.start_node(half, layers, extra=["--dtype", dtype, "--device", "cuda"], timeout=300)
        info = swarm.status()["nodes"].get(gpu.peer_id)  # its capacity record in the DHT
        with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                         dtype=tdtype) as remote:
            got = [remote.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False) for p in prompts]
    return {
        "dtype": dtype, "blocks": layers, "cpu_node": [0, half], "cuda_node": [half, layers],
        "cuda_node_device": (info or {}).get("device"), "cuda_node_dtype": (info or {}).get("dtype"),
        "match": [bool(torch.equal(g, t)) for g, t in zip(got, truths)],
        "seconds": round(time.monotonic() - began, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a checkpoint folder")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device is visible to torch"}))
        return 1
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, min(vocab, 1000), (1, n), generator=generator) for n in (7, 19)]
    runs = []
    for dtype in args.dtypes:
        runs.append(check(args.model, dtype, prompts))
        print(json.dumps(runs[-1]), flush=True)
    ok = all(all(r["match"]) for r in runs)
    print(json.dumps({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "runs": runs, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
