"""Every `join` flag is validated before anything starts, with a message that says what to do."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from swarmnode.cli import main

PEER = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWF4wEr5XtqQayPrXS8NnvDGNZqpszHir9fBj4b7KJ3i9j"


@pytest.mark.parametrize("flags,message", [
    (["--blocks", "10:5"], "empty or negative"),
    (["--blocks", "abc"], "not a block range"),
    (["--blocks", "0:10", "--leftover-mem", "lots"], "not a size"),
    (["--blocks", "0:10", "--leftover-mem", "1000T"], "more than this machine has free"),
    (["--blocks", "0:10", "--initial-peers", "not-a-maddr"], "not a multiaddr"),
    (["--blocks", "0:10", "--port", "70000"], "70000"),
    (["--blocks", "0:10", "--dtype", "int3"], "int3"),
    (["--blocks", "0:10", "--quantize", "int3"], "int3"),
    (["--blocks", "0:10", "--quantize", "int8", "--dtype", "float64"], "float64"),
    (["--blocks", "0:99", "--cache-tokens", "8"], "outside the model"),
    (["--blocks", "0:10", "--prefill-chunk", "-1"], "-1 is not in the range 0<=x<=1048576"),
    (["--blocks", "0:10", "--prefill-chunk", "lots"], "'lots' is not a valid integer"),
    (["--leftover-mem", "12X"], "not a size"),
    (["--leftover-mem", "-5G"], "not a size"),
    (["--leftover-mem", "100T"], "more than this machine has free"),
    (["--leftover-mem", "300M"], "holds no block"),
    (["--leftover-mem", "1G", "--leftover-cores", "4000"], "more than this machine has"),
    (["--leftover-mem", "1G", "--leftover-cores", "0"], "0"),
    (["--leftover-mem", "1G", "--trusted-coordinator", "not-a-key"], "neither an `ssh-rsa"),
    (["--leftover-mem", "1G", "--trusted-coordinator", "ssh-rsa AAAAbroken"], "not an OpenSSH RSA public key"),
    (["--leftover-mem", "1G", "--coordinator", "--min-replicas", "0"], "0 is not in the range 1<=x<=16"),
    (["--leftover-mem", "1G", "--coordinator", "--min-replicas", "two"], "'two' is not a valid integer"),
    (["--blocks", "0:10", "--reachability", "maybe"], "'maybe' is not one of 'auto', 'direct', 'relay'"),
    (["--blocks", "0:10", "--reachability", "relay"], "--reachability relay needs --initial-peers"),
    (["--blocks", "0:10", "--reachability", "relay", "--initial-peers", PEER, "--port", "31400"],
     "--announce-host and --port do not apply"),
    (["--blocks", "0:10", "--reachability", "relay", "--initial-peers", PEER, "--announce-host", "10.0.0.5"],
     "--announce-host and --port do not apply"),
])
def test_join_refuses_bad_flags(model_dir, flags, message):
    result = CliRunner().invoke(main, ["join", "--model", str(model_dir), *flags])
    assert result.exit_code != 0
    assert message in result.output


def test_join_needs_a_real_checkpoint(tmp_path):
    result = CliRunner().invoke(main, ["join", "--model", str(tmp_path), "--blocks", "0:1", "--initial-peers", PEER])
    assert result.exit_code != 0
    assert "config.json" in result.output


def test_join_refuses_a_quantization_the_models_layers_cannot_take(tmp_path):
    """int8 needs every linear's in_features to be a multiple of 16: an MLP of 72 columns is refused at start."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=72, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "odd")
    flags = ["--blocks", "0:2", "--initial-peers", PEER, "--leftover-mem", "1G"]
    result = CliRunner().invoke(main, ["join", "--model", str(tmp_path / "odd"), *flags, "--quantize", "int8"])
    assert result.exit_code != 0
    assert "in_features 72 is not a multiple of 16" in result.output, result.output


def test_join_refuses_blocks_whose_shard_is_missing(model_dir, tmp_path):
    """A checkpoint whose shards do not hold the requested blocks: one line naming the missing file."""
    import json
    import os

    copy = tmp_path / "partial"
    copy.mkdir()
    for item in model_dir.iterdir():
        if item.is_file():
            os.link(item, copy / item.name)
    shard = json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"]["model.layers.0.mlp.up_proj.weight"]
    (copy / shard).unlink()
    result = CliRunner().invoke(main, ["join", "--model", str(copy), "--blocks", "0:3", "--initial-peers", PEER,
                                       "--leftover-mem", "1G"])
    assert result.exit_code != 0
    assert f"lacks {shard}" in result.output and "block 0" in result.output, result.output


@pytest.mark.parametrize("value,message", [("0", "0 is not in the range 1<=x<=16"), ("17", "17 is not in the range"),
                                           ("many", "'many' is not a valid integer")])
def test_coordinate_refuses_a_bad_redundancy_floor(model_dir, value, message):
    result = CliRunner().invoke(main, ["coordinate", "--model", str(model_dir), "--initial-peers", PEER,
                                       "--min-replicas", value])
    assert result.exit_code != 0
    assert message in result.output


# --- addresses: --host, --port, --announce-host -----------------------------------------------------------
NOT_MINE = "203.0.113.7"  # TEST-NET-3: never an address of this machine

BAD_ADDRESSES = [
    (["--host", "localhost"], "is not an IPv4 address"),
    (["--host", "::1"], "is not an IPv4 address"),
    (["--host", "10.0.0.300"], "is not an IPv4 address"),
    (["--host", NOT_MINE], "is not an address of this machine"),
    (["--announce-host", "example.org"], "is not an IPv4 address"),
    (["--announce-host", "0.0.0.0"], "cannot be dialled"),
    (["--announce-host", "224.0.0.1"], "cannot be dialled"),
    (["--host", "127.0.0.1", "--announce-host", NOT_MINE], "would not reach this peer"),
    (["--port", "-1"], "-1"),
]


@pytest.mark.parametrize("flags,message", BAD_ADDRESSES)
def test_join_refuses_bad_addresses(model_dir, flags, message):
    result = CliRunner().invoke(main, ["join", "--model", str(model_dir), "--leftover-mem", "1G",
                                       "--initial-peers", PEER, *flags])
    assert result.exit_code != 0
    assert message in result.output, result.output


@pytest.mark.parametrize("flags,message", BAD_ADDRESSES)
def test_coordinate_refuses_bad_addresses(model_dir, flags, message):
    result = CliRunner().invoke(main, ["coordinate", "--model", str(model_dir), "--initial-peers", PEER, *flags])
    assert result.exit_code != 0
    assert message in result.output, result.output


@pytest.mark.parametrize("flags,message", BAD_ADDRESSES)
def test_bootstrap_refuses_bad_addresses(flags, message):
    result = CliRunner().invoke(main, ["bootstrap", *flags])
    assert result.exit_code != 0
    assert message in result.output, result.output


def test_announcing_an_address_this_machine_lacks_is_allowed_with_a_warning(model_dir):
    """Behind 1:1 NAT the address to announce is not on any interface: allowed, with a warning that says what
    must hold (the join then stops at the next check, before anything starts)."""
    result = CliRunner().invoke(main, ["join", "--model", str(model_dir), "--initial-peers", PEER,
                                       "--announce-host", NOT_MINE, "--leftover-mem", "100T"])
    assert result.exit_code != 0 and "more than this machine has free" in result.output
    assert f"--announce-host {NOT_MINE} is not an address of this machine" in result.output
    assert "pin --port" in result.output


def test_announced_addresses(monkeypatch):
    """On all interfaces a peer announces its non-loopback addresses, and loopback only to a swarm on loopback
    (or when it has nothing else); bound to one address it announces that one (hivemind's default)."""
    from swarmnode import dht

    monkeypatch.setattr(dht, "local_ipv4_addresses", lambda: ["127.0.0.1", "10.1.2.3", "192.168.5.6"])
    remote = "/ip4/10.9.9.9/tcp/31337/p2p/" + PEER.rsplit("/", 1)[1]
    assert dht.announced_hosts("0.0.0.0", None, [remote]) == ["10.1.2.3", "192.168.5.6"]
    assert dht.announced_hosts("0.0.0.0", None, []) == ["10.1.2.3", "192.168.5.6"]
    assert dht.announced_hosts("0.0.0.0", None, [PEER]) == ["10.1.2.3", "192.168.5.6", "127.0.0.1"]
    assert dht.announced_hosts("0.0.0.0", "198.51.100.1", [PEER]) == ["198.51.100.1"]
    assert dht.announced_hosts("127.0.0.1", None, [PEER]) is None
    assert dht.announced_hosts("10.1.2.3", None, [remote]) is None
    monkeypatch.setattr(dht, "local_ipv4_addresses", lambda: ["127.0.0.1"])
    assert dht.announced_hosts("0.0.0.0", None, [remote]) == ["127.0.0.1"]


def test_bootstrap_prints_a_multiaddr_per_address_then_loopback():
    from swarmnode.bootstrap.peer import printed_maddrs

    tail = "tcp/31337/p2p/" + PEER.rsplit("/", 1)[1]
    visible = [f"/ip4/10.1.2.3/{tail}", f"/ip4/192.168.5.6/{tail}"]
    assert printed_maddrs(visible, "0.0.0.0") == [*visible, f"/ip4/127.0.0.1/{tail}"]
    assert printed_maddrs([f"/ip4/127.0.0.1/{tail}"], "127.0.0.1") == [f"/ip4/127.0.0.1/{tail}"]
    assert printed_maddrs([f"/ip4/127.0.0.1/{tail}", *visible], "0.0.0.0") == [*visible, f"/ip4/127.0.0.1/{tail}"]


def test_announcing_without_a_port_picks_one():
    """`--announce-host` with no `--port`: p2pd refuses port 0 in announced addresses, so a free port is picked
    first instead of failing at start (peers on all interfaces announce the same way: tests/test_netns_swarm.py)."""
    from swarmnode.dht import start_dht

    dht = start_dht(host="127.0.0.1", announce_host="127.0.0.1")
    try:
        announced = [str(a) for a in dht.get_visible_maddrs()]
        assert len(announced) == 1 and announced[0].startswith("/ip4/127.0.0.1/tcp/")
        assert int(announced[0].split("/")[4]) > 0
    finally:
        dht.shutdown()


def test_prepare_model_makes_a_tiny_checkpoint_of_any_family_that_a_node_opens(tmp_path):
    from swarmnode.runtime.checkpoint import Checkpoint

    result = CliRunner().invoke(main, ["prepare-model", "--tiny", "gpt_oss", "--out", str(tmp_path / "tiny")])
    assert result.exit_code == 0, result.output
    checkpoint = Checkpoint(result.stdout.strip())  # stdout is the path alone; progress goes to stderr
    assert checkpoint.config.model_type == "gpt_oss" and checkpoint.num_blocks == 6
    for flags, message in ((["--tiny", "gpt_oss"], "--tiny needs --out"),
                           (["--tiny", "bloom", "--out", str(tmp_path / "x")], "'bloom' is not one of")):
        refused = CliRunner().invoke(main, ["prepare-model", *flags])
        assert refused.exit_code == 2 and message in refused.output, refused.output


@pytest.mark.parametrize(("flags", "message"), [
    (["--quantize", "int8"], "served in its own quantization (Q4_1): drop --quantize int8"),
    (["--quantize", "gguf"], "'gguf' is not one of"),
    (["--blocks", "0:31"], "outside the model's 0:30"),
])
def test_join_on_a_gguf_file_refuses_what_it_cannot_do(smollm2_gguf, flags, message):
    result = CliRunner().invoke(main, ["join", "--model", str(smollm2_gguf), "--initial-peers", PEER,
                                       "--leftover-mem", "1G", *flags])
    assert result.exit_code != 0
    assert message in result.output, result.output


def test_join_on_a_missing_or_broken_gguf_file(tmp_path):
    result = CliRunner().invoke(main, ["join", "--model", str(tmp_path / "absent.gguf"), "--blocks", "0:1",
                                       "--initial-peers", PEER])
    assert result.exit_code != 0 and "no GGUF file" in result.output, result.output
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + bytes(12))
    result = CliRunner().invoke(main, ["join", "--model", str(tmp_path / "broken.gguf"), "--blocks", "0:1",
                                       "--initial-peers", PEER])
    assert result.exit_code != 0 and "not a readable GGUF file" in result.output, result.output


def test_join_refuses_an_identity_it_cannot_sign_with(model_dir, tmp_path):
    """A node signs its records with its libp2p identity's key (readers check a record's peer id against its
    signer): a file that is not an identity, or one holding a key other than RSA, is refused at start; a path
    that does not exist yet gets a new RSA identity (tested by every swarm test's nodes)."""
    from hivemind.proto import crypto_pb2

    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"\xff\x00 not protobuf")
    ed25519 = tmp_path / "ed25519.key"
    ed25519.write_bytes(crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=bytes(64)).SerializeToString())
    for path, message in [(garbage, "not a libp2p identity file"), (ed25519, "holds a key of type Ed25519")]:
        result = CliRunner().invoke(main, ["join", "--model", str(model_dir), "--blocks", "0:2", "--initial-peers",
                                           PEER, "--identity", str(path)])
        assert result.exit_code != 0
        assert message in result.output and str(path) in result.output, result.output


@pytest.mark.parametrize("flags,message", [
    (["--prompt-lookup", "-1"], "-1 is not in the range 0<=x<=64"),
    (["--prompt-lookup", "ten"], "'ten' is not a valid integer"),
    (["--prompt-lookup", "65"], "65 is not in the range 0<=x<=64"),
    (["--speculative-passes", "0"], "0 is not in the range x>=1"),
    (["--speculative-passes", "5"], "5 passes in flight: at most 4"),
])
def test_generate_refuses_bad_flags(model_dir, flags, message):
    result = CliRunner().invoke(main, ["generate", "--model", str(model_dir), "--initial-peers", PEER, *flags, "Hi"])
    assert result.exit_code != 0
    assert message in result.output


def test_api_refuses_a_bad_prompt_lookup(model_dir):
    result = CliRunner().invoke(main, ["api", "--model", str(model_dir), "--initial-peers", PEER,
                                       "--prompt-lookup", "100"])
    assert result.exit_code != 0
    assert "100 is not in the range 0<=x<=64" in result.output
