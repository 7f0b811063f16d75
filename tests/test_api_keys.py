"""API keys of `swarmnode api` on plain data: the keys file, its reloading, per-key limits, `swarmnode api-key`.

The server itself, with real keys through the official `openai` client, is `tests/test_api_keys_swarm.py`.
"""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from swarmnode.api.keys import (
    RELOAD_CHECK_PERIOD,
    APIKey,
    KeyFileError,
    KeyRing,
    digest_of,
    key_line,
    new_key,
    parse_keys,
)
from swarmnode.api.limits import WINDOW, Limits
from swarmnode.api.schemas import APIError
from swarmnode.cli import main

ALICE = "sk-swarm-alice-0123456789abcdef"
BOB = "sk-swarm-bob-0123456789abcdef"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_keys_file_holds_keys_or_their_digests_with_limits():
    text = f"""
    # the operator's keys
    alice  {ALICE}   sessions=2 tokens_per_minute=500
    bob    sha256:{digest_of(BOB)}    # bob's key is not in the file
    """
    keys = parse_keys(text)
    assert keys[digest_of(ALICE)] == APIKey("alice", digest_of(ALICE), sessions=2, tokens_per_minute=500)
    assert keys[digest_of(BOB)] == APIKey("bob", digest_of(BOB))
    assert parse_keys("") == {}


@pytest.mark.parametrize("line, message", [
    ("alice", "expected 'NAME KEY"),
    ("al ice", "has 3 characters"),
    (f"-alice {ALICE}", "must be 1-64 letters"),
    ("alice sha256:abc", "64 lowercase hex digits"),
    (f"alice {ALICE} sessions=0", "sessions must be a whole number of at least 1"),
    (f"alice {ALICE} sessions=two", "sessions must be a whole number"),
    (f"alice {ALICE} rpm=3", "unknown option 'rpm=3'"),
    (f"alice {ALICE} sessions=1 sessions=2", "sessions is given twice"),
    (f"alice {ALICE}\nalice {BOB}", "line 3: the name 'alice' is given twice"),
    (f"alice {ALICE}\nbob sha256:{digest_of(ALICE)}", "line 3: the key of 'bob' is also the key of 'alice'"),
])
def test_a_malformed_keys_file_is_refused_with_its_line(line, message):
    with pytest.raises(KeyFileError, match=message) as caught:
        parse_keys(f"# keys\n{line}", "keys.txt")
    assert "keys.txt, line " in str(caught.value)


def test_key_lines_hold_the_digest_and_parse_back():
    key = new_key()
    assert key.startswith("sk-swarm-") and len(key) > 40 and new_key() != key
    line = key_line("ci-bot", key, sessions=1, tokens_per_minute=1000)
    assert key not in line
    assert parse_keys(line) == {digest_of(key): APIKey("ci-bot", digest_of(key), 1, 1000)}
    with pytest.raises(KeyFileError, match="key name"):
        key_line("no spaces", key)


def test_the_ring_reads_the_file_again_when_it_changes_and_keeps_its_keys_when_it_breaks(tmp_path, caplog):
    path = tmp_path / "keys.txt"
    path.write_text(f"alice {ALICE}\n")
    clock = Clock()
    ring = KeyRing(path, clock=clock)
    assert ring.lookup(ALICE).name == "alice" and ring.lookup(BOB) is None and ring.lookup("") is None

    path.write_text(f"bob {BOB} sessions=1\n")  # alice revoked, bob added
    os.utime(path, ns=(1, 2))  # a new modification time, however fast the file changed
    assert ring.lookup(ALICE).name == "alice", "read again at most once per check period"
    clock.now += RELOAD_CHECK_PERIOD
    assert ring.lookup(ALICE) is None and ring.lookup(BOB) == APIKey("bob", digest_of(BOB), sessions=1)

    path.write_text(f"bob {BOB} sessions=\n")  # a typo: the keys read before stand, the log says where
    clock.now += RELOAD_CHECK_PERIOD
    assert ring.lookup(BOB) is not None
    assert "keys.txt, line 1" in caplog.text and "keeping the 1 keys read before" in caplog.text

    path.unlink()
    clock.now += RELOAD_CHECK_PERIOD
    assert ring.lookup(BOB) is not None and "is gone" in caplog.text

    path.write_text("")  # emptied: every key revoked
    clock.now += RELOAD_CHECK_PERIOD
    assert ring.lookup(BOB) is None and len(ring) == 0


def test_a_ring_refuses_a_file_it_cannot_read_at_start(tmp_path):
    with pytest.raises(KeyFileError, match="cannot read the keys file"):
        KeyRing(tmp_path / "missing.txt")
    bad = tmp_path / "bad.txt"
    bad.write_text("alice short\n")
    with pytest.raises(KeyFileError, match=r"bad\.txt, line 1"):
        KeyRing(bad)


def test_sessions_at_once_are_capped_with_retry_after():
    limits = Limits(clock=Clock())
    key = APIKey("solo", digest_of(ALICE), sessions=1)
    first = limits.admit(key, 10)
    with pytest.raises(APIError) as caught:
        limits.admit(key, 10)
    assert caught.value.status == 429 and caught.value.headers == {"Retry-After": "1"}
    assert caught.value.body()["error"]["code"] == "rate_limit_exceeded" and "sessions=1" in caught.value.message
    first.close()
    first.close()  # idempotent: one generation ends once
    second = limits.admit(key, 10)
    assert limits.used(key) == (1, 20)
    second.close()
    other = APIKey("other", digest_of(BOB), sessions=1)
    limits.admit(other, 1)  # limits are per key


def test_tokens_per_minute_count_prompts_and_generated_tokens_over_a_sliding_minute():
    clock = Clock()
    limits = Limits(clock=clock)
    key = APIKey("meter", digest_of(ALICE), tokens_per_minute=100)
    first = limits.admit(key, 30)
    clock.now += 10
    first.spend(50)  # generated tokens count as they come
    first.close()
    assert limits.used(key) == (0, 80)
    with pytest.raises(APIError) as caught:
        limits.admit(key, 30)  # 80 + 30 > 100: the prompt's 30 tokens leave the window first, at +60 s
    assert caught.value.status == 429 and caught.value.headers["Retry-After"] == str(int(WINDOW) - 10)
    limits.admit(key, 20).close()  # 80 + 20 fits
    clock.now += WINDOW - 10  # the first prompt has left the window, the rest has not
    assert limits.used(key) == (0, 70)
    limits.admit(key, 30).close()
    with pytest.raises(APIError) as caught:
        limits.admit(key, 101)  # could never pass: not a 429 to retry
    assert caught.value.status == 400 and "more than the API key 'meter' may use in a minute" in caught.value.message


def test_api_key_command_makes_a_key_and_its_line(tmp_path):
    runner = CliRunner()
    done = runner.invoke(main, ["api-key", "alice", "--sessions", "2", "--json"])
    assert done.exit_code == 0, done.output
    made = json.loads(done.output)  # JSON only on stdout
    assert made["name"] == "alice" and made["key"] not in made["line"]
    assert parse_keys(made["line"])[digest_of(made["key"])].sessions == 2

    path = tmp_path / "keys.txt"
    for name in ("alice", "bob"):
        assert runner.invoke(main, ["api-key", name, "--append-to", str(path)]).exit_code == 0
    assert [k.name for k in parse_keys(path.read_text()).values()] == ["alice", "bob"]
    again = runner.invoke(main, ["api-key", "bob", "--append-to", str(path)])
    assert again.exit_code != 0 and "not appended" in again.output and "given twice" in again.output
    assert len(parse_keys(path.read_text())) == 2
    for bad in (["api-key", "no name"], ["api-key", "x", "--sessions", "0"],
                ["api-key", "x", "--tokens-per-minute", "-1"]):
        refused = runner.invoke(main, bad)
        assert refused.exit_code == 2, (bad, refused.output)
