"""Serving from behind NAT: peers that anyone can dial relay calls to nodes that nobody can dial.

- `reachability`: a starting node asks public peers to dial it back, to learn whether it is behind NAT.
- `service`: what a public peer (the bootstrap, a reachable node) offers: reservations, and forwarding of
  calls for reserved nodes over the connections those nodes opened to it.
- `keeper`: a node behind NAT holds a reservation with one relay, renews it, and moves to another relay when
  its relay goes away.
- `dialer`: how every caller (client, node, coordinator) reaches a relayed node: through its relay, named
  in the node's records.
"""

# How a node learns whether it is behind NAT (`swarmnode join --reachability`): ask the swarm (auto), assume
# others can dial it (direct), or always serve through a relay (relay).
REACHABILITY = ("auto", "direct", "relay")


def reachability_problem(reachability: str, *, has_initial_peers: bool, announce_host: str | None,
                         port: int | None) -> str | None:
    """What is wrong with serving with `--reachability REACHABILITY` beside these options (None: nothing);
    the one rule the CLI and the node both apply."""
    if reachability not in REACHABILITY:
        return f"--reachability {reachability} is not one of {', '.join(REACHABILITY)}"
    if reachability == "relay" and not has_initial_peers:
        return "--reachability relay needs --initial-peers: the node reserves a relay among them"
    if reachability == "relay" and (announce_host or port):
        return ("--reachability relay: nobody dials this node, so --announce-host and --port do not apply; leave "
                "them out, or use --reachability direct")
    return None
