"""Test-only fault injection: a node that returns wrong hidden states on purpose.

Verifying clients (`client/verify.py`) must catch a peer whose outputs are wrong, and the only honest way to
test that is a real node that really computes wrong answers. The product has no option for it: this module
is a separate entry point that installs a filter through the node's one hook (`server.output_hook`) and
then runs the ordinary command line,

    SWARMNODE_ALLOW_FAULTS=1 python -m swarmnode.testing.faults --inject-fault NAME join --model ... ,

so the node passes every output tensor it returns, from `forward` and from every `inference` step, through
a filter that perturbs it (`LocalSwarm` starts a node this way when its arguments hold `--inject-fault`):

| fault              | what the node returns                                                          |
|--------------------|--------------------------------------------------------------------------------|
| `corrupt-outputs`  | every output with `OFFSET` added to its first `DIMS` hidden dimensions          |
| `corrupt-after:N`  | the first N outputs correct, every later one corrupted as above                 |

The perturbation is fixed and deterministic (the same input gives the same wrong output), so a faulty
node is consistent with itself and only a comparison with another replica exposes it. Faults are refused
unless the environment says this is a test (`SWARMNODE_ALLOW_FAULTS=1`).
"""
from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping
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


def check_allowed(environ: Mapping[str, str] | None = None) -> None:
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


FLAG = "--inject-fault"


def split_fault(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the fault named by `--inject-fault NAME` or `--inject-fault=NAME` anywhere in `argv`, the rest)."""
    rest, fault = [], None
    items = iter(argv)
    for item in items:
        if item == FLAG:
            fault = next(items, None)
            if fault is None:
                raise FaultError(f"{FLAG} needs a fault name: one of {', '.join(FAULTS)}")
        elif item.startswith(FLAG + "="):
            fault = item.split("=", 1)[1]
        else:
            rest.append(item)
    return fault, rest


def main(argv: list[str] | None = None) -> None:
    """`python -m swarmnode.testing.faults --inject-fault NAME <swarmnode command line>`: the command with
    the fault's filter installed; an unknown fault, or any fault outside tests, is refused before it starts."""
    from swarmnode.cli import main as swarmnode_main
    from swarmnode.server.output_hook import install_output_filter

    try:
        text, rest = split_fault(sys.argv[1:] if argv is None else argv)
        if text is None:
            raise FaultError(f"no fault named: pass {FLAG} NAME ({', '.join(FAULTS)}) before the swarmnode command")
        fault = parse_fault(text)
        check_allowed()
    except FaultError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    install_output_filter(output_filter(fault), fault.describe())
    swarmnode_main(args=rest, prog_name="swarmnode")


if __name__ == "__main__":
    main()
