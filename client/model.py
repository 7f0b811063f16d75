"""`DistributedModelForCausalLM`: a `transformers` causal LM whose transformer blocks run in the swarm.

The client holds only the model's two ends (`runtime.model_ends`): the embeddings and the final norm and head,
read from the checkpoint, with the family's own code around them (Gemma's embedding scale, Gemma 2's logit
soft-capping, Granite's multipliers), and checks before it joins that its path through the family gives
`transformers`' logits (`runtime.family_check`). The blocks run on peers found in the DHT. `generate()` is
`transformers`' own (`GenerationMixin`), so greedy and sampled decoding, logits processors, stopping criteria,
streamers and batches of prompts of different lengths (left padding with an attention mask) behave exactly as
with a local model. Each generation runs in an `InferenceSession` that the swarm keeps the KV cache for;
`model.inference_session(max_length=...)` opens one for step-by-step control, and `generate()` continues it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
from transformers.modeling_outputs import CausalLMOutputWithPast

from swarmnode.admission import Admission
from swarmnode.client.drafts import SwarmDrafts
from swarmnode.client.errors import ClientConfigError, SessionError
from swarmnode.client.loop import LoopThread
from swarmnode.client.session import InferenceSession
from swarmnode.client.speculative import PipelinedDecoding
from swarmnode.client.swarm import ClientConfig, SwarmView
from swarmnode.client.swarm_cache import SwarmCache
from swarmnode.errors import ERROR_BAD_REQUEST
from swarmnode.messages import WIRE_DTYPES
from swarmnode.records import model_prefix
from swarmnode.runtime.checkpoint import Checkpoint
from swarmnode.runtime.family_check import check_family
from swarmnode.runtime.model_ends import ModelEnds
from swarmnode.runtime.sources import open_checkpoint

logger = logging.getLogger(__name__)


def resolve_dtype(dtype: torch.dtype | str, config) -> torch.dtype:
    """The client's compute dtype from `from_pretrained(dtype=...)`: one of `messages.WIRE_DTYPES`, given as a
    `torch.dtype` or its name, or "auto" for the checkpoint config's own (float32 when it names none)."""
    choices = ", ".join(["auto", *WIRE_DTYPES])
    if dtype == "auto":
        declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if declared is None:
            return torch.float32
        dtype = declared
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in WIRE_DTYPES:
            raise ClientConfigError(f"dtype {dtype!r} is not one of {choices}")
        return WIRE_DTYPES[dtype.removeprefix("torch.")]
    if dtype not in WIRE_DTYPES.values():
        raise ClientConfigError(f"dtype {dtype!r} is not one of {choices}")
    return dtype


def _counted(position_ids: torch.Tensor | None, length: int) -> bool:
    """Whether `position_ids` (generate's, or none) number a sequence's `length` tokens from 0, as unpadded tokens are."""
    return position_ids is None or (position_ids.shape[-1] == length
                                    and bool((position_ids.reshape(-1, length) == torch.arange(length)).all()))


class DistributedModelForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = PretrainedConfig
    base_model_prefix = "model"
    _supports_sdpa = True

    def __init__(self, config, *, checkpoint: Checkpoint, swarm: SwarmView, dht=None,
                 dtype: torch.dtype = torch.float32):
        # a copy: this class runs no attention of its own, and transformers would set the implementation it
        # supports on the config it is given, where the family's blocks and ends read theirs
        super().__init__(copy.deepcopy(config))
        self.compute_dtype = dtype
        self.ends = ModelEnds(checkpoint, dtype)
        self.local_model = self.ends.model  # a submodule: the ends' parameters are this model's parameters
        self.checkpoint = checkpoint
        self.swarm = swarm
        self._dht = dht
        self._local = threading.local()
        self.eval().requires_grad_(False)

    @property
    def embed_tokens(self) -> torch.nn.Module:
        return self.ends.input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.ends.output_embeddings()

    # An intentionally different signature from transformers' loader (it joins a swarm: `initial_peers` is
    # required, the Hub loader's options do not apply), which mypy reports as an unsafe override.
    @classmethod
    def from_pretrained(  # type: ignore[override]
        cls, path: str | Path, *, initial_peers: list[str], dht_prefix: str | None = None,
        config: ClientConfig | None = None, dtype: torch.dtype | str = "auto", model_name: str | None = None,
        admission: Admission | None = None, **kwargs,
    ) -> DistributedModelForCausalLM:
        """Load the local parts of the model at `path` (a checkpoint folder or a Hugging Face Hub name, of which
        only the config, tokenizer and the shards holding the embeddings, norm and head are fetched) and join the
        swarm through `initial_peers`. `model_name`: the model's name in the swarm when the folder's own is not
        it (see `Checkpoint.name`).

        `dtype` is the precision of the client's embeddings, norm and LM head and of the hidden states it
        sends (each node computes in its own dtype and answers in this one): a `torch.dtype`, its name, or
        "auto" (the default, as in transformers 5: the checkpoint's `dtype`, float32 when it names none).
        Other keyword arguments are `ClientConfig` fields (e.g. `verify=0.25`); with `config` they override
        its fields. `admission`: this client's admission to a private swarm (`swarmnode.admission.Admission.load`
        with `Role.CLIENT` and an invitation, or the owner's key); None for a public swarm.
        """
        from hivemind.utils.crypto import RSAPrivateKey

        from swarmnode.dht import start_dht

        if not initial_peers:
            raise ClientConfigError("initial_peers is empty: pass the multiaddr that `swarmnode bootstrap` "
                                    "printed")
        known = {f.name for f in dataclasses.fields(ClientConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown client settings {unknown}: the settings are ClientConfig's fields "
                            f"({', '.join(sorted(known))})")
        checkpoint = open_checkpoint(path, model_name=model_name)
        check_family(checkpoint.config)  # a family whose path here is not transformers' is refused, in one line
        compute_dtype = resolve_dtype(dtype, checkpoint.config)
        client_config = dataclasses.replace(config, **kwargs) if config is not None else ClientConfig(**kwargs)
        # this client's own key: the reports it publishes are signed with it (in a private swarm, its admitted one)
        key = admission.identity.key if admission is not None else RSAPrivateKey()
        # the DHT process is forked before this process starts the loop's thread
        dht = start_dht(initial_peers, client_mode=True, startup_timeout=client_config.connect_timeout, key=key,
                        admission=admission)
        loop = None
        try:
            loop = LoopThread()
            p2p = loop.run(dht.replicate_p2p(), client_config.connect_timeout)
            members = None
            if admission is not None:  # a private swarm: publish the invitation before calling any node
                from swarmnode.membership import Membership

                members = Membership(dht, admission, key)
                loop.run(members.start(), client_config.connect_timeout)
            swarm = SwarmView(dht, p2p, loop, dht_prefix or model_prefix(checkpoint.name), checkpoint.num_blocks,
                              client_config, key=key, members=members)
            model = cls(checkpoint.config, checkpoint=checkpoint, swarm=swarm, dht=dht, dtype=compute_dtype)
        except BaseException:
            dht.shutdown()
            if loop is not None:
                loop.stop()
            raise
        if (checkpoint.path / "generation_config.json").is_file():
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(checkpoint.path)
        return model

    def shutdown(self) -> None:
        """Leave the swarm: close the DHT peer (and its p2pd) and the client loop."""
        if self._dht is None:
            return
        try:
            self.swarm.loop.run(self.swarm.p2p.shutdown(), timeout=10)
        except (TimeoutError, OSError, P2PDaemonError):  # the DHT process below closes the daemon anyway
            logger.debug("closing the P2P replica failed", exc_info=True)
        self.swarm.loop.stop()
        self._dht.shutdown()
        self._dht = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # --- transformers plumbing -----------------------------------------------------------------------
    def get_input_embeddings(self):
        return self.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    @property
    def active_session(self) -> InferenceSession | None:
        return getattr(self._local, "session", None)

    @contextmanager
    def inference_session(self, max_length: int):
        """Open a session through the swarm; `generate()` and forward calls inside continue it."""
        if self.active_session is not None:
            raise SessionError("an inference session is already active in this thread", code=ERROR_BAD_REQUEST)
        session = InferenceSession(self.swarm, max_length)
        self._local.session = session
        try:
            yield session
        finally:
            self._local.session = None
            session.close()

    def generate(self, inputs=None, generation_config=None, **kwargs):
        """`transformers`' `generate`, continuing the active session or in a session of its own. Speculative
        decoding is `transformers`' assisted generation, called as with a local model: a draft model of the
        same tokenizer (`assistant_model=`) or n-gram lookup in the prompt (`prompt_lookup_num_tokens=`).
        Each pass sends the drafted tokens through the swarm as one step; the rejected ones are taken back on
        every node (`SwarmCache.crop`, `InferenceSession.rewind`). With prompt lookup and hidden states pushed node
        to node, several passes are in flight at once (`speculative_passes=`, default `ClientConfig.speculative_passes`;
        1: one at a time): see `client.speculative`."""
        passes = kwargs.pop("speculative_passes", None)
        if passes is not None:  # checked as ClientConfig checks its own (ClientConfigError)
            dataclasses.replace(self.swarm.config, speculative_passes=passes)
        self._local.passes = passes
        if kwargs.get("cache") is not None and not (isinstance(kwargs["cache"], SwarmCache)
                                                    and kwargs["cache"].session is self.active_session):
            raise ClientConfigError("generate() got a cache, but the swarm's nodes hold this model's KV cache: "
                                    "pass none (continue a session with model.inference_session(...) instead)")
        # the nodes hold the KV cache, so no local one is made: a checkpoint's `cache_implementation` (Gemma's
        # "hybrid") or a caller's would only make transformers refuse the session's `SwarmCache`
        kwargs.pop("cache_implementation", None)
        if getattr(self.generation_config, "cache_implementation", None) is not None:
            self.generation_config.cache_implementation = None
        if generation_config is not None and getattr(generation_config, "cache_implementation", None) is not None:
            generation_config = copy.copy(generation_config)
            generation_config.cache_implementation = None
        if self.active_session is not None:
            kwargs["cache"] = SwarmCache(self.active_session)
            return self._generate(inputs, generation_config, kwargs)
        input_ids = inputs if inputs is not None else kwargs.get("input_ids")
        if input_ids is None:
            raise ValueError("generate() needs input_ids")
        config = generation_config or self.generation_config
        max_new = kwargs.get("max_new_tokens") or getattr(config, "max_new_tokens", None)
        max_length = input_ids.shape[1] + max_new if max_new else (kwargs.get("max_length") or config.max_length)
        with self.inference_session(max_length=int(max_length)) as session:
            kwargs["cache"] = SwarmCache(session)
            return self._generate(inputs, generation_config, kwargs)

    def _generate(self, inputs, generation_config, kwargs):
        """`transformers`' generate; then, as it does for its own draft-model generator, the draft model keeps
        the draft length its heuristic schedule reached, for the next call (`SwarmDrafts.keep_schedule`)."""
        self._local.drafts = None
        output = super().generate(inputs, generation_config, **kwargs)
        drafts, self._local.drafts = self._local.drafts, None
        if drafts is not None:
            drafts.keep_schedule()
        return output

    def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                           streamer=None, inputs_tensor=None, assistant_model=None, assistant_tokenizer=None,
                           tokenizer=None, **model_kwargs):
        """Prompt lookup with hidden states pushed node to node runs with verification passes pipelined
        (`client.speculative.PipelinedDecoding`, up to `speculative_passes` in flight); anything else, and
        `speculative_passes=1`, runs `transformers`' own loop, one pass at a time."""
        session = self.active_session
        passes = getattr(self._local, "passes", None) or self.swarm.config.speculative_passes
        mask = model_kwargs.get("attention_mask")
        drafts = None
        if (passes > 1 and assistant_model is None and generation_config.prompt_lookup_num_tokens
                and getattr(generation_config, "assistant_early_exit", None) is None
                and session is not None and session.pipeline is not None and input_ids.shape[0] == 1
                and input_ids.shape[1] > 0 and model_kwargs.get("inputs_embeds") is None
                and _counted(model_kwargs.get("position_ids"), input_ids.shape[1])
                and not generation_config.return_dict_in_generate
                and not synced_gpus and (mask is None or bool(mask.all()))):
            drafts = self._get_candidate_generator(
                generation_config=generation_config, input_ids=input_ids, inputs_tensor=inputs_tensor,
                assistant_model=None, logits_processor=logits_processor, target_tokenizer=tokenizer,
                assistant_tokenizer=assistant_tokenizer, model_kwargs=model_kwargs)
        if drafts is not None and isinstance(drafts.inner, PromptLookupCandidateGenerator):
            inner = drafts.inner

            def drafter(sequence: torch.Tensor, limit: int) -> list[int]:
                candidates, _ = inner.get_candidates(sequence)
                return candidates[0, sequence.shape[1]:sequence.shape[1] + limit].tolist()

            def first(candidates: torch.Tensor, keep: int) -> torch.Tensor:
                return self(input_ids=candidates, attention_mask=torch.ones_like(candidates),
                            logits_to_keep=keep).logits

            decoding = PipelinedDecoding(
                self.ends, session, drafter, most=int(generation_config.prompt_lookup_num_tokens), passes=passes,
                max_length=int(generation_config.max_length), logits_processor=logits_processor,
                stopping_criteria=stopping_criteria, do_sample=bool(generation_config.do_sample), streamer=streamer)
            return decoding.run(input_ids, first)
        return super()._assisted_decoding(
            input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=synced_gpus,
            streamer=streamer, inputs_tensor=inputs_tensor, assistant_model=assistant_model,
            assistant_tokenizer=assistant_tokenizer, tokenizer=tokenizer, **model_kwargs)

    def _get_candidate_generator(self, generation_config, *args, **kwargs):
        """`transformers`' drafts for assisted generation, bounded to what the session has room for and, for
        prompt lookup, paced by their acceptance (`client.drafts.SwarmDrafts`; a draft model keeps
        `transformers`' own pace, `num_assistant_tokens_schedule`)."""
        inner = super()._get_candidate_generator(generation_config, *args, **kwargs)
        session = self.active_session
        room = generation_config.max_length if session is None else min(generation_config.max_length,
                                                                         session.max_length)
        self._local.drafts = SwarmDrafts(inner, max_length=room, paced=isinstance(inner, PromptLookupCandidateGenerator))
        return self._local.drafts

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, logits_to_keep: int = 0, **kwargs):
        tokens = input_ids if inputs_embeds is None else inputs_embeds
        if tokens is None:
            raise ValueError("forward() needs input_ids or inputs_embeds")
        batch, n = tokens.shape[:2]
        session = self.active_session
        if attention_mask is not None:
            total = attention_mask.shape[1]
        elif position_ids is not None:  # no padding: positions count the tokens before these
            total = int(position_ids[0, -1]) + 1
        elif session is not None:  # no padding, no positions: the tokens follow what the session holds
            total = session.position + n
        else:
            total = None
        if session is not None:
            assert total is not None, "a session's tokens have a length"
            start = total - n
            if start < session.position:  # the caller repeated tokens the swarm already holds: skip them
                skip = session.position - start
                if skip >= n:
                    raise SessionError(f"all {n} tokens are already in the session (position "
                                       f"{session.position})", code=ERROR_BAD_REQUEST)
                tokens = tokens[:, skip:]
                if position_ids is not None:
                    position_ids = position_ids[:, skip:]
                n -= skip
                if isinstance(logits_to_keep, int) and logits_to_keep > n:
                    raise SessionError(f"{logits_to_keep} tokens' logits were asked for, but only {n} of these tokens "
                                       f"are new to the session (it holds {session.position}): continue it from its "
                                       f"last token, or open a new one", code=ERROR_BAD_REQUEST)
            elif start > session.position:
                raise SessionError(f"tokens from position {session.position} to {start} were never sent",
                                   code=ERROR_BAD_REQUEST)
        if attention_mask is None:
            attention_mask = torch.ones(batch, (total or n), dtype=torch.long)
        new_mask = attention_mask[:, -n:]
        if position_ids is None:
            full = attention_mask.long().cumsum(-1) - 1
            position_ids = full.masked_fill(attention_mask == 0, 0)[:, -n:]
        else:
            position_ids = position_ids[:, -n:]
        keep = logits_to_keep if isinstance(logits_to_keep, int) and not isinstance(logits_to_keep, bool) else 0
        inputs = {"input_ids": tokens} if inputs_embeds is None else {"inputs_embeds": tokens}
        if session is not None:
            logits = self.ends.logits(lambda hidden: session.step(hidden, position_ids, new_mask, keep_last=keep),
                                      position_ids=position_ids, logits_to_keep=logits_to_keep, **inputs)
        else:  # one-shot: a session just for this call
            with InferenceSession(self.swarm, max_length=n) as once:
                logits = self.ends.logits(lambda hidden: once.step(hidden, position_ids, new_mask, keep_last=keep),
                                          position_ids=position_ids, logits_to_keep=logits_to_keep, **inputs)
        return CausalLMOutputWithPast(logits=logits, cache=cache)
