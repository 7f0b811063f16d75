"""Fast checks of the pieces under the swarm: sizes, records, messages, routing, cache budget, blocks."""

from __future__ import annotations

import itertools

import pytest
import torch

from swarmnode.client.routing import NoRouteError, PeerSpan, shortest_route
from swarmnode.messages import (
    InferenceRequest,
    ProtocolError,
    pack_metadata,
    unpack_metadata,
    validate_step_tensors,
)
from swarmnode.records import ServerRecord, model_prefix, parse_record
from swarmnode.runtime.kv_cache import CacheBudget, CacheFullError
from swarmnode.sizes import parse_size


@pytest.mark.parametrize("text,expected", [("512M", 512 * 2**20), ("40G", 40 * 2**30), ("1.5T", int(1.5 * 2**40)),
                                           ("40GiB", 40 * 2**30), ("123", 123), (" 2g ", 2 * 2**30)])
def test_parse_size_accepts_usual_forms(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "forty", "-1G", "1.2.3G", "10X", "0", "0M"])
def test_parse_size_rejects_garbage_with_a_hint(text):
    with pytest.raises(ValueError, match=r"size|zero"):
        parse_size(text)


def test_model_prefix_is_dht_safe():
    assert model_prefix("SmolLM2-135M-Instruct") == "smollm2-135m-instruct"
    assert model_prefix("Qwen/Qwen3 0.6B") == "qwen-qwen3-0.6b"
    with pytest.raises(ValueError):
        model_prefix("///")


def test_malformed_server_records_are_ignored():
    good = dict(state="online", peer_id="12D3KooWF4wEr5XtqQayPrXS8NnvDGNZqpszHir9fBj4b7KJ3i9j", start=0, end=10,
                throughput=100.0, free_cache_tokens=5, cache_tokens=8)
    assert parse_record(ServerRecord, good, what="t").end == 10
    for bad in ({**good, "end": 0}, {**good, "state": "dancing"}, {**good, "throughput": -1}, "nonsense", None,
                {**good, "start": 5, "end": 5}, {**good, "peer_id": "not a peer id!"}):
        assert parse_record(ServerRecord, bad, what="t") is None


def test_metadata_is_validated_at_the_edge():
    raw = pack_metadata({"session": {"session_id": "s", "start": 0, "end": 3, "max_length": 8, "batch_size": 1}})
    assert unpack_metadata(raw, InferenceRequest).session.end == 3
    for bad in ({"session": {"session_id": "s", "start": 3, "end": 1, "max_length": 8, "batch_size": 1}},
                {"session": {"session_id": "", "start": 0, "end": 1, "max_length": 8, "batch_size": 1}},
                {"step": {"step_id": -1, "prefix_length": 0}}, {"unknown": 1}):
        with pytest.raises(ProtocolError):
            unpack_metadata(pack_metadata(bad), InferenceRequest)
    with pytest.raises(ProtocolError, match="msgpack"):
        unpack_metadata(b"\xc1\xff", InferenceRequest)
    with pytest.raises(ProtocolError, match="limit"):
        unpack_metadata(b"x" * 10000, InferenceRequest)


def _tensors(b=1, t=2, h=8, dtype=torch.float32):
    return [torch.zeros(b, t, h, dtype=dtype), torch.arange(t).repeat(b, 1), torch.ones(b, t, dtype=torch.int64)]


def test_step_tensors_are_validated():
    kwargs = dict(hidden_size=8, batch_size=1, max_tokens=4, max_position=16)
    for wire in (torch.float32, torch.bfloat16, torch.float16):  # every wire dtype is accepted as sent
        assert validate_step_tensors(_tensors(dtype=wire), **kwargs)[0].dtype == wire
    cases = [
        (_tensors()[:2], "expected 3"),
        ([torch.zeros(2, 8), *_tensors()[1:]], "rank 3"),
        (_tensors(h=9), "hidden size"),
        (_tensors(b=2), "batch size"),
        (_tensors(t=5), "do not fit"),
        (_tensors(dtype=torch.float64), "float64: send them as one of float32, bfloat16, float16"),
        ([torch.zeros(1, 2, 8, dtype=torch.int32), *_tensors()[1:]], "int32: send"),
        ([torch.full((1, 2, 8), float("nan")), *_tensors()[1:]], "NaN"),
        ([_tensors()[0], torch.tensor([[3, 1]]), _tensors()[2]], "decrease"),
        ([_tensors()[0], torch.tensor([[0, 99]]), _tensors()[2]], r"\[0, 16\)"),
        ([*_tensors()[:2], torch.tensor([[1, 2]])], "0 and 1"),
        ([_tensors()[0], torch.zeros(1, 2), _tensors()[2]], "integer"),
    ]
    for tensors, message in cases:
        with pytest.raises(ProtocolError, match=message):
            validate_step_tensors(tensors, **kwargs)


def test_route_is_shortest_and_may_enter_mid_span():
    spans = [PeerSpan("a", 0, 7, 100, 1000), PeerSpan("b", 5, 19, 100, 1000), PeerSpan("c", 19, 30, 100, 1000),
             PeerSpan("full", 0, 30, 100, 1000)]
    assert [(h.peer_id, h.start, h.end) for h in shortest_route(spans, 0, 30)] == [("full", 0, 30)]
    route = shortest_route(spans, 0, 30, banned=frozenset({"full"}))
    assert [h.peer_id for h in route] == ["a", "b", "c"]
    assert route[0].start == 0 and route[-1].end == 30
    assert all(x.end == y.start for x, y in itertools.pairwise(route))
    mid = shortest_route(spans, 7, 19, banned=frozenset({"full"}))
    assert [(h.peer_id, h.start, h.end) for h in mid] == [("b", 7, 19)]
    slow = [*spans[:3], PeerSpan("full", 0, 30, 1, 1000)]  # a slow full replica loses to three fast hops
    assert [h.peer_id for h in shortest_route(slow, 0, 30)] == ["a", "b", "c"]


def test_route_reports_the_gap_and_cache_shortage():
    spans = [PeerSpan("a", 0, 7, 100, 1000), PeerSpan("c", 19, 30, 100, 10)]
    with pytest.raises(NoRouteError, match="block 7"):
        shortest_route(spans, 0, 30)
    with pytest.raises(NoRouteError, match="is full"):
        shortest_route([PeerSpan("a", 0, 30, 100, 10)], 0, 30, min_cache_tokens=64)


def test_route_errors_say_whether_peers_are_missing_full_too_small_or_banned():
    # peers that serve the blocks but are busy: a wait, named as such, not a missing block
    busy = [PeerSpan("a", 0, 30, 100, 10, cache_tokens=1000), PeerSpan("b", 0, 30, 100, 20, cache_tokens=1000)]
    with pytest.raises(NoRouteError, match=r"every peer serving block 0 is full .*most free cache is 20") as err:
        shortest_route(busy, 0, 30, min_cache_tokens=64)
    assert not err.value.permanent
    # peers whose whole cache is smaller than the session: permanent, with the size that would fit
    small = [PeerSpan("a", 0, 30, 100, 10, cache_tokens=32)]
    with pytest.raises(NoRouteError, match=r"can never hold this session's 64 cache tokens .*32 tokens") as err:
        shortest_route(small, 0, 30, min_cache_tokens=64)
    assert err.value.permanent
    # every server of a block banned by this client
    spans = [PeerSpan("a", 0, 30, 100, 1000), PeerSpan("b", 0, 30, 100, 1000)]
    with pytest.raises(NoRouteError, match=r"every peer serving block 0 \(2 of them.*banned"):
        shortest_route(spans, 0, 30, banned=frozenset({"a", "b"}))
    # nobody serves block 12 at all
    with pytest.raises(NoRouteError, match=r"no live peer serves block 12"):
        shortest_route([PeerSpan("a", 0, 12, 100, 1000)], 0, 30)


def test_cache_budget_refuses_up_front_and_returns_everything():
    budget = CacheBudget(tokens=100, span_blocks=10)
    first = budget.reserve(batch_size=1, max_length=50, num_blocks=10)
    partial = budget.reserve(batch_size=2, max_length=50, num_blocks=5)  # half the blocks: half the cost
    assert budget.free_tokens == 0
    with pytest.raises(CacheFullError, match="max_length"):
        budget.reserve(batch_size=1, max_length=1, num_blocks=1)
    budget.release(first)
    budget.release(partial)
    assert budget.free_tokens == 100 and budget.used_block_tokens == 0


def test_block_stack_matches_transformers(model_dir, local_model):
    from swarmnode.runtime.blocks import BlockStack
    from swarmnode.runtime.checkpoint import Checkpoint

    checkpoint = Checkpoint(model_dir)
    stack = BlockStack(checkpoint, 0, 30)
    ids = torch.tensor([[1, 510, 2003, 314, 253, 1234]])
    with torch.no_grad():
        states = local_model(ids, output_hidden_states=True).hidden_states
        hidden = stack.forward(0, 29, states[0], torch.arange(6)[None])
    torch.testing.assert_close(hidden, states[29], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="outside"):
        BlockStack(checkpoint, 25, 31)


def test_bfloat16_travels_in_two_bytes_and_round_trips_exactly():
    from swarmnode.messages import deserialize_tensors, serialize_tensors

    hidden = torch.randn(2, 3, 8).to(torch.bfloat16)
    [proto] = serialize_tensors([hidden])
    assert len(proto.buffer) == hidden.numel() * 2  # not widened to float32 on the wire
    [back] = deserialize_tensors([proto])
    assert back.dtype == torch.bfloat16 and torch.equal(back, hidden)


def test_client_dtype_is_resolved_like_transformers(model_dir):
    """`from_pretrained(dtype=...)`: a torch dtype, its name, or "auto" (the checkpoint's own); anything else
    is refused before the client joins anything."""
    from swarmnode.client.errors import ClientConfigError
    from swarmnode.client.model import resolve_dtype
    from swarmnode.runtime.checkpoint import Checkpoint

    config = Checkpoint(model_dir).config
    assert resolve_dtype("auto", config) == torch.float32  # SmolLM2's config.json says float32
    assert resolve_dtype(torch.bfloat16, config) == resolve_dtype("bfloat16", config) == torch.bfloat16
    assert resolve_dtype("torch.float16", config) == torch.float16
    for bad in ("int8", torch.int8, torch.float64, "bf16"):
        with pytest.raises(ClientConfigError, match="is not one of auto, float32, bfloat16, float16"):
            resolve_dtype(bad, config)


def test_a_model_name_that_cannot_name_a_swarm_is_refused(model_dir):
    from swarmnode.runtime.checkpoint import Checkpoint, CheckpointError

    with pytest.raises(CheckpointError, match="no letter or digit"):
        Checkpoint(model_dir, model_name="!!!")
    assert model_prefix(Checkpoint(model_dir, model_name="Org/My-Model").name) == "org-my-model"
