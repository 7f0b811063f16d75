"""The dashboard of `swarmnode api`, rendered by headless Chromium against a real 3-node swarm.

The page is static (no CDN) and draws itself from `/api/v1/state`; the rendered DOM must show every block
of the model with its replicas and every node of the swarm. A screenshot is kept in the test's tmp dir
and copied to `tests/artifacts/` (git-ignored).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.swarm

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parent / "artifacts"


@pytest.fixture(scope="module")
def dashboard_swarm(three_node_swarm):
    """The run's shared swarm (three nodes, 0:10, 10:20, 20:30) and the API that serves the dashboard."""
    return {"url": three_node_swarm.url, "nodes": three_node_swarm.nodes}


def chromium(args: list[str], profile: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is not installed: `make install` installs Debian's chromium package (as root)")
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage", f"--user-data-dir={profile}", *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            import os
            import signal

            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)
    return subprocess.CompletedProcess(command, process.returncode, out.decode(errors="replace"),
                                       err.decode(errors="replace"))


def test_state_endpoint_has_every_block_and_node(dashboard_swarm):
    state = httpx.get(dashboard_swarm["url"] + "/api/v1/state", timeout=30).json()
    assert state["num_blocks"] == 30
    assert state["replicas"] == [1] * 30 and state["uncovered_blocks"] == []
    # manual nodes and no placement: no floor was planned, so none is missed and no node is "unused"
    assert (state["min_replicas"], state["single_points"], state["under_replicated_blocks"], state["unused"]) == \
        (1, [], [], {})
    peers = {s["peer_id"] for s in state["servers"]}
    assert peers == {n.peer_id for n in dashboard_swarm["nodes"]}
    for asset in ("/", "/static/dashboard.js", "/static/dashboard.css"):
        response = httpx.get(dashboard_swarm["url"] + asset, timeout=10)
        assert response.status_code == 200
    page = httpx.get(dashboard_swarm["url"] + "/", timeout=10).text
    assert not re.search(r"""(src|href)=["']https?://""", page)  # nothing from a CDN


def test_dashboard_renders_coverage_of_every_block_and_node(dashboard_swarm, tmp_path):
    url = dashboard_swarm["url"] + "/"
    dom = chromium(["--virtual-time-budget=8000", "--dump-dom", url], tmp_path / "profile-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert 'data-ready="1"' in html, html[:3000]
    blocks = dict(re.findall(r'data-block="(\d+)" data-replicas="(\d+)"', html))
    assert sorted(int(b) for b in blocks) == list(range(30))
    assert all(int(r) == 1 for r in blocks.values())
    for node, (a, b) in zip(dashboard_swarm["nodes"], ((0, 10), (10, 20), (20, 30))):
        assert f'data-peer="{node.peer_id}"' in html
        served = sorted(int(x) for x in re.findall(rf'data-serves="{node.peer_id}:(\d+)"', html))
        assert served == list(range(a, b))

    shot = tmp_path / "dashboard.png"
    result = chromium(["--virtual-time-budget=8000", f"--screenshot={shot}", "--window-size=1400,1000", url],
                      tmp_path / "profile-shot")
    assert result.returncode == 0 and shot.is_file() and shot.stat().st_size > 10_000, result.stderr[-2000:]
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(shot, ARTIFACTS / "dashboard.png")
    print(f"dashboard screenshot: {shot} (copied to {ARTIFACTS / 'dashboard.png'})")
