"""`scripts/make_random_checkpoint.py`: the `tiny` shape's folder is a checkpoint that `transformers` and
`Checkpoint` load (bfloat16, an index that matches its shards, blocks whole within shards); the tiny
mixture-of-experts shapes (gpt_oss, qwen3_moe) load into transformers with every key in place and the
family's Hub layout on disk, and the real ones (gpt-oss-20b, qwen3-30b-a3b) are planned at their published
sizes without writing; the script refuses a non-empty folder, an unknown shape and a full disk with one line
and exit code 2."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "make_random_checkpoint.py"


def _load_script():
    """The script as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("swarmnode_scripts_make_random_checkpoint", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


mrc = _load_script()


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          check=False)


def _tensor_headers(folder: Path) -> dict[str, tuple[str, object, list[int]]]:
    """name -> (shard, dtype, shape) for every tensor in the folder's safetensors files."""
    from safetensors import safe_open

    headers = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                piece = f.get_slice(name)
                headers[name] = (shard.name, piece.get_dtype(), piece.get_shape())
    return headers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny shape written by the script, with shards small enough (3 MB) to need three of them."""
    out = tmp_path_factory.mktemp("random") / "tiny"
    result = _run("--shape", "tiny", "--out", str(out), "--shard-size", "3MB", "--json")
    assert result.returncode == 0, result.stderr
    return out, result


def test_json_line(tiny):
    out, result = tiny
    lines = result.stdout.splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert set(summary) == {"path", "shape", "parameters", "bytes", "shards", "seconds", "peak_rss_bytes"}
    assert Path(summary["path"]) == out and summary["shape"] == "tiny"
    assert summary["shards"] == len(list(out.glob("model-*-of-*.safetensors"))) == 3
    assert summary["parameters"] * 2 == summary["bytes"]
    assert summary["peak_rss_bytes"] > 0 and summary["seconds"] > 0
    assert "shard 1/3" in result.stderr  # progress goes to stderr


def test_index_matches_shards(tiny):
    out, _ = tiny
    index = json.loads((out / "model.safetensors.index.json").read_text())
    headers = _tensor_headers(out)
    assert set(index["weight_map"]) == set(headers)
    for name, shard in index["weight_map"].items():
        assert (out / shard).is_file() and headers[name][0] == shard
    assert {dtype for _, dtype, _ in headers.values()} == {"BF16"}
    assert index["metadata"]["total_size"] == sum(2 * math.prod(shape) for _, _, shape in headers.values())
    assert "lm_head.weight" not in headers  # the tiny shape ties its embeddings
    config = json.loads((out / "config.json").read_text())
    assert config["_name_or_path"] == "swarmnode-random/llama-tiny"
    assert config["dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLM"]
    assert not (out / "tokenizer.json").exists()  # a 1024-token vocabulary: no tokenizer fits it


def test_blocks_stay_whole_in_shards(tiny):
    out, _ = tiny
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shards_of_block: dict[int, set[str]] = {}
    for name, shard in weight_map.items():
        if name.startswith("model.layers."):
            shards_of_block.setdefault(int(name.split(".")[2]), set()).add(shard)
    assert sorted(shards_of_block) == [0, 1, 2, 3]
    assert all(len(shards) == 1 for shards in shards_of_block.values())
    assert len(set(weight_map.values())) == 3


def test_transformers_loads_and_runs(tiny):
    import torch
    from transformers import AutoModelForCausalLM

    out, _ = tiny
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with torch.no_grad():
        logits = model(torch.tensor([[1, 7, 300, 1023]])).logits
    assert logits.shape == (1, 4, 1024) and torch.isfinite(logits).all()


def test_swarmnode_checkpoint_reads_it(tiny):
    import torch

    from swarmnode.runtime.checkpoint import Checkpoint

    out, _ = tiny
    shape = mrc.SHAPES["tiny"]
    h, i, kv = shape.hidden_size, shape.intermediate_size, shape.num_kv_heads * shape.head_dim
    checkpoint = Checkpoint(out)
    assert checkpoint.num_blocks == shape.num_layers == 4
    assert checkpoint.block_param_bytes(0, torch.bfloat16) == 2 * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h)


def test_untied_head_and_weights_independent_of_shard_size(tiny, tmp_path):
    """An untied head is written as `lm_head.weight`; a tensor's values depend on the seed and its name only,
    and --force replaces a checkpoint folder."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    tied, _ = tiny
    shape = dataclasses.replace(mrc.SHAPES["tiny"], num_layers=2, tie_word_embeddings=False)
    out = tmp_path / "untied"
    mrc.make_random_checkpoint(shape, out, seed=0, shard_size=10**9)
    summary = mrc.make_random_checkpoint(shape, out, seed=0, shard_size=10**6, force=True)
    assert summary["shards"] == 4  # embedding, block 0, block 1, head: each over half of 1 MB
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    ours, theirs = (json.loads((d / "model.safetensors.index.json").read_text())["weight_map"] for d in (out, tied))
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.up_proj.weight"):  # (down_proj scales with depth)
        with safe_open(out / ours[name], framework="pt") as a, safe_open(tied / theirs[name], framework="pt") as b:
            assert torch.equal(a.get_tensor(name), b.get_tensor(name))


def test_refuses_non_empty_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    result = _run("--shape", "tiny", "--out", str(tmp_path))
    assert result.returncode == 2 and not result.stdout
    assert len(result.stderr.strip().splitlines()) == 1 and "--force" in result.stderr
    # --force replaces only a checkpoint folder, not any folder
    result = _run("--shape", "tiny", "--out", str(tmp_path), "--force")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_refuses_unknown_shape(tmp_path):
    result = _run("--shape", "70b", "--out", str(tmp_path / "x"))
    assert result.returncode == 2 and not result.stdout
    assert len(result.stderr.strip().splitlines()) == 1 and "tiny, 1b, 8b" in result.stderr
    assert not (tmp_path / "x").exists()


def test_refuses_full_disk(tmp_path, monkeypatch, capsys):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(mrc.shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 10**6, 10**6))
    assert mrc.main(["--shape", "1b", "--out", str(tmp_path / "big")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not enough disk" in err
    assert list(tmp_path.iterdir()) == []


MOE_SHAPES = ("gpt-oss-tiny", "qwen3-moe-tiny")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """The tiny MoE shapes written in-process with 600 kB shards: one block (about 500 kB) per shard."""
    root = tmp_path_factory.mktemp("random-moe")
    return {name: (root / name, mrc.make_random_checkpoint(mrc.SHAPES[name], root / name, shard_size=600_000))
            for name in MOE_SHAPES}


@pytest.mark.parametrize("name", MOE_SHAPES)
def test_moe_loads_in_transformers_and_runs(moe, name):
    import torch
    from transformers import AutoModelForCausalLM

    out, summary = moe[name]
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert sum(p.numel() for p in model.parameters()) == summary["parameters"]  # untied: every parameter stored
    with torch.no_grad():
        logits = model(torch.arange(0, 1024, 7).unsqueeze(0)).logits  # 147 tokens: past gpt-oss' 128 window
    assert logits.shape == (1, 147, 1024) and torch.isfinite(logits).all()
    config = json.loads((out / "config.json").read_text())
    assert config["_name_or_path"] == f"swarmnode-random/{name}" and config["dtype"] == "bfloat16"
    assert config["architectures"] == [type(model).__name__]
    assert (out / "generation_config.json").is_file() and not (out / "tokenizer.json").exists()


@pytest.mark.parametrize("name", MOE_SHAPES)
def test_moe_blocks_stay_whole_in_shards(moe, name):
    out, summary = moe[name]
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map) == set(_tensor_headers(out))
    shards_of_block: dict[int, set[str]] = {}
    for tensor, shard in weight_map.items():
        if tensor.startswith("model.layers."):
            shards_of_block.setdefault(int(tensor.split(".")[2]), set()).add(shard)
    assert sorted(shards_of_block) == [0, 1, 2, 3]
    assert all(len(shards) == 1 for shards in shards_of_block.values())
    assert len({next(iter(shards)) for shards in shards_of_block.values()}) == 4  # one block per shard here
    assert summary["shards"] == len(set(weight_map.values())) > 4
    # the embedding opens the first shard, the head closes the last
    first, last = sorted(set(weight_map.values()))[0], sorted(set(weight_map.values()))[-1]
    assert weight_map["model.embed_tokens.weight"] == first
    assert weight_map["lm_head.weight"] == weight_map["model.norm.weight"] == last


def test_qwen3_moe_stores_experts_one_by_one(moe):
    """On disk each expert is three 2-D linears, as in Qwen3-30B-A3B's Hub checkpoint; transformers fuses them
    into 3-D parameters when it loads them."""
    import torch
    from transformers import AutoModelForCausalLM

    out, _ = moe["qwen3-moe-tiny"]
    config = mrc.SHAPES["qwen3-moe-tiny"].config
    experts, h, i = config["num_experts"], config["hidden_size"], config["moe_intermediate_size"]
    headers = _tensor_headers(out)
    for e in range(experts):
        p = f"model.layers.3.mlp.experts.{e}."
        assert headers[p + "gate_proj.weight"][2] == headers[p + "up_proj.weight"][2] == [i, h]
        assert headers[p + "down_proj.weight"][2] == [h, i]
    assert not any(name.endswith("experts.gate_up_proj") for name in headers)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    fused = dict(model.named_parameters())
    assert fused["model.layers.3.mlp.experts.gate_up_proj"].shape == (experts, 2 * i, h)
    assert fused["model.layers.3.mlp.experts.down_proj"].shape == (experts, h, i)


def test_gpt_oss_initial_values(moe):
    """Experts stay fused as in gpt-oss' bfloat16 checkpoints; norms are ones, biases and sinks zeros, and the
    projections into the residual stream (fused experts' `down_proj` too) start smaller than the rest."""
    import torch
    from safetensors.torch import load_file

    out, _ = moe["gpt-oss-tiny"]
    tensors = {}
    for shard in out.glob("*.safetensors"):
        tensors.update(load_file(shard))
    p = "model.layers.1."
    assert tensors[p + "mlp.experts.gate_up_proj"].shape == (4, 128, 256)
    assert all(torch.all(tensors[p + n] == 1) for n in ("input_layernorm.weight", "post_attention_layernorm.weight"))
    assert all(torch.all(tensors[p + n] == 0) for n in ("self_attn.sinks", "self_attn.q_proj.bias",
                                                          "mlp.router.bias", "mlp.experts.gate_up_proj_bias"))
    residual = mrc.INIT_STD / math.sqrt(2 * 4)
    assert tensors[p + "mlp.experts.gate_up_proj"].float().std().item() == pytest.approx(mrc.INIT_STD, rel=0.05)
    for name in ("mlp.experts.down_proj", "self_attn.o_proj.weight"):
        assert tensors[p + name].float().std().item() == pytest.approx(residual, rel=0.05)


def test_tied_moe_shape_leaves_the_head_out(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    shape = mrc.SHAPES["qwen3-moe-tiny"]
    tied = dataclasses.replace(shape, config={**shape.config, "num_hidden_layers": 1, "tie_word_embeddings": True})
    mrc.make_random_checkpoint(tied, tmp_path / "tied")
    assert "lm_head.weight" not in _tensor_headers(tmp_path / "tied")
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "tied", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_moe_json_line(tmp_path, capsys):
    assert mrc.main(["--shape", "qwen3-moe-tiny", "--out", str(tmp_path / "q"), "--json"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["shape"] == "qwen3-moe-tiny" and summary["shards"] == 1
    assert summary["bytes"] == 2 * summary["parameters"] == mrc.plan_checkpoint(mrc.SHAPES["qwen3-moe-tiny"])["bytes"]
    assert "model.layers.3 written" in captured.err


@pytest.mark.parametrize("name,parameters,expert", [
    ("gpt-oss-20b", 20.9e9, ("model.layers.23.mlp.experts.gate_up_proj", (32, 2880, 5760))),
    ("qwen3-30b-a3b", 30.5e9, ("model.layers.47.mlp.experts.127.down_proj.weight", (2048, 768))),
])
def test_real_moe_shapes_are_planned_not_written(tmp_path, monkeypatch, name, parameters, expert):
    """The published shapes are only planned (from meta tensors): their size, block count and tensors."""
    monkeypatch.chdir(tmp_path)
    shape = mrc.SHAPES[name]
    plan = mrc.plan_checkpoint(shape, shard_size=10**9)
    assert plan["parameters"] == pytest.approx(parameters, rel=0.01)
    assert plan["bytes"] == 2 * plan["parameters"] and plan["blocks"] == shape.num_layers
    assert plan["shards"] >= plan["blocks"]  # each block is over 1 GB: a shard of its own
    tensors = mrc.checkpoint_tensors(shape)
    assert tensors[expert[0]] == expert[1] and "lm_head.weight" in tensors
    assert list(tmp_path.iterdir()) == []
