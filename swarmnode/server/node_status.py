"""What a node serves and where it is in its life, owned in one place.

`NodeStatus` holds the node's serving units (newest last), the range its placement assigns it, the
placement's version, the range being loaded and how far, and the state and note its records announce
(`records.NodeState`). The node and its placement follower (`server.follower`) both change it; every
change that others should see at once calls `on_change` (the node wakes its announcer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from swarmnode.records import NodeState
from swarmnode.server.unit import ServingUnit

__all__ = ["NodeStatus"]

logger = logging.getLogger(__name__)


class NodeStatus:
    def __init__(self, *, assigned: tuple[int, int] | None, on_change: Callable[[], None]):
        """`assigned`: the range given with `--blocks` (None: the placement's, once there is one).
        `on_change`: called when the state or the units change."""
        self.state = NodeState.MEASURING
        self.note = ""
        self.units: list[ServingUnit] = []
        self.assigned = assigned
        self.placement_version: int | None = None
        self.loading: tuple[int, int] | None = None
        self.progress = 0.0
        self._on_change = on_change

    def live_units(self) -> list[ServingUnit]:
        """The units that take new sessions, newest last."""
        return [u for u in self.units if u.live]

    def changed(self) -> None:
        """Tell the node something others should see changed (its records are announced again soon)."""
        self._on_change()

    def set_state(self, state: NodeState, note: str | None = None) -> None:
        """Enter `state`; `note` (logged) says why, for the node's record."""
        self.state = state
        if note is not None:
            self.note = note
            logger.info("%s", note)
        self._on_change()

    def add_unit(self, unit: ServingUnit) -> None:
        self.units.append(unit)

    def remove_unit(self, unit: ServingUnit) -> None:
        self.units = [u for u in self.units if u is not unit]
