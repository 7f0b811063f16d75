"""A small sparse MILP builder over HiGHS (``highspy``), shared by the MILP formulations.

Variables and rows are added one at a time; :meth:`SparseModel.solve` passes the model to HiGHS in one
piece (row-wise sparse matrix), maximises, optionally warm-starts from a full assignment, reports
improving solutions, and interrupts the search once the incumbent reaches ``stop_at``. Inside
:func:`recording`, every model solved is logged with its size (Helix Table 8 reports its MILP's size), so a
search that solves models deep inside other modules can report what it ran.

HiGHS writes nothing: ``swarmnode plan --json`` prints JSON alone on stdout, and HiGHS logs to stdout
(:class:`_SilentHighs` says how its banner is kept off).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import highspy
import numpy as np

__all__ = ["ModelSize", "SolveOutcome", "SparseModel", "recording"]

#: The log :func:`recording` opened in this context (None outside it).
_SOLVED: ContextVar[list[ModelSize] | None] = ContextVar("solved_models", default=None)


@dataclass(frozen=True)
class ModelSize:
    """A model's size as HiGHS receives it: columns (variables) and rows (constraints)."""

    columns: int
    rows: int

    def to_dict(self) -> dict[str, int]:
        return {"columns": self.columns, "rows": self.rows}


@contextmanager
def recording() -> Iterator[list[ModelSize]]:
    """Log the size of every model :meth:`SparseModel.solve` solves inside the ``with`` block, in order
    (nested blocks log to the innermost one only)."""
    log: list[ModelSize] = []
    token = _SOLVED.set(log)
    try:
        yield log
    finally:
        _SOLVED.reset(token)


class _SilentHighs(highspy.Highs):
    """``highspy.Highs`` with HiGHS' output off from the start. ``Highs.__init__`` calls
    :meth:`enableCallbacks` (``setCallback``), the first call that is not an option setting, and HiGHS
    writes its banner ("Running HiGHS ...") to stdout at that call unless ``output_flag`` is already off
    (HiGHS issue #1702: output must be switched off before any other call); ``silent()`` after
    construction comes too late for the first instance of a process."""

    def enableCallbacks(self) -> None:
        self.setOptionValue("output_flag", False)
        self.setOptionValue("log_to_console", False)
        super().enableCallbacks()


@dataclass(frozen=True)
class SolveOutcome:
    status: str
    values: list[float] | None
    objective: float | None
    bound: float | None
    seconds: float


class SparseModel:
    """Columns with bounds, costs and integrality; rows ``lower <= a x <= upper``; maximisation."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.cost: list[float] = []
        self.integer: list[bool] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.row_start: list[int] = [0]
        self.index: list[int] = []
        self.value: list[float] = []

    @property
    def num_vars(self) -> int:
        return len(self.lower)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)

    @property
    def size(self) -> ModelSize:
        return ModelSize(self.num_vars, self.num_rows)

    def var(
        self, lower: float = 0.0, upper: float = math.inf, *, integer: bool = False, obj: float = 0.0
    ) -> int:
        """Add a variable; returns its column index."""
        self.lower.append(float(lower))
        self.upper.append(float(upper))
        self.cost.append(float(obj))
        self.integer.append(integer)
        return len(self.lower) - 1

    def row(self, terms: Mapping[int, float] | list[tuple[int, float]], lower: float, upper: float) -> int:
        """Add ``lower <= sum(coef * x[col]) <= upper`` (repeated columns are summed)."""
        items = terms.items() if isinstance(terms, Mapping) else terms
        merged: dict[int, float] = {}
        for col, coef in items:
            merged[col] = merged.get(col, 0.0) + coef
        for col, coef in merged.items():
            if coef != 0.0:
                self.index.append(col)
                self.value.append(coef)
        self.row_lower.append(float(lower))
        self.row_upper.append(float(upper))
        self.row_start.append(len(self.index))
        return len(self.row_lower) - 1

    def _lp(self) -> highspy.HighsLp:
        inf = highspy.kHighsInf

        def bounded(values: list[float]) -> np.ndarray:
            return np.clip(np.asarray(values, dtype=float), -inf, inf)

        lp = highspy.HighsLp()
        lp.num_col_ = self.num_vars
        lp.num_row_ = self.num_rows
        lp.col_cost_ = np.asarray(self.cost, dtype=float)
        lp.col_lower_ = bounded(self.lower)
        lp.col_upper_ = bounded(self.upper)
        lp.row_lower_ = bounded(self.row_lower)
        lp.row_upper_ = bounded(self.row_upper)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.num_col_ = self.num_vars
        lp.a_matrix_.num_row_ = self.num_rows
        lp.a_matrix_.start_ = np.asarray(self.row_start, dtype=np.int32)
        lp.a_matrix_.index_ = np.asarray(self.index, dtype=np.int32)
        lp.a_matrix_.value_ = np.asarray(self.value, dtype=float)
        lp.integrality_ = [
            highspy.HighsVarType.kInteger if flag else highspy.HighsVarType.kContinuous
            for flag in self.integer
        ]
        lp.sense_ = highspy.ObjSense.kMaximize
        return lp

    def solve(
        self,
        *,
        time_limit: float,
        start: list[float] | None = None,
        stop_at: float = math.inf,
        on_improve: Callable[[float, float], None] | None = None,
        mip_rel_gap: float = 1e-4,
        seed: int = 0,
    ) -> SolveOutcome:
        """Maximise with HiGHS (one thread) for at most ``time_limit`` seconds."""
        log = _SOLVED.get()
        if log is not None:
            log.append(self.size)
        h = _SilentHighs()
        h.setOptionValue("time_limit", max(0.1, float(time_limit)))
        h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
        h.setOptionValue("threads", 1)
        h.setOptionValue("random_seed", int(seed))
        h.passModel(self._lp())
        if start is not None:
            solution = highspy.HighsSolution()
            solution.col_value = list(start)
            solution.value_valid = True
            h.setSolution(solution)
        best = [-math.inf]

        def improving(event) -> None:
            value = float(event.data_out.objective_function_value)
            if value > best[0]:
                best[0] = value
                if on_improve is not None:
                    on_improve(value, float(event.data_out.mip_dual_bound))

        def interrupt(event) -> None:
            if best[0] >= stop_at:
                event.interrupt()

        if any(self.integer):
            h.cbMipImprovingSolution.subscribe(improving)
            if math.isfinite(stop_at):
                h.cbMipInterrupt.subscribe(interrupt)
        h.run()
        status = h.modelStatusToString(h.getModelStatus())
        info = h.getInfo()
        values = objective = None
        if info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible:
            values = list(h.getSolution().col_value)
            objective = float(info.objective_function_value)
        bound = None
        if any(self.integer):
            if math.isfinite(info.mip_dual_bound):
                bound = float(info.mip_dual_bound)
        elif objective is not None:
            bound = objective
        return SolveOutcome(
            status=status, values=values, objective=objective, bound=bound, seconds=float(h.getRunTime())
        )
