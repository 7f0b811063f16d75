"""The planner's exceptions: one base class, :class:`PlannerError`, with a machine-readable ``code``.

Every error the planner raises on purpose derives from :class:`PlannerError`, so a caller (the CLI, the
coordinator, a benchmark) can tell "this input cannot be planned" from a bug with one ``except``. The
base derives from :class:`ValueError` because every planner error is about the data it was given.
"""

from __future__ import annotations

__all__ = ["CannotPlaceError", "PlannerError"]


class PlannerError(ValueError):
    """A planning input that cannot be used; the message says what was wrong and what to do.

    ``code`` names the kind of error for programs (a subclass sets its own); the message is for people.
    """

    code = "planner_error"

    def __init__(self, message: str, *, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class CannotPlaceError(PlannerError):
    """The offered nodes cannot hold the model yet (too little memory in all, or a block nobody can hold):
    not a bug, the coordinator waits for more offers."""

    code = "cannot_place"
