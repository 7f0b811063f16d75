"""The cluster specs shipped with the planner, and loading a spec by path or by name.

``planner/clusters/`` (installed as package data) is the home of the specs: the clusters of the Helix,
LLaMPS, HexGen and HexGen-2 papers in the format of ``planner/clusters/README.md``. The environment
variable ``SWARMNODE_CLUSTERS_DIR`` points at another folder of specs when set.
:func:`resolve_cluster` is how every command and benchmark turns what a user typed (a spec file, or the
name of a shipped spec) into a :class:`~planner.cluster.spec.Cluster`.
"""

from __future__ import annotations

import os
from pathlib import Path

from .spec import Cluster, SpecError, load_cluster

__all__ = [
    "CLUSTERS_DIR_ENV",
    "list_shared_clusters",
    "load_shared_cluster",
    "resolve_cluster",
    "shared_clusters_dir",
]

CLUSTERS_DIR_ENV = "SWARMNODE_CLUSTERS_DIR"
_SUFFIXES = (".json", ".yaml", ".yml")


def shared_clusters_dir() -> Path:
    """The folder of named cluster specs: ``$SWARMNODE_CLUSTERS_DIR`` when set, else the specs shipped
    in ``planner/clusters/``."""
    override = os.environ.get(CLUSTERS_DIR_ENV)
    if override:
        return Path(override).expanduser().resolve()
    return Path(__file__).resolve().parent.parent / "clusters"


def list_shared_clusters() -> list[str]:
    """Names (file stems) of the specs in :func:`shared_clusters_dir`."""
    folder = shared_clusters_dir()
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.iterdir() if p.suffix.lower() in _SUFFIXES)


def load_shared_cluster(name: str) -> Cluster:
    """Load a named spec (``helix-single-24``) or its file name (``helix-single-24.json``)."""
    folder = shared_clusters_dir()
    for candidate in (name, *(f"{name}{suffix}" for suffix in _SUFFIXES)):
        path = folder / candidate
        if path.is_file():
            return load_cluster(path)
    known = ", ".join(list_shared_clusters()) or "none"
    raise SpecError(
        f"no cluster spec {name!r} in {folder} (known: {known}); set {CLUSTERS_DIR_ENV} to another folder"
    )


def resolve_cluster(spec: str | os.PathLike[str]) -> Cluster:
    """The cluster ``spec`` names: a spec file (JSON or YAML) when that path exists, else a named spec of
    :func:`shared_clusters_dir`. Every failure is a :class:`~planner.cluster.spec.SpecError` saying what to fix."""
    path = Path(spec)
    if path.is_dir():
        raise SpecError(f"{spec}: is a directory, not a cluster spec file")
    if path.exists():
        try:
            return load_cluster(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecError(f"{spec}: cannot read it ({exc})") from None
    try:
        return load_shared_cluster(str(spec))
    except SpecError as exc:
        raise SpecError(f"{spec}: no such file, and not a named cluster spec ({exc})") from None
