"""Cost model: Helix Fig. 2's link capacities, HexGen Eqs. 4-7, T_j, the CPU knee, measured rates."""

from __future__ import annotations

import dataclasses
import math

import pytest

from swarmnode.planner import (
    COORDINATOR,
    CostModel,
    LinkSpec,
    Workload,
    cluster_from_dict,
    load_shared_cluster,
)
from swarmnode.planner.cluster.spec import SpecError
from swarmnode.planner.costs.roofline import (
    CostParams,
    RequestShape,
    activation_bytes,
    batch_time,
    block_capacity,
    compute_time,
    concurrent_requests,
    decode_step_time,
    flow_link_capacity,
    kv_bytes_per_token,
    kv_capacity,
    link_capacity,
    nic_capacity,
    node_throughput,
    params_per_block,
    pass_latency,
    per_gpu_memory,
    pp_comm_time,
    prefill_time,
    tp_comm_time,
    typical_batch,
)


def fig2_cluster():
    """Helix Fig. 2: coordinator, an A100 and two T4s; each node in its own region so every link can be
    given; 4-byte tokens and 16 KiB activations (hidden 8192 x 2 bytes)."""
    link = lambda a, b, mbps: {"a": a, "b": b, "bandwidth_mbps": mbps, "latency_ms": 1}  # noqa: E731
    return cluster_from_dict(
        {
            "name": "fig2",
            "model": {
                "name": "m",
                "num_blocks": 3,
                "hidden_size": 8192,
                "dtype_bytes": 2,
                "block_bytes": 10**9,
            },
            "nodes": [
                {
                    "id": "A100",
                    "region": "ra",
                    "device": "gpu",
                    "memory_bytes": 4 * 10**9,
                    "block_throughput": 3000,
                },
                {
                    "id": "T4-1",
                    "region": "r1",
                    "device": "gpu",
                    "memory_bytes": 4 * 10**9,
                    "block_throughput": 1000,
                },
                {
                    "id": "T4-2",
                    "region": "r2",
                    "device": "gpu",
                    "memory_bytes": 4 * 10**9,
                    "block_throughput": 1000,
                },
            ],
            "network": {
                "intra_region": {"bandwidth_mbps": 10000, "latency_ms": 1},
                "coordinator_region": "coord",
                "region_links": [
                    link("coord", "ra", 80),
                    link("coord", "r1", 40),
                    link("coord", "r2", 20),
                    link("ra", "r2", 60),
                    link("ra", "r1", 90),
                    link("r1", "r2", 50),
                ],
            },
        }
    )


def test_helix_fig2_link_capacities():
    cluster = fig2_cluster()
    assert link_capacity(cluster, COORDINATOR, "A100") == pytest.approx(2.5e6)
    assert link_capacity(cluster, COORDINATOR, "T4-1") == pytest.approx(1.25e6)
    assert link_capacity(cluster, "T4-2", COORDINATOR) == pytest.approx(625e3)
    assert round(link_capacity(cluster, "A100", "T4-2")) == 458
    assert round(link_capacity(cluster, "T4-1", "A100")) == 687
    assert activation_bytes(cluster.model) == 16384


def test_flow_capacities_count_the_prompt_per_output_token():
    """In output tokens: a request's s_in + s_out - 1 new tokens cross every link once each (the prompt
    in one pass, then one per decode pass) for s_out output tokens; the last stage returns one token id
    per pass."""
    cluster = fig2_cluster()  # no workload in the spec: Helix's 763 / 232
    shape = RequestShape(763.0, 232.0)
    assert shape.tokens_per_pass == pytest.approx((763 + 231) / 232)
    assert shape.context_per_pass == pytest.approx(231 * (763 + 116) / 232)
    assert shape.kv_tokens == 995
    per_token = shape.tokens_per_pass
    assert flow_link_capacity(cluster, "A100", "T4-2") == pytest.approx(7.5e6 / 16384 / per_token)
    assert flow_link_capacity(cluster, COORDINATOR, "A100") == pytest.approx(2.5e6 / per_token)
    assert flow_link_capacity(cluster, "T4-2", COORDINATOR) == pytest.approx(625e3)
    cost = CostModel(cluster)
    assert cost.link_capacity(COORDINATOR, "T4-2") == pytest.approx(625e3 / per_token)
    assert cost.link_capacity("T4-2", COORDINATOR) == pytest.approx(625e3)
    # with one-token prompts every pass is one transmission: Helix's Fig. 2 numbers exactly
    decode_only = CostModel(cluster, workload=Workload(1, 16))
    assert round(decode_only.link_capacity("A100", "T4-2")) == 458
    with pytest.raises(ValueError, match="avg_output_tokens >= 1"):
        RequestShape(10.0, 0.5)


def test_real_shapes_llama2_70b():
    model = load_shared_cluster("helix-single-24").model
    # GQA attention (8 of 64 heads for K/V) + SwiGLU MLP: the weights in block_bytes (norms aside)
    assert params_per_block(model) * model.dtype_bytes == pytest.approx(model.block_bytes, rel=1e-4)
    assert kv_bytes_per_token(model) == 2 * 1024 * 2
    gpt = load_shared_cluster("llamps-bloom3b-3server").model
    assert params_per_block(gpt) == 12 * gpt.hidden_size**2
    assert kv_bytes_per_token(gpt) == 2 * gpt.hidden_size * gpt.dtype_bytes


def test_hexgen_equations_by_hand():
    h, b_type = 1024, 2
    # Eq. 4, one device: memory scan s_out times plus 24 b (s_in + s_out) H^2 FLOPs, per layer
    t = compute_time(3, [1e12], [1e11], hidden_size=h, dtype_bytes=b_type, batch=2, s_in=10, s_out=5)
    expected = 3 * (12 * h * h * b_type * 5 / 1e11 + 24 * 2 * 15 * h * h / 1e12)
    assert t == pytest.approx(expected)
    # two devices split both terms; the slower device decides
    t2 = compute_time(
        3, [1e12, 2e12], [1e11, 1e11], hidden_size=h, dtype_bytes=b_type, batch=2, s_in=10, s_out=5
    )
    assert t2 == pytest.approx(expected / 2)
    # Eq. 5: nothing to communicate on one device; 4 supersteps per layer otherwise
    assert (
        tp_comm_time(3, [[0.0]], [[1e9]], hidden_size=h, dtype_bytes=b_type, batch=2, s_in=10, s_out=5) == 0
    )
    alpha = [[0, 1e-3], [1e-3, 0]]
    beta = [[1, 1e9], [1e9, 1]]
    tp = tp_comm_time(1, alpha, beta, hidden_size=h, dtype_bytes=b_type, batch=2, s_in=10, s_out=5)
    pre = 1e-3 + 2 * 10 * h * b_type / (2 * 1e9)
    dec = 1e-3 + 2 * h * b_type / (2 * 1e9)
    assert tp == pytest.approx(pre * 4 + dec * 4 * 5)
    # Eq. 6 uses the fastest link between the stages
    pp = pp_comm_time([(0.1, 1e6), (1e-3, 1e9)], hidden_size=h, dtype_bytes=b_type, batch=2, s_in=10, s_out=5)
    assert pp == pytest.approx((1e-3 + 2 * 10 * h * b_type / 1e9) + (1e-3 + 2 * h * b_type / 1e9) * 5)
    # Eq. 7 per GPU
    mem = per_gpu_memory(4, 2, hidden_size=h, dtype_bytes=b_type, batch=3, s_in=10, s_out=6)
    assert mem == pytest.approx((12 * h * h * 2 / 2 + 2 * 3 * 16 * h * 2 / 2) * 4 + 4 * 3 * 16 * h * 2)


def test_throughput_table_shape():
    cluster = load_shared_cluster("helix-single-24")
    cost = CostModel(cluster)
    for node in cluster.nodes:
        row = cost.table[node.id]
        assert len(row) == block_capacity(cluster, node) + 1
        assert row[0] == 0
        assert all(row[j] > 0 for j in range(1, len(row)))
        assert all(row[j + 1] <= row[j] for j in range(1, len(row) - 1))  # more layers, fewer tokens/s
        # where compute binds, more layers never process more layer-tokens: the KV cache left for
        # requests shrinks, and so does the typical batch (the NIC caps an A100 holding one block)
        nic = nic_capacity(cluster, node) / cost.shape.tokens_per_pass
        assert all(
            (j + 1) * row[j + 1] <= j * row[j] * (1 + 1e-9) for j in range(1, len(row) - 1) if row[j] < nic
        )
    assert cost.throughput("a100-0", 1) == pytest.approx(
        nic_capacity(cluster, cluster.node("a100-0")) / cost.shape.tokens_per_pass
    )
    assert cost.throughput("a100-0", 13) == 0  # beyond max_blocks
    # faster GPUs give more per layer
    assert cost.best_layer_rate("a100-0") > cost.best_layer_rate("l4-0") > cost.best_layer_rate("t4-0")
    upper = cost.upper_bound()
    assert upper == pytest.approx(sum(cost.best_layer_rate(n) for n in cluster.node_ids) / 80)


def _cpu_cluster(cores: int, **node_extra):
    return cluster_from_dict(
        {
            "model": {
                "name": "m",
                "num_blocks": 4,
                "hidden_size": 1024,
                "dtype_bytes": 4,
                "block_bytes": 10**8,
            },
            "nodes": [
                {
                    "id": "s",
                    "region": "lab",
                    "device": "cpu",
                    "memory_bytes": 4 * 10**9,
                    "cores": cores,
                    **node_extra,
                }
            ],
            "network": {"intra_region": {"bandwidth_mbps": 1000, "latency_ms": 0.5}},
        }
    )


def test_cpu_cores_knee():
    rates = {c: node_throughput(_cpu_cluster(c), _cpu_cluster(c).nodes[0], 2) for c in (2, 4, 8, 16, 56)}
    assert rates[2] < rates[4] < rates[8]
    assert rates[8] == pytest.approx(rates[16]) == pytest.approx(rates[56])
    lower_knee = CostParams(cpu_core_knee=4)
    c8 = _cpu_cluster(8)
    assert node_throughput(c8, c8.nodes[0], 2, lower_knee) == pytest.approx(rates[4])


def test_measured_block_throughput_and_nic_cap():
    cluster = _cpu_cluster(2, block_throughput=120.0)
    node = cluster.nodes[0]
    assert node_throughput(cluster, node, 1) == pytest.approx(120.0)
    assert node_throughput(cluster, node, 3) == pytest.approx(40.0)
    assert decode_step_time(cluster, node, 3, batch=2) == pytest.approx(2 * 3 / 120.0)
    assert prefill_time(cluster, node, 2, tokens=10) == pytest.approx(10 * 2 / 120.0)
    # a NIC of 1 Mbps carries 125000 / 4096 activations/s of 1024 x 4 bytes, and each output token of
    # Helix's average request (763 / 232) brings (763 + 231) / 232 of them
    slow = _cpu_cluster(2, block_throughput=1e6, nic_mbps=1.0)
    assert node_throughput(slow, slow.nodes[0], 1) == pytest.approx(1e6 / 8 / 4096 * 232 / 994)


def test_a_measured_prefill_rate_prices_prompts_as_prompts():
    """With both rates measured, decode steps cost 1 / block_throughput per token and block, a prompt's tokens
    1 / prefill_throughput (in a mixed batch too), and the decode throughput T_j is unchanged."""
    cluster = _cpu_cluster(2, block_throughput=120.0, prefill_throughput=2400.0)
    node = cluster.nodes[0]
    assert decode_step_time(cluster, node, 3, batch=2) == pytest.approx(2 * 3 / 120.0)
    assert prefill_time(cluster, node, 2, tokens=240) == pytest.approx(2 * 240 / 2400.0)
    decode_only = _cpu_cluster(2, block_throughput=120.0)  # a prompt token costs a decode step
    assert prefill_time(decode_only, decode_only.nodes[0], 2, tokens=240) == pytest.approx(2 * 240 / 120.0)
    cost = CostModel(cluster)
    assert cost.batch_seconds("s", 2, 240, 4) == pytest.approx(2 * (240 / 2400.0 + 4 / 120.0))
    assert node_throughput(cluster, node, 3) == pytest.approx(40.0)
    with pytest.raises(SpecError, match="prefill_throughput"):
        _cpu_cluster(2, block_throughput=120.0, prefill_throughput=-1.0)


def test_multi_gpu_node_pays_tensor_parallel_traffic():
    cluster = load_shared_cluster("helix-hetero-42")
    one = cluster.node("l4-0")
    two = cluster.node("2xl4-0")
    slow_link = CostParams(intra_node_link=LinkSpec(bandwidth_mbps=8000, latency_ms=0.01))
    ideal_link = CostParams(intra_node_link=LinkSpec(bandwidth_mbps=1e9, latency_ms=0.0))
    # two GPUs are faster than one, but not twice as fast, and slower links cost more (short requests:
    # both run the largest batch, so only the GPUs differ)
    short = Workload(64, 16)
    t1 = node_throughput(cluster, one, 4, workload=short)
    t2 = node_throughput(cluster, two, 4, workload=short)
    assert t1 < t2 < 2 * t1
    assert node_throughput(cluster, two, 4, slow_link, short) < t2
    step = decode_step_time(cluster, two, 4, batch=8, context=512)
    assert step > decode_step_time(cluster, two, 4, batch=8, context=512, params=ideal_link)
    assert math.isfinite(step)


def test_typical_batch_is_the_pipeline_share_of_the_requests_that_fit():
    """Helix §4.3/§5.2: T_j at a node's typical batch, N j / L of the N requests whose KV cache fits."""
    cluster = load_shared_cluster("helix-single-24")  # LLaMA-2 70B, Helix's 763 / 232 workload
    t4 = cluster.node("t4-0")
    shape = RequestShape.of(cluster.workload)
    free = t4.memory_bytes - (1 << 30) - 4 * cluster.model.block_bytes  # 1 GiB runtime reserve
    assert kv_capacity(cluster, t4, 4) == pytest.approx(free / kv_bytes_per_token(cluster.model))
    requests = concurrent_requests(cluster, t4, 4, shape)
    assert requests == int(free / kv_bytes_per_token(cluster.model) / (4 * 995))
    n = typical_batch(cluster, t4, 4, shape)
    # Little's law over the loop: n = N B(n) / R with R = (L / j) B(n) + the pass's network latency (to
    # the coordinator and back, 20 hops in between, 1 ms each)
    latency = pass_latency(cluster, t4, 4)
    assert latency == pytest.approx(2 * 0.001 + 19 * 0.001)
    batch = batch_time(cluster, t4, 4, n * shape.tokens_per_pass, n * shape.context_per_pass)
    assert n == pytest.approx(requests * batch / (80 / 4 * batch + latency))
    assert n < requests * 4 / 80 < CostParams().max_batch  # latency makes the batch a little smaller
    assert node_throughput(cluster, t4, 4) == pytest.approx(n / batch)
    # short requests fit by the thousand: the batch is the largest a node runs
    short = Workload(64, 16)
    assert typical_batch(cluster, t4, 4, RequestShape.of(short)) == CostParams().max_batch
    assert node_throughput(cluster, t4, 4, workload=short) > 1.5 * node_throughput(cluster, t4, 4)
    # a node whose memory holds the blocks but not one request's KV cache still serves one at a time
    # (LLaMPS counts a request's cache in the overhead)
    tight = dataclasses.replace(
        cluster,
        weight_memory_fraction=1.0,  # weights may use the memory the overhead leaves
        overhead_bytes=int(free - 4 * 995 * kv_bytes_per_token(cluster.model) / 2),
    )
    assert block_capacity(tight, t4) == 4 and kv_capacity(tight, t4, 4) < 4 * 995
    assert concurrent_requests(tight, t4, 4, shape) == 1
    assert 0 < node_throughput(tight, t4, 4) < node_throughput(cluster, t4, 4) / 10


def test_cost_model_takes_the_workload_as_a_parameter():
    cluster = load_shared_cluster("helix-geo-24")
    short = Workload(64, 16)
    given = CostModel(cluster, workload=short)
    in_spec = CostModel(dataclasses.replace(cluster, workload=short))
    assert given.table == in_spec.table
    assert given.link_capacity("1-a100-0", "2-l4-0") == in_spec.link_capacity("1-a100-0", "2-l4-0")
    default = CostModel(cluster)
    assert default.workload == cluster.workload and default.table != given.table
    # the 100 Mbps link between regions: 763 activations/s, 64 + 15 of them per 16 output tokens
    assert given.link_capacity("1-a100-0", "2-l4-0") == pytest.approx(100e6 / 8 / 16384 * 16 / 79)
