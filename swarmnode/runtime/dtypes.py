"""The floating-point dtypes a node computes in and hidden states travel in, by their protocol names.

The names are part of the records and the CLI (`records.DTYPE_NAMES`); this maps them to torch. Both the
wire (`messages.WIRE_DTYPES`) and the nodes' compute dtypes come from this one table.
"""

from __future__ import annotations

import torch

from swarmnode.records import DTYPE_NAMES

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


def dtype_name(dtype: torch.dtype) -> str:
    """The protocol name of a torch dtype (`torch.bfloat16` -> "bfloat16")."""
    return str(dtype).removeprefix("torch.")
