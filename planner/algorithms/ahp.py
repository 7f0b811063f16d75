"""OPA, the optimal placement algorithm of LLaMPS (ICPE 2024), Algorithm 1, with a full Analytic
Hierarchy Process (Saaty) for the server scores.

LLaMPS scores each server by a weighted sum of its leftover memory and its cores (steps 5-11), the
weights coming from AHP over the decision-maker's preferences, then gives servers blocks in score order,
``floor(LM / TB)`` each, contiguously (steps 12-13). The paper gives no matrix; this module states its own:

* Criteria (each used only when the cluster says something about it):
  ``memory`` — leftover memory ``LM = memory x weight_memory_fraction - overhead`` (always);
  ``cores`` — ``min(cores, knee)`` (LLaMPS §5.1: little gain past 8 cores; nodes without a core count,
  i.e. GPU nodes, count as ``knee``), used when some node has ``cores``;
  ``throughput`` — the measured ``block_throughput`` (the cost model's one-block estimate for nodes
  without a measurement), used when some node has a measurement;
  ``link`` — mean bandwidth from the node to the coordinator and to every other node, used when it
  differs between nodes.
* Pairwise comparison matrix on Saaty's 1-9 scale, settable by the operator; the default
  (:data:`DEFAULT_MATRIX`) says memory is strongly more important than cores (5) and link quality (5),
  and moderately more important than measured throughput (3); throughput is moderately more important
  than cores (3) and link quality (3); cores and link quality are equal (1).
* Weights: the principal eigenvector of the matrix (restricted to the criteria in use), normalised to
  sum 1. Consistency: ``CI = (lambda_max - n) / (n - 1)``, ``CR = CI / RI(n)`` with Saaty's random indices;
  a matrix with ``CR > 0.1`` is refused (:class:`AHPError`).
* Criteria are normalised before weighting (AHP's ideal mode: each value over the best node's value).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..cluster.spec import COORDINATOR, Cluster
from ..costs.roofline import CostModel, block_capacity
from ..errors import PlannerError
from ..placement import Placement, contiguous_fill
from .gma import leftover_memory

__all__ = [
    "CRITERIA",
    "DEFAULT_KNEE",
    "DEFAULT_MATRIX",
    "LLAMPS_MATRIX",
    "RANDOM_INDEX",
    "AHPError",
    "AHPWeights",
    "PairwiseMatrix",
    "ahp",
    "ahp_ranking",
    "ahp_weights",
    "criteria_values",
]

CRITERIA = ("memory", "cores", "throughput", "link")
DEFAULT_KNEE = 8

#: Saaty's random consistency indices RI(n), n = 1..10.
RANDOM_INDEX = {1: 0.0, 2: 0.0, 3: 0.58, 4: 0.90, 5: 1.12, 6: 1.24, 7: 1.32, 8: 1.41, 9: 1.45, 10: 1.49}

MAX_CONSISTENCY_RATIO = 0.1


class AHPError(PlannerError):
    """A pairwise comparison matrix that cannot be used (malformed, or CR > 0.1)."""

    code = "bad_ahp_matrix"


@dataclass(frozen=True)
class PairwiseMatrix:
    """A reciprocal pairwise comparison matrix: ``values[i][j]`` is how much more ``criteria[i]`` matters
    than ``criteria[j]`` (Saaty scale 1/9..9, ``values[j][i] == 1 / values[i][j]``)."""

    criteria: tuple[str, ...]
    values: tuple[tuple[float, ...], ...]

    @classmethod
    def from_preferences(
        cls, criteria: Sequence[str], preferences: Mapping[tuple[str, str], float]
    ) -> PairwiseMatrix:
        """Build the matrix from the upper triangle: ``{(a, b): how much more a matters than b}``;
        missing pairs are 1 (equal importance)."""
        criteria = tuple(criteria)
        n = len(criteria)
        values = [[1.0] * n for _ in range(n)]
        for (a, b), v in preferences.items():
            if a not in criteria or b not in criteria:
                raise AHPError(f"preference ({a!r}, {b!r}) names a criterion not in {criteria}")
            if v <= 0:
                raise AHPError(f"preference ({a!r}, {b!r}) must be positive, got {v}")
            i, j = criteria.index(a), criteria.index(b)
            values[i][j] = float(v)
            values[j][i] = 1.0 / float(v)
        return cls(criteria, tuple(tuple(r) for r in values))

    def restricted(self, criteria: Sequence[str]) -> PairwiseMatrix:
        """The sub-matrix over ``criteria`` (those of this matrix, in this matrix's order)."""
        keep = [i for i, c in enumerate(self.criteria) if c in criteria]
        return PairwiseMatrix(
            tuple(self.criteria[i] for i in keep),
            tuple(tuple(self.values[i][j] for j in keep) for i in keep),
        )


#: The default matrix over all four criteria (see the module docstring).
DEFAULT_MATRIX = PairwiseMatrix.from_preferences(
    CRITERIA,
    {
        ("memory", "cores"): 5,
        ("memory", "throughput"): 3,
        ("memory", "link"): 5,
        ("throughput", "cores"): 3,
        ("throughput", "link"): 3,
        ("cores", "link"): 1,
    },
)

#: LLaMPS' two criteria with its strong preference for memory over cores (Saaty 5).
LLAMPS_MATRIX = PairwiseMatrix.from_preferences(("memory", "cores"), {("memory", "cores"): 5})


@dataclass(frozen=True)
class AHPWeights:
    criteria: tuple[str, ...]
    weights: tuple[float, ...]
    lambda_max: float
    consistency_index: float
    consistency_ratio: float


def ahp_weights(matrix: PairwiseMatrix) -> AHPWeights:
    """Criterion weights from the principal eigenvector of ``matrix``, with its consistency ratio;
    raises :class:`AHPError` for a malformed matrix or one with ``CR > 0.1``."""
    n = len(matrix.criteria)
    if n == 0:
        raise AHPError("the comparison matrix has no criteria")
    if len(set(matrix.criteria)) != n:
        raise AHPError(f"criteria repeat: {matrix.criteria}")
    a = np.asarray(matrix.values, dtype=float)
    if a.shape != (n, n):
        raise AHPError(f"the comparison matrix must be {n}x{n} for criteria {matrix.criteria}, got {a.shape}")
    if not np.all(np.isfinite(a)) or np.any(a <= 0):
        raise AHPError("comparison values must be positive finite numbers (Saaty scale 1/9..9)")
    if not np.allclose(np.diag(a), 1.0):
        raise AHPError(
            "the diagonal of a comparison matrix must be 1 (a criterion is as important as itself)"
        )
    if not np.allclose(a * a.T, 1.0, rtol=1e-6):
        raise AHPError("the comparison matrix must be reciprocal: values[j][i] == 1 / values[i][j]")
    eigenvalues, eigenvectors = np.linalg.eig(a)
    k = int(np.argmax(eigenvalues.real))
    lambda_max = float(eigenvalues[k].real)
    vector = np.abs(eigenvectors[:, k].real)
    weights = vector / vector.sum()
    ci = (lambda_max - n) / (n - 1) if n > 1 else 0.0
    ri = RANDOM_INDEX.get(n, 1.49)
    cr = ci / ri if ri > 0 else 0.0
    if cr > MAX_CONSISTENCY_RATIO:
        raise AHPError(
            f"the comparison matrix is inconsistent: consistency ratio {cr:.3f} > {MAX_CONSISTENCY_RATIO} "
            f"(lambda_max {lambda_max:.3f} for {n} criteria); revise the preferences so they agree "
            "(if a > b by x and b > c by y, a > c by about x*y)"
        )
    return AHPWeights(matrix.criteria, tuple(float(w) for w in weights), lambda_max, ci, cr)


def criteria_values(
    cluster: Cluster, *, knee: int = DEFAULT_KNEE, cost: CostModel | None = None
) -> dict[str, dict[str, float]]:
    """Raw criterion values per node for the criteria the cluster informs (see module docstring)."""
    ids = cluster.node_ids
    values: dict[str, dict[str, float]] = {"memory": {n: max(0.0, leftover_memory(cluster, n)) for n in ids}}
    if any(cluster.node(n).cores is not None for n in ids):
        cores = {n: cluster.node(n).cores for n in ids}
        values["cores"] = {n: float(min(c, knee)) if c is not None else float(knee) for n, c in cores.items()}
    if any(cluster.node(n).block_throughput is not None for n in ids):
        cost = cost or CostModel(cluster)
        measured = {n: cluster.node(n).block_throughput for n in ids}
        values["throughput"] = {n: t if t is not None else cost.throughput(n, 1) for n, t in measured.items()}
    link = {}
    for n in ids:
        others = [m for m in ids if m != n] + [COORDINATOR]
        link[n] = float(np.mean([cluster.link(n, m).bandwidth_mbps for m in others]))
    if len(set(link.values())) > 1:
        values["link"] = link
    return values


def ahp_ranking(
    cluster: Cluster,
    *,
    matrix: PairwiseMatrix | None = None,
    knee: int = DEFAULT_KNEE,
    cost: CostModel | None = None,
) -> list[tuple[str, float]]:
    """Nodes with their AHP scores, best first (ties keep the spec's order)."""
    if knee < 1:
        raise AHPError(f"the core knee must be at least 1, got {knee}")
    matrix = matrix or DEFAULT_MATRIX
    raw = criteria_values(cluster, knee=knee, cost=cost)
    used = [c for c in matrix.criteria if c in raw]
    if not used:
        raise AHPError(
            f"none of the matrix's criteria {matrix.criteria} apply to this cluster (available: {sorted(raw)})"
        )
    weights = ahp_weights(matrix.restricted(used))
    scores = dict.fromkeys(cluster.node_ids, 0.0)
    for criterion, weight in zip(weights.criteria, weights.weights, strict=True):
        column = raw[criterion]
        best = max(column.values())
        for n, v in column.items():
            scores[n] += weight * (v / best if best > 0 else 0.0)
    order = sorted(range(len(cluster.node_ids)), key=lambda i: -scores[cluster.node_ids[i]])
    return [(cluster.node_ids[i], scores[cluster.node_ids[i]]) for i in order]


def ahp(
    cluster: Cluster,
    *,
    matrix: PairwiseMatrix | None = None,
    knee: int = DEFAULT_KNEE,
    cost: CostModel | None = None,
) -> Placement:
    """Place the model with LLaMPS' OPA: servers in AHP score order, ``floor(LM / TB)`` blocks each."""
    ranking = ahp_ranking(cluster, matrix=matrix, knee=knee, cost=cost)
    sizes = {n.id: block_capacity(cluster, n) for n in cluster.nodes}
    return contiguous_fill([n for n, _ in ranking], sizes, cluster.model.num_blocks)
