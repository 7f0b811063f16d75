"""Each planning algorithm's options, one frozen dataclass per algorithm, checked when built.

The registry (:mod:`planner.registry`) names each algorithm's options type; callers build an options object
with :meth:`planner.registry.Algorithm.options` (``REGISTRY["milp"].options(time_limit=5)``), which refuses
an option the algorithm does not take by naming the algorithm and the options it takes. Every field is
checked in ``__post_init__``: a wrong value is a :class:`~planner.errors.PlannerError` (code
``bad_option``) that says which option of which algorithm is wrong, what it got and what it takes.

Fields marked :data:`INTERNAL` are for programs (warm starts, progress callbacks, cost parameters); the
others are what a user may tune, and the command line checks its flags against them
(:attr:`planner.registry.Algorithm.tunable`).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from .algorithms.ahp import DEFAULT_KNEE, PairwiseMatrix
from .algorithms.milp import DEFAULT_LINK_DEGREE, FORMULATIONS
from .costs.hexgen_gpus import HexGenParams
from .errors import PlannerError
from .placement import Placement
from .search.portfolio import ProgressCallback

__all__ = [
    "INTERNAL",
    "AhpOptions",
    "AlgorithmOptions",
    "GmaOptions",
    "HexGen2Options",
    "HexGenOptions",
    "MilpOptions",
    "PetalsOptions",
    "SwarmOptions",
]

#: The metadata of a field programs set (not a user-tunable option): ``field(default=..., metadata=INTERNAL)``.
INTERNAL = {"internal": True}


@dataclass(frozen=True)
class AlgorithmOptions:
    """The base of every algorithm's options: the field names, which are tunable, and the checks."""

    algorithm: ClassVar[str] = ""

    @classmethod
    def names(cls) -> frozenset[str]:
        """Every option (field) this type has."""
        return frozenset(f.name for f in fields(cls))

    @classmethod
    def tunable(cls) -> frozenset[str]:
        """The options a user may tune (the fields not marked :data:`INTERNAL`)."""
        return frozenset(f.name for f in fields(cls) if not f.metadata.get("internal"))

    def kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments (not deep-copied, unlike :func:`dataclasses.asdict`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # -- checks shared by the subclasses: each raises a PlannerError saying what is wrong and what to do --

    def _fail(self, name: str, wanted: str) -> PlannerError:
        return PlannerError(
            f"{self.algorithm} option {name}: must be {wanted}, got {getattr(self, name)!r}", code="bad_option"
        )

    def _number(self, name: str, *, low: float = 0.0, low_open: bool = True, high: float | None = None,
                optional: bool = False) -> None:
        value = getattr(self, name)
        if value is None and optional:
            return
        wanted = f"a number {'above' if low_open else 'from'} {low:g}" + (f" and below {high:g}" if high else "")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise self._fail(name, wanted + (" (or None)" if optional else ""))
        number = float(value)
        if (number <= low if low_open else number < low) or (high is not None and number >= high):
            raise self._fail(name, wanted)

    def _whole(self, name: str, *, low: int = 0, optional: bool = False) -> None:
        value = getattr(self, name)
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < low:
            raise self._fail(name, f"a whole number from {low}" + (" (or None)" if optional else ""))

    def _flag(self, name: str) -> None:
        if not isinstance(getattr(self, name), bool):
            raise self._fail(name, "True or False")

    def _instance(self, name: str, kind: type, what: str) -> None:
        if getattr(self, name) is not None and not isinstance(getattr(self, name), kind):
            raise self._fail(name, f"{what} or None")

    def _callable(self, name: str) -> None:
        if getattr(self, name) is not None and not callable(getattr(self, name)):
            raise self._fail(name, "a function or None")

    def _lengths(self, value: object) -> None:
        """``lengths``: a HexGen-2 workload name, ``(prompt tokens, output tokens)``, or None."""
        if value is None or isinstance(value, str):
            return
        if not isinstance(value, Sequence) or len(value) != 2 or not all(
            isinstance(v, numbers.Real) and not isinstance(v, bool) and float(v) > 0 for v in value
        ):
            raise self._fail("lengths", "a workload name (e.g. LPLD), (prompt tokens, output tokens) or None")
        object.__setattr__(self, "lengths", tuple(value))

    def _min_replicas(self) -> None:
        self._whole("min_replicas", low=1)


@dataclass(frozen=True)
class MilpOptions(AlgorithmOptions):
    """Helix's MILP (:func:`planner.algorithms.milp.milp`): stop after ``time_limit`` seconds or within
    ``gap`` of the lowest upper bound; ``formulation`` (``auto``, ``coverage``, ``typed``, ``per-node``);
    ``partial_inference`` (Helix §4.4); ``min_replicas`` (the redundancy floor). Internal: ``link_degree``
    (§4.5 pruning; None keeps every link), ``mip_rel_gap`` (HiGHS'), ``warm_start``, ``seed``, ``progress``."""

    algorithm: ClassVar[str] = "milp"
    time_limit: float = 60.0
    gap: float = 0.05
    formulation: str = "auto"
    partial_inference: bool = True
    min_replicas: int = 1
    link_degree: int | None = field(default=DEFAULT_LINK_DEGREE, metadata=INTERNAL)
    mip_rel_gap: float = field(default=1e-4, metadata=INTERNAL)
    warm_start: Placement | None = field(default=None, metadata=INTERNAL)
    seed: int = field(default=0, metadata=INTERNAL)
    progress: ProgressCallback | None = field(default=None, metadata=INTERNAL)

    def __post_init__(self) -> None:
        self._number("time_limit")
        self._number("gap", low_open=False, high=1.0)
        if self.formulation not in FORMULATIONS:
            raise self._fail("formulation", "one of " + ", ".join(FORMULATIONS))
        self._flag("partial_inference")
        self._min_replicas()
        self._whole("link_degree", low=1, optional=True)
        self._number("mip_rel_gap", low_open=False)
        self._instance("warm_start", Placement, "a Placement")
        self._whole("seed")
        self._callable("progress")


@dataclass(frozen=True)
class AhpOptions(AlgorithmOptions):
    """LLaMPS' OPA with AHP scores (:func:`planner.algorithms.ahp.ahp`). Internal: ``ahp_matrix`` (the
    decision-maker's pairwise preferences; None: the default) and ``knee``."""

    algorithm: ClassVar[str] = "ahp"
    ahp_matrix: PairwiseMatrix | None = field(default=None, metadata=INTERNAL)
    knee: int = field(default=DEFAULT_KNEE, metadata=INTERNAL)

    def __post_init__(self) -> None:
        self._instance("ahp_matrix", PairwiseMatrix, "a PairwiseMatrix")
        self._whole("knee", low=1)


@dataclass(frozen=True)
class GmaOptions(AlgorithmOptions):
    """LLaMPS' greedy memory algorithm (:func:`planner.algorithms.gma.gma`) takes no options."""

    algorithm: ClassVar[str] = "gma"


@dataclass(frozen=True)
class PetalsOptions(AlgorithmOptions):
    """Petals' block selection (:func:`planner.algorithms.petals.petals`): ``seed`` of the join order (None:
    the spec's order), ``rebalance`` (Petals' rebalancing pass, which Helix's baseline lacks),
    ``min_replicas``. Internal: ``order`` (a join order given outright)."""

    algorithm: ClassVar[str] = "petals"
    seed: int | None = 0
    rebalance: bool = False
    min_replicas: int = 1
    order: tuple[str, ...] | None = field(default=None, metadata=INTERNAL)

    def __post_init__(self) -> None:
        self._whole("seed", optional=True)
        self._flag("rebalance")
        self._min_replicas()
        if self.order is not None:
            if isinstance(self.order, str) or not isinstance(self.order, Sequence):
                raise self._fail("order", "a sequence of node ids or None")
            object.__setattr__(self, "order", tuple(self.order))


@dataclass(frozen=True)
class SwarmOptions(AlgorithmOptions):
    """SWARM's equal stages, the SWARM paper's baseline (:func:`planner.algorithms.swarm_baseline.swarm`):
    ``min_replicas``."""

    algorithm: ClassVar[str] = "swarm"
    min_replicas: int = 1

    def __post_init__(self) -> None:
        self._min_replicas()


@dataclass(frozen=True)
class HexGenOptions(AlgorithmOptions):
    """HexGen's genetic search (:func:`planner.algorithms.hexgen.plan_hexgen`): ``time_limit`` (s), ``seed``,
    ``lengths`` (the planning request), ``generations``, ``population``, ``rate`` (requests/s of the fitness
    trace; None: 75% of the best initial grouping's capacity), ``slo_scale``, ``sim_duration`` (s),
    ``max_stages``. Internal: ``params`` (cost parameters), ``offspring``, ``beam``."""

    algorithm: ClassVar[str] = "hexgen"
    time_limit: float = 120.0
    seed: int = 0
    lengths: str | tuple[int, int] | None = None
    generations: int = 30
    population: int = 8
    rate: float | None = None
    slo_scale: float = 5.0
    sim_duration: float = 30.0
    max_stages: int = 8
    params: HexGenParams | None = field(default=None, metadata=INTERNAL)
    offspring: int = field(default=4, metadata=INTERNAL)
    beam: int = field(default=4000, metadata=INTERNAL)

    def __post_init__(self) -> None:
        self._number("time_limit")
        self._whole("seed")
        self._lengths(self.lengths)
        self._whole("generations")
        self._whole("population", low=1)
        self._number("rate", optional=True)
        self._number("slo_scale")
        self._number("sim_duration")
        self._whole("max_stages", low=1)
        self._instance("params", HexGenParams, "a HexGenParams")
        self._whole("offspring")
        self._whole("beam", low=1)


@dataclass(frozen=True)
class HexGen2Options(AlgorithmOptions):
    """HexGen-2's partition and refinement (:func:`planner.algorithms.hexgen2.plan_hexgen2`): ``time_limit``
    (s), ``seed``, ``lengths`` (the planning request), ``kv_batch``, ``max_iterations``. Internal: ``params``
    (cost parameters), ``lookahead``."""

    algorithm: ClassVar[str] = "hexgen2"
    time_limit: float = 120.0
    seed: int = 0
    lengths: str | tuple[int, int] | None = None
    kv_batch: int = 32
    max_iterations: int = 50
    params: HexGenParams | None = field(default=None, metadata=INTERNAL)
    lookahead: int = field(default=8, metadata=INTERNAL)

    def __post_init__(self) -> None:
        self._number("time_limit")
        self._whole("seed")
        self._lengths(self.lengths)
        self._whole("kv_batch")
        self._whole("max_iterations")
        self._instance("params", HexGenParams, "a HexGenParams")
        self._whole("lookahead", low=1)
