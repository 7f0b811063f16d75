"""`swarmnode api --api-keys` over the run's shared 3-node swarm, driven by the official `openai` client.

A request without a valid key gets 401 in OpenAI's error shape (a key in the wrong header is told where it
goes); a key generates exactly what local `transformers` does; a key capped at one generation at once, or at
a number of tokens per minute, gets 429 with `Retry-After` beyond it; keys added to and removed from the file
take effect without a restart; `/metrics` counts requests and tokens per key name.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from swarmnode.api.keys import key_line, new_key

pytestmark = pytest.mark.swarm

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = "Once upon a time, in a small village by the sea,"  # continued for dozens of tokens without an end


@pytest.fixture(scope="module")
def keyed_api(three_node_swarm, tmp_path_factory):
    """A second `swarmnode api` on the shared swarm, with a keys file: `alice` (no limits), `solo` (one
    generation at once) and `meter` (40 tokens per minute)."""
    keys = {name: new_key() for name in ("alice", "solo", "meter")}
    path = tmp_path_factory.mktemp("api-keys") / "keys.txt"
    path.write_text("# test keys\n" + "\n".join([
        key_line("alice", keys["alice"]),
        f"solo {keys['solo']} sessions=1",  # a key written as itself works too
        key_line("meter", keys["meter"], tokens_per_minute=40),
    ]) + "\n")
    swarm = three_node_swarm.swarm
    process, url = swarm.start_api(name="api-keyed", extra=["--api-keys", str(path)])
    assert "3 API keys from" in process.log()
    try:
        yield {"url": url, "keys": keys, "path": path, "process": process}
    finally:
        swarm.stop(process)


@pytest.fixture(scope="module")
def model_id(model_dir):
    from pathlib import Path

    return Path(model_dir).resolve().name


def openai_client(url: str, key: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=300)


def test_requests_without_a_valid_key_get_401_in_openai_shape(keyed_api, model_id):
    import openai

    url = keyed_api["url"]
    with openai_client(url, "sk-swarm-not-a-key-of-this-server") as client, \
            pytest.raises(openai.AuthenticationError) as caught:
        client.models.list()
    assert caught.value.status_code == 401
    error = caught.value.body if isinstance(caught.value.body, dict) else {}
    assert error.get("code") == "invalid_api_key" and "not valid on this server" in error.get("message", "")
    assert "sk-swarm-not-a-key" not in error.get("message", ""), "a refused key is not echoed whole"

    cases = {
        "no key": ({}, "needs an API key"),
        "wrong header": ({"X-API-Key": keyed_api["keys"]["alice"]}, "'x-api-key' header"),
        "wrong scheme": ({"Authorization": f"Basic {keyed_api['keys']['alice']}"}, "must be 'Bearer KEY'"),
        "empty bearer": ({"Authorization": "Bearer"}, "and no key"),
    }
    for what, (headers, message) in cases.items():
        response = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=30,
                              json={"model": model_id, "messages": QUESTION, "max_tokens": 4})
        assert response.status_code == 401, what
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        body = response.json()["error"]
        assert set(body) == {"message", "type", "param", "code"} and body["code"] == "invalid_api_key", what
        assert message in body["message"], (what, body)
    # what is open: the metrics and the dashboard's state
    assert httpx.get(f"{url}/metrics", timeout=30).status_code == 200


def test_a_key_generates_what_local_transformers_does(keyed_api, model_id, local_model, tokenizer):
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    out = local_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    truth = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    with openai_client(keyed_api["url"], keyed_api["keys"]["alice"]) as client:
        assert [m.id for m in client.models.list().data] == [model_id]
        reply = client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=16, temperature=0)
        assert reply.choices[0].message.content == truth
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model_id, messages=QUESTION, max_tokens=16, temperature=0, stream=True) if c.choices)
        assert streamed == truth


def test_a_key_capped_at_one_generation_gets_429_with_retry_after(keyed_api, model_id):
    import openai

    key = keyed_api["keys"]["solo"]
    started, result = threading.Event(), {}

    def long_stream() -> None:
        try:
            with openai_client(keyed_api["url"], key) as client:
                chunks = 0
                for _chunk in client.completions.create(model=model_id, prompt=STORY, max_tokens=48, temperature=0,
                                                        stream=True):
                    chunks += 1
                    started.set()
                result["chunks"] = chunks
        except Exception as exc:  # reported below
            result["error"] = exc
            started.set()

    worker = threading.Thread(target=long_stream)
    worker.start()
    try:
        assert started.wait(120) and "error" not in result, result
        with openai_client(keyed_api["url"], key) as client, pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=4, temperature=0)
        assert caught.value.status_code == 429 and caught.value.response.headers["Retry-After"] == "1"
        assert "sessions=1" in caught.value.message
        with openai_client(keyed_api["url"], keyed_api["keys"]["alice"]) as other:  # other keys are untouched
            other.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=2, temperature=0)
    finally:
        worker.join(300)
    assert "error" not in result and result["chunks"] > 1, result
    with openai_client(keyed_api["url"], key) as client:  # the first one ended: the key may run again
        client.chat.completions.create(model=model_id, messages=QUESTION, max_tokens=2, temperature=0)


def test_a_key_capped_in_tokens_per_minute_gets_429_until_the_minute_frees_them(keyed_api, model_id):
    """Requests of `meter` (40 tokens per minute) one after another: each is admitted exactly while the
    prompts and generated tokens of the last minute leave room for its prompt, else 429 with Retry-After."""
    import openai

    budget, used, generated, refused = 40, 0, 0, None
    with openai_client(keyed_api["url"], keyed_api["keys"]["meter"]) as client:
        for _ in range(10):
            try:
                reply = client.completions.create(model=model_id, prompt=STORY, max_tokens=8, temperature=0)
            except openai.RateLimitError as exc:
                refused = exc
                break
            used += reply.usage.prompt_tokens + reply.usage.completion_tokens
            generated += reply.usage.completion_tokens
            prompt = reply.usage.prompt_tokens
            assert used - reply.usage.completion_tokens <= budget, "admitted beyond the budget"
        assert refused is not None, "never refused"
        assert used + prompt > budget, f"refused with room left ({used} + {prompt} <= {budget})"
        wait = int(refused.response.headers["Retry-After"])
        assert 1 <= wait <= 60 and f"used {used} of its {budget} tokens per minute" in refused.message
        with pytest.raises(openai.BadRequestError, match="more than the API key 'meter' may use in a minute"):
            client.completions.create(model=model_id, prompt="word " * 80, max_tokens=1)
    keyed_api["meter_generated"] = generated


def test_keys_added_and_revoked_take_effect_without_a_restart(keyed_api, model_id):
    import openai

    path, url = keyed_api["path"], keyed_api["url"]
    late = new_key()
    path.write_text(path.read_text() + key_line("late", late) + "\n")
    deadline = time.monotonic() + 30
    with openai_client(url, late) as client:
        while True:  # read again within a second or two of the change
            try:
                assert [m.id for m in client.models.list().data] == [model_id]
                break
            except openai.AuthenticationError:
                assert time.monotonic() < deadline, "the added key was never accepted"
                time.sleep(0.5)
    path.write_text("\n".join(line for line in path.read_text().splitlines() if not line.startswith("late ")) + "\n")
    deadline = time.monotonic() + 30
    with openai_client(url, late) as client:
        while True:
            try:
                client.models.list()
                assert time.monotonic() < deadline, "the revoked key was still accepted"
                time.sleep(0.5)
            except openai.AuthenticationError:
                break
    assert "revoked late" in keyed_api["process"].log()


def test_metrics_count_requests_and_tokens_per_key(keyed_api):
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{keyed_api['url']}/metrics", timeout=30).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def value(name: str, **labels) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    assert value("swarmnode_api_key_requests_total", key="alice", status="200") >= 3
    assert value("swarmnode_api_key_requests_total", key="-", status="401") >= 4
    assert value("swarmnode_api_key_requests_total", key="solo", status="429") >= 1
    assert value("swarmnode_api_key_requests_total", key="meter", status="429") >= 1
    assert value("swarmnode_api_key_tokens_total", key="meter", kind="prompt") > 0
    assert value("swarmnode_api_key_tokens_total", key="meter", kind="completion") == keyed_api["meter_generated"]
    assert value("swarmnode_api_key_sessions", key="solo") == 0, "every generation that ended gave its slot back"
    assert keyed_api["keys"]["alice"] not in text
