"""The OpenAI-compatible API (`swarmnode api`) over a real 3-node swarm, driven by the real `openai` client.

Greedy answers equal local `transformers`, streamed or not; errors are OpenAI-shaped with the right status
and the server keeps serving; a streaming client that disconnects frees its sessions on the nodes; the
API server and the nodes export Prometheus metrics that count generated and processed tokens.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch

pytestmark = pytest.mark.swarm

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def api_swarm(three_node_swarm):
    """The run's shared swarm: bootstrap, 3 manual nodes (0:10, 10:20, 20:30) with --metrics-port, and
    `swarmnode api` on a free port."""
    shared = three_node_swarm
    return {"swarm": shared.swarm, "url": shared.url, "nodes": shared.nodes, "node_metrics": shared.node_metrics,
            "api": shared.api}


@pytest.fixture(scope="module")
def client(api_swarm):
    from openai import OpenAI

    with OpenAI(base_url=api_swarm["url"] + "/v1", api_key="x", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(model_dir):
    from pathlib import Path

    return Path(model_dir).resolve().name


def local_greedy(local_model, tokenizer, input_ids: torch.Tensor, max_new: int) -> tuple[str, int, str]:
    """(text, completion tokens, finish_reason) of local `transformers` greedy decoding."""
    out = local_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new,
                               do_sample=False)
    new = out[0, input_ids.shape[1]:]
    finish = "stop" if int(new[-1]) == local_model.generation_config.eos_token_id else "length"
    return tokenizer.decode(new, skip_special_tokens=True), len(new), finish


def chat_ids(tokenizer, messages) -> torch.Tensor:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def scrape(url: str) -> dict[str, float]:
    """Sample name (with labels) -> value, parsed with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


def test_models_lists_the_checkpoint(client, model_id):
    assert [m.id for m in client.models.list().data] == [model_id]


def test_chat_greedy_equals_local(client, model_id, local_model, tokenizer):
    ids = chat_ids(tokenizer, QUESTION)
    truth, count, finish = local_greedy(local_model, tokenizer, ids, 24)
    reply = client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=24, temperature=0)
    assert reply.choices[0].message.content == truth
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == finish
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (ids.shape[1], count)
    assert reply.usage.total_tokens == ids.shape[1] + count

    chunks = list(client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == truth
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [finish]
    assert chunks[-1].usage.completion_tokens == count
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # really streamed


def test_chat_until_eos_finishes_with_stop(client, model_id, local_model, tokenizer):
    messages = [{"role": "user", "content": "Say hello."}]
    truth, count, finish = local_greedy(local_model, tokenizer, chat_ids(tokenizer, messages), 64)
    reply = client.chat.completions.create(model=model_id, messages=messages, max_tokens=64, temperature=0)
    assert reply.choices[0].message.content == truth
    assert reply.choices[0].finish_reason == finish
    assert reply.usage.completion_tokens == count


def test_completions_greedy_equals_local(client, model_id, local_model, tokenizer):
    prompt = "The capital of France is"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    truth, count, finish = local_greedy(local_model, tokenizer, ids, 16)
    reply = client.completions.create(model=model_id, prompt=prompt, max_tokens=16, temperature=0)
    assert reply.choices[0].text == truth
    assert reply.choices[0].finish_reason == finish
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (ids.shape[1], count)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_id, prompt=prompt, max_tokens=16, temperature=0, stream=True) if c.choices)
    assert streamed == truth


def test_prompt_lookup_extension_gives_the_same_text(client, model_id, local_model, tokenizer):
    """`prompt_lookup` (sent with the official client's `extra_body`) turns on speculative decoding for the
    request: the same greedy text, streamed in several tokens a pass."""
    from swarmnode.testing.workload import PASSAGES

    messages = [{"role": "user", "content": f"Repeat the following passage exactly, word for word:\n\n{PASSAGES[0]}"}]
    truth, count, finish = local_greedy(local_model, tokenizer, chat_ids(tokenizer, messages), 40)
    reply = client.chat.completions.create(model=model_id, messages=messages, max_tokens=40, temperature=0,
                                           extra_body={"prompt_lookup": 10})
    assert reply.choices[0].message.content == truth and reply.usage.completion_tokens == count
    assert reply.choices[0].finish_reason == finish
    chunks = list(client.chat.completions.create(model=model_id, messages=messages, max_tokens=40, temperature=0,
                                                 stream=True, extra_body={"prompt_lookup": 10}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == truth


def test_stop_sequences_are_trimmed(client, model_id, local_model, tokenizer):
    prompt = "The capital of France is"
    truth, _, _ = local_greedy(local_model, tokenizer, tokenizer(prompt, return_tensors="pt").input_ids, 16)
    words = truth.split()
    stop = words[len(words) // 2]
    expected = truth[: truth.find(stop)]
    reply = client.completions.create(model=model_id, prompt=prompt, max_tokens=16, temperature=0,
                                      stop=[stop, "never-appears"])
    assert reply.choices[0].text == expected
    assert reply.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_id, prompt=prompt, max_tokens=16, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == expected


def test_seeded_sampling_is_reproducible_and_local(client, model_id, local_model, tokenizer):
    kwargs = dict(model=model_id, messages=QUESTION, max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    second = client.chat.completions.create(**kwargs).choices[0].message.content
    assert first == second
    ids = chat_ids(tokenizer, QUESTION)
    torch.manual_seed(1234)
    out = local_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=True,
                               temperature=0.9, top_p=0.95, top_k=0)
    assert first == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_malformed_requests_get_openai_errors(api_swarm, client, model_id):
    url = api_swarm["url"]

    def post(path: str, body, raw: bool = False) -> httpx.Response:
        return httpx.post(url + path, content=body if raw else json.dumps(body),
                          headers={"Content-Type": "application/json"}, timeout=60)

    def check(response: httpx.Response, status: int, param: str | None = "*") -> dict:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if param != "*":
            assert error["param"] == param
        return error

    chat = {"model": model_id, "messages": QUESTION}
    check(post("/v1/chat/completions", b'{"model": "x", "messages": [', raw=True), 400)
    check(post("/v1/chat/completions", b"not json", raw=True), 400)
    check(post("/v1/chat/completions", {**chat, "model": "gpt-4"}), 404, "model")
    check(post("/v1/completions", {"model": "nope", "prompt": "hi"}), 404, "model")
    check(post("/v1/chat/completions", {**chat, "max_tokens": 0}), 400, "max_tokens")
    check(post("/v1/chat/completions", {**chat, "max_tokens": -3}), 400, "max_tokens")
    check(post("/v1/completions", {"model": model_id, "prompt": "hi", "max_tokens": -1}), 400, "max_tokens")
    check(post("/v1/chat/completions", {**chat, "n": 2}), 400, "n")
    assert check(post("/v1/chat/completions", {**chat, "max_tokens": 100_000}), 400)["code"] == \
        "context_length_exceeded"
    check(post("/v1/chat/completions", {"model": model_id}), 400, "messages")
    check(post("/v1/chat/completions", {**chat, "messages": []}), 400, "messages")
    check(post("/v1/chat/completions", {**chat, "temperature": 5}), 400, "temperature")
    check(post("/v1/completions", {"model": model_id, "prompt": "hi", "stop": 3}), 400, "stop")
    check(post("/v1/chat/completions", {**chat, "prompt_lookup": 65}), 400, "prompt_lookup")
    check(post("/v1/chat/completions", {**chat, "prompt_lookup": "ten"}), 400, "prompt_lookup")
    check(httpx.get(url + "/v1/nothing-here", timeout=10), 404)

    import openai

    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=QUESTION)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_id, messages=QUESTION, n=3)
    # still serving
    reply = client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4 and reply.choices[0].message.content


def test_disconnected_stream_frees_its_sessions(api_swarm, model_id, local_model, tokenizer):
    node_urls = api_swarm["node_metrics"]
    prompt = "Chapter 1\n\nIt was a dark and stormy night, and the old lighthouse keeper"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    _, count, _ = local_greedy(local_model, tokenizer, ids, 48)
    assert count == 48  # the answer goes on well past the moment the client hangs up
    body = {"model": model_id, "prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as http, \
            http.stream("POST", api_swarm["url"] + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = response.iter_lines()  # (breaking out of a for loop over it would close the connection)
        lines = 0
        while lines < 4:
            lines += next(events).startswith("data: ")
        during = [(scrape(u)["swarmnode_node_sessions_open"], scrape(u)["swarmnode_node_cache_tokens_used"])
                  for u in node_urls]
        assert all(open_ >= 1 and used > 0 for open_, used in during), during
        began = time.monotonic()
    # the client went away: the API server must stop generating and close the session on every node
    deadline = time.monotonic() + 10
    while True:
        after = [scrape(u) for u in node_urls]
        if all(m["swarmnode_node_sessions_open"] == 0 and m["swarmnode_node_cache_tokens_used"] == 0 for m in after):
            break
        assert time.monotonic() < deadline, f"sessions still open 10 s after the disconnect: {after}"
        time.sleep(0.25)
    print(f"sessions freed {time.monotonic() - began:.2f} s after the client disconnected")
    assert all(m["swarmnode_node_cache_tokens_total"] > 0 for m in after)
    api = scrape(api_swarm["url"] + "/metrics")
    assert api["swarmnode_api_cancelled_total"] >= 1
    assert api["swarmnode_api_active_sessions"] == 0


def test_metrics_count_tokens(api_swarm, client, model_id):
    api_url = api_swarm["url"] + "/metrics"
    before, node_before = scrape(api_url), scrape(api_swarm["node_metrics"][1])
    reply = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=8, temperature=0)
    after, node_after = scrape(api_url), scrape(api_swarm["node_metrics"][1])
    generated = reply.usage.completion_tokens
    assert after["swarmnode_api_tokens_generated_total"] - before["swarmnode_api_tokens_generated_total"] == generated
    assert after["swarmnode_api_prompt_tokens_total"] > before["swarmnode_api_prompt_tokens_total"]
    assert after["swarmnode_api_time_per_token_seconds_count"] > before["swarmnode_api_time_per_token_seconds_count"]
    key = "swarmnode_api_requests_total{endpoint=/v1/completions,status=200}"
    assert after[key] == before.get(key, 0) + 1
    assert "swarmnode_api_banned_peers" in after and "swarmnode_api_session_retries_total" in after
    processed = "swarmnode_node_tokens_processed_total{kind=inference}"
    # the prompt's tokens and every decode step but the last went through the middle node
    assert node_after[processed] - node_before.get(processed, 0) >= reply.usage.prompt_tokens + generated - 1
    steps = "swarmnode_node_step_latency_seconds_count{kind=inference}"
    assert node_after[steps] > node_before.get(steps, 0)
    assert node_after["swarmnode_node_placement_version"] == -1  # manual --blocks node
