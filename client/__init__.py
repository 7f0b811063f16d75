"""The client library: a `transformers`-style model whose blocks run on remote peers.

    from swarmnode.client import DistributedModelForCausalLM
    model = DistributedModelForCausalLM.from_pretrained(path, initial_peers=[maddr])
    model.generate(input_ids, max_new_tokens=32)
"""

from swarmnode.client.errors import RemoteError, SessionError
from swarmnode.client.model import DistributedModelForCausalLM
from swarmnode.client.session import InferenceSession
from swarmnode.client.swarm import ClientConfig

__all__ = ["ClientConfig", "DistributedModelForCausalLM", "InferenceSession", "RemoteError", "SessionError"]
