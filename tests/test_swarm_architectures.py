"""Tiny random-weight models of each supported family, served by a real 2-node swarm, match local logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from swarmnode.client import DistributedModelForCausalLM
from swarmnode.testing.checkpoints import TINY_FAMILIES, make_tiny_checkpoint
from swarmnode.testing.local_swarm import LocalSwarm

pytestmark = pytest.mark.swarm


@pytest.fixture(scope="module")
def tiny_swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    paths = {family: make_tiny_checkpoint(family, root / f"tiny-{family}", seed=i)
             for i, family in enumerate(TINY_FAMILIES)}
    with LocalSwarm(paths["llama"], log_dir=tmp_path_factory.mktemp("tiny-swarm")) as swarm:
        swarm.start_bootstrap()
        nodes = []
        for family, path in paths.items():
            swarm.model = path
            nodes += [swarm.start_node(0, 4, name=f"{family}-a", wait=False),
                      swarm.start_node(3, 6, name=f"{family}-b", wait=False)]
        for node in nodes:
            swarm.wait_serving(node)
        yield swarm, paths


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_family_logits_match_local(tiny_swarm, family):
    swarm, paths = tiny_swarm
    local = AutoModelForCausalLM.from_pretrained(paths[family], dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(3, 500, (2, 24), generator=generator)  # longer than Mistral's window of 16
    with DistributedModelForCausalLM.from_pretrained(paths[family], initial_peers=swarm.initial_peers) as remote:
        with torch.no_grad():
            ours = remote(input_ids).logits
            truth = local(input_ids).logits
        torch.testing.assert_close(ours, truth, atol=1e-4, rtol=0)
        # cached decoding through the swarm: every step's logits match a full local recompute
        with remote.inference_session(max_length=32) as session:
            with torch.no_grad():
                remote(input_ids)
                sequence = input_ids
                for _ in range(6):
                    next_ids = torch.randint(3, 500, (2, 1), generator=generator)
                    sequence = torch.cat([sequence, next_ids], 1)
                    step = remote(next_ids, attention_mask=torch.ones_like(sequence)).logits[:, -1]
                    full = local(sequence).logits[:, -1]
                    torch.testing.assert_close(step, full, atol=1e-4, rtol=0)
            assert session.position == sequence.shape[1]
            assert [(h.hop.start, h.hop.end) for h in session.hops] in ([(0, 4), (4, 6)], [(0, 3), (3, 6)])
