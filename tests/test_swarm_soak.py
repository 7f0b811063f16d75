"""Load and churn (issue 5, checks 4 and 5) in their CI form, with real processes on 127.0.0.1 and local
`transformers` as the truth:

- the churn soak's short form (`scripts/soak_churn.py --short`): nodes are SIGKILLed, restarted and join
  while clients generate; no request may fail or differ, the churn must really have happened, and its
  report must account for it: kill attempts and skips, the failover delay of every kill that hit a request
  under way, and the windows in which some block had no live replica;
- 16 concurrent clients on a 3-node planned swarm (`scripts/bench_load.py`'s clients): every output exact,
  every node alive with its KV cache all given back; then sessions too long for all to fit at once must wait
  for room or be refused with an error that names the cache, and never hurt a node.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from swarmnode.client import ClientConfig, DistributedModelForCausalLM
from swarmnode.testing.local_swarm import peak_open_sessions
from swarmnode.testing.swarm_reader import node_info, wait_cache_free
from swarmnode.testing.workload import chat_inputs

pytestmark = pytest.mark.swarm

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
CLIENTS = 16
NEW_TOKENS = 10


def _script(name: str):
    """A benchmark script as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"swarmnode_scripts_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def tightest_block_tokens(spans: list[dict]) -> int:
    """Block-tokens per block that the swarm can hold for sessions crossing its thinnest run of blocks.

    For each run R of blocks between span boundaries: the budgets (cache_tokens x span blocks) of every span
    that meets R, over |R|. Sessions of `length` tokens at once are at most this // length.
    """
    bounds = sorted({s["start"] for s in spans} | {s["end"] for s in spans})
    best = None
    for i, a in enumerate(bounds):
        for c in bounds[i + 1:]:
            supply = sum(s["cache_tokens"] * (s["end"] - s["start"]) for s in spans if s["start"] < c and s["end"] > a)
            best = supply // (c - a) if best is None else min(best, supply // (c - a))
    return best


def servable_length(spans: list[dict]) -> int:
    """The longest session every block can take on one span: the least, over blocks, of its largest cache."""
    blocks = range(min(s["start"] for s in spans), max(s["end"] for s in spans))
    return min(max(s["cache_tokens"] for s in spans if s["start"] <= b < s["end"]) for b in blocks)


def test_churn_soak_short_form_loses_no_request(tmp_path):
    soak = _script("soak_churn")
    report = soak.run(soak.parse_args(["--short", "--log-dir", str(tmp_path / "soak")]))
    summary = {k: report[k] for k in ("requests", "completed", "failed", "mismatched", "retries", "replans",
                                      "replanned_after_end_s",
                                      "kills", "joins", "restarts", "events", "skipped")}
    assert report["requests"] > 0, summary
    assert report["failed"] == 0, f"{report['failed']} of {report['requests']} requests failed: {report['errors']}"
    assert report["mismatched"] == 0, f"outputs differ from local transformers: {summary}"
    assert report["completed"] == report["requests"], summary
    assert report["kills"] > 0, f"no node was killed: {summary}"
    assert report["restarts"] > 0, f"no killed node was restarted: {summary}"
    assert report["replans"] > 0, f"the coordinator never re-planned: {summary}"
    assert report["clients_finished"], "a client was still inside a request long after the soak ended"
    assert report["coordinator_alive"], report["processes"]
    assert report["exited_unexpectedly"] == [], report["processes"]
    assert report["leftover_processes"] == {}, "processes outlived the swarm"

    # what the churn did and cost: kill attempts, failover delays, uncovered blocks
    churn = {k: report[k] for k in ("kill_attempts", "kills", "kills_skipped", "kill_skip_fraction", "skipped",
                                    "kill_details", "failover_delays_s", "uncovered_windows", "coverage_samples")}
    assert report["kill_attempts"] >= report["kills"], churn
    assert report["kills_skipped"] == report["kill_attempts"] - report["kills"] == sum(report["skipped"].values())
    assert 0 <= report["kill_skip_fraction"] < 1, churn
    details = report["kill_details"]
    assert [d["node"] for d in details] == [node for _t, action, node in report["events"] if action == "kill"]
    for kill in details:  # every request completed: each one a kill hit failed over, or no longer needed the node
        assert len(kill["next_token_s"]) + kill["done_on_old_route"] == kill["requests_hit"], churn
        if kill["next_token_s"]:
            assert kill["failover_s"] == max(kill["next_token_s"]) >= 0, churn
        else:
            assert kill["failover_s"] is None, churn
    delays = report["failover_delays_s"]
    assert delays == [d["failover_s"] for d in details if d["failover_s"] is not None], churn
    assert report["kills_hitting_no_request"] == [d["node"] for d in details if d["failover_s"] is None], churn
    assert all(0 <= d <= report["soak_s"] for d in delays), churn
    if delays:
        assert report["failover_p50_s"] <= report["failover_p95_s"] <= report["failover_max_s"] == max(delays)
    assert report["coverage_samples"] >= 10 and report["coverage_errors"] == [], churn
    longest, total = report["uncovered_longest_s"], report["uncovered_total_s"]
    assert isinstance(longest, float) and isinstance(total, float), churn
    assert 0 <= longest <= total <= report["soak_s"], churn
    windows = report["uncovered_windows"]
    assert total == pytest.approx(sum(w[1] for w in windows), abs=0.01 * len(windows) + 0.01), churn
    assert all(0 <= kill["uncovered_s"] <= total + 0.01 for kill in details), churn
    assert report["load_s"] is not None and report["load_s"] > 0, "no node logged loading its blocks"
    assert report["uncovered_bound_s"] > report["replan_bound_s"] > 0
    assert report["aims"]["no_failed"] is True and report["aims"]["no_mismatched"] is True
    assert set(report["aims"]) == set(report["aim_thresholds"])


def test_sixteen_concurrent_clients_exact_then_sessions_beyond_the_cache(swarm_factory, model_dir, local_model,
                                                                          tokenizer):
    bench = _script("bench_load")
    prompts = chat_inputs(tokenizer, CLIENTS)
    truths = [local_model.generate(p, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)[0]
              .tolist() for p in prompts]
    swarm = swarm_factory()
    nodes = bench.start_swarm(swarm, fixed=False, cache_tokens=None)
    config = ClientConfig(trusted_coordinators=swarm.trusted_coordinators())
    with DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers,
                                                     config=config) as remote:
        bench.wait_settled(swarm, remote, nodes)
        before = {n.peer_id: node_info(remote, n.peer_id) for n in nodes}
        assert all(0 < info["free_cache_tokens"] == info["cache_tokens"] for info in before.values()), before
        full = {peer: info["cache_tokens"] for peer, info in before.items()}

        # 16 clients at once, one thread each, sharing the model: every text exact
        results = bench.concurrent_requests(remote, prompts, list(range(CLIENTS)), NEW_TOKENS)
        assert [r.error for r in results if r.error] == []
        for result in results:
            assert result.output == truths[result.prompt], f"prompt {result.prompt} differs from local transformers"
            assert result.tokens == NEW_TOKENS and len(result.gaps) == NEW_TOKENS - 1
        peaks = [peak_open_sessions(n) for n in nodes]
        assert min(peaks) >= CLIENTS // 2, f"the sessions hardly overlapped on the nodes: peaks {peaks}"
        assert wait_cache_free(remote, full, timeout=20) == full, "a node did not give all its cache back"
        assert all(n.alive() for n in nodes)

        # sessions so long that at most two fit in the swarm's cache at once. The budget is in block-tokens: a
        # session pays for every block it crosses on whichever node serves it, and a node may spend its whole
        # budget (cache_tokens x its span's blocks) on any part of its span. So for any run of blocks R, the
        # sessions at once are at most the budgets of the nodes whose spans meet R over |R| x length; the
        # tightest R (where the planned spans overlap least) bounds the swarm. Each session waits for room and
        # is then served with the exact text, or is refused with an error that names the cache.
        spans = [span for info in before.values() for span in info["spans"]]
        per_block = tightest_block_tokens(spans)
        length = per_block // 3 + 1
        at_once = per_block // length
        assert length <= servable_length(spans) and length > max(p.shape[1] for p in prompts) + NEW_TOKENS, (
            spans, length)
        smallest = min(full, key=full.get)
        small_node = next(n for n in nodes if n.peer_id == smallest)
        offset = len(small_node.log())
        with bench.SessionEvents() as events:
            tight = bench.concurrent_requests(remote, prompts, list(range(6)), NEW_TOKENS, session_length=length)
        served = [r for r in tight if r.error is None]
        refused = [r for r in tight if r.error is not None]
        for result in served:
            assert result.output == truths[result.prompt], f"prompt {result.prompt} differs from local transformers"
        for result in refused:
            assert "SessionError" in result.error and "cache" in result.error, result.error
        held_back = [r for r in tight if r.error is not None or r.cache_waits or r.session_key in events.waited]
        assert len(held_back) >= 6 - at_once, (f"{6 - len(held_back)} sessions ran at once where the swarm's "
                                                f"cache holds {at_once}: the budget was not enforced")
        assert served, [r.error for r in refused]
        assert peak_open_sessions(small_node, since=offset) <= at_once
        assert wait_cache_free(remote, full, timeout=20) == full, "a node did not give all its cache back"
    assert all(n.alive() for n in nodes), "a node died under load"
    for node in nodes:
        log = node.log()
        assert "inference session failed" not in log and "Traceback" not in log, log[-3000:]
