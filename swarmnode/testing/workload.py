"""Workloads for a local swarm: distinct chat prompts, timed greedy generations, local truths.

The benchmarks and the load tests send the same kind of requests: single-turn chat prompts, each generated
greedily for an exact number of tokens in a session of its own, timed token by token, and compared with
what local `transformers` generates for the same prompt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["CHAT_QUESTIONS", "PASSAGES", "TimedRequest", "TokenClock", "chat_inputs", "local_truths",
           "passage_inputs", "timed_request"]

CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "Why is the sky blue?",
    "Give me a tip for learning to cook.",
    "What is a prime number?",
    "Name three rivers in Europe.",
    "How do bees make honey?",
    "Suggest a name for a black cat.",
    "What does a compiler do?",
    "Describe a rainy morning in one sentence.",
    "How many legs does a spider have?",
    "What is the boiling point of water?",
    "Tell me a fun fact about octopuses.",
    "Why do leaves change colour in autumn?",
    "What is the tallest mountain on Earth?",
    "Explain photosynthesis simply.",
    "Recommend a board game for four people.",
    "What is the difference between weather and climate?",
    "How does a bicycle stay upright?",
    "Write a short greeting for a birthday card.",
    "What are the three states of matter?",
    "Who wrote Romeo and Juliet?",
    "How can I sleep better?",
)


def chat_inputs(tokenizer, count: int) -> list:
    """`count` distinct single-turn chat prompts as input_ids (1, n), cycling `CHAT_QUESTIONS` with a numbered
    suffix once they run out."""
    prompts = []
    for i in range(count):
        question = CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]
        if i >= len(CHAT_QUESTIONS):
            question += f" (version {i // len(CHAT_QUESTIONS) + 1})"
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                     add_generation_prompt=True, return_tensors="pt",
                                                     return_dict=True)["input_ids"])
    return prompts


# Passages given in the prompt, to be repeated, corrected or summarised: answers that reuse the prompt's words,
# where drafts taken from the prompt (speculative decoding's prompt lookup) can be right.
PASSAGES = (
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin covers seven million "
    "square kilometres, of which five and a half million are covered by the rainforest. The region includes "
    "territory belonging to nine nations. The majority of the forest is contained within Brazil, with 60% of the "
    "rainforest, followed by Peru with 13%, and Colombia with 10%.",
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after the "
    "engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. It was the entrance "
    "arch to the 1889 World's Fair, and was initially criticised by some of France's leading artists.",
    "Honey bees collect nectar from flowers and carry it back to the hive in a special stomach. In the hive, "
    "worker bees pass the nectar from one to another, adding enzymes that break the sugars down. They spread it "
    "in the cells of the comb and fan it with their wings until most of the water evaporates, and then they seal "
    "each cell with wax.",
)
PASSAGE_TASKS = (
    "Repeat the following passage exactly, word for word:",
    "Rewrite the following passage, keeping every sentence but writing 'the' in capitals:",
    "Summarise the following passage, reusing its own words:",
)


def passage_inputs(tokenizer, count: int) -> list:
    """`count` chat prompts (input_ids (1, n)) that each give a passage (`PASSAGES`) and ask for it back,
    edited or summarised (`PASSAGE_TASKS`), cycling through their combinations."""
    prompts = []
    for i in range(count):
        passage = PASSAGES[i % len(PASSAGES)]
        task = PASSAGE_TASKS[(i // len(PASSAGES)) % len(PASSAGE_TASKS)]
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": f"{task}\n\n{passage}"}],
                                                     add_generation_prompt=True, return_tensors="pt",
                                                     return_dict=True)["input_ids"])
    return prompts


@dataclass
class TimedRequest:
    """One generation through the swarm: its output (token ids, prompt included) or the error that ended it,
    when it began and ended (time.perf_counter()), time to first token, the gaps between later tokens, and
    the retries (failed hops re-routed) and cache waits of its session."""

    prompt: int
    began: float
    ended: float
    tokens: int = 0
    output: list[int] | None = None
    error: str | None = None
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    retries: int = 0
    cache_waits: int = 0  # refusals for a full KV cache the session waited out (`InferenceSession.cache_waits`)
    session_key: int = 0  # id() of its InferenceSession, to match what was logged about it


def timed_request(remote, prompt: int, input_ids, new_tokens: int, *,
                  session_length: int | None = None) -> TimedRequest:
    """Generate exactly `new_tokens` greedy tokens for `input_ids` (1, n) in a session of its own (of
    `session_length` tokens, default just enough), timed with a `TokenClock`. A failure is a result: its
    message is in `error`."""
    clock = TokenClock()
    began = time.perf_counter()
    session = None
    try:
        with remote.inference_session(max_length=session_length or input_ids.shape[1] + new_tokens) as session:
            out = remote.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, streamer=clock)
        request = TimedRequest(prompt, began, time.perf_counter(), out.shape[1] - input_ids.shape[1],
                               out[0].tolist())
    except Exception as exc:  # any failure is this request's result, counted by the caller: keep its message
        request = TimedRequest(prompt, began, time.perf_counter(), error=f"{type(exc).__name__}: {exc}")
    if len(clock.times) > 1:
        request.ttft = clock.times[1] - began
        request.gaps = clock.gaps()
    if session is not None:
        request.retries = session.retries
        request.cache_waits = session.cache_waits
        request.session_key = id(session)
    return request


def local_truths(model_dir, prompts: list, new_tokens: int) -> list[list[int]]:
    """What local `transformers` generates greedily (exactly `new_tokens` tokens) for each prompt: the
    reference every swarm output is compared with."""
    import torch
    from transformers import AutoModelForCausalLM

    local = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [local.generate(p, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)[0].tolist()
            for p in prompts]


class TokenClock:
    """A `generate(streamer=...)` streamer that timestamps every `put`: `times[0]` is the prompt, `times[k]`
    the k-th new token (time.perf_counter()). Time to first token is `times[1] - began`; the gaps between
    later entries are the time per token a user sees."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times[1:], self.times[2:])]
