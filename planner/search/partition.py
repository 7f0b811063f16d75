"""Graph partitioning and clustering used by the HexGen and HexGen-2 planners.

Everything here works on dense numpy matrices over a small set of items (GPUs or groups of GPUs) and is
deterministic for a given seed:

- :func:`kmeans` and :func:`elbow` build HexGen's initial pipeline groups (HexGen §4.3, "Initialization":
  vanilla K-means over the latency and bandwidth matrices, the number of groups from the Elbow method).
- :func:`spectral_partition` and :func:`kernighan_lin` are HexGen-2's initial partition (HexGen-2 §3.2 step (i):
  spectral partitioning with several Laplacian eigenvectors, Alpert & Yao 1995, then Kernighan-Lin refinement,
  Kernighan & Lin 1970, that lowers the cut and balances node weights, i.e. memory, across groups).
- :func:`coarsen` and :func:`max_cut_bipartition` are HexGen-2 §3.2 step (ii): merge each group into a super
  node and split the super nodes in two so that the weight *between* the two sides is as large as possible.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

__all__ = [
    "coarsen",
    "cut_weight",
    "elbow",
    "imbalance",
    "kernighan_lin",
    "kmeans",
    "max_cut_bipartition",
    "spectral_partition",
]


def _check_square(weights: np.ndarray, name: str = "weights") -> np.ndarray:
    w = np.asarray(weights, dtype=float)
    if w.ndim != 2 or w.shape[0] != w.shape[1]:
        raise ValueError(f"{name} must be a square matrix, got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise ValueError(f"{name} must be finite")
    if np.any(w < 0):
        raise ValueError(f"{name} must be non-negative")
    return w


def kmeans(points: np.ndarray, k: int, *, seed: int = 0, iterations: int = 100) -> tuple[np.ndarray, float]:
    """Lloyd's K-means with k-means++ seeding; returns ``(labels, inertia)``.

    Labels are renumbered ``0..k'-1`` in order of first appearance, so equal clusterings compare equal; ``k'``
    can be below ``k`` when there are fewer distinct points than clusters.
    """
    x = np.asarray(points, dtype=float)
    if x.ndim != 2:
        raise ValueError(f"points must be a 2-d array, got shape {x.shape}")
    n = x.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    rng = np.random.default_rng(seed)
    centers = [x[rng.integers(n)]]
    for _ in range(1, k):
        d2 = np.min([np.sum((x - c) ** 2, axis=1) for c in centers], axis=0)
        total = d2.sum()
        if total <= 0:
            break
        centers.append(x[rng.choice(n, p=d2 / total)])
    c = np.array(centers)
    labels = np.zeros(n, dtype=int)
    for _ in range(iterations):
        dist = ((x[:, None, :] - c[None, :, :]) ** 2).sum(axis=2)
        new = np.argmin(dist, axis=1)
        if _ > 0 and np.array_equal(new, labels):
            break
        labels = new
        for j in range(len(c)):
            members = x[labels == j]
            if len(members):
                c[j] = members.mean(axis=0)
    inertia = float(sum(np.sum((x[labels == j] - c[j]) ** 2) for j in range(len(c))))
    return _renumber(labels), inertia


def _renumber(labels: np.ndarray) -> np.ndarray:
    mapping: dict[int, int] = {}
    out = np.empty(len(labels), dtype=int)
    for i, lab in enumerate(labels):
        out[i] = mapping.setdefault(int(lab), len(mapping))
    return out


def elbow(points: np.ndarray, k_max: int, *, seed: int = 0) -> int:
    """Number of clusters by the Elbow method (HexGen §4.3).

    K-means runs for ``k = 1..k_max``; the elbow is the ``k`` whose (k, inertia) point lies farthest below
    the straight line from the first to the last point of the curve (the "knee" of the normalised curve).
    """
    x = np.asarray(points, dtype=float)
    k_max = max(1, min(k_max, len(np.unique(x, axis=0))))
    if k_max <= 2:
        return k_max
    inertias = np.array([kmeans(x, k, seed=seed)[1] for k in range(1, k_max + 1)])
    if inertias[0] <= 0:
        return 1
    ks = np.arange(1, k_max + 1, dtype=float)
    kn = (ks - 1) / (k_max - 1)
    yn = inertias / inertias[0]
    # distance below the chord from (0, 1) to (1, y_last)
    chord = 1 + (yn[-1] - 1) * kn
    return int(ks[int(np.argmax(chord - yn))])


def cut_weight(weights: np.ndarray, labels: Sequence[int] | np.ndarray) -> float:
    """Total weight of the edges whose ends carry different labels (each undirected edge once)."""
    w = _check_square(weights)
    lab = np.asarray(labels)
    different = lab[:, None] != lab[None, :]
    return float((w * different).sum() / 2)


def imbalance(labels: Sequence[int] | np.ndarray, node_weights: Sequence[float] | np.ndarray) -> float:
    """Largest relative deviation of a group's node weight from the mean group weight."""
    lab = np.asarray(labels)
    nw = np.asarray(node_weights, dtype=float)
    groups = np.unique(lab)
    totals = np.array([nw[lab == g].sum() for g in groups])
    mean = totals.mean()
    return float(np.max(np.abs(totals - mean)) / mean) if mean > 0 else 0.0


def spectral_partition(weights: np.ndarray, k: int, *, seed: int = 0) -> np.ndarray:
    """Partition a weighted graph into ``k`` groups with a small cut (HexGen-2 §3.2 step (i)).

    Follows Alpert & Yao's "more eigenvectors, the better": embed every node with the eigenvectors of the
    ``k`` smallest eigenvalues of the symmetric normalised Laplacian ``I - D^-1/2 W D^-1/2``, normalise the
    rows and cluster them with K-means. Heavy (high-bandwidth) edges end up inside groups.
    """
    w = _check_square(weights)
    n = w.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    if k == 1:
        return np.zeros(n, dtype=int)
    w = (w + w.T) / 2
    np.fill_diagonal(w, 0.0)
    deg = w.sum(axis=1)
    inv_sqrt = np.where(deg > 0, 1.0 / np.sqrt(np.where(deg > 0, deg, 1.0)), 0.0)
    lap = np.eye(n) - inv_sqrt[:, None] * w * inv_sqrt[None, :]
    _, vecs = np.linalg.eigh(lap)
    emb = vecs[:, :k]
    norms = np.linalg.norm(emb, axis=1, keepdims=True)
    emb = emb / np.where(norms > 0, norms, 1.0)
    # small deterministic tie-breaking so identical rows (same machine) still stay together
    best_labels, best_cut = None, None
    for trial in range(4):
        labels, _ = kmeans(np.round(emb, 9), k, seed=seed + trial)
        cut = cut_weight(w, labels)
        if best_cut is None or cut < best_cut - 1e-9:
            best_labels, best_cut = labels, cut
    assert best_labels is not None
    return best_labels


def _group_totals(lab: np.ndarray, nw: np.ndarray, groups: list[int]) -> dict[int, float]:
    """Summed node weight (memory) of every group."""
    return {g: float(nw[lab == g].sum()) for g in groups}


def _totals_imbalance(tot: dict[int, float]) -> float:
    """Largest relative deviation of a group total from the mean total (0 when the mean is 0)."""
    mean = sum(tot.values()) / len(tot)
    return max(abs(v - mean) for v in tot.values()) / mean if mean > 0 else 0.0


def _best_balancing_move(
    w: np.ndarray,
    lab: np.ndarray,
    nw: np.ndarray,
    fixed: np.ndarray,
    tot: dict[int, float],
    heavy: int,
    light: int,
    tolerance: float,
) -> int | None:
    """The movable node of ``heavy`` whose move to ``light`` lowers the imbalance, preferring moves that
    bring it within ``tolerance``, then the smallest cut increase, then the lowest imbalance; None when no
    move helps or ``heavy`` would be left empty."""
    if np.sum(lab == heavy) <= 1:
        return None
    current = _totals_imbalance(tot)
    best = None
    for i in map(int, np.flatnonzero((lab == heavy) & ~fixed)):
        trial = dict(tot)
        trial[heavy] -= nw[i]
        trial[light] += nw[i]
        new_imb = _totals_imbalance(trial)
        if new_imb >= current - 1e-12:
            continue
        delta_cut = w[i, lab == heavy].sum() - w[i, lab == light].sum()
        key = (new_imb > tolerance, delta_cut, new_imb)
        if best is None or key < best[0]:
            best = (key, i)
    return None if best is None else best[1]


def _balance(
    w: np.ndarray, lab: np.ndarray, nw: np.ndarray, fixed: np.ndarray, groups: list[int], tolerance: float
) -> None:
    """Balancing phase, in place: while the imbalance exceeds ``tolerance``, move one node from the
    heaviest group to the lightest (:func:`_best_balancing_move`)."""
    for _ in range(len(lab) * len(groups)):
        tot = _group_totals(lab, nw, groups)
        if _totals_imbalance(tot) <= tolerance:
            return
        heavy = max(groups, key=lambda g: tot[g])
        light = min(groups, key=lambda g: tot[g])
        node = _best_balancing_move(w, lab, nw, fixed, tot, heavy, light, tolerance)
        if node is None:
            return
        lab[node] = light


def _initial_gains(w: np.ndarray, lab: np.ndarray, nodes: list[int], ga: int, gb: int) -> dict[int, float]:
    """Kernighan-Lin's ``D`` of every node of groups ``ga`` and ``gb``: its edge weight to the other group
    minus its edge weight inside its own group."""
    internal = {i: w[i, lab == lab[i]].sum() for i in nodes}
    external = {i: w[i, lab == (gb if lab[i] == ga else ga)].sum() for i in nodes}
    return {i: external[i] - internal[i] for i in nodes}


def _best_swap(
    w: np.ndarray,
    nw: np.ndarray,
    d: dict[int, float],
    free_a: set[int],
    free_b: set[int],
    ga: int,
    gb: int,
    work_tot: dict[int, float],
    allowed: float,
) -> tuple[float, int, int] | None:
    """The free pair ``(a, b)`` with the largest gain ``D_a + D_b - 2 w_ab`` whose swap keeps the imbalance
    within ``allowed``, as ``(gain, a, b)``; None when every swap would unbalance the groups."""
    best = None
    for a in free_a:
        for b in free_b:
            trial = dict(work_tot)
            trial[ga] += nw[b] - nw[a]
            trial[gb] += nw[a] - nw[b]
            if _totals_imbalance(trial) > allowed:
                continue
            gain = d[a] + d[b] - 2 * w[a, b]
            if best is None or gain > best[0] + 1e-12:
                best = (gain, a, b)
    return best


def _swap_pass(
    w: np.ndarray,
    nw: np.ndarray,
    d: dict[int, float],
    a_nodes: list[int],
    b_nodes: list[int],
    ga: int,
    gb: int,
    tot: dict[int, float],
    allowed: float,
) -> tuple[list[tuple[int, int]], list[float]]:
    """One Kernighan-Lin pass between groups ``ga`` and ``gb``: repeatedly pick the best free pair
    (:func:`_best_swap`), lock both and update the ``D`` values of the remaining free nodes as if the pair
    had been swapped. Returns the tentative swaps in order and their gains; nothing is moved yet."""
    free_a, free_b = set(a_nodes), set(b_nodes)
    swaps: list[tuple[int, int]] = []
    gains: list[float] = []
    work_tot = dict(tot)
    while free_a and free_b:
        best = _best_swap(w, nw, d, free_a, free_b, ga, gb, work_tot, allowed)
        if best is None:
            break
        gain, a, b = best
        swaps.append((a, b))
        gains.append(gain)
        free_a.discard(a)
        free_b.discard(b)
        work_tot[ga] += nw[b] - nw[a]
        work_tot[gb] += nw[a] - nw[b]
        for x in free_a:
            d[x] += 2 * w[x, a] - 2 * w[x, b]
        for y in free_b:
            d[y] += 2 * w[y, b] - 2 * w[y, a]
    return swaps, gains


def _apply_best_prefix(
    lab: np.ndarray, swaps: list[tuple[int, int]], gains: list[float], ga: int, gb: int
) -> bool:
    """Apply, in place, the prefix of ``swaps`` with the largest total gain if that gain is positive;
    returns whether anything moved."""
    if not gains:
        return False
    cumulative = np.cumsum(gains)
    k = int(np.argmax(cumulative))
    if cumulative[k] <= 1e-9:
        return False
    for a, b in swaps[: k + 1]:
        lab[a], lab[b] = gb, ga
    return True


def _refine_pair(
    w: np.ndarray,
    lab: np.ndarray,
    nw: np.ndarray,
    fixed: np.ndarray,
    groups: list[int],
    ga: int,
    gb: int,
    tolerance: float,
) -> bool:
    """One Kernighan-Lin pass between groups ``ga`` and ``gb``, in place; the imbalance may not grow beyond
    ``max(tolerance, current)``. Returns whether the cut improved."""
    a_nodes = [int(i) for i in np.flatnonzero(lab == ga) if not fixed[i]]
    b_nodes = [int(i) for i in np.flatnonzero(lab == gb) if not fixed[i]]
    if not a_nodes or not b_nodes:
        return False
    tot = _group_totals(lab, nw, groups)
    allowed = max(tolerance, _totals_imbalance(tot)) + 1e-12
    d = _initial_gains(w, lab, a_nodes + b_nodes, ga, gb)
    swaps, gains = _swap_pass(w, nw, d, a_nodes, b_nodes, ga, gb, tot, allowed)
    return _apply_best_prefix(lab, swaps, gains, ga, gb)


def kernighan_lin(
    weights: np.ndarray,
    labels: Sequence[int] | np.ndarray,
    node_weights: Sequence[float] | np.ndarray,
    *,
    tolerance: float = 0.1,
    max_passes: int = 10,
    locked: Sequence[bool] | None = None,
) -> np.ndarray:
    """Refine a multi-way partition by Kernighan-Lin pair swaps, balanced on node weights.

    HexGen-2 §3.2 step (i): the initial spectral groups are improved by swapping node pairs between groups,
    which lowers the inter-group edge weight and balances node weights (GPU memory) across groups.

    The refinement has two parts:

    1. balancing (:func:`_balance`): while the largest relative deviation of a group's weight from the mean
       exceeds ``tolerance``, move the node from the heaviest group to the lightest one that reduces the
       imbalance at the smallest cut increase;
    2. Kernighan-Lin passes (:func:`_refine_pair`) for every pair of groups (A, B): repeatedly pick the
       unlocked pair (a, b) with the largest gain ``D_a + D_b - 2 w_ab`` (``D`` = external minus internal
       weight) whose swap keeps the imbalance within ``max(tolerance, current)``, lock both and update ``D``;
       apply the prefix of swaps with the largest positive total gain. Passes repeat until none improves
       the cut.

    ``locked`` marks nodes that must not move. Returns new labels (same label values).
    """
    w = _check_square(weights)
    w = (w + w.T) / 2
    np.fill_diagonal(w, 0.0)
    lab = np.array(labels, dtype=int)
    nw = np.asarray(node_weights, dtype=float)
    n = len(lab)
    if w.shape[0] != n or len(nw) != n:
        raise ValueError("weights, labels and node_weights must describe the same nodes")
    if np.any(nw < 0):
        raise ValueError("node weights must be non-negative")
    fixed = np.zeros(n, dtype=bool) if locked is None else np.asarray(locked, dtype=bool)
    groups = sorted(set(lab.tolist()))
    if len(groups) < 2:
        return lab
    _balance(w, lab, nw, fixed, groups, tolerance)
    for _ in range(max_passes):
        improved = False
        for ga, gb in itertools.combinations(groups, 2):
            improved |= _refine_pair(w, lab, nw, fixed, groups, ga, gb, tolerance)
        if not improved:
            break
    return lab


def coarsen(weights: np.ndarray, labels: Sequence[int] | np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Merge every group into a super node (HexGen-2 §3.2 step (ii), Hendrickson & Leland's coarsening).

    Returns the super-node weight matrix (sum of the edge weights between the two groups, zero diagonal) and
    the group label of each super node, in ascending label order.
    """
    w = _check_square(weights)
    lab = np.asarray(labels)
    groups = sorted(set(lab.tolist()))
    m = len(groups)
    out = np.zeros((m, m))
    for i, g in enumerate(groups):
        for j, h in enumerate(groups):
            if i != j:
                out[i, j] = w[np.ix_(lab == g, lab == h)].sum()
    return out, groups


def max_cut_bipartition(
    weights: np.ndarray, *, min_side: int = 1, exhaustive_limit: int = 16, seed: int = 0
) -> np.ndarray:
    """Split nodes in two sides so that the total weight *between* the sides is largest (HexGen-2 §3.2 (ii)).

    Used on the coarsened graph: one side becomes the prefill replicas, the other the decoding replicas, and
    a large cut means wide links for the KV-cache transfers between them. Up to ``exhaustive_limit`` nodes
    every split is tried (node 0 fixed on side ``False`` to skip mirror images); above that the sign of the
    Laplacian's top eigenvector is refined by single-node flips. Returns a boolean mask (``True`` = side 1),
    each side holding at least ``min_side`` nodes.
    """
    w = _check_square(weights)
    w = (w + w.T) / 2
    np.fill_diagonal(w, 0.0)
    n = w.shape[0]
    if n < 2 * min_side:
        raise ValueError(f"cannot split {n} nodes into two sides of at least {min_side}")

    def value(mask: np.ndarray) -> float:
        return float(w[np.ix_(mask, ~mask)].sum())

    if n <= exhaustive_limit:
        best_mask, best_val = None, -1.0
        for bits in range(1 << (n - 1)):
            mask = np.array([False] + [bool((bits >> i) & 1) for i in range(n - 1)])
            ones = int(mask.sum())
            if ones < min_side or n - ones < min_side:
                continue
            v = value(mask)
            # prefer balanced splits among equal cuts
            if v > best_val + 1e-9 or (
                best_mask is not None
                and abs(v - best_val) <= 1e-9
                and abs(2 * ones - n) < abs(2 * best_mask.sum() - n)
            ):
                best_mask, best_val = mask, v
        assert best_mask is not None
        return best_mask
    lap = np.diag(w.sum(axis=1)) - w
    _, vecs = np.linalg.eigh(lap)
    top = vecs[:, -1]
    mask = top > np.median(top)
    improved = True
    while improved:
        improved = False
        for i in range(n):
            trial = mask.copy()
            trial[i] = not trial[i]
            ones = int(trial.sum())
            if ones < min_side or n - ones < min_side:
                continue
            if value(trial) > value(mask) + 1e-9:
                mask, improved = trial, True
    return mask
