"""`swarmnode prepare-model`: make the SmolLM2-135M-Instruct checkpoint (or a tiny test model) once."""

from pathlib import Path

import click


@click.command("prepare-model")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for the checkpoint (default: ~/.cache/swarmnode/models/SmolLM2-135M-Instruct).")
@click.option("--tiny", type=click.Choice(["llama", "mistral", "qwen2", "qwen3"]), default=None,
              help="Make a tiny random-weight model of this family instead (needs --out).")
def command(out_dir, tiny):
    """Prepare a checkpoint that nodes and clients can load without a model hub."""
    from swarmnode import model_prep

    if tiny:
        if out_dir is None:
            raise click.UsageError("--tiny needs --out FOLDER")
        path = model_prep.make_tiny_checkpoint(tiny, out_dir)
    else:
        try:
            path = model_prep.prepare_smollm2(out_dir)
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from exc
    click.echo(str(path))
