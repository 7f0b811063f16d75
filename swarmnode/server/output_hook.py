"""The one hook a process may install before it starts a node: a filter on every output the node returns.

A normal node has none and runs no code of this module but the check that none is installed. The hook is
how a node that computes wrong answers on purpose is made, the only honest test of the clients that must
catch one (`client/verify.py`): the test package installs a filter (`swarmnode.testing.faults`, run as
`python -m swarmnode.testing.faults --inject-fault NAME join ...`), and the node applies it to each
output tensor it returns, from `forward` and from every `inference` step. The product never imports the
test package; the node says loudly in its log that a filter is installed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

OutputFilter = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class InstalledFilter:
    """A filter on the node's outputs (B, T, H) -> a new tensor of the same shape, never the input changed in
    place, and what it does, for the log."""

    apply: OutputFilter
    description: str


_installed: InstalledFilter | None = None


def install_output_filter(apply: OutputFilter, description: str) -> None:
    """Make every node this process starts from now on pass its outputs through `apply`."""
    global _installed
    if not description.strip():
        raise ValueError("an output filter needs a description: the node's log says what it does")
    _installed = InstalledFilter(apply, description)


def installed_output_filter() -> InstalledFilter | None:
    """The filter installed in this process, None in a normal node."""
    return _installed
