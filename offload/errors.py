"""Errors of the offloading layer meant for the person at the keyboard (bad profile, a plan
that cannot fit); the CLI prints them as one line."""


class OffloadError(ValueError):
    """The message says what is wrong and what to change."""
