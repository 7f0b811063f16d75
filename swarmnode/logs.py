"""Logging set-up shared by every command: one line per event, with time, level and component."""

import logging
import os


def setup_logging(level: str | None = None) -> None:
    level = (level or os.environ.get("SWARMNODE_LOG_LEVEL", "INFO")).upper()
    logging.basicConfig(
        level=level,
        format="%(asctime)s.%(msecs)03d %(levelname)s [%(name)s] %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("hivemind", "asyncio", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
