"""How well a verifying client tells honest low-precision peers from tampered ones: detection and false-alarm
rates of the statistics it could compare, on SmolLM2-135M's real blocks, in one run.

What a check compares (`client/verify.py`): the checked peer's output for a step, from its cached stream
(the prompt's prefill, then one token a step), against another replica's stateless `forward` of the hop's
whole input so far, in the same dtype and quantization. Here both sides run in this process on
`runtime.blocks.BlockStack`, the nodes' own code:

- honest: the stream of one stack against the stateless forward of the same kind (a replica holds the same
  weights, so this is exactly what two honest nodes of one kind compute). The reference of every step is one
  stateless forward of the whole sequence, read at that step's tokens (causal: position t sees the tokens up
  to t, as a forward of the prefix does); `--prefix-steps` steps are also checked against a forward of
  exactly their prefix, as the verifier runs it, and reported apart;
- tampered, each a peer that claims the honest kind:
  `wrong-weights-S` (the hop's middle block with every weight, or quantized scale, off by S at random),
  `skip-block` (the hop's last block not run), `int4-as-int8` / `int8-as-bf16` (a cheaper quantization
  served in the kind's place), `other-model` (random weights of the same shapes), and `noise-R` (the honest
  output plus Gaussian noise of R times each token's RMS, the size of a cheap attack that perturbs outputs).

The inputs are real: chat prompts (`testing.workload.chat_inputs`) and local `transformers`' greedy
continuations, the hidden states entering each hop from the float32 model, cast to the kind's dtype.

The statistics (per check, over the step's tokens), each a distance whose honest values must stay below a
threshold that the tampered ones exceed:
- `max_rel`: the float32 rule, `client.verify.max_difference` (largest element difference over its token's
  largest magnitude);
- `toploc`: TOPLOC's (Ong et al., ICML'25, §3): the k largest-magnitude elements of each token, their
  overlap and the relative differences where they overlap; distance = max(1 - overlap, median relative
  difference) over the step's tokens;
- `trimmed`: `client.agreement.trimmed_distance`, the product's: per token the L2 norm of the difference
  over the output's, without the few largest elements, largest over the step's tokens;
- `median`, `mean`: the median (mean) element difference over the median (mean) magnitude of the token;
- `element`: the largest element difference over that element's magnitude plus the token's RMS.

It prints, per kind and statistic: the largest honest value (decode steps and prefills apart), each tamper's
smallest value, and, at the statistic's threshold (`client.agreement`'s for `trimmed`, 1.5 times the largest
honest value for the others: the best a threshold could do for them), the false alarms among
honest checks and each tamper's detection rate per check, with the chance a client verifying a share `verify`
of its steps has caught it within 32 steps (the first step, the prefill, is always checked). The last line is
one JSON object.

    .venv/bin/python scripts/bench_verification.py                 # about 10 minutes on 2 cores
    .venv/bin/python scripts/bench_verification.py --sequences 4 --tamper-sequences 2   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

KINDS = ("bfloat16", "bfloat16+int8", "bfloat16+int4")
HOPS = ((0, 10), (10, 20), (20, 30))
WRONG_WEIGHTS = (0.02, 0.05, 0.1)
NOISE_LEVELS = (0.003, 0.01, 0.03)
TOPLOC_K = 128
PRODUCT_STAT = "trimmed"  # the statistic `client.agreement` uses for low precision


def parse_kind(kind: str) -> tuple[torch.dtype, str]:
    dtype, _, quantization = kind.partition("+")
    return getattr(torch, dtype), quantization or "none"


# --- the statistics ---------------------------------------------------------------------------------------
def toploc_distance(a: torch.Tensor, b: torch.Tensor, k: int = TOPLOC_K) -> float:
    """TOPLOC's comparison (ICML'25, §3) as a distance: per token, 1 - the overlap of the k largest-magnitude
    elements' indices, and the median relative difference of the elements both hold; the larger of the two,
    largest over the tokens."""
    a, b = a.float().reshape(-1, a.shape[-1]), b.float().reshape(-1, b.shape[-1])
    k = min(k, a.shape[-1])
    worst = 0.0
    for x, y in zip(a, b):
        ix, iy = x.abs().topk(k).indices, y.abs().topk(k).indices
        common = ix[torch.isin(ix, iy)]
        overlap = common.numel() / k
        relative = float(((x[common] - y[common]).abs() / x[common].abs().clamp_min(1e-6)).median()) if common.numel() \
            else float("inf")
        worst = max(worst, 1.0 - overlap, relative)
    return worst


def mean_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Per token, the mean element difference over the mean magnitude; largest over the tokens."""
    a, b = a.float(), b.float()
    scale = ((a.abs() + b.abs()) / 2).mean(-1).clamp_min(1e-6)
    return float(((a - b).abs().mean(-1) / scale).max())


def median_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Per token, the median element difference over the median magnitude; largest over the tokens."""
    a, b = a.float(), b.float()
    scale = ((a.abs() + b.abs()) / 2).median(-1).values.clamp_min(1e-12)
    return float(((a - b).abs().median(-1).values / scale).max())


def element_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Per element, |a - b| over |a| + |b| + the token's RMS; largest over elements and tokens."""
    a, b = a.float(), b.float()
    rms = ((a.pow(2).mean(-1, keepdim=True) + b.pow(2).mean(-1, keepdim=True)) / 2).sqrt()
    return float(((a - b).abs() / (a.abs() + b.abs() + rms).clamp_min(1e-12)).max())


def statistics_of(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    from swarmnode.client.agreement import max_difference, trimmed_distance

    return {"trimmed": trimmed_distance(a, b), "max_rel": max_difference(a, b), "toploc": toploc_distance(a, b),
            "median": median_distance(a, b), "mean": mean_distance(a, b), "element": element_distance(a, b)}


# --- streams ----------------------------------------------------------------------------------------------
def stream(stack, start: int, end: int, x: torch.Tensor, prompt: int, skip_last: bool = False) -> list[torch.Tensor]:
    """A node's outputs for input `x` (1, L, H): the prompt's prefill, then one token a step."""
    last = end - 1 if skip_last else end
    length = x.shape[1]
    cache = stack.new_session_cache(start, last, 1, length)
    positions = torch.arange(length)[None]
    mask = torch.ones(1, length, dtype=torch.int64)
    outs = [stack.step([cache], start, last, x[:, :prompt], positions[:, :prompt], mask[:, :prompt])]
    for t in range(prompt, length):
        outs.append(stack.step([cache], start, last, x[:, t:t + 1], positions[:, t:t + 1], mask[:, t:t + 1]))
    return outs


def reference(stack, start: int, end: int, x: torch.Tensor) -> torch.Tensor:
    return stack.forward(start, end, x, torch.arange(x.shape[1])[None], torch.ones(1, x.shape[1], dtype=torch.int64))


def steps_of(prompt: int, length: int) -> list[tuple[int, int]]:
    return [(0, prompt), *((t, t + 1) for t in range(prompt, length))]


def perturb_weights(layer: torch.nn.Module, size: float, seed: int) -> None:
    """Every floating-point weight (a quantized linear's scales) of `layer` off by `size` at random."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
            if not tensor.is_floating_point() or tensor.dim() < 1 or "norm" in name or "inv_freq" in name:
                continue
            noise = torch.randn(tensor.shape, generator=generator).to(tensor.dtype)
            tensor.mul_(1 + size * noise)


def corrupt(out: torch.Tensor) -> torch.Tensor:
    """What `swarmnode.testing.faults` makes a node return: 8.0 added to the first 64 hidden dimensions."""
    from swarmnode.testing.faults import DIMS, OFFSET

    wrong = out.float().clone()
    wrong[..., :DIMS] += OFFSET
    return wrong.to(out.dtype)


def one_element(out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One element of each token, drawn at random, moved by the token's RMS (a sparse, targeted change)."""
    wrong = out.float().clone()
    rms = wrong.pow(2).mean(-1).sqrt()
    index = torch.randint(wrong.shape[-1], wrong.shape[:-1], generator=generator)
    wrong.scatter_add_(-1, index[..., None], rms[..., None])
    return wrong.to(out.dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default=",".join(KINDS), help="kinds to measure (dtype or dtype+quantization)")
    parser.add_argument("--sequences", type=int, default=70, help="honest sequences per kind and hop (70: about "
                        "10,000 honest checks per kind)")
    parser.add_argument("--tamper-sequences", type=int, default=6, help="of them, the ones also run tampered")
    parser.add_argument("--new-tokens", type=int, default=48, help="greedy tokens after each prompt (decode steps)")
    parser.add_argument("--prefix-steps", type=int, default=300, help="honest steps per kind and hop also checked "
                        "against a forward of exactly their prefix")
    parser.add_argument("--verify", type=float, default=0.1, help="the share of steps a client checks, for the "
                        "caught-within-32-steps figure")
    parser.add_argument("--hops", default=",".join(f"{a}:{b}" for a, b in HOPS),
                        help="hops to measure, A:B,... (a whole-model hop 0:30 is what one node serving all blocks runs)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dump", default=None, help="write every check's values here (JSON)")
    parser.add_argument("--cost-tokens", type=int, default=32, help="tokens per prompt for the cost in tok/s: a "
                        "swarm of two bfloat16 nodes, generation with and without verify (0: skip)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    try:
        hops = [tuple(int(x) for x in part.split(":")) for part in args.hops.split(",")]
    except ValueError:
        parser.error(f"--hops must be A:B,... with whole numbers, got {args.hops!r}")
    sizes = {end - start for start, end in hops}
    if len(sizes) > 1:
        parser.error("--hops must all hold as many blocks (the threshold is per block): measure the sizes apart")
    blocks = sizes.pop()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarmnode.client.agreement import tolerance_for
    from swarmnode.model_prep import prepare_smollm2
    from swarmnode.runtime.blocks import BlockStack
    from swarmnode.runtime.checkpoint import Checkpoint
    from swarmnode.testing.workload import chat_inputs

    began = time.monotonic()
    model_dir = prepare_smollm2()
    checkpoint = Checkpoint(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = chat_inputs(tokenizer, args.sequences)
    inputs: list[tuple[int, tuple[torch.Tensor, ...]]] = []  # (prompt length, hidden states entering each block)
    with torch.no_grad():
        for ids in prompts:
            full = local.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                  do_sample=False)
            inputs.append((ids.shape[1], local(full, output_hidden_states=True).hidden_states))
    print(f"{len(inputs)} sequences of {args.new_tokens} new tokens ({time.monotonic() - began:.0f} s)",
          file=sys.stderr, flush=True)

    # values[kind][stat][case] -> list of (value, is_prefill); case "honest", "honest-prefix" or a tamper's name
    values: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for kind in [k.strip() for k in args.kinds.split(",") if k.strip()]:
        dtype, quantization = parse_kind(kind)
        # a cheaper computation served as this kind: int4 as int8, int8 as unquantized (none below int4 here)
        cheaper = {"none": "int8", "int8": "int4"}.get(quantization)
        cheaper_name = f"{cheaper}-as-{quantization if quantization != 'none' else 'bf16'}"
        for start, end in hops:
            hop_began = time.monotonic()
            stack = BlockStack(checkpoint, start, end, dtype=dtype, quantization=quantization)
            wrong = {}
            for size in WRONG_WEIGHTS:
                wrong[size] = BlockStack(checkpoint, start, end, dtype=dtype, quantization=quantization)
                perturb_weights(wrong[size].layers[(start + end) // 2], size, seed=start)
            cheap = BlockStack(checkpoint, start, end, dtype=dtype, quantization=cheaper) if cheaper else None
            other = BlockStack(checkpoint, start, end, dtype=dtype, quantization=quantization, random_weights=True)
            prefix_left = args.prefix_steps
            for number, (prompt, hidden) in enumerate(inputs):
                x = hidden[start].to(dtype)
                steps = steps_of(prompt, x.shape[1])
                honest = stream(stack, start, end, x, prompt)
                ref = reference(stack, start, end, x)
                for (a, b), out in zip(steps, honest):
                    for name, value in statistics_of(out, ref[:, a:b]).items():
                        values[kind][name]["honest"].append((value, b - a > 1))
                for (a, b), out in zip(steps[1:], honest[1:]):  # decode steps against their exact prefix
                    if prefix_left <= 0:
                        break
                    prefix_left -= 1
                    exact = reference(stack, start, end, x[:, :b])[:, a:b]
                    for name, value in statistics_of(out, exact).items():
                        values[kind][name]["honest-prefix"].append((value, False))
                if number >= args.tamper_sequences:
                    continue
                tampered = {f"wrong-weights-{size:g}": stream(wrong[size], start, end, x, prompt)
                            for size in WRONG_WEIGHTS}
                tampered["skip-block"] = stream(stack, start, end, x, prompt, skip_last=True)
                if cheap is not None:
                    tampered[cheaper_name] = stream(cheap, start, end, x, prompt)
                tampered["other-model"] = stream(other, start, end, x, prompt)
                generator = torch.Generator().manual_seed(number)
                for level in NOISE_LEVELS:
                    tampered[f"noise-{level:g}"] = [
                        (out.float() + level * out.float().pow(2).mean(-1, keepdim=True).sqrt()
                         * torch.randn(out.shape, generator=generator)).to(out.dtype) for out in honest]
                tampered["corrupt-outputs"] = [corrupt(out) for out in honest]  # the tests' fault injection
                tampered["one-element"] = [one_element(out, generator) for out in honest]
                for case, outs in tampered.items():
                    for (a, b), out in zip(steps, outs):
                        for name, value in statistics_of(out, ref[:, a:b]).items():
                            values[kind][name][case].append((value, b - a > 1))
            print(f"{kind} blocks [{start}, {end}): {time.monotonic() - hop_began:.0f} s", file=sys.stderr, flush=True)
            del stack, wrong, cheap, other

    report = summarize(values, tolerance_for, args.verify, hops, blocks)
    if args.dump:
        Path(args.dump).write_text(json.dumps({k: {s: dict(c) for s, c in v.items()} for k, v in values.items()}))
    if args.cost_tokens:
        report["cost"] = cost(model_dir, prompts[:2], args.cost_tokens, args.verify)
    report["seconds"] = round(time.monotonic() - began, 1)
    print_table(report)
    print(json.dumps(report))


def cost(model_dir, prompts: list, tokens: int, share: float) -> dict:
    """Decode tokens/s of a bfloat16 client through a swarm of two bfloat16 nodes serving all blocks, without
    verification and with `verify` = `share` and 1.0, turn about on the same prompts (greedy, so every mode
    generates the same text; the first token's time, the prompt's, is left out)."""
    import itertools

    from swarmnode.client import DistributedModelForCausalLM
    from swarmnode.testing.local_swarm import LocalSwarm
    from swarmnode.testing.token_clock import TokenClock

    shares = (0.0, share, 1.0)
    timings: dict[float, list[float]] = {s: [] for s in shares}
    texts: dict[float, list] = {s: [] for s in shares}
    with LocalSwarm(model_dir) as swarm:
        swarm.start_bootstrap()
        nodes = [swarm.launch_node(0, 30, name=f"bf16-{i}", extra=["--dtype", "bfloat16"]) for i in range(2)]
        for node in nodes:
            swarm.wait_serving(node, 300)
        for round_, (ids, verify) in enumerate(itertools.product(prompts, shares)):
            with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                             dtype=torch.bfloat16, verify=verify,
                                                             verify_seed=round_) as remote:
                clock = TokenClock()
                out = remote.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                      streamer=clock)
            stamps = clock.times  # the first is the prompt, the second the first generated token
            timings[verify].append((len(stamps) - 2) / (stamps[-1] - stamps[1]))
            texts[verify].append(out)
    rates = {f"verify={s:g}": round(sum(timings[s]) / len(timings[s]), 2) for s in shares}
    base = rates["verify=0"]
    return {"tokens_per_s": rates, "ratio": {k: round(v / base, 3) for k, v in rates.items()},
            "same_text": all(torch.equal(a, b) for s in shares for a, b in zip(texts[0.0], texts[s]))}


def summarize(values, tolerance_for, share: float, hops, blocks: int) -> dict:
    out: dict = {"benchmark": "verification", "model": "SmolLM2-135M-Instruct", "hops": [list(h) for h in hops],
                 "verify_share": share, "kinds": {}}
    for kind, by_stat in values.items():
        entry: dict = {}
        for stat, cases in by_stat.items():
            honest = cases["honest"]
            honest_decode = [v for v, prefill in honest if not prefill]
            honest_prefill = [v for v, prefill in honest if prefill]
            prefix = [v for v, _ in cases.get("honest-prefix", [])]
            honest_max = max([v for v, _ in honest] + prefix)
            # the product's threshold for its statistic; for the others, what a margin of 1.5 over the largest
            # honest value measured here would give (the best any threshold could do, with a little room)
            threshold = tolerance_for(kind, blocks) if stat == PRODUCT_STAT else 1.5 * honest_max
            decode_threshold = threshold
            row: dict = {"honest_checks": len(honest) + len(prefix), "threshold_from":
                         "client.agreement" if stat == PRODUCT_STAT else "1.5 x the largest honest value",
                         "honest_max_decode": max(honest_decode), "honest_max_prefill": max(honest_prefill),
                         "honest_max_prefix": max(prefix) if prefix else None,
                         "honest_p999": quantile([v for v, _ in honest], 0.999), "threshold": threshold,
                         "decode_threshold": decode_threshold,
                         "margin": threshold / max([v for v, p in honest if p] or [1e-12]),
                         "decode_margin": decode_threshold / max(honest_decode + prefix),
                         "tampered": {}}
            row["false_alarms"] = (sum(v > (threshold if p else decode_threshold) for v, p in honest)
                                   + sum(v > decode_threshold for v in prefix))
            for case, items in cases.items():
                if case.startswith("honest"):
                    continue
                tamper = {"min": min(v for v, _ in items), "checks": len(items),
                          "prefill_min": min(v for v, p in items if p),
                          "decode_median": quantile([v for v, p in items if not p], 0.5)}
                prefill = [v > threshold for v, p in items if p]
                decode = [v > decode_threshold for v, p in items if not p]
                tamper["prefill_caught"] = sum(prefill) / len(prefill)
                tamper["decode_caught"] = sum(decode) / len(decode)
                # the prefill is always checked, then each of 31 later steps with probability `share`
                missed = (1 - tamper["prefill_caught"]) * (1 - share * tamper["decode_caught"]) ** 31
                tamper["caught_within_32"] = 1 - missed
                row["tampered"][case] = tamper
            entry[stat] = row
        out["kinds"][kind] = entry
    return out


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.floor(q * len(xs)))]


def print_table(report: dict) -> None:
    for kind, entry in report["kinds"].items():
        for stat, row in entry.items():
            print(f"\n{kind} / {stat}: {row['honest_checks']} honest checks, largest {row['honest_max_decode']:.3g} "
                  f"(decode), {row['honest_max_prefill']:.3g} (prefill), "
                  f"{row['honest_max_prefix'] if row['honest_max_prefix'] is None else round(row['honest_max_prefix'], 5)}"
                  f" (exact prefix); thresholds {row['threshold']:.3g} / {row['decode_threshold']:.3g} for several tokens / "
                  f"one ({row['margin']:.2f}x / {row['decode_margin']:.2f}x the largest honest values); "
                  f"false alarms {row.get('false_alarms')}")
            for case, t in row["tampered"].items():
                rates = (f"; caught per prefill {t['prefill_caught']:.0%}, per decode step {t['decode_caught']:.0%}, "
                         f"within 32 steps {t['caught_within_32']:.1%}" if "decode_caught" in t else "")
                print(f"  {case:18s} smallest {t['min']:.3g} (prefill {t['prefill_min']:.3g}, decode median "
                      f"{t['decode_median']:.3g}){rates}")
    if "cost" in report:
        print(f"\ncost: tokens/s {report['cost']['tokens_per_s']}, ratio {report['cost']['ratio']}, same text "
              f"{report['cost']['same_text']}")
    print(f"\n{report['seconds']:.0f} s in all", file=sys.stderr)


if __name__ == "__main__":
    main()
