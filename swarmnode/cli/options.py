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
                 "declares, else the folder's name). Peers with the same name meet; it sets the DHT prefix.",
        )(command)
        return click.option(
            "--model", required=True, metavar="DIR|ORG/NAME",
            help=f"A checkpoint folder or a Hugging Face Hub name (fetched into the Hugging Face cache; "
                 f"honours HF_HUB_OFFLINE, HF_HOME, HF_ENDPOINT): {what}.",
        )(command)

    return decorate


def open_checkpoint(model: str, model_name: str | None = None):
    """The command's checkpoint; a source that is neither a checkpoint folder nor a reachable Hub name is a
    one-line usage error."""
    from swarmnode.runtime.checkpoint import Checkpoint, CheckpointError

    try:
        return Checkpoint(model, model_name=model_name)
    except CheckpointError as exc:
        raise click.ClickException(str(exc)) from None
