"""`swarmnode prepare-model`: make the SmolLM2-135M-Instruct checkpoint (or a tiny random-weight one) once."""

from pathlib import Path

import click

# the families `swarmnode.tiny_models` makes (kept here so that `--help` imports nothing heavy; a test checks
# that the two lists agree)
TINY_CHOICES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "gemma2",
                "gemma3_text", "granite", "phi3", "olmo2")


@click.command("prepare-model")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder for the checkpoint (default: ~/.cache/swarmnode/models/SmolLM2-135M-Instruct).")
@click.option("--tiny", type=click.Choice(TINY_CHOICES), default=None,
              help="Make a tiny random-weight model of this family instead (needs --out): to try the family's "
                   "path through a swarm in seconds; its text means nothing.")
def command(out_dir, tiny):
    """Prepare a checkpoint that nodes and clients can load without a model hub."""
    if tiny:
        if out_dir is None:
            raise click.UsageError("--tiny needs --out FOLDER")
        from swarmnode.tiny_models import make_tiny_checkpoint

        path = make_tiny_checkpoint(tiny, out_dir)
    else:
        from swarmnode.model_prep import PrepareModelError, prepare_smollm2

        try:
            path = prepare_smollm2(out_dir)
        except PrepareModelError as exc:
            raise click.ClickException(str(exc)) from exc
    click.echo(str(path))
