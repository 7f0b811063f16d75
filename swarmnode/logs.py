"""Logging set-up shared by every command: one line per event, with time, level and component."""

import logging
import os

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def setup_logging(level: str | None = None) -> None:
    """Log to stderr at `level`, else at `SWARMNODE_LOG_LEVEL`, else INFO; an unknown level stops the command
    with a line that names it."""
    given = level or os.environ.get("SWARMNODE_LOG_LEVEL", "INFO")
    if given.upper() not in LEVELS:
        source = "the log level" if level else "SWARMNODE_LOG_LEVEL"
        raise SystemExit(f"{source} {given!r} is not one of {', '.join(LEVELS)}: set SWARMNODE_LOG_LEVEL to one "
                         f"of them (or leave it unset for INFO)")
    logging.basicConfig(
        level=given.upper(),
        format="%(asctime)s.%(msecs)03d %(levelname)s [%(name)s] %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("hivemind", "asyncio", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
