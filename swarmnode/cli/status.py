"""`swarmnode status`: the swarm as the DHT sees it: placement, nodes, replicas per block, and reports of
peers whose outputs verifying clients found diverging (`swarmnode.client.verify`). The JSON shape
(`--json`) is `swarm_state.state_dict`'s, the one the API server's dashboard reads too."""

from __future__ import annotations

import json

import click

from swarmnode.cli.options import (
    admission_options,
    initial_peers_option,
    load_admission,
    model_options,
    validate_maddrs,
)
from swarmnode.naming import short_id


def _report_line(report: dict) -> str:
    blocks = ", ".join(f"{a}:{b}" for a, b in report["blocks"])
    clients = "client" if report["reporters"] == 1 else "clients"
    return (f"  ! reported by {report['reporters']} {clients}: {'; '.join(report['reasons'])} on blocks {blocks} "
            f"(difference {report['max_diff']:.3g} > tolerance {report['tolerance']:.3g})")


def served_as(node: dict) -> str:
    """What a node computes in: its dtype, and its weight quantization when it has one (`bfloat16+int8`)."""
    from swarmnode.records import served_kind

    return served_kind(node["dtype"], node.get("quantization", "none"))


def _blocks_text(blocks: list[int]) -> str:
    """Block numbers as ranges: [1, 2, 3, 7] -> "1-3, 7"."""
    spans: list[list[int]] = []
    for b in blocks:
        if spans and spans[-1][1] == b - 1:
            spans[-1][1] = b
        else:
            spans.append([b, b])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _relay_text(node: dict) -> str:
    """A node's phase when it serves one only ("[prefill] "), and how a node behind NAT is reached
    ("[relayed via ID] ", "[relayed, no relay yet] "); "" for the rest."""
    phase = f"[{node['phase']}] " if node.get("phase", "both") != "both" else ""
    if not node.get("relayed"):
        return phase
    return phase + (f"[relayed via {short_id(node['relay'])}] " if node.get("relay") else "[relayed, no relay yet] ")


def status_text(data: dict) -> str:
    """What `swarmnode status` prints for a `state_dict` (`--json` prints the dict itself)."""
    lines = [f"model {data['model'] or '?'} (DHT prefix {data['prefix']}, {data['num_blocks']} blocks)"]
    placement = data["placement"]
    if placement is None:
        lines.append("placement: none yet (nodes wait for a coordinator; manual nodes serve their --blocks)")
    else:
        lines.append(f"placement v{placement['version']} (term {placement['term']}, {placement['algorithm']}, "
                     f"by {short_id(placement['coordinator'])}, {placement['throughput']:.0f} tok/s planned, "
                     f"{placement['moved_blocks']} blocks moved)")
        lines.append(f"  why: {placement['reason']}")
        if placement.get("phases"):
            lines.append("  phases (HexGen-2): " + ", ".join(
                f"{short_id(p)}={phase}" for p, phase in sorted(placement["phases"].items(), key=lambda i: i[1])))
        for sender, targets in sorted(placement.get("kv_links", {}).items()):
            lines.append(f"  KV cache {short_id(sender)} -> " + ", ".join(
                f"{short_id(d)} ({rate:.2g} req/s)" for d, rate in sorted(targets.items())))
    for lease in data["coordinators"]:
        lines.append(f"coordinator {short_id(lease['holder'])}: term {lease['term']}, lease expires in "
                     f"{lease['expires_in']:.0f} s")
    lines.append(f"{'node':<8} {'state':<9} {'dtype':<14} {'offer':>9} {'max':>4} {'tok/s/blk':>9} {'assigned':>9} "
                 f"{'serving':>14} {'links':>5}  note")
    from swarmnode.sizes import format_size

    for peer, node in data["nodes"].items():
        serving = ",".join(f"{a}:{b}" for a, b in node["serving"]) or "-"
        assigned = f"{node['assigned'][0]}:{node['assigned'][1]}" if node["assigned"] else "-"
        state = node["state"] + (f" {100 * node['progress']:.0f}%" if node["state"] == "loading" else "")
        lines.append(f"{short_id(peer):<8} {state:<9} {served_as(node):<14} {format_size(node['memory_bytes']):>9} "
                     f"{node['max_blocks']:>4} "
                     f"{node['block_throughput']:>9.0f} {assigned:>9} {serving:>14} {len(node['links']):>5}  "
                     f"{_relay_text(node)}{node['note']}")
        if peer in data["reports"]:
            lines.append(_report_line(data["reports"][peer]))
    for peer, report in data["reports"].items():
        if peer not in data["nodes"]:
            lines.append(f"{short_id(peer):<8} (no node record)")
            lines.append(_report_line(report))
    replicas = data["replicas"]
    lines.append("replicas per block: " + " ".join(str(n) for n in replicas))
    if data["uncovered_blocks"]:
        lines.append(f"UNCOVERED blocks: {data['uncovered_blocks']}")
    if placement is not None:
        floor = data["min_replicas"]
        if data["single_points"]:
            spans = ", ".join(f"{a}-{b - 1}" for a, b in data["single_points"])
            lines.append(f"SINGLE POINTS OF FAILURE: blocks {spans} are planned on fewer than {floor} nodes "
                         f"(the offers cannot hold more copies; a node lost there is a gap until re-planned)")
        elif floor > 1:
            lines.append(f"redundancy: every block planned on at least {floor} nodes")
        if data["under_replicated_blocks"]:
            lines.append(f"below {floor} live replicas now: blocks {_blocks_text(data['under_replicated_blocks'])}")
        for peer, why in data["unused"].items():
            lines.append(f"unused {short_id(peer)}: {why}")
    for item in data["rejected"]:
        lines.append(f"ignored: {item['why']}")
    return "\n".join(lines)


@click.command("status")
@model_options("its name and number of blocks; no weights are read")
@initial_peers_option(required=True)
@click.option("--json", "as_json", is_flag=True, default=False, help="Print one JSON object.")
@click.option("--trusted-coordinator", "trusted", multiple=True, metavar="KEY|FILE",
              help="Coordinator keys whose placements count (default: this machine's swarm key).")
@click.option("--dht-prefix", default=None, help="DHT prefix of the model (default: from the model's name).")
@admission_options()
def command(model, model_name, initial_peers, as_json, trusted, dht_prefix, invitation, owner_key, identity_path):
    """Print the swarm's placement, every node's offer, measurements and ranges, and block replicas."""
    import asyncio

    from swarmnode.identity import KeyFileError, load_trusted_keys
    from swarmnode.records import model_prefix
    from swarmnode.runtime.checkpoint import CheckpointError
    from swarmnode.runtime.sources import open_checkpoint

    peers = validate_maddrs(initial_peers)
    try:
        checkpoint = open_checkpoint(model, model_name=model_name)
        trusted_keys = load_trusted_keys(list(trusted), create=False)
    except (CheckpointError, KeyFileError) as exc:
        raise click.ClickException(str(exc)) from exc
    prefix = dht_prefix or model_prefix(checkpoint.name)

    from swarmnode.dht import start_dht
    from swarmnode.swarm_state import read_state, state_dict

    admission = load_admission(None, invitation, identity_path, owner_key)
    dht = start_dht(peers, client_mode=True, admission=admission,
                    key=admission.identity.key if admission is not None else None)

    async def read():
        members = None
        if admission is not None:  # a private swarm: records of peers it does not admit are listed as ignored
            from swarmnode.membership import Membership

            members = Membership(dht, admission, admission.identity.key)
            await members.refresh()
        return await read_state(dht, prefix, checkpoint.num_blocks, trusted_keys, members)

    try:
        state = asyncio.run(read())
    finally:
        dht.shutdown()
    data = state_dict(state, checkpoint.num_blocks, prefix, model=checkpoint.name)
    click.echo(json.dumps(data) if as_json else status_text(data))
