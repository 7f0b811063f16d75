"""Human-readable memory sizes (`512M`, `40G`, `1.5T`), parsed strictly for CLI flags."""

from __future__ import annotations

import re

from swarmnode.errors import SwarmError

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE_RE = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


class SizeError(SwarmError, ValueError):
    """Text that is not a memory size; the message shows the accepted forms."""

    code = "bad_size"


def parse_size(text: str) -> int:
    """Bytes in `text`: a number with an optional K/M/G/T suffix (binary units; `GiB`/`GB` also read as 2^30).

    Raises `SizeError` (a ValueError) with a message that shows the accepted forms.
    """
    match = _SIZE_RE.match(str(text))
    if not match:
        raise SizeError(f"{text!r} is not a size: write a number with an optional unit, like 512M, 40G or 1.5T")
    value = float(match.group("number")) * _UNITS[match.group("unit").upper()]
    if value < 1:
        raise SizeError(f"{text!r} is zero: give a positive size")
    return int(value)


def format_size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024:
            return f"{num_bytes:.1f} {unit}" if unit != "B" else f"{int(num_bytes)} B"
        num_bytes /= 1024
    return f"{num_bytes:.2f} TiB"
