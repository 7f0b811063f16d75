"""The `swarmnode` command line: one module per command, registered on one click group.

Each command module imports its heavy dependencies (torch, hivemind) inside the command body, so that
`swarmnode plan` and `swarmnode --help` start fast and never touch the network stack. An error the swarm
raises on purpose (`SwarmError`: an unreachable initial peer, a bad key file, ...) ends a command with its
one-line message, not a traceback; anything else is a bug and keeps its traceback.
"""

import importlib

import click

from swarmnode.errors import SwarmError

# command name -> module under swarmnode.cli that defines a click command called `command`
COMMANDS = {
    "bootstrap": "bootstrap",
    "join": "join",
    "coordinate": "coordinate",
    "status": "status",
    "generate": "generate",
    "prepare-model": "prepare_model",
    "plan": "plan",
    "simulate": "simulate",
    "api": "api",
    "api-key": "api_key",
    "identity": "identity",
    "invite": "invite",
    "revoke": "revoke",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        module_name = COMMANDS.get(name)
        if module_name is None:
            return None
        module = importlib.import_module(f"swarmnode.cli.{module_name}")
        return module.command

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except SwarmError as exc:
            raise click.ClickException(str(exc)) from None


@click.group(cls=_LazyGroup)
@click.version_option(package_name="swarmnode")
def main():
    """swarmnode: serve a language model across a swarm of peers."""
