"""The runtime's exception family."""


class OffloadError(Exception):
    """The runtime cannot do what was asked (budget too small, prompt too long, ...): says why and the fix."""
