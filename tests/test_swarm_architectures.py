"""Every supported family, served by a real 2-node swarm, matches local `transformers`; quantized MoE nodes match
local `transformers` quantized the same way; families that cannot be served are refused in one line.

One bootstrap, and two `join --blocks` nodes per family (one family at a time) on tiny random checkpoints
(`swarmnode.tiny_models`):
dense families, mixtures of experts whose checkpoints store experts one by one (Qwen3-MoE, Mixtral) or fused
(gpt-oss, with attention sinks and eager attention), latent attention (DeepSeek V3), Gemma 2/3 and Granite with
their input and logit scaling. Beside them, `--dtype bfloat16 --quantize int8` nodes serve two MoE families whole.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from swarmnode.client import DistributedModelForCausalLM
from swarmnode.runtime.family import FamilyError
from swarmnode.testing.local_swarm import LocalSwarm
from swarmnode.testing.swarm_reader import SwarmReader
from swarmnode.tiny_models import TINY_FAMILIES, make_tiny_checkpoint

pytestmark = pytest.mark.swarm

#: MoE families also served by one int8 node each (fused experts with biases, and per-expert checkpoints).
QUANTIZED_MOE = ("gpt_oss", "qwen3_moe")
INT8 = ["--dtype", "bfloat16", "--quantize", "int8"]
class TinySwarm:
    """One bootstrap for the module, and the nodes of one family at a time (`serve`): 28 tiny nodes side by side
    kept 2 cores busy with their DHT and link-probe traffic alone, so late starters could not join in time."""

    def __init__(self, swarm: LocalSwarm, paths: dict):
        self.swarm, self.paths = swarm, paths
        self.group: tuple[str, bool] | None = None
        self.nodes: list = []
        self.started: dict[str, list] = {}  # family -> every node started for it, in order

    def serve(self, family: str, *, int8: bool = False) -> list:
        """The family's nodes, started now unless they are the ones running: two `join --blocks` nodes over
        [0, 4) and [3, 6), or (`int8`) one `--dtype bfloat16 --quantize int8` node over all six blocks."""
        if self.group != (family, int8):
            self.stop()
            path, launch = self.paths[family], self.swarm.launch_node
            if int8:
                self.nodes = [launch(0, 6, name=f"{family}-int8", extra=INT8, model=path)]
            else:
                self.nodes = [launch(0, 4, name=f"{family}-a", model=path), launch(3, 6, name=f"{family}-b", model=path)]
            self.group = (family, int8)
            self.started.setdefault(family, []).extend(self.nodes)
            for node in self.nodes:
                self.swarm.wait_serving(node, 300)
        return self.nodes

    def others(self, family: str) -> frozenset[str]:
        """Peers started earlier for `family` and stopped since: their records outlive them for a TTL."""
        return frozenset(n.peer_id for n in self.started.get(family, []) if n not in self.nodes)

    def stop(self) -> None:
        # nothing here tests a node's shutdown (test_swarm_shutdown.py does): the process groups (p2pd daemons
        # included) are killed rather than waiting for each node's offline announcement
        for node in self.nodes:
            self.swarm.kill(node, signal.SIGKILL)
        for node in self.nodes:
            node.popen.wait(10)
        self.nodes, self.group = [], None


@pytest.fixture(scope="module")
def tiny_swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    paths = {family: make_tiny_checkpoint(family, root / f"tiny-{family}", seed=i)
             for i, family in enumerate(TINY_FAMILIES)}
    with LocalSwarm(paths["llama"], log_dir=tmp_path_factory.mktemp("tiny-swarm")) as swarm:
        swarm.start_bootstrap()
        tiny = TinySwarm(swarm, paths)
        try:
            yield tiny
        finally:
            tiny.stop()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_family_logits_match_local(tiny_swarm, family):
    tiny_swarm.serve(family)
    swarm, paths = tiny_swarm.swarm, tiny_swarm.paths
    local = AutoModelForCausalLM.from_pretrained(paths[family], dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(3, 500, (2, 24), generator=generator)  # longer than every tiny family's window
    excluded = tiny_swarm.others(family)
    with DistributedModelForCausalLM.from_pretrained(paths[family], initial_peers=swarm.initial_peers,
                                                     exclude_peers=excluded) as remote:
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
        # generate() through the swarm as through local transformers, and without transformers' deprecation
        # warnings in the user's output
        from transformers.utils import logging as hf_logging

        hf_logging.warning_once.cache_clear()  # warnings once per process: this test must see them if they come
        records = _Records()
        hf_logging.get_logger().addHandler(records)
        try:
            kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
            assert torch.equal(remote.generate(input_ids[:1], **kwargs), local.generate(input_ids[:1], **kwargs))
        finally:
            hf_logging.get_logger().removeHandler(records)
        assert not [m for m in records.messages if "deprecated" in m], records.messages


@pytest.mark.parametrize("family", QUANTIZED_MOE)
def test_int8_moe_node_equals_local_int8(tiny_swarm, family):
    """An int8 node quantizes the experts too: its greedy tokens equal local transformers' whose decoder layers
    were quantized the same way, and it announces blocks about half their bfloat16 size."""
    from swarmnode.runtime.checkpoint import Checkpoint
    from swarmnode.runtime.quantize import quantize_block
    from swarmnode.server.memory_plan import block_bytes

    [only] = tiny_swarm.serve(family, int8=True)
    swarm, paths = tiny_swarm.swarm, tiny_swarm.paths
    local = AutoModelForCausalLM.from_pretrained(paths[family], dtype=torch.bfloat16).eval()
    quantized = copy.deepcopy(local)
    for layer in quantized.model.layers:
        quantize_block(layer, "int8", torch.bfloat16)
    excluded = tiny_swarm.others(family)
    prompts = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(11))
    with DistributedModelForCausalLM.from_pretrained(paths[family], initial_peers=swarm.initial_peers,
                                                     dtype=torch.bfloat16, exclude_peers=excluded) as remote:
        for prompt in prompts:
            kwargs = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
            assert torch.equal(remote.generate(prompt[None], **kwargs), quantized.generate(prompt[None], **kwargs))
        with remote.inference_session(max_length=4) as session:
            remote(prompts[:1, :2])
            assert [h.hop.peer_id for h in session.hops] == [only.peer_id]
    reader = SwarmReader(paths[family], swarm.initial_peers, swarm.trusted_coordinators())  # that model's swarm
    try:
        announced = reader.status()["nodes"][only.peer_id]["block_bytes"]
    finally:
        reader.close()
    family_of = Checkpoint(paths[family]).family
    bf16 = max(block_bytes(family_of, i, torch.bfloat16) for i in range(family_of.num_layers))
    assert announced < 0.56 * bf16, (announced, bf16)


def test_a_family_with_recurrent_state_is_refused_in_one_line(tiny_swarm, tmp_path):
    """Qwen3-Next keeps linear-attention state: `join` exits with one line naming the family and why, before it
    joins; a client refuses before it joins too."""
    swarm = tiny_swarm.swarm
    path = make_tiny_checkpoint("qwen3_next", tmp_path / "tiny-qwen3_next", num_layers=4)
    result = subprocess.run([sys.executable, "-m", "swarmnode", "join", "--model", str(path), "--blocks", "0:2",
                             "--initial-peers", *swarm.initial_peers], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "\n" not in errors[0]
    assert errors[0].startswith("Error: qwen3_next cannot be served: its layer 0 keeps recurrent state"), errors
    with pytest.raises(FamilyError, match=r"^qwen3_next cannot be served"):
        DistributedModelForCausalLM.from_pretrained(path, initial_peers=swarm.initial_peers)
