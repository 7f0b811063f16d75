"""Checkpoints named by Hub repo id, resolved from a Hugging Face cache (offline) or a local fake Hub.

The cache is built in tmp_path from the prepared SmolLM2 folder (`swarmnode.testing.hf_cache`), so these
tests never reach huggingface.co. They check that a Hub name resolves like a folder, that only the
shards holding the requested tensors are read (and, online, downloaded), that a partial cache still
serves what it holds and says which file is missing otherwise, and that the model's declared name, not
its folder's name, decides the swarm's DHT prefix.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from swarmnode.model_prep import SMOLLM2_REPO_ID, declare_model_name
from swarmnode.records import model_prefix
from swarmnode.runtime.checkpoint import Checkpoint, CheckpointError
from swarmnode.testing.hf_cache import DEFAULT_COMMIT, FakeHub, build_hf_cache, shards_by_block, use_hf_cache

REPO = SMOLLM2_REPO_ID


def _shards_of(model_dir, *wanted) -> set[str]:
    """Shard files that hold any of `wanted` (block indexes, or tensor names)."""
    return {shard for shard, held in shards_by_block(model_dir).items() if held & set(wanted)}


def _block_shards(model_dir) -> list[str]:
    """Shards holding decoder blocks, in block order."""
    layout = shards_by_block(model_dir)
    with_blocks = [s for s, held in layout.items() if any(isinstance(x, int) for x in held)]
    return sorted(with_blocks, key=lambda s: min(x for x in layout[s] if isinstance(x, int)))


@pytest.fixture
def hf_cache(tmp_path, model_dir, monkeypatch):
    """An offline Hugging Face cache holding the whole prepared SmolLM2 as repo REPO."""
    cache = tmp_path / "hub"
    build_hf_cache(model_dir, cache, REPO)
    use_hf_cache(monkeypatch, cache, offline=True)
    return cache


def test_the_prepared_model_is_sharded_by_blocks(model_dir):
    """The tests below rely on blocks spread over several shards, apart from embeddings and norm."""
    block_shards = _block_shards(model_dir)
    assert len(block_shards) >= 3
    assert _shards_of(model_dir, "model.embed_tokens.weight").isdisjoint(block_shards[:1])


def test_hub_name_resolves_from_the_cache(hf_cache, model_dir):
    checkpoint = Checkpoint(REPO)
    assert checkpoint.name == REPO and checkpoint.repo_id == REPO
    assert checkpoint.revision == DEFAULT_COMMIT
    assert checkpoint.path.name == DEFAULT_COMMIT and checkpoint.path.is_relative_to(hf_cache)
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (checkpoint.path / name).is_file()
    assert checkpoint.num_blocks == 30 and checkpoint.layer_prefix == "model.layers."
    assert checkpoint.opened_shards == set()
    assert model_prefix(checkpoint.name) == "huggingfacetb-smollm2-135m-instruct"
    pinned = Checkpoint(f"{REPO}@{DEFAULT_COMMIT}")
    assert pinned.name == REPO and pinned.path == checkpoint.path
    assert Checkpoint(f"{REPO}@main").revision == DEFAULT_COMMIT


def test_blocks_open_only_the_shards_that_hold_them(hf_cache, model_dir):
    checkpoint = Checkpoint(REPO)
    first = _block_shards(model_dir)[0]
    last_in_first = max(x for x in shards_by_block(model_dir)[first] if isinstance(x, int))
    for block in range(last_in_first + 1):
        checkpoint.load_tensors(checkpoint.block_prefix(block))
    assert checkpoint.opened_shards == {first}
    checkpoint.load_tensors(checkpoint.block_prefix(last_in_first + 1))
    assert checkpoint.opened_shards == _shards_of(model_dir, *range(last_in_first + 2))
    assert len(checkpoint.opened_shards) == 2
    # the same weights as read from the folder
    ours = checkpoint.load_tensors(checkpoint.block_prefix(0))
    theirs = Checkpoint(model_dir).load_tensors("model.layers.0.")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_client_tensors_open_only_their_shards(hf_cache, model_dir):
    checkpoint = Checkpoint(REPO)
    checkpoint.load_tensors("model.embed_tokens.")
    checkpoint.load_tensors("model.norm.")
    assert checkpoint.opened_shards == _shards_of(model_dir, "model.embed_tokens.weight", "model.norm.weight")


def test_sizes_need_no_shard_and_match_the_folder(hf_cache, model_dir):
    checkpoint, folder = Checkpoint(REPO), Checkpoint(model_dir)
    assert [checkpoint.block_param_bytes(i, torch.bfloat16) for i in range(30)] == \
           [folder.block_param_bytes(i, torch.bfloat16) for i in range(30)]
    assert checkpoint.tensor_shapes("model.layers.3.") == folder.tensor_shapes("model.layers.3.")
    info = checkpoint.tensor_info("model.layers.3.")["model.layers.3.self_attn.q_proj.weight"]
    assert info.dtype == "F32" and info.torch_dtype is torch.float32 and info.shape == (576, 576)
    assert checkpoint.opened_shards == set()


def test_a_cache_missing_a_shard_serves_the_others(tmp_path, model_dir, monkeypatch):
    block_shards = _block_shards(model_dir)
    missing = block_shards[len(block_shards) // 2]
    missing_block = min(x for x in shards_by_block(model_dir)[missing] if isinstance(x, int))
    files = [p.name for p in model_dir.iterdir() if p.is_file() and not p.name.startswith(".") and p.name != missing]
    cache = tmp_path / "hub"
    build_hf_cache(model_dir, cache, REPO, files=files)
    use_hf_cache(monkeypatch, cache, offline=True)

    checkpoint = Checkpoint(REPO)
    assert checkpoint.load_tensors(checkpoint.block_prefix(0))
    with pytest.raises(CheckpointError) as caught:
        checkpoint.load_tensors(checkpoint.block_prefix(missing_block))
    message = str(caught.value)
    assert missing in message and str(cache) in message and "HF_HUB_OFFLINE=1" in message
    assert "hf download" in message and "\n" not in message
    assert missing not in checkpoint.opened_shards
    # memory accounting sizes every block, the missing shard's ones from alike blocks
    folder = Checkpoint(model_dir)
    assert [checkpoint.block_param_bytes(i, torch.float32) for i in range(30)] == \
           [folder.block_param_bytes(i, torch.float32) for i in range(30)]


def test_a_cache_without_block_shards_sizes_nothing(tmp_path, model_dir, monkeypatch):
    """A cache holding config, tokenizer, index and the embeddings' shard alone (no block in it)."""
    embeddings = _shards_of(model_dir, "model.embed_tokens.weight")
    assert not any(isinstance(x, int) for shard in embeddings for x in shards_by_block(model_dir)[shard])
    files = [p.name for p in model_dir.iterdir()
             if p.is_file() and not p.name.startswith(".") and (p.suffix != ".safetensors" or p.name in embeddings)]
    cache = tmp_path / "hub"
    build_hf_cache(model_dir, cache, REPO, files=files)
    use_hf_cache(monkeypatch, cache, offline=True)
    checkpoint = Checkpoint(REPO)
    assert checkpoint.load_tensors("model.embed_tokens.")
    with pytest.raises(CheckpointError, match="no block alike it has its shard here") as caught:
        checkpoint.block_param_bytes(0, torch.float32)
    assert "HF_HUB_OFFLINE=1" in str(caught.value) and _block_shards(model_dir)[0] in str(caught.value)
    with pytest.raises(CheckpointError, match=next(iter(_shards_of(model_dir, "model.norm.weight")))):
        checkpoint.load_tensors("model.norm.")


def test_a_hub_name_not_in_the_cache_offline(hf_cache):
    with pytest.raises(CheckpointError) as caught:
        Checkpoint("HuggingFaceTB/not-in-the-cache")
    message = str(caught.value)
    assert message.startswith("HuggingFaceTB/not-in-the-cache is not in the Hugging Face cache at ")
    assert str(hf_cache) in message and "HF_HUB_OFFLINE=1" in message
    assert "hf download HuggingFaceTB/not-in-the-cache" in message and "\n" not in message


def test_a_local_folder_missing_a_shard_names_it(tmp_path, model_dir):
    folder = tmp_path / "partial"
    folder.mkdir()
    missing = _block_shards(model_dir)[-1]
    for p in model_dir.iterdir():
        if p.is_file() and p.name != missing:
            (folder / p.name).symlink_to(p)
    checkpoint = Checkpoint(folder)
    assert checkpoint.load_tensors("model.layers.0.")
    block = max(x for x in shards_by_block(model_dir)[missing] if isinstance(x, int))
    with pytest.raises(CheckpointError, match=missing):
        checkpoint.load_tensors(checkpoint.block_prefix(block))
    assert checkpoint.block_param_bytes(block, torch.float32) == checkpoint.block_param_bytes(0, torch.float32)


def _copy_small_files(model_dir, dest, name_or_path=None):
    """A folder with the config, index and tokenizer files of `model_dir` (shards linked, not copied)."""
    dest.mkdir(parents=True)
    for p in model_dir.iterdir():
        if p.suffix == ".safetensors":
            (dest / p.name).symlink_to(p)
        elif p.is_file() and not p.name.startswith("."):
            shutil.copyfile(p, dest / p.name)
    config = json.loads((dest / "config.json").read_text())
    config.pop("_name_or_path", None)
    if name_or_path is not None:
        config["_name_or_path"] = name_or_path
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_the_declared_name_decides_the_swarm(tmp_path, model_dir, hf_cache):
    one = _copy_small_files(model_dir, tmp_path / "smol", REPO)
    other = _copy_small_files(model_dir, tmp_path / "some-other-folder", REPO)
    assert Checkpoint(one).name == Checkpoint(other).name == REPO
    assert model_prefix(Checkpoint(one).name) == model_prefix(Checkpoint(other).name) \
        == model_prefix(Checkpoint(REPO).name)
    # a name given explicitly wins, for a folder and for a Hub name
    assert Checkpoint(one, model_name="me/custom").name == "me/custom"
    assert Checkpoint(REPO, model_name="me/custom").name == "me/custom"
    with pytest.raises(CheckpointError):
        Checkpoint(one, model_name="  ")
    # a local path in the config declares nothing: the folder's name stands
    assert Checkpoint(_copy_small_files(model_dir, tmp_path / "local-path", "/home/me/run-1")).name == "local-path"
    assert Checkpoint(_copy_small_files(model_dir, tmp_path / "dot-path", "./out")).name == "dot-path"
    assert Checkpoint(_copy_small_files(model_dir, tmp_path / "undeclared")).name == "undeclared"
    # a snapshot folder of a Hugging Face cache, given as a path, is named after its repo
    snapshot = _copy_small_files(model_dir, tmp_path / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots"
                                 / DEFAULT_COMMIT)
    assert Checkpoint(snapshot).name == REPO


def test_the_prepared_folder_declares_its_hub_name(tmp_path, model_dir):
    assert Checkpoint(model_dir).name == REPO
    folder = _copy_small_files(model_dir, tmp_path / "older")
    declare_model_name(folder, REPO)
    written = (folder / "config.json").stat().st_mtime_ns
    declare_model_name(folder, REPO)
    assert (folder / "config.json").stat().st_mtime_ns == written
    assert Checkpoint(folder).name == REPO


def test_the_tokenizer_loads_from_the_snapshot_folder(hf_cache, model_dir):
    from transformers import AutoTokenizer

    checkpoint = Checkpoint(REPO)
    ours, theirs = AutoTokenizer.from_pretrained(checkpoint.path), AutoTokenizer.from_pretrained(model_dir)
    text = "The capital of France is"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)


@pytest.mark.parametrize("source", ["", "not a path or name!", "gpt2", "/nonexistent/folder", "./nowhere", "a/b/c",
                                    "org/na--me", "config.json"])
def test_bad_sources_get_a_clear_error(source, model_dir, monkeypatch):
    monkeypatch.chdir(model_dir)  # so that "config.json" names a file, not a folder
    with pytest.raises(CheckpointError) as caught:
        Checkpoint(source)
    assert "\n" not in str(caught.value)
    assert "org/name" in str(caught.value)


def test_online_fetches_shards_only_when_read(tmp_path, model_dir, monkeypatch):
    with FakeHub(model_dir, REPO) as hub:
        use_hf_cache(monkeypatch, tmp_path / "hub", offline=False, endpoint=hub.endpoint)
        checkpoint = Checkpoint(REPO)
        assert checkpoint.revision == DEFAULT_COMMIT
        assert not any(name.endswith(".safetensors") for name in hub.downloaded())
        assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= hub.downloaded()
        # sizes come from the shards' headers on the Hub, a ranged request each
        folder = Checkpoint(model_dir)
        assert [checkpoint.block_param_bytes(i, torch.float32) for i in range(30)] == \
               [folder.block_param_bytes(i, torch.float32) for i in range(30)]
        assert hub.ranged() == set(_block_shards(model_dir))
        assert not any(name.endswith(".safetensors") for name in hub.downloaded())
        checkpoint.load_tensors(checkpoint.block_prefix(0))
        assert {n for n in hub.downloaded() if n.endswith(".safetensors")} == _shards_of(model_dir, 0)
        # a second checkpoint finds the shard in the cache
        again = Checkpoint(REPO)
        before = len(hub.requests)
        again.load_tensors(again.block_prefix(0))
        assert len(hub.requests) == before
        with pytest.raises(CheckpointError, match="no model repo HuggingFaceTB/nope"):
            Checkpoint("HuggingFaceTB/nope")
        with pytest.raises(CheckpointError, match="no revision 'v9'"):
            Checkpoint(f"{REPO}@v9")
