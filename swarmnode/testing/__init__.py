"""Test-only code: a local swarm of real processes, what tests read back from it, workloads, tiny
checkpoints and fault injection.

The demo, the benchmarks and the test suite use this package; the product does not. The one exception is
the node's fault-injection hook, which imports :mod:`swarmnode.testing.faults` only when a fault is asked
for, and which refuses any fault unless the environment says this is a test.

| module          | what lives there                                                                  |
|-----------------|-----------------------------------------------------------------------------------|
| `local_swarm`   | starting and stopping `swarmnode` processes on 127.0.0.1, waiting for them         |
| `swarm_reader`  | reading such a swarm's state: DHT records, a node's `info` RPC, derived checks    |
| `workload`      | chat prompts, timed generations, local `transformers` truths                     |
| `checkpoints`   | tiny random-weight checkpoints of each supported architecture                    |
| `faults`        | a node that returns wrong outputs on purpose (`join --inject-fault`)              |
| `errors`        | the exceptions the helpers above raise                                            |
"""
