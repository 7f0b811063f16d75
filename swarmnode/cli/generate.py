"""`swarmnode generate`: stream a model's answer to a prompt through the swarm to the terminal."""

import click

from swarmnode.cli.options import (
    admission_options,
    initial_peers_option,
    load_admission,
    model_options,
    open_checkpoint,
    validate_maddrs,
)
from swarmnode.records import DTYPE_NAMES


@click.command("generate")
@initial_peers_option()
@model_options("embeddings, norm, head and tokenizer are read from it")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", *DTYPE_NAMES]),
              help="Dtype of the client's embeddings, norm and head and of the hidden states it sends "
                   "(auto: the checkpoint's).")
@click.option("--max-new-tokens", default=128, type=click.IntRange(1, 32768), show_default=True)
@click.option("--temperature", default=0.0, type=click.FloatRange(0.0, 100.0), show_default=True,
              help="0 for greedy decoding.")
@click.option("--top-p", default=1.0, type=click.FloatRange(0.0, 1.0, min_open=True), show_default=True)
@click.option("--top-k", default=0, type=click.IntRange(0, None), show_default=True, help="0: no top-k.")
@click.option("--chat/--no-chat", default=True, show_default=True, help="Wrap the prompt in the chat template.")
@click.option("--dht-prefix", default=None)
@click.option("--verify", default=0.0, type=click.FloatRange(0.0, 1.0), show_default=True,
              help="Share of steps re-run on another replica to catch wrong answers (>0 also checks every "
                   "first step); peers found wrong are banned and reported. See docs/operations.md.")
@click.option("--prompt-lookup", default=0, type=click.IntRange(0, 64), show_default=True, metavar="N",
              help="Speculative decoding: draft up to N tokens a pass by looking the text so far up in the prompt "
                   "(0: off). Same greedy output; faster where the answer reuses the prompt's words.")
@click.option("--speculative-passes", default=None, type=click.IntRange(1, None), metavar="N",
              help="With --prompt-lookup: verification passes in flight at once (1 to 4), each sent before the ones "
                   "ahead are verified while drafts are being accepted; 1: one pass at a time (default: the "
                   "client library's, ClientConfig.speculative_passes).")
@admission_options()
@click.argument("prompt")
def command(initial_peers, model, model_name, dtype, max_new_tokens, temperature, top_p, top_k, chat, dht_prefix, verify,
            prompt_lookup, speculative_passes, invitation, owner_key, identity_path, prompt):
    """Generate an answer to PROMPT through the swarm and stream it."""
    import time

    from transformers import AutoTokenizer, TextStreamer

    from swarmnode.admission import Role
    from swarmnode.client import ClientConfig, DistributedModelForCausalLM
    from swarmnode.client.swarm import MAX_SPECULATIVE_PASSES
    from swarmnode.logs import setup_logging

    if speculative_passes is None:
        speculative_passes = ClientConfig.speculative_passes
    if speculative_passes > MAX_SPECULATIVE_PASSES:
        raise click.BadParameter(f"{speculative_passes} passes in flight: at most {MAX_SPECULATIVE_PASSES}",
                                 param_hint="--speculative-passes")

    setup_logging("WARNING")
    peers = validate_maddrs(initial_peers)
    admission = load_admission(Role.CLIENT, invitation, identity_path, owner_key)
    checkpoint = open_checkpoint(model, model_name)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.path)
    if chat and tokenizer.chat_template:
        input_ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  return_tensors="pt", return_dict=True)["input_ids"]
    else:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k) if temperature > 0 else \
        dict(do_sample=False)
    with DistributedModelForCausalLM.from_pretrained(model, initial_peers=peers, dht_prefix=dht_prefix,
                                                     model_name=model_name, dtype=dtype, verify=verify,
                                                     speculative_passes=speculative_passes,
                                                     admission=admission) as remote:
        began = time.perf_counter()
        # a SessionError (no route, retries ran out) ends the command with its message (`swarmnode.cli`)
        output = remote.generate(input_ids, max_new_tokens=max_new_tokens,
                                 streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
                                 **sampling, **({"prompt_lookup_num_tokens": prompt_lookup} if prompt_lookup else {}))
        elapsed = time.perf_counter() - began
    count = output.shape[1] - input_ids.shape[1]
    click.echo(f"\n[{count} tokens, {count / elapsed:.1f} tokens/s]", err=True)
