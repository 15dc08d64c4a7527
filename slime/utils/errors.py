"""The errors that end a run with one message instead of a traceback (:func:`slime.preflight.main`)."""

__all__ = ["UserError", "RunFinished"]


class UserError(ValueError):
    """A mistake in the command line, the data or a hook: reported as one message, no traceback."""


class RunFinished(UserError):
    """The checkpoint to resume from has already completed every step: nothing to do (exit 0)."""
