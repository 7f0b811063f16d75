"""The dashboard: static files (HTML, JS, CSS, all served from this package: no CDN) at `/`.

The page fetches `/api/v1/state` every 2 s and draws the block-coverage map (replicas per block and
which node serves which blocks), the nodes with their offers, measured throughput and links, the current
placement and why it changed, and this server's live tokens/s.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).with_name("static")


def mount_dashboard(app: FastAPI) -> None:
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")
