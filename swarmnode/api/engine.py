"""Runs generations through the swarm client for the API server.

Each request becomes one `model.generate()` call on a worker thread (`ThreadPoolExecutor`): the client
keeps its inference session in a thread-local, so concurrent generations each open their own
`InferenceSession` and share only the `SwarmView`, whose DHT and routing work runs on the client's single
asyncio loop thread (safe from several threads, as `scripts/bench_generate.py`'s concurrent clients do).

Sampling uses torch's global RNG, so sampled generations hold `_rng_lock` for their whole run (a `seed`
then reproduces the output exactly); greedy generations (temperature 0) run concurrently.

A generation streams its tokens to the asyncio side through a queue; the HTTP side decodes them, trims
stop sequences and sets the job's cancel flag when it has what it needs or when the HTTP client goes
away. A `StoppingCriteria` reads that flag at every step, so `generate()` returns and its session closes
(the peers free the KV cache at once).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from swarmnode import metrics
from swarmnode.api.schemas import APIError

logger = logging.getLogger(__name__)


@dataclass
class GenerationParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stops: list[str] = field(default_factory=list)
    seed: int | None = None
    prompt_lookup: int = 0  # speculative decoding: draft up to this many tokens a pass from the prompt (0: off)


@dataclass
class Result:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


class _End:
    """End of a generation's token stream (`error` set when generate() raised)."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


class Job:
    """One generation: its cancel flag and the queue its tokens arrive in."""

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt_ids: list[int], params: GenerationParams):
        self.id = uuid.uuid4().hex
        self.loop = loop
        self.prompt_ids = prompt_ids
        self.params = params
        self.cancelled = threading.Event()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.retries = 0
        self.began = time.perf_counter()

    def cancel(self) -> None:
        self.cancelled.set()

    def push(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel()


class _CancelCriteria(StoppingCriteria):
    """Stops generate() once the job is cancelled; also notes the session's retries."""

    def __init__(self, job: Job, model):
        self.job = job
        self.model = model

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        session = getattr(self.model, "active_session", None)
        if session is not None:
            self.job.retries = session.retries
        done = torch.full((input_ids.shape[0],), self.job.cancelled.is_set(), device=input_ids.device,
                          dtype=torch.bool)
        return cast(torch.BoolTensor, done)  # transformers' annotation: a tensor of dtype bool


class _QueueStreamer(BaseStreamer):
    """Sends each new token id to the job's queue (the first put is the prompt: skipped)."""

    def __init__(self, job: Job):
        self.job = job
        self.prompt_seen = False
        self.last: float | None = None

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        now = time.perf_counter()
        ids = [int(t) for t in value.reshape(-1).tolist()]
        if self.last is None:
            metrics.API_TIME_TO_FIRST_TOKEN.observe(now - self.job.began)
        else:  # a speculative pass brings several tokens: each is counted at its share of the gap
            for _ in ids:
                metrics.API_TIME_PER_TOKEN.observe((now - self.last) / len(ids))
        self.last = now
        metrics.API_TOKENS_GENERATED.inc(len(ids))
        self.job.push(ids)

    def end(self) -> None:
        pass  # the worker pushes _End after generate() returns (or raises)


def _held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` must wait: a partial UTF-8 character, or a prefix of a stop."""
    hold = 0
    stripped = text.rstrip("\ufffd")
    if len(stripped) != len(text):
        hold = len(text) - len(stripped)
    for stop in stops:
        for k in range(min(len(stop) - 1, len(stripped)), 0, -1):
            if stripped.endswith(stop[:k]):
                hold = max(hold, len(text) - len(stripped) + k)
                break
    return hold


class Engine:
    """The swarm client, its tokenizer and a pool of generation threads."""

    def __init__(self, model, tokenizer, *, model_id: str, workers: int = 4, default_max_tokens: int = 256,
                 prompt_lookup: int = 0):
        self.model = model
        self.prompt_lookup = prompt_lookup  # a request's draft length when it names none
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())
        config = model.config
        self.context_length = int(getattr(config, "max_position_embeddings", 2048) or 2048)
        self.vocab_size = int(getattr(config, "vocab_size", 0) or 0)
        gen = getattr(model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.pad_id = getattr(gen, "pad_token_id", None) if gen is not None else None
        if self.pad_id is None:
            self.pad_id = next(iter(self.eos_ids), 0)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="swarmnode-generate")
        self._rng_lock = threading.Lock()
        self.active = 0
        self._count_lock = threading.Lock()
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=4096)
        self._state_cache: tuple[float, dict] | None = None
        self._state_lock = threading.Lock()
        metrics.bind_client(model)

    @classmethod
    def load(cls, model_path: str, initial_peers: list[str], *, model_name: str | None = None, dtype="auto",
             trusted=None, workers: int = 4, default_max_tokens: int = 256, verify: float = 0.0,
             prompt_lookup: int = 0, admission=None) -> Engine:
        """`model_path`: a checkpoint folder or a Hub name; `verify`: the share of steps checked on another
        replica (`ClientConfig.verify`); `prompt_lookup`: the draft length of requests that name none;
        `admission`: the server's admission to a private swarm, as a client (`swarmnode.admission`)."""
        from transformers import AutoTokenizer

        from swarmnode.client import ClientConfig, DistributedModelForCausalLM

        config = ClientConfig(trusted_coordinators=trusted, verify=verify) if trusted is not None else \
            ClientConfig(verify=verify)
        model = DistributedModelForCausalLM.from_pretrained(model_path, initial_peers=initial_peers, config=config,
                                                            model_name=model_name, dtype=dtype, admission=admission)
        try:
            tokenizer = AutoTokenizer.from_pretrained(model.checkpoint.path)
        except BaseException:
            model.shutdown()
            raise
        folder = Path(model_path)
        model_id = folder.resolve().name if folder.is_dir() else model.checkpoint.name
        return cls(model, tokenizer, model_id=model_id, workers=workers, default_max_tokens=default_max_tokens,
                   prompt_lookup=prompt_lookup)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.model.shutdown()

    # --- prompts -------------------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=True)
        except Exception as exc:  # safe: the template is the model's code; whatever it raises refuses the messages
            raise APIError(400, f"the model's chat template refused these messages: {exc}", param="messages") from exc
        ids = encoded["input_ids"]
        return [int(i) for i in (ids[0] if ids and isinstance(ids[0], list) else ids)]

    def text_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt)["input_ids"]
        else:
            ids = list(prompt)
            if any(not isinstance(i, int) or i < 0 or (self.vocab_size and i >= self.vocab_size) for i in ids):
                raise APIError(400, f"token ids must be integers in [0, {self.vocab_size})", param="prompt")
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        return [int(i) for i in ids]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def params(self, request, prompt_ids: list[int], default_max: int) -> GenerationParams:
        room = self.context_length - len(prompt_ids)
        requested = request.requested_max_tokens()
        if room <= 0 or (requested is not None and requested > room):
            raise APIError(400, f"this model's maximum context length is {self.context_length} tokens; the prompt has "
                                f"{len(prompt_ids)} and {requested or 0} more were requested",
                           param="max_tokens" if room > 0 else "messages", code="context_length_exceeded")
        max_new = requested if requested is not None else min(default_max, room)
        lookup = request.prompt_lookup if request.prompt_lookup is not None else self.prompt_lookup
        return GenerationParams(max_new_tokens=max_new, temperature=request.temperature, top_p=request.top_p,
                                stops=request.stops(), seed=request.seed, prompt_lookup=lookup)

    # --- generation ----------------------------------------------------------------------------------
    def start(self, prompt_ids: list[int], params: GenerationParams) -> tuple[Job, asyncio.Future]:
        loop = asyncio.get_running_loop()
        job = Job(loop, prompt_ids, params)
        future = loop.run_in_executor(self.pool, self._run, job)
        return job, future

    def _run(self, job: Job) -> None:
        params = job.params
        input_ids = torch.tensor([job.prompt_ids], dtype=torch.long)
        kwargs: dict[str, Any] = dict(
            attention_mask=torch.ones_like(input_ids), max_new_tokens=params.max_new_tokens,
            streamer=_QueueStreamer(job), stopping_criteria=StoppingCriteriaList([_CancelCriteria(job, self.model)]),
            pad_token_id=self.pad_id,
        )
        sampling = params.temperature > 0
        if sampling:
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0)
        else:
            kwargs.update(do_sample=False)
        if params.prompt_lookup:
            kwargs.update(prompt_lookup_num_tokens=params.prompt_lookup)
        with self._count_lock:
            self.active += 1
        metrics.API_ACTIVE_SESSIONS.inc()
        metrics.API_PROMPT_TOKENS.inc(len(job.prompt_ids))
        error = None
        try:
            if job.cancelled.is_set():
                return
            if sampling:
                with self._rng_lock:
                    if params.seed is not None:
                        torch.manual_seed(params.seed)
                    self.model.generate(input_ids, **kwargs)
            else:
                self.model.generate(input_ids, **kwargs)
        except BaseException as exc:  # safe: handed to the request's stream, which answers it; the worker goes on
            error = exc
            logger.warning("generation %s failed: %s", job.id[:8], exc)
        finally:
            with self._count_lock:
                self.active -= 1
            metrics.API_ACTIVE_SESSIONS.dec()
            if job.retries:
                metrics.API_RETRIES.inc(job.retries)
            job.push(_End(error))

    async def stream(self, prompt_ids: list[int], params: GenerationParams, *,
                     on_tokens: Callable[[int], None] | None = None) -> AsyncGenerator[tuple[str, Any], None]:
        """Yields ("text", delta) items, then one ("done", Result). Closing the iterator early cancels the
        generation (and waits for its session to close). `on_tokens(n)` is told of every n tokens generated
        as they arrive (an API key's usage counts them, `api.limits`)."""
        job, future = self.start(prompt_ids, params)
        generated: list[int] = []
        emitted = 0
        finish = None
        text = ""
        try:
            while True:
                item = await job.queue.get()
                if isinstance(item, _End):
                    if item.error is not None:
                        raise APIError(503, f"the swarm could not finish the generation: {item.error}",
                                       type="server_error", code="swarm_unavailable")
                    break
                # a speculative pass brings several tokens: each is taken as if it came alone, so a stop
                # sequence, an end of sequence or max_tokens ends the text (and the count) where it would
                ended = False
                for token in item:
                    generated.append(token)
                    self._recent.append((time.monotonic(), 1))
                    if on_tokens is not None:
                        on_tokens(1)
                    text = self.decode(generated)
                    cut = min((i for i in (text.find(s) for s in params.stops) if i >= 0), default=None)
                    if cut is not None:
                        text = text[:cut]
                        finish = "stop"
                        job.cancel()
                        ended = True
                        break
                    if token in self.eos_ids:
                        finish = "stop"
                        ended = True
                        break
                    if len(generated) >= params.max_new_tokens:
                        ended = True
                        break
                if ended:
                    break
                safe = len(text) - _held_back(text, params.stops)
                if safe > emitted:
                    yield "text", text[emitted:safe]
                    emitted = safe
            if finish is None:
                text = self.decode(generated)
                finish = "stop" if generated and generated[-1] in self.eos_ids else (
                    "length" if len(generated) >= params.max_new_tokens else "stop")
            if len(text) > emitted:
                yield "text", text[emitted:]
            await asyncio.shield(future)
            yield "done", Result(text, finish, len(prompt_ids), len(generated))
        finally:
            if not future.done():
                job.cancel()
                if finish is None:
                    metrics.API_CANCELLED.inc()

    async def complete(self, prompt_ids: list[int], params: GenerationParams, *,
                       on_tokens: Callable[[int], None] | None = None) -> Result:
        result = None
        stream = self.stream(prompt_ids, params, on_tokens=on_tokens)
        try:
            async for kind, value in stream:
                if kind == "done":
                    result = value
        finally:
            await stream.aclose()
        assert result is not None
        return result

    # --- dashboard -----------------------------------------------------------------------------------
    def tokens_per_second(self, window: float = 10.0) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._recent) if now - t <= window]
        if not recent:
            return 0.0
        return sum(n for _, n in recent) / window

    def state(self) -> dict:
        """The swarm as `swarmnode status --json` shows it, plus serving records and this server's load."""
        with self._state_lock:
            now = time.monotonic()
            if self._state_cache is not None and now - self._state_cache[0] < 1.0:
                data = self._state_cache[1]
            else:
                from swarmnode.swarm_state import read_state, state_dict

                swarm = self.model.swarm
                state = swarm.loop.run(read_state(swarm.dht, swarm.prefix, swarm.num_blocks,
                                                  swarm.config.trusted_coordinators or frozenset()), 15)
                data = state_dict(state, swarm.num_blocks, swarm.prefix, model=self.model.checkpoint.name)
                servers = {}
                for records in state.blocks.values():
                    for record in records:
                        servers[(record.peer_id, record.start, record.end)] = record.to_dict()
                data["servers"] = [servers[k] for k in sorted(servers, key=lambda k: (k[1], k[2], k[0]))]
                self._state_cache = (now, data)
        swarm = self.model.swarm
        return {**data, "model": self.model_id, "api": {
            "tokens_per_s": round(self.tokens_per_second(), 2), "active_generations": self.active,
            "banned_peers": sorted(swarm.banned()), "rtts": {p: round(r * 1000, 2) for p, r in swarm.rtts.items()},
        }}
