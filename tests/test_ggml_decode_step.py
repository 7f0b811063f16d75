"""The C decode step of a Llama block of GGUF matrices (`runtime.ggml.decode_step`): one token through the block in
two calls of the kernels gives the layer's own output to float32 rounding (exactly, where only the rotary embedding
and the residuals are involved), fills the cache as the layer does, and leaves everything it does not take
(prompts, batches, masks, other dtypes) to the layer's own forward, bit for bit."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from swarmnode.runtime.ggml import decode_step
from swarmnode.runtime.ggml.formats import GGMLType
from swarmnode.runtime.ggml.weights import GGMLLinear, install, quantize_weight
from swarmnode.runtime.quantize import quantize_block
from swarmnode.tiny_models import tiny_config

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def _model(kind: GGMLType | None = GGMLType.F32, *, seed: int = 0, dtype=torch.float32, attn_implementation="sdpa",
           **settings):
    """A random 2-block Llama whose block linears are GGUF matrices of `kind` (None: left as torch linears)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama", 2)
    for key, value in settings.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model = model.eval().requires_grad_(False)
    for param in model.parameters():
        param.normal_(0.0, 0.2)
    if kind is not None:
        for layer in model.model.layers:
            for name in LINEARS:
                install(layer, name, quantize_weight(layer.get_submodule(name).weight, kind), dtype)
    return model


def _stepped(model):
    twin = copy.deepcopy(model)
    assert all(decode_step.attach(layer) for layer in twin.model.layers)
    return twin


def _generate(model, input_ids, **kwargs):
    out = model.generate(input_ids, max_new_tokens=12, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture
def own_forward_calls(monkeypatch):
    """How many times the Llama layer's own forward ran."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    calls = [0]
    original = LlamaDecoderLayer.forward

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LlamaDecoderLayer, "forward", counted)
    return calls


def test_float_blocks_decode_as_the_layer_does(own_forward_calls) -> None:
    plain = _model(GGMLType.F32)
    stepped = _stepped(plain)
    prompt = torch.tensor([[1, 17, 33, 250, 9]])
    tokens, logits = _generate(plain, prompt)
    calls = own_forward_calls[0]
    ours, our_logits = _generate(stepped, prompt)
    # the prompt goes through each layer's own forward, every decode step through the C step
    assert own_forward_calls[0] - calls == len(stepped.model.layers)
    assert torch.equal(ours, tokens)
    assert torch.equal(our_logits[0], logits[0])  # the prompt: the same code
    assert _relative(our_logits, logits) < 1e-5


def test_quantized_blocks_stay_close() -> None:
    """With Q8_0 (and Q4_1) blocks the activations are quantized for the matmuls, so a last-place difference in a
    norm can move an activation by one step: close, not bit-equal, to the layer's own forward."""
    for kind in (GGMLType.Q8_0, GGMLType.Q4_1):
        plain = _model(kind, hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2)
        stepped = _stepped(plain)
        prompt = torch.tensor([[1, 17, 33, 250, 9]])
        _, logits = _generate(plain, prompt)
        _, ours = _generate(stepped, prompt)
        cosine = torch.nn.functional.cosine_similarity(ours.flatten(1), logits.flatten(1), dim=1)
        assert cosine.min() > 0.999, (kind, cosine)


def test_long_context_attention_runs_on_all_threads() -> None:
    """Past 512 cached positions (4 heads of 16) the attention is shared out among the threads: same results."""
    plain = _model(GGMLType.F32, max_position_embeddings=2048)
    stepped = _stepped(plain)
    prompt = torch.randint(3, 500, (1, 700), generator=torch.Generator().manual_seed(1))
    tokens, logits = _generate(plain, prompt)
    ours, our_logits = _generate(stepped, prompt)
    assert torch.equal(ours, tokens)
    assert _relative(our_logits, logits) < 1e-5


def _padded_batch(plain, stepped, own_forward_calls):
    """Greedy tokens and logits of a left-padded batch of two, from `plain` and from `stepped`, and how many times
    the layer's own forward ran for `stepped`'s."""
    batch = torch.tensor([[0, 0, 5, 6, 7], [1, 17, 33, 250, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    want, want_logits = _generate(plain, batch, attention_mask=mask)
    calls = own_forward_calls[0]
    got, got_logits = _generate(stepped, batch, attention_mask=mask)
    return want, want_logits, got, got_logits, own_forward_calls[0] - calls


def test_a_padded_batch_decodes_each_row_as_alone(own_forward_calls) -> None:
    """Rows of a batch (here left-padded: a boolean mask) take the step together; each row attends only the keys
    its mask shows, so it decodes as it does alone, and as the layer's own forward decodes the batch."""
    plain = _model(GGMLType.F32)
    stepped = _stepped(plain)
    want, want_logits, got, got_logits, own_calls = _padded_batch(plain, stepped, own_forward_calls)
    assert own_calls == len(stepped.model.layers)  # the prompt only
    assert torch.equal(got, want)
    assert _relative(got_logits, want_logits) < 1e-5
    for row, prompt in enumerate(([5, 6, 7], [1, 17, 33, 250, 9])):
        alone, alone_logits = _generate(stepped, torch.tensor([prompt]))
        assert torch.equal(alone[0, len(prompt):], got[row, 5:])
        assert _relative(alone_logits[:, 0], got_logits[:, row]) < 1e-5


def test_what_the_step_does_not_take_runs_as_before(own_forward_calls) -> None:
    """An additive mask that masks something (eager attention, left-padded) and a bfloat16 model take the layer's
    own forward: the same bits as without the step."""
    plain = _model(GGMLType.Q8_0, attn_implementation="eager")
    stepped = _stepped(plain)
    want, want_logits, got, got_logits, own_calls = _padded_batch(plain, stepped, own_forward_calls)
    assert own_calls == 12 * len(stepped.model.layers)  # every step, prompt included
    assert torch.equal(got, want) and torch.equal(got_logits, want_logits)

    bf16 = _model(GGMLType.Q8_0, dtype=torch.bfloat16)
    assert "float32" in decode_step.why_not(bf16.model.layers[0])
    assert not decode_step.attach(bf16.model.layers[0])


def test_which_layers_take_the_step() -> None:
    assert decode_step.why_not(_model(GGMLType.Q4_0).model.layers[0]) is None
    assert "linear" in decode_step.why_not(_model(None).model.layers[0])
    assert "activation" in decode_step.why_not(_model(GGMLType.F32, hidden_act="gelu").model.layers[0])
    biased = _model(GGMLType.F32)
    biased.model.layers[0].self_attn.q_proj.bias = torch.nn.Parameter(torch.zeros(64), requires_grad=False)
    assert "bias" in decode_step.why_not(biased.model.layers[0])
    with pytest.raises(ValueError, match="cannot take the C decode step"):
        decode_step.LlamaDecodeStep(biased.model.layers[0])
    hooked = _model(GGMLType.F32).model.layers[0]
    hook = hooked.forward = lambda *args, **kwargs: None  # a forward replaced already (an accelerate-style hook)
    assert not decode_step.attach(hooked) and hooked.forward is hook
    # a checkpoint quantized into ggml's blocks gets the step, so its local reference computes as its nodes do
    quantized = _model(None)
    for layer in quantized.model.layers:
        quantize_block(layer, "q8_0", torch.float32)
        assert isinstance(layer.self_attn.q_proj, GGMLLinear)
        assert isinstance(layer.__dict__.get("forward"), decode_step._DecodeForward)


def test_a_copied_or_pickled_model_steps_with_its_own_tensors() -> None:
    stepped = _stepped(_model(GGMLType.Q4_0))
    prompt = torch.tensor([[1, 17, 33, 250, 9]])
    want, want_logits = _generate(stepped, prompt)
    for twin in (copy.deepcopy(stepped), pickle.loads(pickle.dumps(stepped))):
        layer = twin.model.layers[0]
        step = layer.forward.step
        assert layer.forward.layer is layer
        assert step.tensors["q_proj"] is layer.self_attn.q_proj.qweight
        assert step._ptr["q_proj"] == layer.self_attn.q_proj.qweight.data_ptr()
        got, got_logits = _generate(twin, prompt)
        assert torch.equal(got, want) and torch.equal(got_logits, want_logits)


def test_a_model_cast_after_the_step_was_attached_takes_its_own_forward(own_forward_calls) -> None:
    stepped = _stepped(_model(GGMLType.F32))
    stepped.to(torch.bfloat16)  # the norms are bfloat16 now (new storage): the step no longer applies
    calls = own_forward_calls[0]
    tokens, _ = _generate(stepped, torch.tensor([[1, 17, 33, 250, 9]]))
    assert tokens.shape == (1, 17)
    assert own_forward_calls[0] - calls == 12 * len(stepped.model.layers)
