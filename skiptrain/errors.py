"""Errors a user can fix; the CLI prints them as one line instead of a traceback."""


class UserError(Exception):
    """Base class for problems in the user's input: the message says what is wrong and how to fix it."""


class DataError(UserError):
    """A missing, unreadable or inconsistent data set."""
