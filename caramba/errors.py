"""Errors that reach the user as a short message instead of a traceback.

`UserError` is bad input (exit code 2): a bad manifest, option or file. `RunError` is a run
that started from valid input and failed (exit code 1).
"""


class CarambaError(Exception):
    exit_code = 1


class UserError(CarambaError):
    """Bad input: the message names what is wrong and how to fix it."""

    exit_code = 2


class RunError(CarambaError):
    """A run failed after its input was accepted."""

    exit_code = 1
