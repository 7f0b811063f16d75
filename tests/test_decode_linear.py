"""Single-row products of bfloat16 linears through the GEMV kernel (`runtime.decode_linear`): the same bits as
`F.linear`, on the real SmolLM2 blocks and on the matrix shapes of the model families nodes serve."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swarmnode.runtime.decode_linear import MAX_IN_FEATURES, DecodeLinear, use_decode_linears


@pytest.mark.parametrize("out_features,in_features,bias", [
    (576, 576, False), (192, 576, False), (1536, 576, False), (576, 1536, False),  # SmolLM2
    (2048, 2048, False), (5632, 2048, False), (2048, 5632, False),  # the 1B Llama
    (4096, 4096, False), (14336, 4096, False), (1024, 4096, True),  # Llama-3-8B (and a biased one)
    (5760, 2880, True), (2880, 2880, True), (49152, 576, False), (7, 3, True),
])
def test_switched_linears_give_f_linears_bits(out_features, in_features, bias):
    """Whether a shape takes the GEMV path depends on this CPU's kernels (on an AVX-512 Xeon every shape here up
    to 6,080 columns did; on an AVX2 EPYC those from 2,048 columns did not): what must hold everywhere is that a
    switched linear's single rows give `F.linear`'s bits, and an unswitched one is left as it was."""
    torch.manual_seed(out_features + in_features)
    block = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=bias, dtype=torch.bfloat16))
    switched = use_decode_linears(block)
    linear = block[0]
    assert switched in (0, 1) and isinstance(linear, torch.nn.Linear)
    assert (type(linear) is DecodeLinear) == bool(switched) or (type(linear) is DecodeLinear and not linear.gemv)
    if in_features > MAX_IN_FEATURES:
        assert switched == 0
    for scale in (0.01, 1.0, 30.0):
        row = (torch.randn(1, 1, in_features) * scale).bfloat16()
        assert torch.equal(linear(row), F.linear(row, linear.weight, linear.bias))
    rows = torch.randn(3, 2, in_features).bfloat16()  # more than one row: F.linear itself
    assert torch.equal(linear(rows), F.linear(rows, linear.weight, linear.bias))


def test_only_plain_bfloat16_linears_narrow_enough_switch():
    block = torch.nn.ModuleDict({
        "bf16": torch.nn.Linear(64, 32, dtype=torch.bfloat16),
        "fp32": torch.nn.Linear(64, 32),
        "wide": torch.nn.Linear(MAX_IN_FEATURES + 64, 32, bias=False, dtype=torch.bfloat16),
    })
    assert use_decode_linears(block) == 1
    assert type(block["bf16"]) is DecodeLinear
    assert type(block["fp32"]) is torch.nn.Linear and type(block["wide"]) is torch.nn.Linear
    assert set(block.state_dict()) == {"bf16.weight", "bf16.bias", "fp32.weight", "fp32.bias", "wide.weight"}


def test_a_bfloat16_stack_decodes_with_the_same_bits_as_transformers(model_dir):
    """Every linear of SmolLM2's bfloat16 blocks switches, and a decode step through the node's stack equals
    the same layers run by transformers (`F.linear` everywhere)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from swarmnode.runtime.blocks import BlockStack
    from swarmnode.runtime.checkpoint import Checkpoint

    stack = BlockStack(Checkpoint(model_dir), 0, 2, dtype=torch.bfloat16)
    assert all(type(m) is DecodeLinear for layer in stack.layers.values() for m in layer.modules()
               if isinstance(m, torch.nn.Linear))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    hidden = torch.randn(1, 6, 576, generator=torch.Generator().manual_seed(0)).bfloat16()
    cache = stack.new_session_cache(0, 2, 1, 8)
    mask = torch.ones(1, 6, dtype=torch.bool)
    ours = [stack.step([cache], 0, 2, hidden[:, :5], torch.arange(5)[None], mask[:, :5]),
            stack.step([cache], 0, 2, hidden[:, 5:], torch.tensor([[5]]), mask[:, 5:])]
    theirs_cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        outputs = []
        for part, positions in ((hidden[:, :5], torch.arange(5)[None]), (hidden[:, 5:], torch.tensor([[5]]))):
            state = part
            embeddings = model.model.rotary_emb(state, positions)
            for layer in model.model.layers[:2]:
                state = layer(state, attention_mask=None, position_ids=positions, cache=theirs_cache,
                              use_cache=True, position_embeddings=embeddings)
                state = state[0] if isinstance(state, tuple) else state
            outputs.append(state)
    assert torch.equal(ours[0], outputs[0]) and torch.equal(ours[1], outputs[1])


def test_prompts_run_in_float32_where_the_cpu_has_no_native_bfloat16():
    """With oneDNN capped below AVX-512 BF16 (as on a CPU without it), a bfloat16 linear's prompt products run in
    float32 (3-6x faster there) and stay within a bfloat16 rounding of `F.linear`'s; single rows keep the GEMV
    path's bits. Run in a process of its own: the CPU's answer is read once per process."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch, torch.nn.functional as F
        from swarmnode.runtime import dtypes
        from swarmnode.runtime.decode_linear import DecodeLinear, prompt_in_float32, use_decode_linears
        assert not dtypes.native_bfloat16() and dtypes.dense_compute_dtype() == torch.float32
        assert prompt_in_float32()
        torch.manual_seed(0)
        wide = torch.nn.Linear(6144, 64).to(torch.bfloat16)  # too wide for the GEMV path: switched for prompts
        narrow = torch.nn.Linear(512, 256, bias=False).to(torch.bfloat16)
        model = torch.nn.Sequential(wide, narrow)
        use_decode_linears(model)
        assert type(wide) is DecodeLinear and not wide.gemv and type(narrow) is DecodeLinear and narrow.gemv
        x = torch.randn(1, 128, 512).to(torch.bfloat16)
        ours = narrow(x)
        exact = F.linear(x.float(), narrow.weight.float()).to(torch.bfloat16)
        assert torch.equal(ours, exact)
        plain = F.linear(x, narrow.weight)
        rel = float((ours.float() - plain.float()).norm() / plain.float().norm())
        assert rel < 4e-3, rel
        row = x[:, :1]
        assert torch.equal(narrow(row), F.linear(row, narrow.weight))
        print("ok", rel)
    """)
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr[-3000:]
