"""`scripts/make_random_checkpoint.py`: the `tiny` shape's folder is a checkpoint that `transformers` and
`Checkpoint` load (bfloat16, an index that matches its shards, blocks whole within shards), and the script
refuses a non-empty folder, an unknown shape and a full disk with one line and exit code 2."""

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
