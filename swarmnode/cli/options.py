"""Click parameter types shared by commands: validated at the edge, with messages that say what to do."""

from __future__ import annotations

import click

from swarmnode.sizes import parse_size


class SizeType(click.ParamType):
    name = "SIZE"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class SpanType(click.ParamType):
    """`A:B`, a half-open range of blocks."""

    name = "A:B"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            start_text, end_text = str(value).split(":")
            start, end = int(start_text), int(end_text)
        except ValueError:
            self.fail(f"{value!r} is not a block range: write A:B, e.g. 0:10", param, ctx)
        if start < 0 or end <= start:
            self.fail(f"{value!r} is empty or negative: write A:B with 0 <= A < B", param, ctx)
        return start, end


SIZE = SizeType()
SPAN = SpanType()


def initial_peers_option(required: bool = True):
    return click.option(
        "--initial-peers", multiple=True, required=required, metavar="MADDR",
        help="Multiaddr of a peer already in the swarm (printed by `swarmnode bootstrap`); repeatable.",
    )


def validate_maddrs(maddrs) -> list[str]:
    from hivemind.utils.multiaddr import Multiaddr

    result = []
    for text in maddrs:
        try:
            Multiaddr(text)
        except ValueError as exc:  # the multiaddr parser's errors (StringParseError) are ValueErrors
            raise click.BadParameter(
                f"{text!r} is not a multiaddr ({exc}); it looks like /ip4/127.0.0.1/tcp/31337/p2p/Qm...",
                param_hint="--initial-peers",
            ) from None
        if "/p2p/" not in text:
            raise click.BadParameter(f"{text!r} has no /p2p/<peer id> part", param_hint="--initial-peers")
        result.append(text)
    return result


def model_options(what: str):
    """`--model` (a checkpoint folder or a Hugging Face Hub name) and `--model-name` for a command;
    `what` says what the command reads from the model."""

    def decorate(command):
        command = click.option(
            "--model-name", default=None, metavar="ORG/NAME",
            help="The model's name in the swarm (default: the Hub name, else the name the folder's config "
                 "declares, else the folder's name; for a GGUF file, its name without .gguf). Peers with the "
                 "same name meet; it sets the DHT prefix.",
        )(command)
        return click.option(
            "--model", required=True, metavar="DIR|ORG/NAME|FILE.gguf",
            help=f"A checkpoint folder, a Hugging Face Hub name (fetched into the Hugging Face cache; honours "
                 f"HF_HUB_OFFLINE, HF_HOME, HF_ENDPOINT), or a GGUF file (a path, or org/name:FILE.gguf on the "
                 f"Hub), served as it is stored: {what}.",
        )(command)

    return decorate


def open_checkpoint(model: str, model_name: str | None = None):
    """The command's checkpoint; a source that is neither a checkpoint folder nor a reachable Hub name is a
    one-line usage error."""
    from swarmnode.runtime.checkpoint import CheckpointError
    from swarmnode.runtime.sources import open_checkpoint

    try:
        return open_checkpoint(model, model_name=model_name)
    except CheckpointError as exc:
        raise click.ClickException(str(exc)) from None


class IPv4Type(click.ParamType):
    """An IPv4 address written as digits (`10.0.0.5`): peers announce `/ip4/` multiaddrs, so names and IPv6
    are refused here rather than deep inside the P2P daemon."""

    name = "IPV4"

    def convert(self, value, param, ctx):
        import ipaddress

        try:
            return str(ipaddress.IPv4Address(str(value).strip()))
        except ValueError:
            self.fail(f"{value!r} is not an IPv4 address: write four numbers, e.g. 10.0.0.5 (host names and IPv6 "
                      f"are not supported)", param, ctx)


IPV4 = IPv4Type()


def address_options(listen_help: str = "Address to listen on", default_port: int = 0):
    """`--host`, `--port` and `--announce-host` of a command whose peer other machines dial."""

    def decorate(command):
        command = click.option(
            "--announce-host", default=None, type=IPV4, metavar="IPV4",
            help="The one address other peers should dial, when it is not one this machine sees on its "
                 "interfaces (behind 1:1 NAT or a port forward: pin --port too). Default: this machine's "
                 "non-loopback addresses.",
        )(command)
        command = click.option(
            "--port", default=default_port, type=click.IntRange(0, 65535), show_default=True,
            help="TCP port to listen on (0: a free port). Open it to the other machines of the swarm.",
        )(command)
        return click.option(
            "--host", default="0.0.0.0", show_default=True, type=IPV4, metavar="IPV4",
            help=f"{listen_help}: an address of this machine, or 0.0.0.0 for all its interfaces (then it "
                 f"announces its non-loopback addresses, and loopback only to a swarm on loopback).",
        )(command)

    return decorate


def check_addresses(host: str, announce_host: str | None, port: int) -> None:
    """Refuse a `--host` this machine does not have and an `--announce-host` no peer could use; warn about an
    `--announce-host` that is not on this machine's interfaces (fine behind 1:1 NAT or a port forward, which
    this machine cannot check)."""
    import ipaddress

    from swarmnode.dht import ALL_INTERFACES, local_ipv4_addresses

    mine = local_ipv4_addresses()
    listed = ", ".join(mine) or "none"
    if host != ALL_INTERFACES and host not in mine:
        raise click.BadParameter(f"{host} is not an address of this machine (it has {listed}); pass one of "
                                 f"those, or 0.0.0.0 for all interfaces", param_hint="--host")
    if announce_host is None:
        return
    address = ipaddress.IPv4Address(announce_host)
    if address.is_unspecified or address.is_multicast or address == ipaddress.IPv4Address("255.255.255.255"):
        raise click.BadParameter(f"{announce_host} cannot be dialled: announce an address of this machine (it "
                                 f"has {listed}) or the public address that forwards to it",
                                 param_hint="--announce-host")
    bound = host != ALL_INTERFACES and announce_host != host
    if bound and (announce_host in mine or address.is_loopback or ipaddress.IPv4Address(host).is_loopback):
        raise click.BadParameter(f"{announce_host} would not reach this peer: it listens only on {host} (--host); "
                                 f"drop --host to listen on all interfaces", param_hint="--announce-host")
    if announce_host not in mine and not address.is_loopback:
        pin = "" if port else "; pin --port so that the forwarded port is known"
        click.echo(f"warning: --announce-host {announce_host} is not an address of this machine ({listed}): peers "
                   f"will dial it, so it must forward to this machine (1:1 NAT or a port forward){pin}", err=True)


def admission_options(identity: bool = True):
    """`--invitation` and `--owner-key` (and `--identity` where the command has none of its own) of a command
    whose peer joins a private swarm (`swarmnode.admission`); both left out: a public swarm."""

    def decorate(command):
        if identity:
            command = click.option(
                "--identity", "identity_path", default=None, type=click.Path(dir_okay=False),
                help="This peer's identity file (its key and peer id; `swarmnode identity FILE` makes one): the "
                     "one its --invitation was issued for.",
            )(command)
        command = click.option(
            "--owner-key", default=None, type=click.Path(dir_okay=False),
            help="The private swarm's owner key (PEM): its holder is admitted in every role.",
        )(command)
        return click.option(
            "--invitation", default=None, metavar="TEXT|FILE",
            help="This peer's invitation to a private swarm (`swarmnode invite` prints it), or a file holding it; "
                 "needs --identity, the identity it was issued for.",
        )(command)

    return decorate


def load_admission(role, invitation: str | None, identity_path: str | None, owner_key: str | None):
    """The `Admission` these options give for `role` (None: a public swarm); a bad one is a one-line error."""
    from swarmnode.admission import Admission, AdmissionError
    from swarmnode.identity import KeyFileError

    try:
        return Admission.load(role, invitation=invitation, identity=identity_path, owner_key=owner_key)
    except (AdmissionError, KeyFileError) as exc:
        raise click.ClickException(str(exc)) from None
