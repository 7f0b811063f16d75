"""Peer ids for people: the one way the project shortens a libp2p peer id in logs, reasons and tables.

A base58 peer id is 46-52 characters; its last six are enough to tell the peers of one swarm apart.
"""

from __future__ import annotations

import re

__all__ = ["short_id", "shorten_ids"]

#: A base58 run long enough to be a peer id (libp2p ids are 46-52 characters; 20 leaves room for others).
_LONG_ID_RE = re.compile(r"\b[1-9A-HJ-NP-Za-km-z]{20,128}\b")


def short_id(peer_id: str) -> str:
    """A peer id for humans: ``..`` and its last 6 characters (ids of 8 characters or fewer unchanged)."""
    return f"..{peer_id[-6:]}" if len(peer_id) > 8 else peer_id


def shorten_ids(text: str) -> str:
    """``text`` with every peer id in it replaced by its :func:`short_id`."""
    return _LONG_ID_RE.sub(lambda m: short_id(m.group(0)), text)
