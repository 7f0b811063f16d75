"""`swarmnode api-key`: make an API key for `swarmnode api --api-keys FILE`."""

from __future__ import annotations

import json

import click


@click.command("api-key")
@click.argument("name")
@click.option("--sessions", type=click.IntRange(1, None), default=None,
              help="Generations the key may run at once (default: no cap beyond the server's --workers).")
@click.option("--tokens-per-minute", type=click.IntRange(1, None), default=None,
              help="Prompt and generated tokens the key may use in any 60 s (default: no cap).")
@click.option("--append-to", type=click.Path(dir_okay=False, writable=True), default=None, metavar="FILE",
              help="Append the key's line to this keys file (made if missing; a running server reads it again).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: name, key, line.")
def command(name, sessions, tokens_per_minute, append_to, as_json):
    """Make a random key for NAME and print it with the line for the keys file, which holds only the key's
    SHA-256: the key itself is shown once, here; give it to its holder."""
    from pathlib import Path

    from swarmnode.api.keys import KeyFileError, new_key, parse_keys
    from swarmnode.api.keys import key_line as make_line

    key = new_key()
    try:
        line = make_line(name, key, sessions=sessions, tokens_per_minute=tokens_per_minute)
    except KeyFileError as exc:
        raise click.BadParameter(str(exc), param_hint="NAME") from None
    if append_to is not None:
        path = Path(append_to)
        text = path.read_text() if path.exists() else ""
        try:
            parse_keys(text + "\n" + line, str(path))  # refused before writing: a duplicate name, a broken file
        except KeyFileError as exc:
            raise click.ClickException(f"not appended: {exc}") from None
        with path.open("a") as out:
            out.write(("" if not text or text.endswith("\n") else "\n") + line + "\n")
    if as_json:
        click.echo(json.dumps({"name": name, "key": key, "line": line}))
        return
    click.echo(f"key:  {key}")
    click.echo(f"line: {line}" + (f"  (appended to {append_to})" if append_to else "  (add it to the keys file)"))
