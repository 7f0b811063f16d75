"""Test-only code: a local swarm of real processes, what tests read back from it, workloads and fault
injection.

The demo, the benchmarks and the test suite use this package; the product never imports it. A faulty node
is a separate entry point (`python -m swarmnode.testing.faults`) that installs a filter through the node's
one hook (`server.output_hook`) and refuses any fault unless the environment says this is a test.

| module          | what lives there                                                                  |
|-----------------|-----------------------------------------------------------------------------------|
| `local_swarm`   | starting and stopping `swarmnode` processes on 127.0.0.1, waiting for them         |
| `swarm_reader`  | reading such a swarm's state: DHT records, a node's `info` RPC, derived checks    |
| `workload`      | chat prompts, timed generations, local `transformers` truths                     |
| `faults`        | a node that returns wrong outputs on purpose (`--inject-fault NAME join ...`)     |
| `errors`        | the exceptions the helpers above raise                                            |

Tiny random-weight checkpoints of each family are a product module (`swarmnode.tiny_models`), since users
make them too (`swarmnode prepare-model --tiny FAMILY`).
"""
