"""Test-only fault injection: a node that returns wrong hidden states on purpose.

Nothing here runs in a normal node: the node imports this module only when `--inject-fault` is given, and
every fault is refused unless the environment enables the guard (`SWARMNODE_ALLOW_FAULTS=1`).

Verifying clients (`swarmnode.client.verify`) must catch a peer whose outputs are wrong, and the only honest
way to test that is a real node that really computes wrong answers. `swarmnode join --inject-fault NAME`
(hidden from `--help`) makes the node pass every output tensor it returns, from `forward` and from every
`inference` step, through a filter (`BlockHandler.output_filter`) that perturbs it:

| fault              | what the node returns                                                          |
|--------------------|--------------------------------------------------------------------------------|
| `corrupt-outputs`  | every output with `OFFSET` added to its first `DIMS` hidden dimensions          |
| `corrupt-after:N`  | the first N outputs correct, every later one corrupted as above                 |

The perturbation is fixed and deterministic (the same input gives the same wrong output), so a faulty
node is consistent with itself and only a comparison with another replica exposes it. Faults are off by
default and refused unless the environment says this is a test (`SWARMNODE_ALLOW_FAULTS=1`): a
production node cannot be started with one by a stray flag.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarmnode.errors import SwarmError

ALLOW_ENV = "SWARMNODE_ALLOW_FAULTS"
OFFSET = 8.0  # added to each corrupted element: far above float32 noise, enough to change greedy tokens
DIMS = 64  # hidden dimensions corrupted (all of them when the model is narrower)
FAULTS = ("corrupt-outputs", "corrupt-after:N")


class FaultError(SwarmError, ValueError):
    """A fault that cannot be injected: an unknown name, or no test environment; the message says why.
    A :class:`ValueError` too: it is a bad option value, which is how the CLI and the node treat it."""

    code = "fault_refused"


@dataclass(frozen=True)
class Fault:
    """A parsed fault: corrupt every output after the first `after` ones."""

    name: str
    after: int = 0

    def describe(self) -> str:
        first = f" after the first {self.after}" if self.after else ""
        return (f"fault {self.name!r}: every output{first} gets {OFFSET:g} added to its first {DIMS} hidden "
                f"dimensions")


def parse_fault(text: str) -> Fault:
    """`corrupt-outputs` or `corrupt-after:N` (N >= 0); anything else is refused naming the known faults."""
    spec = text.strip()
    if spec == "corrupt-outputs":
        return Fault(spec)
    if spec.startswith("corrupt-after:"):
        count = spec.split(":", 1)[1]
        if count.isdigit():
            return Fault(spec, after=int(count))
        raise FaultError(f"fault {text!r}: N in corrupt-after:N must be a whole number of outputs, e.g. corrupt-after:5")
    raise FaultError(f"unknown fault {text!r}: the faults are {', '.join(FAULTS)}")


def check_allowed(environ: dict[str, str] | None = None) -> None:
    """Refuse fault injection outside tests: only `SWARMNODE_ALLOW_FAULTS=1` allows it."""
    environ = os.environ if environ is None else environ
    if environ.get(ALLOW_ENV) != "1":
        raise FaultError(
            f"--inject-fault makes this node return wrong outputs on purpose and is only for tests: it is refused "
            f"unless the environment sets {ALLOW_ENV}=1. Remove the flag to serve normally."
        )


def output_filter(fault: Fault) -> Callable[[torch.Tensor], torch.Tensor]:
    """The filter the node's handler applies to each output (B, T, H) it returns: a new tensor, never the
    input changed in place (the runtime may hold on to it)."""
    lock = threading.Lock()
    seen = [0]

    def corrupt(output: torch.Tensor) -> torch.Tensor:
        with lock:
            seen[0] += 1
            if seen[0] <= fault.after:
                return output
        wrong = output.clone()
        wrong[..., :DIMS] += OFFSET
        return wrong

    return corrupt


def make_filter(text: str | None, environ: dict[str, str] | None = None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The output filter for `--inject-fault TEXT`, None without one; refused outside tests."""
    if text is None:
        return None
    fault = parse_fault(text)
    check_allowed(environ)
    return output_filter(fault)
