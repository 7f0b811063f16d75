"""Measure weight-only quantization on CPU: speed of a block's linears, and quality on SmolLM2-135M.

Speed: the seven linears of one decoder block (q, k, v, o, gate, up, down) of SmolLM2-135M (hidden 576,
intermediate 1536, 9 heads / 3 KV heads of 64) and of a 1B Llama (hidden 2048, intermediate 5632, 32 heads /
8 KV heads of 64), random weights, applied in turn to M input rows: M=1 and M=8 (decoding one or eight
sessions) and M=512 (a prefill). Variants, timed in turns in the same run so that load from other users
of the machine hits them alike: ``nn.Linear`` in bfloat16 (the baseline) and float32, and
:class:`swarmnode.runtime.quantize.QuantizedLinear` int8 and int4 with bfloat16 inputs, and with float32
inputs (``*_f32in``, which includes the casts to and from the kernels' bfloat16). Ratios are medians of
time over the bfloat16 baseline's median: below 1 is faster.

Quality: the real SmolLM2 checkpoint (``scripts/prepare_model.py``) with every block's linears quantized
(not the embeddings nor the LM head), run over the opening of "Pride and Prejudice" in
``tests/data``: perplexity and per-position cosine similarity of the logits against the unquantized model
in bfloat16 and in float32. ``int4_group64`` is int4 with groups of 64 for comparison.

Experts (``--no-experts`` skips them): mixtures of experts keep their experts as fused 3-D weights, which
nodes quantize expert by expert (:class:`swarmnode.runtime.quantize.QuantizedExperts`). Quality: tiny random
checkpoints of each MoE family (``swarmnode.tiny_models``) with every block quantized, against the
same model in bfloat16 (mean cosine of the logits over a 64-token prompt; random weights quantize worse than
trained ones, so these are floors). Speed: one block of gpt-oss-20b's and of Qwen3-30B-A3B's shapes with
random weights, built and timed as a node measures itself (``server.capacity``: decode steps of one token,
and a 256-token prefill), in bfloat16 (transformers' own experts forward) and quantized, with its bytes.

``--third-party`` also times, on the 1B block's largest linear (5632x2048), whichever of optimum-quanto,
torchao, bitsandbytes and hqq import (they are not project dependencies: install them elsewhere and put
them on ``PYTHONPATH``).

Prints progress lines, then ONE JSON line last.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_quantize.py [--repeats 5] [--no-speed] [--no-quality]
        [--no-experts] [--third-party]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from swarmnode.runtime.quantize import (
    QUANTIZATIONS,
    QuantizedLinear,
    quantize_block,
    quantized_tensor_bytes,
)

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "data" / "pride_and_prejudice_ch1.txt"

SHAPES = {
    "smollm2-135m": {"hidden": 576, "intermediate": 1536, "heads": 9, "kv_heads": 3, "head_dim": 64},
    "llama-1b": {"hidden": 2048, "intermediate": 5632, "heads": 32, "kv_heads": 8, "head_dim": 64},
}
ROWS = (1, 8, 512)
# the variants: (name, quantization, input dtype)
VARIANTS = [
    ("bfloat16", "none", torch.bfloat16),
    ("float32", "none", torch.float32),
    ("int8", "int8", torch.bfloat16),
    ("int4", "int4", torch.bfloat16),
    ("int8_f32in", "int8", torch.float32),
    ("int4_f32in", "int4", torch.float32),
]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def block_linears(shape: dict) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of a Llama block's linears."""
    hidden, inter = shape["hidden"], shape["intermediate"]
    q, kv = shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    return {
        "self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


def build_variant(weights: dict[str, torch.Tensor], quantization: str, dtype: torch.dtype) -> list:
    layers = []
    for weight in weights.values():
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight = torch.nn.Parameter(weight.to(dtype), requires_grad=False)
        layers.append(linear if quantization == "none" else QuantizedLinear.from_linear(linear, quantization, dtype))
    return layers


def time_pass(layers: list, inputs: list[torch.Tensor], loops: int) -> float:
    start = time.perf_counter()
    for _ in range(loops):
        for layer, x in zip(layers, inputs):
            layer(x)
    return (time.perf_counter() - start) / loops


def bench_speed(repeats: int) -> dict:
    results = {}
    for model, shape in SHAPES.items():
        generator = torch.Generator().manual_seed(0)
        weights = {name: torch.randn(out, inp, generator=generator) * 0.02
                   for name, (out, inp) in block_linears(shape).items()}
        variants = {name: (build_variant(weights, quant, dtype), dtype) for name, quant, dtype in VARIANTS}
        results[model] = {}
        for rows in ROWS:
            inputs = {dtype: [torch.randn(rows, w.shape[1], generator=generator).to(dtype) for w in weights.values()]
                      for dtype in (torch.bfloat16, torch.float32)}
            # calibrate loops so one sample of the baseline takes about 0.2 s
            time_pass(variants["bfloat16"][0], inputs[torch.bfloat16], 1)
            once = time_pass(variants["bfloat16"][0], inputs[torch.bfloat16], 1)
            loops = max(1, int(0.2 / once))
            samples: dict[str, list[float]] = {name: [] for name in variants}
            for layers, dtype in variants.values():  # warm-up
                time_pass(layers, inputs[dtype], 1)
            for _ in range(repeats):
                for name, (layers, dtype) in variants.items():
                    samples[name].append(time_pass(layers, inputs[dtype], loops))
            base = statistics.median(samples["bfloat16"])
            entry = {"bfloat16_us": round(base * 1e6, 1)}
            entry.update({name: round(statistics.median(s) / base, 3) for name, s in samples.items()
                          if name != "bfloat16"})
            results[model][f"M={rows}"] = entry
            log(f"speed {model} M={rows}: {entry}")
    return results


def block_bytes() -> dict:
    """Bytes of one block's linear weights per mode, as nodes account for them."""
    out = {}
    for model, shape in SHAPES.items():
        linears = block_linears(shape)
        out[model] = {
            mode: sum(quantized_tensor_bytes(f"{name}.weight", s, mode, torch.bfloat16) for name, s in linears.items())
            for mode in QUANTIZATIONS
        }
    return out


def bench_third_party(repeats: int) -> dict:
    """Time the third-party CPU quantizers that import, on a 5632x2048 linear, against bfloat16."""
    import warnings

    warnings.filterwarnings("ignore")
    out_features, in_features = 5632, 2048
    base = torch.nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16)

    def ours(mode):
        return lambda: QuantizedLinear.from_linear(base, mode, torch.bfloat16)

    def quanto(kind):
        def build():
            from optimum.quanto import freeze, qint4, qint8, quantize
            module = torch.nn.Sequential(copy.deepcopy(base))
            quantize(module, weights={"int8": qint8, "int4": qint4}[kind])
            freeze(module)
            return module
        return build

    def torchao_int8():
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        module = torch.nn.Sequential(copy.deepcopy(base))
        quantize_(module, Int8WeightOnlyConfig())
        return module

    def torchao_int4():
        from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
        from torchao.quantization import quantize_
        module = torch.nn.Sequential(copy.deepcopy(base))
        quantize_(module, PrototypeInt4WeightOnlyConfig(group_size=32))
        return module

    def bnb(kind):
        def build():
            import bitsandbytes as bnb
            if kind == "int8":
                module = bnb.nn.Linear8bitLt(in_features, out_features, bias=False, has_fp16_weights=False)
                module.weight = bnb.nn.Int8Params(base.weight.data.float().clone(), requires_grad=False,
                                                  has_fp16_weights=False)
                return module.to("cpu")
            module = bnb.nn.Linear4bit(in_features, out_features, bias=False, compute_dtype=torch.bfloat16,
                                       quant_type="nf4")
            module.weight = bnb.nn.Params4bit(base.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                              blocksize=64)._quantize("cpu")
            return module
        return build

    def hqq(bits):
        def build():
            from hqq.core.quantize import BaseQuantizeConfig, HQQLinear
            return HQQLinear(copy.deepcopy(base), quant_config=BaseQuantizeConfig(nbits=bits, group_size=64),
                             compute_dtype=torch.bfloat16, device="cpu")
        return build

    candidates = {
        "torch_int8": ours("int8"), "torch_int4": ours("int4"),
        "quanto_qint8": quanto("int8"), "quanto_qint4": quanto("int4"), "torchao_int8wo": torchao_int8,
        "torchao_int4wo": torchao_int4,
        "bnb_int8": bnb("int8"), "bnb_nf4": bnb("nf4"), "hqq_8bit": hqq(8), "hqq_4bit": hqq(4),
    }
    results = {}
    for name, build in candidates.items():
        try:
            module = build()
        except Exception as exc:
            results[name] = f"unavailable: {type(exc).__name__}: {str(exc)[:120]}"
            log(f"third-party {name}: {results[name]}")
            continue
        results[name] = {}
        for rows in ROWS:
            x = torch.randn(rows, in_features, dtype=torch.bfloat16)
            try:
                module(x)
            except Exception as exc:
                results[name] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
                break
            loops = max(1, int(0.1 / max(time_pass([base], [x], 1), 1e-6)))
            ours_t, base_t = [], []
            for _ in range(repeats):
                ours_t.append(time_pass([module], [x], loops))
                base_t.append(time_pass([base], [x], loops))
            results[name][f"M={rows}"] = round(statistics.median(ours_t) / statistics.median(base_t), 3)
        log(f"third-party {name}: {results[name]}")
    return results


def bench_quality() -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarmnode.model_prep import prepare_smollm2

    path = prepare_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(TEXT.read_text(), return_tensors="pt")["input_ids"]
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    reference_f32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def logits(model):
        return model(ids).logits[0].float()

    def quantized(source, mode, dtype, group_size=None):
        model = copy.deepcopy(source)
        for layer in model.model.layers:
            if group_size is None:
                quantize_block(layer, mode, dtype)
            else:  # a group size other than the nodes' own, for comparison
                for name, child in list(layer.named_modules()):
                    if isinstance(child, torch.nn.Linear):
                        parent, _, attr = name.rpartition(".")
                        setattr(layer.get_submodule(parent), attr,
                                QuantizedLinear.from_linear(child, mode, dtype, group_size=group_size))
        return model

    ref_bf16, ref_f32 = logits(base), logits(reference_f32)
    targets = ids[0, 1:]

    def figures(out):
        cos_bf16 = torch.nn.functional.cosine_similarity(out, ref_bf16, dim=-1)
        cos_f32 = torch.nn.functional.cosine_similarity(out, ref_f32, dim=-1)
        ppl = torch.exp(torch.nn.functional.cross_entropy(out[:-1], targets)).item()
        return {"perplexity": round(ppl, 4), "cos_vs_bf16_mean": round(cos_bf16.mean().item(), 5),
                "cos_vs_bf16_min": round(cos_bf16.min().item(), 5),
                "cos_vs_f32_mean": round(cos_f32.mean().item(), 5), "cos_vs_f32_min": round(cos_f32.min().item(), 5)}

    results = {"tokens": ids.shape[1], "bfloat16": figures(ref_bf16), "float32": figures(ref_f32)}
    for name, source, mode, dtype, group in [
        ("int8", base, "int8", torch.bfloat16, None), ("int4", base, "int4", torch.bfloat16, None),
        ("int8_f32", reference_f32, "int8", torch.float32, None),
        ("int4_f32", reference_f32, "int4", torch.float32, None),
        ("int4_group64", base, "int4", torch.bfloat16, 64),
    ]:
        results[name] = figures(logits(quantized(source, mode, dtype, group)))
        log(f"quality {name}: {results[name]}")
    return results


#: The MoE shapes (`make_random_checkpoint.py`'s, the published configs) whose blocks the experts benchmark times.
MOE_SHAPES = ("gpt-oss-20b", "qwen3-30b-a3b")


def bench_experts() -> dict:
    import tempfile

    from transformers import AutoModelForCausalLM

    from swarmnode.runtime.blocks import BlockStack, measure_block_throughput, measure_prefill_throughput
    from swarmnode.runtime.family_check import MemoryCheckpoint
    from swarmnode.runtime.quantize import block_bytes as layer_bytes
    from swarmnode.tiny_models import TINY_MOE_FAMILIES, make_tiny_checkpoint

    quality = {}
    root = Path(tempfile.mkdtemp(prefix="bench-experts-"))
    ids = torch.randint(3, 500, (1, 64), generator=torch.Generator().manual_seed(0))
    for i, family in enumerate(TINY_MOE_FAMILIES):
        path = make_tiny_checkpoint(family, root / family, seed=i)
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        reference = base(ids).logits[0].float()
        quality[family] = {}
        for mode in ("int8", "int4"):
            model = copy.deepcopy(base)
            for layer in model.model.layers:
                quantize_block(layer, mode, torch.bfloat16)
            cosine = torch.nn.functional.cosine_similarity(model(ids).logits[0].float(), reference, dim=-1)
            quality[family][mode] = {"cos_vs_bf16_mean": round(cosine.mean().item(), 5),
                                     "cos_vs_bf16_min": round(cosine.min().item(), 5)}
        log(f"experts quality {family}: {quality[family]}")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_random_checkpoint

    speed = {}
    for name in MOE_SHAPES:
        config = make_random_checkpoint.transformers_config(make_random_checkpoint.SHAPES[name])
        source = MemoryCheckpoint(config, {})  # random weights: no tensors, and block 0 is an MoE block
        speed[name] = {}
        for mode in ("none", "int8", "int4"):
            stack = BlockStack(source, 0, 1, dtype=torch.bfloat16, quantization=mode, random_weights=True)
            decode = sorted(measure_block_throughput(stack, repeats=16) for _ in range(3))[1]
            speed[name][mode] = {"decode_tokens_per_s": round(decode, 1),
                                 "prefill_tokens_per_s": round(measure_prefill_throughput(stack), 1),
                                 "block_bytes": layer_bytes(source.family.new_layer(0), mode, torch.bfloat16)}
            log(f"experts speed {name} {mode}: {speed[name][mode]}")
            del stack
    return {"quality": quality, "block_speed": speed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed samples per variant (medians are reported)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-speed", action="store_true", help="skip the speed figures")
    parser.add_argument("--no-quality", action="store_true", help="skip the SmolLM2 quality figures")
    parser.add_argument("--third-party", action="store_true", help="also time the third-party quantizers that import")
    parser.add_argument("--no-experts", action="store_true", help="skip the mixture-of-experts figures")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    result = {
        "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(), "threads": args.threads, "block_linear_bytes": block_bytes(),
    }
    if not args.no_speed:
        result["speed_ratio_vs_bfloat16"] = bench_speed(args.repeats)
    if args.third_party:
        result["third_party_ratio_vs_bfloat16"] = bench_third_party(args.repeats)
    if not args.no_quality:
        result["quality"] = bench_quality()
    if not args.no_experts:
        result["experts"] = bench_experts()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
