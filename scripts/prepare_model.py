"""Prepare the SmolLM2-135M-Instruct checkpoint in the cache and print its folder (used by `make`)."""

from swarmnode.model_prep import prepare_smollm2

if __name__ == "__main__":
    print(prepare_smollm2())
