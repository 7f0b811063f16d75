"""Shared fixtures: the real SmolLM2 checkpoint, local `transformers` as the truth, and local swarms.

Swarm fixtures start real processes (bootstrap and nodes) bound to 127.0.0.1 and stop them by PID when the
test module ends, whether it passed or failed. `netns_bed` is one bed of network namespaces for every test
across hosts in the run (`swarmnode.testing.netns`), deleted at the end whatever happened.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def model_dir():
    from swarmnode.model_prep import prepare_smollm2

    return prepare_smollm2()


@pytest.fixture(scope="session")
def local_model(model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def chat_prompts(tokenizer):
    from swarmnode.testing.workload import chat_inputs

    return chat_inputs(tokenizer, 3)


@pytest.fixture
def swarm_factory(model_dir, tmp_path_factory):
    """Make LocalSwarms that are all closed when the test ends."""
    from swarmnode.testing.local_swarm import LocalSwarm

    swarms = []

    def make(model=None):
        swarm = LocalSwarm(model or model_dir, log_dir=tmp_path_factory.mktemp("swarm-logs"))
        swarms.append(swarm)
        return swarm

    yield make
    for swarm in swarms:
        swarm.close()


@pytest.fixture(scope="session")
def netns_bed():
    """Network namespaces on one bridge, shared by the run's tests across hosts; each module ends the processes
    it started on it. Without root or `ip netns` this fails with the reason."""
    from swarmnode.testing.netns import NetnsBed

    with NetnsBed() as bed:
        yield bed
