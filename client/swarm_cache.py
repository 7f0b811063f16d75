"""`SwarmCache`: what `transformers`' generation sees of a session's KV cache, which lives on the nodes.

`GenerationMixin.generate` asks its cache two things: how many tokens it holds (to send only the new ones)
and, in assisted generation (`assistant_model=`, `prompt_lookup_num_tokens=`: speculative decoding), to drop
the drafted tokens the model rejected (`crop`). This cache answers both from the client's
`InferenceSession`: its length is the session's position, and a crop rewinds the session
(`InferenceSession.rewind`), after which every node rolls its own cache back on the next step. It holds no
tensors: the keys and values stay on the nodes, each for its own blocks.
"""

from __future__ import annotations

from transformers.cache_utils import Cache

from swarmnode.client.session import InferenceSession


class SwarmCache(Cache):
    """The KV cache of `session`, as `transformers` reads and crops it (see the module's docstring)."""

    is_compileable = False

    def __init__(self, session: InferenceSession):
        super().__init__(layers=[])
        self.session = session

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.session.position

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def is_sliding(self) -> list[bool]:
        return [False]

    @property
    def is_linear(self) -> list[bool]:
        return [False]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` tokens (a negative count or 0, as `transformers` 5 crops)."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
            raise ValueError(f"crop takes the number of tokens to remove as a negative integer (or 0), got "
                             f"{tokens_to_remove!r}")
        if tokens_to_remove:
            self.session.rewind(self.session.position + tokens_to_remove)

    def __repr__(self) -> str:
        return f"SwarmCache(session={self.session.session_id[:8]}, tokens={self.session.position})"
