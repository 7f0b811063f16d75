"""What this machine really has: checks an operator's offer against free memory before a node starts."""

from __future__ import annotations

import psutil

from swarmnode.errors import SwarmError
from swarmnode.sizes import format_size

# Kept free for the operating system and other programs when the operator names no size.
SAFETY_MARGIN_BYTES = 1 * 2**30
DEFAULT_SHARE = 0.8


class ResourceError(SwarmError, ValueError):
    """An offer this machine cannot give (more memory or cores than it has free); the message names both."""

    code = "not_enough_resources"


def available_memory(device: str = "cpu") -> int:
    if device.startswith("cuda"):
        import torch

        index = torch.device(device).index or 0
        free, _total = torch.cuda.mem_get_info(index)
        return int(free)
    return int(psutil.virtual_memory().available)


def check_offer(offered: int | None, device: str = "cpu") -> int:
    """The bytes a node may use: the operator's offer if the machine has it, else a safe default.

    Raises `ResourceError` (a ValueError) when the offer exceeds what is free now, naming both figures.
    """
    free = available_memory(device)
    if offered is None:
        default = int(free * DEFAULT_SHARE) - SAFETY_MARGIN_BYTES
        if default <= 0:
            raise ResourceError(f"only {format_size(free)} is free on {device}: too little to serve anything")
        return default
    if offered > free:
        raise ResourceError(
            f"--leftover-mem {format_size(offered)} is more than this machine has free on {device} "
            f"({format_size(free)}): offer at most that, or free memory first"
        )
    return offered


def check_cores(offered: int | None) -> int | None:
    """The cores a node may use: the operator's figure if the machine has that many, else None (all)."""
    if offered is None:
        return None
    have = psutil.cpu_count(logical=True) or 1
    if offered > have:
        raise ResourceError(f"--leftover-cores {offered} is more than this machine has ({have}): offer at most {have}")
    return offered
