"""`swarmnode prepare-model`: make the SmolLM2-135M-Instruct checkpoint (or a tiny test model) once."""

from pathlib import Path

import click


@click.command("prepare-model")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for the checkpoint (default: ~/.cache/swarmnode/models/SmolLM2-135M-Instruct).")
@click.option("--tiny", type=click.Choice(["llama", "mistral", "qwen2", "qwen3"]), default=None,
              help="Make a tiny random-weight model of this family instead, for tests (needs --out).")
def command(out_dir, tiny):
    """Prepare a checkpoint that nodes and clients can load without a model hub."""
    if tiny:
        if out_dir is None:
            raise click.UsageError("--tiny needs --out FOLDER")
        # test models come from the test helpers, imported only when one is asked for
        from swarmnode.testing.checkpoints import make_tiny_checkpoint

        path = make_tiny_checkpoint(tiny, out_dir)
    else:
        from swarmnode.model_prep import PrepareModelError, prepare_smollm2

        try:
            path = prepare_smollm2(out_dir)
        except PrepareModelError as exc:
            raise click.ClickException(str(exc)) from exc
    click.echo(str(path))
