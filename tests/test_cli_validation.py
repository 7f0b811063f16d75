"""Every `join` flag is validated before anything starts, with a message that says what to do."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from swarmnode.cli import main

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWF4wEr5XtqQayPrXS8NnvDGNZqpszHir9fBj4b7KJ3i9j"


@pytest.mark.parametrize("flags,message", [
    (["--blocks", "10:5"], "empty or negative"),
    (["--blocks", "abc"], "not a block range"),
    (["--blocks", "0:10", "--leftover-mem", "lots"], "not a size"),
    (["--blocks", "0:10", "--leftover-mem", "1000T"], "more than this machine has free"),
    (["--blocks", "0:10", "--initial-peers", "not-a-maddr"], "not a multiaddr"),
    (["--blocks", "0:10", "--port", "70000"], "70000"),
    (["--blocks", "0:10", "--dtype", "int3"], "int3"),
    (["--blocks", "0:10", "--quantize", "int3"], "int3"),
    (["--blocks", "0:10", "--quantize", "int8", "--dtype", "float64"], "float64"),
    (["--blocks", "0:99", "--cache-tokens", "8"], "outside the model"),
    (["--leftover-mem", "12X"], "not a size"),
    (["--leftover-mem", "-5G"], "not a size"),
    (["--leftover-mem", "100T"], "more than this machine has free"),
    (["--leftover-mem", "300M"], "holds no block"),
    (["--leftover-mem", "1G", "--leftover-cores", "4000"], "more than this machine has"),
    (["--leftover-mem", "1G", "--leftover-cores", "0"], "0"),
    (["--leftover-mem", "1G", "--trusted-coordinator", "not-a-key"], "neither an `ssh-rsa"),
    (["--leftover-mem", "1G", "--trusted-coordinator", "ssh-rsa AAAAbroken"], "not an OpenSSH RSA public key"),
])
def test_join_refuses_bad_flags(model_dir, flags, message):
    result = CliRunner().invoke(main, ["join", "--model", str(model_dir), *flags])
    assert result.exit_code != 0
    assert message in result.output


def test_join_needs_a_real_checkpoint(tmp_path):
    result = CliRunner().invoke(main, ["join", "--model", str(tmp_path), "--blocks", "0:1", "--initial-peers", PEER])
    assert result.exit_code != 0
    assert "config.json" in result.output


def test_join_refuses_a_quantization_the_models_layers_cannot_take(tmp_path):
    """int8 needs every linear's in_features to be a multiple of 16: an MLP of 72 columns is refused at start."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=72, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "odd")
    flags = ["--blocks", "0:2", "--initial-peers", PEER, "--leftover-mem", "1G"]
    result = CliRunner().invoke(main, ["join", "--model", str(tmp_path / "odd"), *flags, "--quantize", "int8"])
    assert result.exit_code != 0
    assert "in_features 72 is not a multiple of 16" in result.output, result.output


def test_join_refuses_blocks_whose_shard_is_missing(model_dir, tmp_path):
    """A checkpoint whose shards do not hold the requested blocks: one line naming the missing file."""
    import json
    import os

    copy = tmp_path / "partial"
    copy.mkdir()
    for item in model_dir.iterdir():
        if item.is_file():
            os.link(item, copy / item.name)
    shard = json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"]["model.layers.0.mlp.up_proj.weight"]
    (copy / shard).unlink()
    result = CliRunner().invoke(main, ["join", "--model", str(copy), "--blocks", "0:3", "--initial-peers", PEER,
                                       "--leftover-mem", "1G"])
    assert result.exit_code != 0
    assert f"lacks {shard}" in result.output and "block 0" in result.output, result.output
