"""Nodes and clients named by Hub model name, resolved offline from a Hugging Face cache, meet nodes started
on a local folder of the same model.

The cache is laid out by the test (`swarmnode.testing.hf_cache`) from the prepared SmolLM2 checkpoint, under
the name `HuggingFaceTB/SmolLM2-135M-Instruct`, and holds only the shards the test's parties need: the node
started on the Hub name serves blocks 0-13, so the cache lacks the shards of blocks 14-29 (another node
serves those from a folder whose own name differs, but which declares the same model name). A client named
by the Hub name generates text equal to local `transformers`; the node read only its blocks' shards, the
client only those of the embeddings, norm and head, and `status` reports the model's name.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from swarmnode.client import DistributedModelForCausalLM
from swarmnode.model_prep import SMOLLM2_REPO_ID
from swarmnode.records import model_prefix
from swarmnode.testing.hf_cache import build_hf_cache, shards_by_block, use_hf_cache
from swarmnode.testing.local_swarm import LocalSwarm

pytestmark = pytest.mark.swarm


def _shards_holding(model_dir, wanted) -> set[str]:
    return {shard for shard, held in shards_by_block(model_dir).items() if held & set(wanted)}


def test_hub_named_node_and_client_meet_a_folder_node(model_dir, tmp_path, monkeypatch, local_model, chat_prompts):
    layout = shards_by_block(model_dir)
    node_shards = _shards_holding(model_dir, range(0, 14))
    client_shards = _shards_holding(model_dir, ["model.embed_tokens.weight", "model.norm.weight"])
    other = set(layout) - node_shards - client_shards
    assert other, "the checkpoint should have block shards the Hub-named parties never need"
    small = [p.name for p in model_dir.iterdir() if p.is_file() and p.name not in layout and not p.name.startswith(".")]
    cache = tmp_path / "hf-cache"
    build_hf_cache(model_dir, cache, SMOLLM2_REPO_ID, files=[*small, *sorted(node_shards | client_shards)])
    use_hf_cache(monkeypatch, cache, offline=True)
    # the same model in a folder with another name: it declares its name in its config
    renamed = tmp_path / "my-copy-of-smollm"
    shutil.copytree(model_dir, renamed, copy_function=os.link)
    assert json.loads((renamed / "config.json").read_text())["_name_or_path"] == SMOLLM2_REPO_ID

    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    with LocalSwarm(SMOLLM2_REPO_ID, log_dir=tmp_path / "logs", env=env) as swarm:
        swarm.start_bootstrap()
        hub_node = swarm.launch_node(0, 14, name="hub-node")
        folder_node = swarm.spawn("folder-node", [
            "join", "--model", str(renamed), "--host", "127.0.0.1", "--blocks", "14:30", "--num-threads", "1",
            *[a for p in swarm.initial_peers for a in ("--initial-peers", p)],
            "--identity", str(tmp_path / "folder-node.key")])
        for node in (hub_node, folder_node):
            swarm.wait_serving(node, 180)
        read = hub_node.log().split("shard files read so far: ")[-1].splitlines()[0].split(", ")
        assert set(read) == node_shards, read

        with DistributedModelForCausalLM.from_pretrained(SMOLLM2_REPO_ID, initial_peers=swarm.initial_peers) as remote:
            assert remote.swarm.prefix == model_prefix(SMOLLM2_REPO_ID)
            for input_ids in chat_prompts[:2]:
                kwargs = dict(max_new_tokens=24, min_new_tokens=16, do_sample=False)
                assert torch.equal(remote.generate(input_ids, **kwargs), local_model.generate(input_ids, **kwargs))
            assert remote.checkpoint.opened_shards == client_shards

        status = subprocess.run(
            [sys.executable, "-m", "swarmnode", "status", "--model", SMOLLM2_REPO_ID, "--json",
             *[a for p in swarm.initial_peers for a in ("--initial-peers", p)]],
            capture_output=True, text=True, timeout=120, env={**os.environ, **env})
        assert status.returncode == 0, status.stderr[-2000:]
        data = json.loads(status.stdout)
        assert data["model"] == SMOLLM2_REPO_ID and data["prefix"] == model_prefix(SMOLLM2_REPO_ID)
        assert {hub_node.peer_id, folder_node.peer_id} <= set(data["nodes"])
        assert data["uncovered_blocks"] == []


def test_hub_name_missing_from_the_offline_cache_is_one_clear_line(tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "swarmnode", "join", "--model", "some-org/not-cached-model",
                             "--blocks", "0:1"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "not in the Hugging Face cache" in lines[0] and "HF_HUB_OFFLINE" in lines[0], \
        result.stderr
