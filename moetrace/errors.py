"""Errors that reach the user as one line and a non-zero exit, never as a traceback."""


class UserError(Exception):
    """Bad input or an unusable environment, explained in one line."""
