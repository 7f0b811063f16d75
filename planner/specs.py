"""Where the shared cluster specs live, and loading them by name.

The specs of ``shared/clusters/`` sit beside the checkout (``<repo>/../shared/clusters``); the environment
variable ``SWARMNODE_CLUSTERS_DIR`` points elsewhere when set. Where neither exists (an installed package,
a clone on its own), the copy shipped in ``planner/clusters/`` is used: the same files, read-only data.
"""

from __future__ import annotations

import os
from pathlib import Path

from .cluster import Cluster, SpecError, load_cluster

__all__ = ["CLUSTERS_DIR_ENV", "list_shared_clusters", "load_shared_cluster", "shared_clusters_dir"]

CLUSTERS_DIR_ENV = "SWARMNODE_CLUSTERS_DIR"


def shared_clusters_dir() -> Path:
    """The folder of shared cluster specs: ``$SWARMNODE_CLUSTERS_DIR``, else ``<repo>/../shared/clusters``
    when it exists, else the copy bundled with the package."""
    override = os.environ.get(CLUSTERS_DIR_ENV)
    if override:
        return Path(override).expanduser().resolve()
    repo_root = Path(__file__).resolve().parents[1]
    beside = (repo_root.parent / "shared" / "clusters").resolve()
    return beside if beside.is_dir() else Path(__file__).resolve().parent / "clusters"


def list_shared_clusters() -> list[str]:
    """Names (file stems) of the specs in :func:`shared_clusters_dir`."""
    folder = shared_clusters_dir()
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.iterdir() if p.suffix.lower() in (".json", ".yaml", ".yml"))


def load_shared_cluster(name: str) -> Cluster:
    """Load a shared spec by name (``helix-single-24``) or file name (``helix-single-24.json``)."""
    folder = shared_clusters_dir()
    for candidate in (name, f"{name}.json", f"{name}.yaml", f"{name}.yml"):
        path = folder / candidate
        if path.is_file():
            return load_cluster(path)
    known = ", ".join(list_shared_clusters()) or "none"
    raise SpecError(
        f"no cluster spec {name!r} in {folder} (known: {known}); set {CLUSTERS_DIR_ENV} to another folder"
    )
