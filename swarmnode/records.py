"""DHT keys and record schemas: defined once here, imported by nodes, coordinators and clients.

Every value read from the DHT is validated with these models; a record that does not validate is logged
and ignored, never trusted. Values travel as plain dicts (msgpack through hivemind's DHT).

| key                        | subkey  | value                      |
|----------------------------|---------|----------------------------|
| `{prefix}.block.{i}`       | peer id | `ServerRecord` (per block) |
"""

from __future__ import annotations

import enum
import logging
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

logger = logging.getLogger(__name__)

# How long a serving record lives without a refresh, and how often nodes refresh it.
SERVER_RECORD_TTL = 30.0
HEARTBEAT_INTERVAL = 10.0

_PREFIX_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")


def model_prefix(name: str) -> str:
    """The DHT prefix of a model: its name lower-cased, with characters outside [a-z0-9._-] as '-'."""
    prefix = re.sub(r"[^a-z0-9._-]+", "-", name.strip().lower()).strip("-.")
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"cannot derive a DHT prefix from model name {name!r}; pass --dht-prefix explicitly")
    return prefix


def block_key(prefix: str, block: int) -> str:
    return f"{prefix}.block.{block}"


class ServerState(str, enum.Enum):
    """What a node is doing with a block: clients route only through ONLINE ones."""

    OFFLINE = "offline"
    JOINING = "joining"
    ONLINE = "online"


class ServerRecord(BaseModel):
    """A node's announcement for each block of its span (`{prefix}.block.{i}`, subkey = peer id)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    state: ServerState
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    throughput: float = Field(ge=0, description="tokens/s the node sustains through one block")
    free_cache_tokens: int = Field(ge=0)
    cache_tokens: int = Field(ge=0, description="the node's whole KV-cache budget, in tokens")
    public_name: str | None = Field(default=None, max_length=128)
    version: str = Field(default="", max_length=32)
    device: str = Field(default="cpu", max_length=32)
    dtype: str = Field(default="float32", max_length=16)

    @model_validator(mode="after")
    def _span_is_ordered(self) -> ServerRecord:
        if self.end <= self.start:
            raise ValueError(f"span [{self.start}, {self.end}) is empty")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def parse_record(model: type[BaseModel], value: Any, *, what: str) -> BaseModel | None:
    """Validate a DHT value; log and return None when it does not fit the schema."""
    try:
        return model.model_validate(value)
    except (ValidationError, TypeError, ValueError) as exc:
        logger.warning("ignoring malformed %s: %s", what, str(exc).replace("\n", "; ")[:300])
        return None
