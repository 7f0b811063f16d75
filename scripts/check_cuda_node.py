"""CUDA nodes beside CPU nodes in one swarm, checked against local `transformers` (needs a GPU).

For each checkpoint (folders given, or tiny random checkpoints of model families made on the spot with
`--families`), a CPU node serves the first half of the blocks and a `--device cuda` node the second half, all
in one swarm per dtype (one bootstrap; the nodes of every model start side by side). A client generates
greedily through each model, and the token ids are compared with local `transformers` on the same weights (on
the CPU), in float32, bfloat16 and float16 (`--dtypes`, the nodes' and the client's dtype). The first step's logits
are compared too (largest difference relative to the largest logit), so a mismatch can be told from a near tie.

What must hold. In float32 the route equals local `transformers` on the CPU token for token. In bfloat16 and
float16 a CUDA kernel rounds differently from the CPU's, so token equality is reported (`match`) but the check
is that the first step's logits agree within `LOW_PRECISION_LOGITS_TOLERANCE` of the largest logit. Measured
on an H200 (torch 2.11, six tiny random families, two prompts, 16 new tokens): float32 12 of 12 generations
equal; bfloat16 and float16 21 of 24 equal, the other 3 parting at a near tie after an equal first step, first
steps within 0.0064. Local `transformers` split the same way (those blocks on the GPU through accelerate's
`dispatch_model`) is no better a truth: 18 of 24 equal, since the node's step shapes pick other GPU kernels.

    .venv/bin/python scripts/check_cuda_node.py --families llama qwen3_moe gpt_oss deepseek_v3 gemma2
    .venv/bin/python scripts/make_random_checkpoint.py --shape tiny --out /tmp/tiny
    .venv/bin/python scripts/check_cuda_node.py /tmp/tiny

Prints one JSON line per model and dtype and, last, one with all of them (and the GPU's name); exits 1 when a
float32 generation differs, a low-precision first step is out of tolerance, or no GPU is visible. CI has no GPU, so this runs by hand on a machine that has one.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from swarmnode.client import DistributedModelForCausalLM
from swarmnode.testing.local_swarm import LocalSwarm

NEW_TOKENS = 16
#: how far a low-precision route's first-step logits may be from local `transformers` on the CPU, relative to the
#: largest logit: several bfloat16 roundings of a 6-block model (measured up to 0.0064)
LOW_PRECISION_LOGITS_TOLERANCE = 0.02


def truths(model_dir: str, dtype: torch.dtype, prompts: list[torch.Tensor]) -> tuple[list, torch.Tensor]:
    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        first = local(prompts[0]).logits[0, -1].float()
    return [local.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=torch.ones_like(p))
            for p in prompts], first


def check_dtype(models: dict[str, str], dtype: str, prompts: dict[str, list[torch.Tensor]]) -> list[dict]:
    tdtype = getattr(torch, dtype)
    began = time.monotonic()
    runs = []
    with LocalSwarm(next(iter(models.values()))) as swarm:
        swarm.start_bootstrap()
        started = {}
        for name, model_dir in models.items():
            layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
            half = layers // 2
            swarm.model = model_dir
            cpu = swarm.launch_node(0, half, name=f"{name}-cpu", extra=["--dtype", dtype])
            gpu = swarm.launch_node(half, layers, name=f"{name}-cuda", extra=["--dtype", dtype, "--device", "cuda"])
            started[name] = (cpu, gpu, layers, half)
        for cpu, gpu, _, _ in started.values():
            swarm.wait_serving(cpu, 300)
            swarm.wait_serving(gpu, 300)
        for name, model_dir in models.items():
            cpu, gpu, layers, half = started[name]
            expected, first = truths(model_dir, tdtype, prompts[name])
            with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                             dtype=tdtype) as remote:
                with remote.inference_session(max_length=prompts[name][0].shape[1] + 1) as session:
                    ours = remote(prompts[name][0]).logits[0, -1].float()
                    hops = [h.hop.peer_id for h in session.hops]
                got = [remote.generate(p, max_new_tokens=NEW_TOKENS, do_sample=False) for p in prompts[name]]
            runs.append({
                "model": name, "dtype": dtype, "blocks": layers, "cpu_node": [0, half], "cuda_node": [half, layers],
                "route": ["cpu" if h == cpu.peer_id else "cuda" if h == gpu.peer_id else h for h in hops],
                "match": [bool(torch.equal(g, t)) for g, t in zip(got, expected)],
                "first_logits_difference": round(float((ours - first).abs().max() / first.abs().max()), 6),
            })
            print(json.dumps(runs[-1]), flush=True)
    for run in runs:
        run["swarm_seconds"] = round(time.monotonic() - began, 1)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="checkpoint folders")
    parser.add_argument("--families", nargs="*", default=[],
                        help="tiny random checkpoints of these families (swarmnode.tiny_models)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device is visible to torch"}))
        return 1
    models = {Path(m).name: m for m in args.models}
    if args.families:
        from swarmnode.tiny_models import make_tiny_checkpoint

        root = Path(tempfile.mkdtemp(prefix="cuda-check-"))
        models |= {f: str(make_tiny_checkpoint(f, root / f, seed=i)) for i, f in enumerate(args.families)}
    if not models:
        parser.error("name checkpoint folders or --families")
    generator = torch.Generator().manual_seed(0)
    prompts = {}
    for name, model_dir in models.items():
        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        prompts[name] = [torch.randint(3, min(vocab, 1000), (1, n), generator=generator) for n in (7, 19)]
    runs = [run for dtype in args.dtypes for run in check_dtype(models, dtype, prompts)]
    ok = all(all(r["match"]) if r["dtype"] == "float32" else r["first_logits_difference"] <= LOW_PRECISION_LOGITS_TOLERANCE
             for r in runs)
    print(json.dumps({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "runs": runs, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
