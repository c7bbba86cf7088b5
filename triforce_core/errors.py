"""Errors meant for the person at the keyboard: the CLI prints them as one line, no traceback."""


class UserError(Exception):
    """Bad input or an unmet precondition the user can fix; the message says how."""


class DamagedFileError(UserError):
    """A model file that exists but cannot be read (truncated, corrupt): in the cache folder,
    rebuilding the entry is the fix, unlike any other UserError."""
