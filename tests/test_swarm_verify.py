"""Wrong answers are caught: a verifying client bans and reports a node that corrupts its outputs, and its
greedy text still equals local `transformers`; the fault flag is refused outside tests; a peer whose KV
cache is full is waited for, not banned.

The swarm: three nodes serving all 30 blocks, one of them started with `--inject-fault corrupt-outputs`
(`swarmnode.testing.faults`); honest-b has a KV cache for one short session only, for the cache-full test
(verification needs no cache on the verifying peer: `forward` is stateless). Routes are steered by
presetting the client's measured round trips, so the faulty node is on the route (or is the first
verifier) where a test needs it.
"""

from __future__ import annotations

import functools
import math
import os
import random
import subprocess
import sys
import threading
import time

import pytest
import torch
from click.testing import CliRunner

from swarmnode.cli import main
from swarmnode.client import ClientConfig, DistributedModelForCausalLM, SessionError
from swarmnode.client.verify import DEFAULT_TOLERANCE, Outcome, judge, max_difference, should_check
from swarmnode.naming import short_id
from swarmnode.records import ReportRecord, report_subkey, reported_peer
from swarmnode.testing.faults import (
    ALLOW_ENV,
    FaultError,
    check_allowed,
    make_filter,
    parse_fault,
    split_fault,
)
from swarmnode.testing.faults import main as fault_main
from swarmnode.testing.local_swarm import LocalSwarm

NEW_TOKENS = 16
SMALL_CACHE = 64  # tokens of honest-b's KV cache: one chat session of the test fits, two do not
PEER = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWF4wEr5XtqQayPrXS8NnvDGNZqpszHir9fBj4b7KJ3i9j"


# --- the decision logic, on plain tensors ---------------------------------------------------------------
def _hidden(seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(seed)) * scale


def test_judge_accepts_two_agreeing_opinions_and_blames_the_odd_one():
    truth = _hidden(0)
    noisy = truth + 1e-6
    wrong = truth.clone()
    wrong[..., :4] += 8.0
    assert judge([truth, noisy], DEFAULT_TOLERANCE).wrong == ()
    checked_wrong = judge([wrong, truth, noisy], DEFAULT_TOLERANCE)
    assert checked_wrong.accepted == 1 and checked_wrong.wrong == (0,)
    assert checked_wrong.differences[0] > 100 * DEFAULT_TOLERANCE
    verifier_wrong = judge([truth, wrong, noisy], DEFAULT_TOLERANCE)
    assert verifier_wrong.accepted == 0 and verifier_wrong.wrong == (1,)


def test_judge_does_not_decide_without_an_independent_second():
    truth = _hidden(0)
    other = _hidden(1)
    assert judge([truth, other], DEFAULT_TOLERANCE).accepted is None  # two replicas that disagree
    assert judge([truth, other, _hidden(2)], DEFAULT_TOLERANCE).accepted is None  # no two agree
    tie = judge([truth, truth + 1e-7, other, other + 1e-7], DEFAULT_TOLERANCE)  # two groups of two
    assert tie.accepted is None and tie.wrong == ()


def test_difference_is_relative_to_each_tokens_scale():
    small = _hidden(3)
    large = _hidden(3)
    large[0, 0, 0] = 25_000.0  # a token with a huge element, as in the middle blocks of SmolLM2
    off_by = large.clone()
    off_by[0, 0, 1] += 0.05  # rounding-sized next to 25,000
    assert max_difference(large, off_by) < DEFAULT_TOLERANCE
    shifted = small.clone()
    shifted[0, 3, 1] += 0.05  # the same absolute change on an ordinary token is a real difference
    assert max_difference(small, shifted) > 10 * DEFAULT_TOLERANCE
    assert max_difference(small, small[:, :3]) == math.inf
    assert max_difference(small, shifted) == max_difference(shifted, small)


def test_sampling_checks_first_steps_always_and_a_reproducible_share_of_others():
    assert should_check(random.Random(0), 0.25, first=True)
    assert not should_check(random.Random(0), 0.0, first=True)
    rng_a, rng_b = random.Random(11), random.Random(11)
    pattern_a = [should_check(rng_a, 0.25, first=False) for _ in range(4000)]
    pattern_b = [should_check(rng_b, 0.25, first=False) for _ in range(4000)]
    assert pattern_a == pattern_b
    assert 0.22 < sum(pattern_a) / len(pattern_a) < 0.28
    assert pattern_a != [should_check(rng_a, 0.25, first=False) for _ in range(4000)]  # not a fixed pattern


@pytest.mark.parametrize("settings,message", [
    (dict(verify=1.5), "between 0 and 1"),
    (dict(verify=-0.1), "between 0 and 1"),
    (dict(verify="often"), "finite number"),
    (dict(verify=float("nan")), "finite number"),
    (dict(verify=0.5, verify_tolerance=0.0), "above 0"),
    (dict(verify=0.5, verify_seed=1.5), "integer"),
    (dict(peer_silence=0), "above 0"),
    (dict(keepalive_period=float("inf")), "above 0"),
    (dict(keepalive_period="1"), "above 0"),
    (dict(keepalive_period=5.0, peer_silence=4.0), "shorter than peer_silence"),
])
def test_client_config_refuses_bad_verify_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        ClientConfig(**settings)


# --- the fault flag ---------------------------------------------------------------------------------------
def test_faults_parse_corrupt_and_are_refused_outside_tests():
    assert parse_fault("corrupt-after:3").after == 3
    for bad, message in (("flip-bits", "unknown fault"), ("corrupt-after:x", "whole number")):
        with pytest.raises(FaultError, match=message):
            parse_fault(bad)
    with pytest.raises(FaultError, match=ALLOW_ENV):
        check_allowed({})
    assert make_filter(None, {}) is None
    output = _hidden(4)
    kept = output.clone()
    corrupt = make_filter("corrupt-after:2", {ALLOW_ENV: "1"})
    assert torch.equal(corrupt(output), kept) and torch.equal(corrupt(output), kept)
    third, fourth = corrupt(output), corrupt(output)
    assert torch.equal(third, fourth) and max_difference(third, kept) > 100 * DEFAULT_TOLERANCE
    assert torch.equal(output, kept)  # the input is never changed in place


def test_a_fault_is_refused_without_the_test_environment_and_the_product_has_no_fault_option(model_dir):
    env = {k: v for k, v in os.environ.items() if k != ALLOW_ENV}
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "swarmnode.testing.faults", "--inject-fault", "corrupt-outputs", "join", "--model",
         str(model_dir), "--blocks", "0:30", "--initial-peers", PEER],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert result.returncode == 2
    assert f"unless the environment sets {ALLOW_ENV}=1" in result.stderr
    assert time.monotonic() - began < 60  # refused before loading anything
    # `swarmnode join` itself knows no fault: the product cannot be started with one by a stray flag
    refused = CliRunner().invoke(main, ["join", "--model", str(model_dir), "--blocks", "0:30", "--initial-peers",
                                        PEER, "--inject-fault", "corrupt-outputs"])
    assert refused.exit_code == 2 and "No such option '--inject-fault'" in refused.output
    assert "inject-fault" not in CliRunner().invoke(main, ["join", "--help"]).output


def test_the_fault_entry_point_refuses_an_unknown_or_missing_fault(monkeypatch, capsys):
    monkeypatch.setenv(ALLOW_ENV, "1")
    for argv, message in ((["--inject-fault", "flip-bits", "join"], "unknown fault 'flip-bits'"),
                          (["--inject-fault=corrupt-after:x", "join"], "whole number"),
                          (["join", "--inject-fault"], "needs a fault name"),
                          (["join", "--blocks", "0:30"], "no fault named")):
        with pytest.raises(SystemExit) as exited:
            fault_main(argv)
        assert exited.value.code == 2
        assert message in capsys.readouterr().err, argv
    assert split_fault(["join", "--inject-fault", "corrupt-outputs", "--blocks", "0:1"]) == \
        ("corrupt-outputs", ["join", "--blocks", "0:1"])


# --- reports: keys and what `status` prints ---------------------------------------------------------------
def test_report_subkey_names_the_accused_and_status_prints_reports():
    from swarmnode.cli.status import status_text
    from swarmnode.swarm_state import SignedReport, SwarmState, state_dict

    accused = "12D3KooWF4wEr5XtqQayPrXS8NnvDGNZqpszHir9fBj4b7KJ3i9j"
    assert reported_peer(report_subkey(b"[owner:ssh-rsa AAAA]", accused)) == accused
    assert reported_peer(b"[owner:ssh-rsa AAAA]") is None
    report = ReportRecord(peer_id=accused, start=0, end=30, max_diff=0.14, tolerance=1e-3, created=100.0)
    with pytest.raises(ValueError):
        ReportRecord(peer_id=accused, start=5, end=5, max_diff=0.1, tolerance=1e-3, created=1.0)
    state = SwarmState({}, {}, None, [], [], 100.0,
                       {accused: [SignedReport(report, "ssh-rsa A", 3700.0), SignedReport(report, "ssh-rsa B", 3700.0)]})
    data = state_dict(state, 30, "smollm2")
    assert data["reports"][accused]["reporters"] == 2
    assert "reported by 2 clients: outputs diverged on blocks 0:30" in status_text(data)


# --- a real swarm with a faulty node ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def swarm(model_dir, tmp_path_factory):
    with LocalSwarm(model_dir, log_dir=tmp_path_factory.mktemp("swarm-verify"), env={ALLOW_ENV: "1"}) as swarm:
        swarm.start_bootstrap()
        swarm.nodes = {
            "honest-a": swarm.start_node(0, 30, name="honest-a", wait=False),
            "honest-b": swarm.start_node(0, 30, name="honest-b", wait=False, extra=["--cache-tokens", str(SMALL_CACHE)]),
            "faulty": swarm.start_node(0, 30, name="faulty", wait=False, extra=["--inject-fault", "corrupt-outputs"]),
        }
        for node in swarm.nodes.values():
            swarm.wait_serving(node)
        assert "FAULT INJECTION" in swarm.nodes["faulty"].log()
        yield swarm


@pytest.fixture(scope="module")
def truth(local_model, chat_prompts):
    """Local `transformers`' greedy continuation of chat prompt i by n tokens (computed once)."""

    @functools.cache
    def continuation(i: int, tokens: int) -> torch.Tensor:
        return local_model.generate(chat_prompts[i], max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)

    return continuation


def _peer(swarm, name: str) -> str:
    return swarm.nodes[name].peer_id


def _client(swarm, model_dir, *, rtts: dict[str, float] | None = None, **settings):
    """A client whose measured round trips are preset, so that routes are steered: lowest first."""
    remote = DistributedModelForCausalLM.from_pretrained(model_dir, initial_peers=swarm.initial_peers, **settings)
    remote.swarm.rtts.update({_peer(swarm, name): rtt for name, rtt in (rtts or {}).items()})
    return remote


def _generate(remote, input_ids, tokens: int = NEW_TOKENS):
    """Greedy text, the session, and the peers its route ended on."""
    with remote.inference_session(max_length=input_ids.shape[1] + tokens) as session:
        output = remote.generate(input_ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        peers = {h.hop.peer_id for h in session.hops}
    return output, session, peers


@pytest.mark.swarm  # starts real peer processes (the module's `swarm` fixture)
def test_the_fault_really_corrupts_the_text(swarm, model_dir, truth, chat_prompts):
    """Control: without verification, a client that can only use the faulty node gets the wrong text."""
    others = frozenset(_peer(swarm, n) for n in ("honest-a", "honest-b"))
    with _client(swarm, model_dir, exclude_peers=others) as remote:
        output, session, peers = _generate(remote, chat_prompts[0])
        assert session.verifier is None and peers == {_peer(swarm, "faulty")}
    assert not torch.equal(output, truth(0, NEW_TOKENS))


@pytest.mark.swarm  # starts real peer processes (the module's `swarm` fixture)
def test_verifying_client_bans_and_reports_the_faulty_peer_and_generates_exactly(swarm, model_dir, truth,
                                                                                  chat_prompts):
    faulty, honest = _peer(swarm, "faulty"), {_peer(swarm, "honest-a"), _peer(swarm, "honest-b")}
    rtts = {"faulty": 0.001, "honest-a": 0.05, "honest-b": 0.06}  # the route starts on the faulty node
    with _client(swarm, model_dir, rtts=rtts, verify=0.25, verify_seed=5) as remote:
        output, session, peers = _generate(remote, chat_prompts[0])
        results = session.verifier.results
        assert results[0].hop.peer_id == faulty and results[0].outcome == Outcome.WRONG
        assert results[0].blamed == [faulty] and results[0].max_diff > 10 * DEFAULT_TOLERANCE
        assert all(r.outcome == Outcome.AGREED and not r.blamed for r in results[1:])
        assert 2 < len(results) < NEW_TOKENS  # the prefill of each hop, then a sampled share of the steps
        assert session.verifier.agreeing_diff < DEFAULT_TOLERANCE / 10  # honest replicas: far inside the margin
        assert peers <= honest and session.retries == 1
        assert faulty in remote.swarm.banned() and set(remote.swarm.diverged) == {faulty}
        assert remote.swarm.reports_stored == 1
        later = remote.swarm.loop.run(remote.swarm.route(0, 30), 30)  # later sessions avoid it too
        assert {hop.peer_id for hop in later} <= honest
    assert torch.equal(output, truth(0, NEW_TOKENS))

    status = swarm.status()
    assert set(status["reports"]) == {faulty}  # the honest peers are not reported
    report = status["reports"][faulty]
    assert report["reporters"] == 1 and report["blocks"] == [[0, 30]]
    assert report["max_diff"] > 10 * report["tolerance"] and report["tolerance"] == DEFAULT_TOLERANCE
    assert set(report["items"][0]["witnesses"]) == honest


@pytest.mark.swarm  # starts real peer processes (the module's `swarm` fixture)
def test_a_faulty_verifier_is_outvoted_and_banned(swarm, model_dir, truth, chat_prompts):
    """The route starts on an honest node and the faulty one is asked first to verify it: the third opinion
    sides with the honest node, whose output is kept; the faulty verifier is banned."""
    faulty, honest_a, honest_b = (_peer(swarm, n) for n in ("faulty", "honest-a", "honest-b"))
    rtts = {"honest-a": 0.001, "faulty": 0.01, "honest-b": 0.05}
    with _client(swarm, model_dir, rtts=rtts, verify=0.25, verify_seed=5) as remote:
        output, session, _ = _generate(remote, chat_prompts[1], tokens=4)
        first = session.verifier.results[0]
        assert first.hop.peer_id == honest_a
        assert first.outcome == Outcome.AGREED and first.blamed == [faulty]
        assert [o[0] for o in first.opinions] == [honest_a, faulty, honest_b]
        assert session.retries == 0 and faulty in remote.swarm.banned()
    assert torch.equal(output, truth(1, 4))


@pytest.mark.swarm  # starts real peer processes (the module's `swarm` fixture)
def test_two_disagreeing_replicas_without_a_third_stop_the_session(swarm, model_dir, chat_prompts):
    """With only the faulty node and one honest one, nothing says which is right (the faulty node recomputes
    its own answer consistently): the step fails, naming both, and no one is banned or reported."""
    faulty, honest = _peer(swarm, "faulty"), _peer(swarm, "honest-a")
    excluded = frozenset({_peer(swarm, "honest-b")})
    with _client(swarm, model_dir, rtts={"faulty": 0.001, "honest-a": 0.05}, exclude_peers=excluded,
                 verify=0.25) as remote:
        with pytest.raises(SessionError, match="no third replica can say which is right") as failure:
            _generate(remote, chat_prompts[0], tokens=2)
        assert short_id(faulty) in str(failure.value) and short_id(honest) in str(failure.value)
        assert not remote.swarm.diverged and remote.swarm.reports_stored == 0
        assert remote.swarm.banned() == excluded


@pytest.mark.swarm  # starts real peer processes (the module's `swarm` fixture)
def test_a_peer_with_a_full_cache_is_waited_for_not_banned(swarm, model_dir, truth, chat_prompts):
    """Two sessions that each fill honest-b's KV cache: the second is refused while the first runs, waits
    without banning the peer, and generates exactly once the first closes."""
    small = _peer(swarm, "honest-b")
    others = frozenset(_peer(swarm, n) for n in ("honest-a", "faulty"))
    tokens = 8
    assert chat_prompts[2].shape[1] + tokens <= SMALL_CACHE
    with _client(swarm, model_dir, exclude_peers=others, route_wait=60.0) as remote:
        results = {}

        def second():
            with remote.inference_session(max_length=SMALL_CACHE) as session:
                results["session"] = session
                results["output"] = remote.generate(chat_prompts[2], max_new_tokens=tokens, min_new_tokens=tokens,
                                                    do_sample=False)

        with remote.inference_session(max_length=SMALL_CACHE) as first:
            remote.generate(chat_prompts[2], max_new_tokens=2, do_sample=False)  # holds the whole cache
            assert [h.hop.peer_id for h in first.hops] == [small]
            thread = threading.Thread(target=second)
            thread.start()
            swarm.wait_until(lambda: results.get("session") and results["session"].cache_waits, 60,
                             "refusal of the second session for a full cache")
            assert "output" not in results  # waiting for room
        thread.join(120)
        session = results["session"]
        assert session.cache_waits >= 1 and session.retries == 0
        assert small not in remote.swarm.banned()
    assert torch.equal(results["output"], truth(2, tokens))
